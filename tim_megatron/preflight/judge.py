"""Go / no-go: a pure function of what the preflight gathered (the ``preflight.json`` report without its verdict).

No-go, each reason naming what failed and where:

* a phase that failed, ran past its timeout, or was still running when the job ended;
* a doctor fail on any node;
* a device shared by two ranks, a rank without its device, or a count that differs from the layout (ranks in the
  job, ranks per node, GPUs a node sees);
* NCCL talking across nodes over sockets where InfiniBand exists, or a bus bandwidth below 10% of nominal;
* a rollout engine that failed to load, does not fit, or produced nothing (named with its ranks);
* a weight sync that failed verification (named by engine; with `tim align`'s first divergence on that engine, which
  the job runs after a failed check);
* a device whose peak memory, extrapolated to the full recipe, is above 95% of its memory.

Warnings (still go): a bus bandwidth between 10% and 50% of nominal; ``tim plan`` underestimating a device's
measured peak by more than 5%. On CPU nothing about bandwidth or memory is judged (no nominal figures; memory is
the process's resident set): those figures are reported only. Step times are reported, never judged.
"""

from __future__ import annotations

from dataclasses import dataclass

from tim_megatron.outcome import Outcome, Status, failed

NO_GO_BANDWIDTH = 0.10
WARN_BANDWIDTH = 0.50
MEMORY_LIMIT = 0.95
"""Share of a device's memory the extrapolated peak may use (``tim plan``'s headroom)."""
PLAN_SLACK = 1.05
"""A measured peak above the plan by more than this factor is a warning: the plan is meant as an upper bound."""
GIB = 2**30


@dataclass(frozen=True)
class Verdict:
    """The go / no-go: every reason found, as outcomes (``fail`` is a no-go reason, ``warn`` a warning)."""

    outcomes: tuple[Outcome, ...] = ()
    """Each reason, its ``name`` the topic (``phase``, ``doctor``, ``devices``, ``bandwidth``, ``start-up``,
    ``engines``, ``syncs``, ``memory``, ``steps``) and its ``detail`` the sentence shown."""

    @property
    def go(self) -> bool:
        return not failed(self.outcomes)

    @property
    def no_go(self) -> list[str]:
        return [o.detail for o in self.outcomes if o.status == "fail"]

    @property
    def warnings(self) -> list[str]:
        return [o.detail for o in self.outcomes if o.status == "warn"]

    def as_dict(self) -> dict:
        """``preflight.json``'s verdict, with the keys it always had: ``go``, ``no_go`` and ``warnings``."""
        return {"go": self.go, "no_go": self.no_go, "warnings": self.warnings}


def _as(status: Status, topic: str, reasons: list[str]) -> list[Outcome]:
    return [Outcome(topic, status, r) for r in reasons]


def _ranks(rs) -> str:
    rs = list(rs)
    return f"rank{'s' if len(rs) != 1 else ''} {', '.join(map(str, rs))}"


def _phases(report: dict, specific: set[str]) -> list[str]:
    out = []
    ended = report.get("job", {}).get("ended", False)
    for name, p in report.get("phases", {}).items():
        ranks = p.get("ranks", {})
        if p["state"] == "timeout":
            out.append(
                f"phase {name} ran past its timeout ({p.get('timeout_s'):g} s) on {_ranks(ranks['timeout'])}"
                + (f"; {_ranks(ranks['running'])} still in it" if ranks.get("running") else "")
            )
        elif p["state"] == "failed" and name not in specific:
            errs = p.get("errors", {})
            first = next(iter(errs.values()), "no error recorded")
            out.append(f"phase {name} failed on {_ranks(ranks['failed'])}: {first}")
        elif p["state"] == "running" and ended:
            state = report["job"].get("state") or "ended"
            out.append(f"the job ended ({state}) during phase {name}: {_ranks(ranks['running'])} still in it")
    return out


def _doctor(report: dict) -> list[str]:
    out = []
    for node in report.get("doctor", []):
        for r in node.get("results", []):
            if r["status"] == "fail":
                fix = f" -> fix: {r['fix']}" if r.get("fix") else ""
                out.append(
                    f"doctor on node {node['node']} ({node['host']}): {r['check']}: {r['detail']}{fix}"
                )
    return out


def _devices(report: dict) -> list[str]:
    ranks = report.get("ranks") or []
    lay = report["layout"]
    if not ranks:
        return []
    out = []
    if len(ranks) != lay["world"]:
        out.append(f"the job runs {len(ranks)} rank(s); the layout needs {lay['world']}")
    nodes: dict[int, list[dict]] = {}
    for d in ranks:
        nodes.setdefault(d["node"], []).append(d)
    if len(nodes) != lay["nodes"]:
        out.append(f"the job spans {len(nodes)} node(s); the layout needs {lay['nodes']}")
    for n, members in sorted(nodes.items()):
        host = members[0]["host"]
        if len(members) != lay["procs_per_node"]:
            out.append(
                f"node {n} ({host}) runs {len(members)} rank(s); the layout needs {lay['procs_per_node']} per node"
            )
        if not lay["gpus_per_node"]:
            continue
        for d in members:
            if d.get("device", "cpu") == "cpu":
                out.append(f"rank {d['rank']} on node {n} ({host}) has no CUDA device")
        gpus = [d for d in members if d.get("device", "cpu") != "cpu"]
        seen: dict[str, list[dict]] = {}
        for d in gpus:
            seen.setdefault(d.get("device_uuid") or d.get("pci_bus") or d["device"], []).append(d)
        for dev, ds in seen.items():
            if len(ds) > 1:
                out.append(
                    f"{_ranks(d['rank'] for d in ds)} on node {n} ({host}) share one device ({ds[0]['device']}, "
                    f"{dev}): every rank needs its own GPU"
                )
        visible = max((d.get("visible_devices") or 0 for d in gpus), default=0)
        if gpus and visible < len(members):
            out.append(f"node {n} ({host}) sees {visible} GPU(s) but runs {len(members)} rank(s)")
    return out


def _bandwidth(report: dict) -> tuple[list[str], list[str]]:
    no, warn = [], []
    for e in report.get("bandwidth", []):
        where = f"{e['kind']} group ({_ranks(e['ranks'])})"
        net = [x.lower() for x in e.get("network", [])]
        if e["backend"] == "nccl" and e["span"] == "inter-node" and e.get("infiniband") and "socket" in net:
            no.append(
                f"{where}: NCCL talks across nodes over sockets although InfiniBand exists (NCCL network "
                f"{', '.join(e['network'])}); check NCCL_IB_DISABLE, NCCL_NET, NCCL_IB_HCA and the container's "
                "RDMA libraries"
            )
        nominal = e.get("nominal_gb_s")
        if not nominal:
            continue
        ratio = e["busbw_gb_s"] / nominal
        text = (
            f"{where}: all-reduce bus bandwidth {e['busbw_gb_s']:.1f} GB/s at {e['bytes'] / 2**20:g} MiB is "
            f"{100 * ratio:.0f}% of the nominal {nominal:g} GB/s ({e['span']})"
        )
        if ratio < NO_GO_BANDWIDTH:
            no.append(text)
        elif ratio < WARN_BANDWIDTH:
            warn.append(text)
    return no, warn


def _engines(report: dict) -> list[str]:
    out = []
    for e in report.get("engines", []):
        who = f"rollout engine {e['engine']} ({_ranks(e['ranks'])})"
        if e.get("error"):
            what = "does not fit" if e.get("kind") == "fit" else "failed to load"
            out.append(f"{who} {what}: {e['error']}")
        elif e.get("steps") and not e.get("response_tokens"):
            out.append(f"{who} produced nothing in {len(e['steps'])} step(s)")
    return out


def _setup(report: dict) -> list[str]:
    return [f"start-up failed on rank {e['rank']}: {e['error']}" for e in report.get("setup_errors", [])]


def _syncs(report: dict) -> list[str]:
    out = []
    aligned = report.get("align") or {}
    for s in report.get("syncs", []):
        if s.get("verdict") == "failed":
            reason = (
                f"weight sync {s['sync']} failed verification ({s['check']}) on rollout engine {s['engine']} "
                f"({_ranks(s['ranks'])}): {s.get('error', '')}"
            )
            if aligned.get("engine") == s["engine"]:
                reason += (
                    f"; tim align on this engine (tolerance {aligned['tolerance']:g}): first divergence "
                    f"{aligned['where']} ({aligned['folder']})"
                )
            elif "skipped" in aligned:
                reason += f"; tim align did not run: {aligned['skipped']}"
            out.append(reason)
    return out


def _memory(report: dict) -> tuple[list[str], list[str]]:
    no, warn = [], []
    for m in report.get("memory", []):
        if m.get("source") != "cuda" or not m.get("device_bytes"):
            continue  # CPU: the resident set, reported only
        where = f"rank {m['rank']} ({m['device']})"
        if m["full_bytes"] > MEMORY_LIMIT * m["device_bytes"]:
            no.append(
                f"{where}: peak memory extrapolated to the full recipe {m['full_bytes'] / GIB:.1f} GiB is above "
                f"{MEMORY_LIMIT:.0%} of the device's {m['device_bytes'] / GIB:.0f} GiB ({m['formula']})"
            )
        if m["peak_bytes"] > PLAN_SLACK * m["plan_bytes"]:
            warn.append(
                f"{where}: tim plan underestimates the measured peak by {100 * (m['plan_ratio'] - 1):.0f}% "
                f"({m['peak_bytes'] / GIB:.2f} GiB measured, {m['plan_bytes'] / GIB:.2f} GiB planned)"
            )
    return no, warn


def blocking(report: dict) -> list[str]:
    """The reasons, among the phases so far, that make running the loop pointless: a failed phase, a doctor
    fail, a device or count problem (the job stops there and reports)."""
    return [*_phases(report, set()), *_doctor(report), *_devices(report)]


def judge(report: dict) -> Verdict:
    """The verdict on a preflight report (see the module docstring for the rules)."""
    engines, setup, syncs = _engines(report), _setup(report), _syncs(report)
    loaded = any(e.get("error") for e in report.get("engines", [])) or setup
    specific = ({"setup"} if loaded else set()) | ({"steps"} if syncs else set())
    bw_no, bw_warn = _bandwidth(report)
    mem_no, mem_warn = _memory(report)
    no = [
        *_as("fail", "phase", _phases(report, specific)),
        *_as("fail", "doctor", _doctor(report)),
        *_as("fail", "devices", _devices(report)),
        *_as("fail", "bandwidth", bw_no),
        *_as("fail", "start-up", setup),
        *_as("fail", "engines", engines),
        *_as("fail", "syncs", syncs),
        *_as("fail", "memory", mem_no),
    ]
    phases = report.get("phases", {})
    if not no and phases.get("steps", {}).get("state") != "done":
        last = next(reversed(phases), None) if phases else None
        reason = "the preflight did not run its loop steps" + (
            f" (last phase: {last}, {phases[last]['state']})"
            if last
            else " (no rank started; see the job log)"
        )
        no.append(Outcome("steps", "fail", reason))
    warn = [*_as("warn", "bandwidth", bw_warn), *_as("warn", "memory", mem_warn)]
    return Verdict(outcomes=(*no, *warn))
