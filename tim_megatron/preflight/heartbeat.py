"""Heartbeats: every rank records the phase it is in, so a hang is named by its phase and its ranks.

Each rank owns one file, ``preflight/ranks/rank-<k>.json`` in the run folder (shared by the nodes), rewritten
atomically at every phase change: the phase, its state (``running``, ``done``, ``failed``, ``timeout``), when it
started and ended, and the error of a failed phase. A :class:`Watchdog` thread per rank marks a phase that runs
past its timeout and calls the job's handler (which writes the verdict and ends the rank); the submitting side
reads the same files when a job ends without a verdict.

A file is replaced by an atomic rename inside the run folder (a link planted at its name or at ``preflight/`` is
never written through), and read back only when it is a regular file (a FIFO would block the reader).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tim_megatron.safe_files import check_inside, read_text, write_atomic

TIMEOUTS: dict[str, float] = {
    "model": 3600.0,
    "rendezvous": 600.0,
    "doctor": 600.0,
    "devices": 120.0,
    "bandwidth": 900.0,
    "setup": 1800.0,
    "steps": 1800.0,
    "align": 900.0,
}
"""Seconds each phase may take, in the order the job runs them (model: the checkpoint in place, downloaded or
built; setup: trainer and engines load; align: only after a failed sync check). The report at the end is bounded by the job's own time limit."""
PHASES = tuple(TIMEOUTS)


def ranks_folder(run_dir: Path) -> Path:
    return Path(run_dir) / "preflight" / "ranks"


MAX_HEARTBEAT_BYTES = 1 << 20
"""Largest rank file read back (a rank writes about a kB)."""


def write_json(path: Path, data, *, root: Path | None = None) -> None:
    """Atomic: a reader never sees half a file, and a link at ``path`` is replaced, not followed. With ``root``
    (the run folder), ``path`` and the folders up to it must lie inside it, none of them a link."""
    if root is not None:
        check_inside(root, path, what="preflight file")  # before any folder is made through a link
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(data, indent=1, default=str), root=root, what="preflight file")


class Heartbeat:
    """This rank's record of its phases."""

    def __init__(self, run_dir: Path, *, rank: int, host: str, timeouts: dict[str, float] | None = None):
        self.run_dir = Path(run_dir)
        self.path = ranks_folder(run_dir) / f"rank-{rank:05d}.json"
        self.timeouts = dict(TIMEOUTS if timeouts is None else timeouts)
        self.record = {"rank": rank, "host": host, "pid": os.getpid(), "current": None, "phases": {}}
        self._lock = threading.Lock()
        self._write()

    def _write(self) -> None:
        self.record["updated"] = time.time()
        write_json(self.path, self.record, root=self.run_dir)

    @property
    def current(self) -> tuple[str, float] | None:
        """The running phase and when it started."""
        with self._lock:
            name = self.record["current"]
            return (name, self.record["phases"][name]["started"]) if name else None

    def begin(self, phase: str) -> None:
        with self._lock:
            self.record["current"] = phase
            self.record["phases"][phase] = {
                "state": "running",
                "started": time.time(),
                "timeout_s": self.timeouts.get(phase),
            }
            self._write()

    def end(self, phase: str, *, error: str | None = None) -> None:
        with self._lock:
            p = self.record["phases"][phase]
            if p["state"] == "timeout":  # the watchdog spoke first; keep its verdict
                return
            p.update(state="failed" if error else "done", ended=time.time())
            p["seconds"] = round(p["ended"] - p["started"], 3)
            if error:
                p["error"] = error
            self.record["current"] = None
            self._write()

    def timed_out(self, phase: str) -> None:
        with self._lock:
            p = self.record["phases"][phase]
            p.update(state="timeout", ended=time.time())
            p["seconds"] = round(p["ended"] - p["started"], 3)
            self._write()

    @contextlib.contextmanager
    def phase(self, name: str):
        """``begin``/``end`` around a block; an exception is recorded as the phase's error and re-raised."""
        self.begin(name)
        try:
            yield
        except BaseException as e:
            self.end(name, error=f"{type(e).__name__}: {e}")
            raise
        self.end(name)


class Watchdog(threading.Thread):
    """Calls ``on_timeout(phase)`` once, after marking the phase, when the heartbeat's phase runs past its
    timeout. The handler decides what happens next (in the job: write the verdict, then end the process)."""

    def __init__(self, hb: Heartbeat, on_timeout: Callable[[str], None], *, poll_s: float = 1.0):
        super().__init__(daemon=True, name="preflight-watchdog")
        self.hb = hb
        self.on_timeout = on_timeout
        self.poll_s = poll_s
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.poll_s):
            cur = self.hb.current
            if cur is None:
                continue
            name, started = cur
            limit = self.hb.timeouts.get(name)
            if limit is not None and time.time() - started > limit:
                self.hb.timed_out(name)
                self.on_timeout(name)
                return

    def stop(self) -> None:
        self._halt.set()


def read_heartbeats(run_dir: Path) -> list[dict]:
    """Every rank's record, by rank (unreadable files are skipped: a rank killed mid-write left a temp file)."""
    out = []
    for f in sorted(ranks_folder(run_dir).glob("rank-*.json")):
        with contextlib.suppress(OSError, ValueError, RecursionError):
            rec = json.loads(read_text(f, max_bytes=MAX_HEARTBEAT_BYTES, what="heartbeat"))
            if isinstance(rec, dict) and isinstance(rec.get("rank"), int):
                out.append(rec)
    return sorted(out, key=lambda r: r["rank"])


def phase_states(heartbeats: list[dict], *, now: float | None = None) -> dict[str, dict]:
    """Per phase: its state over the ranks (the worst of ``timeout`` > ``failed`` > ``running`` > ``done``), the
    ranks in each state, the slowest rank's seconds and each failing rank's error."""
    now = time.time() if now is None else now
    order = {"done": 0, "running": 1, "failed": 2, "timeout": 3}
    out: dict[str, dict] = {}
    for hb in heartbeats:
        for name, p in hb.get("phases", {}).items():
            e = out.setdefault(
                name, {"state": "done", "ranks": {}, "seconds": 0.0, "timeout_s": p.get("timeout_s")}
            )
            st = p.get("state", "running")
            e["ranks"].setdefault(st, []).append(hb["rank"])
            if order.get(st, 1) > order[e["state"]]:
                e["state"] = st
            secs = p.get("seconds", now - p.get("started", now))
            e["seconds"] = max(e["seconds"], round(secs, 3))
            if p.get("error"):
                e.setdefault("errors", {})[str(hb["rank"])] = p["error"]
    return {name: out[name] for name in sorted(out, key=lambda n: PHASES.index(n) if n in PHASES else 99)}
