"""One process per run folder: an ``flock`` on ``<run folder>/run.lock``.

The lock is held for the life of the process that takes it; the kernel releases it when the last
descriptor closes, so a run killed with SIGKILL (or a dead node's) leaves no stale lock behind. The lock
file names its holder (host, pid, start time) for the error a second process gets.

One process of a run takes it: a single ``tim train``, the ``tim train --nproc N`` launcher before it
starts its ranks, or global rank 0 of a job whose ranks a launcher (torchrun under srun) started. A rank
whose launcher ancestor already holds the lock goes on without taking it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

LOCK_FILE = "run.lock"


class RunFolderBusy(RuntimeError):
    """Another process holds the run folder."""


@dataclass
class RunLock:
    path: Path
    fd: int | None
    """Our descriptor; None when an ancestor (our launcher) holds the lock for us."""

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _ancestors() -> set[int]:
    """Our parent, its parent, ... (Linux /proc)."""
    out, pid = set(), os.getppid()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state letter: ppid
    return out


def _holder(fd: int) -> dict:
    """The holder's record; it may still be writing it, so look a few times."""
    for _ in range(40):
        with contextlib.suppress(OSError, ValueError):
            data = os.pread(fd, 4096, 0)
            if data:
                rec = json.loads(data)
                if isinstance(rec, dict):
                    return rec
        time.sleep(0.05)
    return {}


def hold(run_dir: str | Path) -> RunLock:
    """Take ``run_dir``'s lock for this process (released at exit), or raise :class:`RunFolderBusy`."""
    path = Path(run_dir) / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        rec = _holder(fd)
        os.close(fd)
        if rec.get("host") == socket.gethostname() and rec.get("pid") in _ancestors():
            return RunLock(path, None)
        who = (
            f"pid {rec.get('pid')} on {rec.get('host')} since {rec.get('started')} ({rec.get('command', '?')})"
            if rec
            else "a process that has not written its name yet"
        )
        raise RunFolderBusy(
            f"run folder {run_dir} is in use by {who}; lock file {path}. Two runs in one folder would "
            f"interleave their metrics and checkpoints: wait for it to end, stop it, or use another folder."
        ) from None
    rec = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": " ".join(_argv())[:300],
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(rec).encode(), 0)
    return RunLock(path, fd)


def _argv() -> list[str]:
    try:
        return Path("/proc/self/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []
