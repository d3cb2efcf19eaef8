"""A real single-node Slurm cluster on loopback for the tests: munged, slurmctld and slurmd from Debian's
slurm-wlm, with every file under a temporary folder and non-default ports. Stopped by pid at the end."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path


def available() -> bool:
    return all(shutil.which(b) for b in ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "squeue"))


def first_job_id() -> int:
    """Where a test cluster's job ids start: a random point in this pytest-xdist worker's own share of 1000-12000,
    so that two workers' clusters never give two jobs one id, and so one rendezvous port (20000 + id, below 32768,
    outside the kernel's ephemeral ports that other tests' free ports come from). A cluster submits far fewer
    than the 500 ids left after its start."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1), index + 1)
    share = 11000 // count
    return 1000 + index * share + int.from_bytes(os.urandom(2), "big") % max(share - 500, 1)


def _ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def start_munge(root: Path) -> Path:
    """A private munged under ``root/munge`` with a fresh key; returns its socket (a file, usable from any
    network namespace)."""
    for d in ("state", "spool", "log", "munge"):
        (root / d).mkdir(parents=True, exist_ok=True)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = root / "munge" / "munge.socket"
    subprocess.run(
        [
            "munged",
            "--force",
            f"--key-file={key}",
            f"--socket={sock}",
            f"--pid-file={root / 'munge' / 'munged.pid'}",
            f"--log-file={root / 'munge' / 'munged.log'}",
            f"--seed-file={root / 'munge' / 'munged.seed'}",
        ],
        check=True,
        capture_output=True,
    )
    return sock


def stop_daemons(pidfiles: list[Path]) -> None:
    """SIGTERM the daemons in reverse start order, then SIGKILL whatever is left."""
    for sig, files in ((signal.SIGTERM, reversed(pidfiles)), (signal.SIGKILL, pidfiles)):
        for pidfile in files:
            try:
                os.kill(int(pidfile.read_text().split()[0]), sig)
            except (FileNotFoundError, ValueError, ProcessLookupError):
                continue
        if sig == signal.SIGTERM:
            time.sleep(1)


def _common_conf(r: Path, sock, *, node: str) -> str:
    """The slurm.conf lines both clusters share: munge, the state and log files under ``r`` (``node``: ``%n`` for
    one spool folder, pid and log file per node of the same host), the plain plugins, requeue, and job ids of
    its own (the job script's rendezvous port is 20000 + id % 20000: other clusters on this machine, the other
    pytest-xdist worker's or other test sessions', would otherwise count from 1 too and collide on it)."""
    per = f"-{node}" if node else ""
    return f"""\
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
StateSaveLocation={r / "state"}
SlurmdSpoolDir={r / "spool"}{"/" + node if node else ""}
SlurmctldPidFile={r / "slurmctld.pid"}
SlurmdPidFile={r / f"slurmd{per}.pid"}
SlurmctldLogFile={r / "log" / "slurmctld.log"}
SlurmdLogFile={r / "log" / f"slurmd{per}.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
ReturnToService=2
JobRequeue=1
FirstJobId={first_job_id()}
KillWait=60
MinJobAge=3600
MpiDefault=none"""


class LocalSlurm:
    def __init__(self, root: Path, *, cpus: int | None = None, memory_mb: int = 16000):
        self.root = Path(root)
        self.cpus = cpus or os.cpu_count() or 2
        self.memory_mb = memory_mb
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.pids: list[Path] = []

    def start(self, timeout: float = 60) -> LocalSlurm:
        r = self.root
        sock = start_munge(r)
        self.pids.append(r / "munge" / "munged.pid")
        ctld, slurmd_port = _ports(2)
        host = socket.gethostname()
        self.conf.write_text(f"""\
ClusterName=timtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld}
SlurmdPort={slurmd_port}
{_common_conf(r, sock, node="")}
NodeName={host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN
PartitionName=cpu Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")
        subprocess.run(["slurmctld", "-f", str(self.conf)], check=True, env=self.env, capture_output=True)
        self.pids.append(r / "slurmctld.pid")
        subprocess.run(["slurmd", "-f", str(self.conf)], check=True, env=self.env, capture_output=True)
        self.pids.append(r / "slurmd.pid")
        deadline = time.time() + timeout
        while time.time() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.strip() in ("idle", "mixed", "allocated"):
                return self
            time.sleep(0.5)
        raise RuntimeError(f"local Slurm did not come up: {out.stdout} {out.stderr}\n" + self.logs())

    def logs(self) -> str:
        parts = []
        for f in (self.root / "log").glob("*.log"):
            parts.append(f"--- {f.name}\n{f.read_text()[-3000:]}")
        return "\n".join(parts)

    @property
    def prefix(self) -> list[str]:
        """Clients run as they are (the two-node cluster runs them in its controller's namespace)."""
        return []

    def run(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        return subprocess.run([*self.prefix, *cmd], env=self.env, capture_output=True, text=True, **kw)

    def stop(self) -> None:
        self.run(["scancel", "--full", "-u", "root"])
        stop_daemons(self.pids)

    def wait(
        self,
        job: str,
        *,
        until=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"),
        timeout: float = 600,
    ) -> str:
        deadline = time.time() + timeout
        state = None
        while time.time() < deadline:
            out = self.run(["scontrol", "show", "job", "-o", job])
            state = next((p.split("=", 1)[1] for p in out.stdout.split() if p.startswith("JobState=")), None)
            if state in until:
                return state
            time.sleep(1)
        raise TimeoutError(f"job {job} still {state} after {timeout} s")


class TwoNodeSlurm(LocalSlurm):
    """A real two-node Slurm cluster on this one machine: two network namespaces that this object creates, joined
    by a veth pair (addresses 10.201.x.1 and .2 inside them, nothing else), slurmctld and slurmd ``node1`` in the
    first, slurmd ``node2`` in the second. munged's socket is a file, shared by both. Clients (sbatch, scontrol,
    make submit) run inside the first namespace through :attr:`prefix`. Needs root (``ip netns``)."""

    IFACE = "tim0"
    """The interface name inside both namespaces (jobs set GLOO_SOCKET_IFNAME to it)."""

    def __init__(
        self, root: Path, *, cpus_per_node: int = 1, memory_mb: int = 8000, slurmd_timeout: int = 15
    ):
        self.root = Path(root)
        # Seconds slurmctld waits for a silent slurmd before it holds the node down and requeues its jobs (Slurm's
        # default is 300): here a lost node is found in a test's time.
        self.slurmd_timeout = slurmd_timeout
        self.cpus = cpus_per_node
        self.memory_mb = memory_mb
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        tag = f"{os.getpid() % 100000}"
        self.ns = (f"timA{tag}", f"timB{tag}")
        subnet = 1 + os.getpid() % 250
        self.addr = (f"10.201.{subnet}.1", f"10.201.{subnet}.2")
        self.pids: list[Path] = []
        self._netns_made = False

    @staticmethod
    def enter(ns: str) -> list[str]:
        """Run in namespace ``ns``: only the network namespace changes (``ip netns exec`` would also remount /sys,
        hiding the cgroup file system slurmd needs)."""
        return ["nsenter", f"--net=/var/run/netns/{ns}"]

    @property
    def prefix(self) -> list[str]:
        return self.enter(self.ns[0])

    @staticmethod
    def available() -> bool:
        return available() and shutil.which("ip") is not None and os.geteuid() == 0

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    def _netns(self) -> None:
        a, b = self.ns
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            self._ip("netns", "add", ns)
        self._netns_made = True
        va, vb = f"va{a[4:]}", f"vb{b[4:]}"
        self._ip("link", "add", va, "type", "veth", "peer", "name", vb)
        for ns, dev, addr in ((a, va, self.addr[0]), (b, vb, self.addr[1])):
            self._ip("link", "set", dev, "netns", ns)
            self._ip("-n", ns, "link", "set", dev, "name", self.IFACE)
            self._ip("-n", ns, "addr", "add", f"{addr}/24", "dev", self.IFACE)
            self._ip("-n", ns, "link", "set", self.IFACE, "up")
            self._ip("-n", ns, "link", "set", "lo", "up")

    def start(self, timeout: float = 90) -> TwoNodeSlurm:
        r = self.root
        self._netns()
        sock = start_munge(r)
        self.pids.append(r / "munge" / "munged.pid")
        ctld, slurmd_port = 6817, 6818  # each namespace has its own ports
        nodes = "\n".join(
            f"NodeName=node{i + 1} NodeAddr={self.addr[i]} CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN"
            for i in range(2)
        )
        self.conf.write_text(f"""\
ClusterName=timtest2
SlurmctldHost={socket.gethostname()}({self.addr[0]})
SlurmctldPort={ctld}
SlurmdPort={slurmd_port}
SlurmdTimeout={self.slurmd_timeout}
{_common_conf(r, sock, node="%n")}
{nodes}
PartitionName=cpu Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP
""")
        a, _ = self.ns
        subprocess.run(
            [*self.enter(a), "slurmctld", "-f", str(self.conf)], check=True, env=self.env, capture_output=True
        )
        self.pids.append(r / "slurmctld.pid")
        for i, ns in enumerate(self.ns):
            (r / "spool" / f"node{i + 1}").mkdir(parents=True, exist_ok=True)
            subprocess.run(
                [*self.enter(ns), "slurmd", "-f", str(self.conf), "-N", f"node{i + 1}"],
                check=True,
                env=self.env,
                capture_output=True,
            )
            self.pids.append(r / f"slurmd-node{i + 1}.pid")
        deadline = time.time() + timeout
        out = None
        while time.time() < deadline:
            out = self.run(["sinfo", "-h", "-o", "%T %D"])
            states = out.stdout.split()
            if out.returncode == 0 and states and states[0] == "idle" and states[-1] == "2":
                return self
            time.sleep(0.5)
        raise RuntimeError(
            f"two-node Slurm did not come up: {out and out.stdout} {out and out.stderr}\n" + self.logs()
        )

    def lose_node2(self) -> None:
        """``node2`` is lost as a node is when its power goes: its link goes down first (so nothing it held says
        goodbye: no FIN, no RST reaches ``node1``), then every process in its namespace (slurmd, the job's launcher,
        ranks and engines) is killed."""
        ns = self.ns[1]
        self._ip("-n", ns, "link", "set", self.IFACE, "down")
        for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
            try:
                os.kill(int(p), signal.SIGKILL)
            except (ValueError, ProcessLookupError):
                continue

    def restore_node2(self) -> None:
        """``node2`` comes back (a replaced or rebooted node): its link up and its slurmd started again; Slurm returns
        it to service when it registers (``ReturnToService=2``)."""
        ns = self.ns[1]
        self._ip("-n", ns, "link", "set", self.IFACE, "up")
        subprocess.run(
            [*self.enter(ns), "slurmd", "-f", str(self.conf), "-N", "node2"],
            check=True,
            env=self.env,
            capture_output=True,
        )

    def stop(self) -> None:
        self.run(["scancel", "--full", "-u", "root"])
        time.sleep(1)
        stop_daemons(self.pids)
        if self._netns_made:
            for ns in self.ns:
                # Processes still inside (a job's leftovers) die with the namespace's last reference.
                pids = subprocess.run(
                    ["ip", "netns", "pids", ns], capture_output=True, text=True
                ).stdout.split()
                for p in pids:
                    try:
                        os.kill(int(p), signal.SIGKILL)
                    except (ValueError, ProcessLookupError):
                        continue
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
