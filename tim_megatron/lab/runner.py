"""Run a grid: every runnable (arm, seed) through the real ``tim train``, in ``jobs`` subprocesses at a time.

Each run lives in ``<root>/<arm>/seed<k>/`` with ``lab.json`` (the base recipe, the exact override list, the
sha256 of the resolved recipe, and, under ``rules``, the sha256 of each rule file as the run starts: what
:mod:`tim_megatron.lab.provenance` judges the report's rules by). A run whose folder says completed with the same resolved recipe is reused
(:func:`is_complete`), so running a grid again only runs what is missing or changed (an arm that needed a
feature added since, an edit anywhere in the recipe's ``base:`` chain, a killed run). An incomplete or outdated
folder is emptied and the run starts over (lab runs keep no intermediate checkpoints). wandb is off; the run's
console output goes to ``train.log`` beside its metrics.

A lab removes only what it holds. It takes ``<root>/lab.lock`` for its whole life (a second ``tim lab`` on the
same run folders stops at once, naming the first), then each run folder's ``run.lock`` before it looks at the
folder; a folder another process holds (a ``tim train --run-dir`` started by hand) is skipped as busy, with
its holder named, and left as it is. The run lock passes to the run's ``tim train`` as an inherited
descriptor, so the folder is never free between the lab's claim and the run's end, and that ``tim train``
takes it through :func:`tim_megatron.run_lock.hold`'s ancestor rule. The lock file itself is never removed:
a new file would be a new lock.

A lab root can come from elsewhere. A run folder is used only when it and the folders above it, up to the root,
are real folders (a linked seed folder would have the lab read, and empty, a folder outside the root), and it is
emptied only when it carries ``lab.json``, which only the lab writes: a folder the lab did not make is refused by
name and left as it is (its run counts as failed). ``lab.json``, ``slot.json`` and ``train.log`` are written
without following a link.

Runs die with the lab. Each runs in its own session (a terminal's Ctrl-C reaches the lab alone); on SIGINT or
SIGTERM the lab sends SIGTERM to every run's process group, SIGKILL after a grace period, and exits; a lab
killed outright takes its runs with it through the kernel's parent-death signal.

With ``jobs > 1`` the machine's cores are split into ``jobs`` disjoint slots and each concurrent run is pinned
to its own slot: the whole process through ``taskset`` (vLLM binds only its OpenMP threads; the rest of a run,
its Python threads included, would otherwise float onto the other run's cores), its thread pools through
``OMP_NUM_THREADS`` and vLLM's ``VLLM_CPU_OMP_THREADS_BIND``. Two runs never share a core. The tiny model
gains little from a second thread, while a run's start (imports, megatron-core and vLLM set-up) is
single-threaded, so on 2 cores two one-core runs finish a grid sooner than one two-core run at a
time. A run's numbers do depend on its thread count (float sums in another order); ``slot.json`` in the run's
folder records the slot, and ``run.json``'s ``cpu_affinity`` the cores the run's process could use.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tim_megatron.lab.grid import ArmPlan, Grid, GridError
from tim_megatron.lab.provenance import rule_hashes
from tim_megatron.lab.runstats import run_meta
from tim_megatron.procs import bound_to_parent
from tim_megatron.recipe import RecipeError, load_recipe, recipe_to_yaml
from tim_megatron.run_dir import RECIPE_FILE
from tim_megatron.run_lock import LOCK_FILE, RunFolderBusy, RunLock, claim, describe
from tim_megatron.safe_files import (
    UnsafePathError,
    check_inside,
    open_append,
    read_text,
    regular_file,
    write_atomic,
)
from tim_megatron.safe_files import describe as describe_path

LAB_FILE = "lab.json"
"""The run's spec, written only by the lab: the mark of a run folder the lab made (and so may empty)."""
MAX_LAB_FILE_BYTES = 1 << 20
LAB_LOCK = "lab.lock"
"""The lock a running ``tim lab`` holds in its root folder."""
STOP_GRACE_S = 10.0
"""How long a stopped lab waits for its runs to exit after SIGTERM before it sends SIGKILL."""


class LabBusy(GridError):
    """Another ``tim lab`` is running on the same run folders."""


class LabStopped(BaseException):
    """The lab got SIGTERM; its runs were stopped. Like KeyboardInterrupt, no ``except Exception`` stops it."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


@dataclass
class RunRecord:
    arm: str
    seed: int
    path: Path
    status: str
    """completed, failed, timeout, reused, busy, or not run."""
    seconds: float = 0.0


def run_dir(root: Path, arm: str, seed: int) -> Path:
    return root / arm / f"seed{seed}"


def foreign(root: Path, d: Path) -> str | None:
    """Why run folder ``d`` under ``root`` is not the lab's to use (None: it is, or it does not exist yet): a
    link at it or at a folder between it and ``root``, or something other than a folder."""
    try:
        check_inside(root, d, what="run folder")
    except UnsafePathError as e:
        return str(e)
    what = describe_path(d)
    if what not in ("missing", "a folder"):
        return f"run folder {d} is {what}; allowed: a real folder inside {root}"
    return None


def recipe_hash(base: Path, overrides: list[str]) -> str:
    """sha256 of the resolved recipe (its whole ``base:`` chain and the overrides), as ``tim recipe show`` prints it."""
    return hashlib.sha256(recipe_to_yaml(load_recipe(base, overrides).recipe).encode()).hexdigest()


def run_spec(grid: Grid, plan: ArmPlan, seed: int) -> dict:
    """What makes a run: ``lab.json``'s content, and the key a completed run is reused under."""
    overrides = grid.run_overrides(plan.arm, seed)
    return {
        "base": str(grid.base.resolve()),
        "overrides": overrides,
        "recipe_sha256": recipe_hash(grid.base, overrides),
    }


def core_slots(jobs: int, cpus: list[int] | None = None) -> list[list[int]]:
    """``jobs`` disjoint, equal groups of this process's cores (the first ones; a remainder stays unused)."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    if jobs < 1:
        raise ValueError(f"jobs = {jobs}: must be at least 1")
    if jobs > len(cpus):
        raise ValueError(f"jobs = {jobs}: more than the {len(cpus)} core(s) this process may use ({cpus})")
    per = len(cpus) // jobs
    return [cpus[k * per : (k + 1) * per] for k in range(jobs)]


def slot_env(cores: list[int]) -> dict[str, str]:
    """Environment that keeps one run on ``cores``: torch's and vLLM's thread pools, and their binding."""
    return {
        "OMP_NUM_THREADS": str(len(cores)),
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
    }


def lab_spec(d: Path) -> dict:
    """The run folder's ``lab.json`` (read bounded, regular files only); empty if missing or unreadable."""
    with contextlib.suppress(OSError, ValueError, RecursionError):
        spec = json.loads(read_text(d / LAB_FILE, max_bytes=MAX_LAB_FILE_BYTES, what="lab spec"))
        if isinstance(spec, dict):
            return spec
    return {}


def is_complete(d: Path, spec: dict) -> bool:
    """A completed run of ``spec``'s resolved recipe: ``lab.json`` records its hash, or (a run from a lab that
    recorded none, or from before the schema gained a key) the recipe the run itself recorded, resolved under
    today's schema, has it. Paths and override lists do not matter, only the recipe they resolve to."""
    meta = run_meta(d)  # bounded, regular files only: a lab root may hold folders from elsewhere
    if meta.get("status") != "completed" or not regular_file(d / "metrics.jsonl"):
        return False
    if lab_spec(d).get("recipe_sha256") == spec["recipe_sha256"]:
        return True
    if not regular_file(d / RECIPE_FILE):  # a link would read another file; a FIFO would block
        return False
    try:
        return recipe_hash(d / RECIPE_FILE, []) == spec["recipe_sha256"]
    except (OSError, RecipeError):
        return False


def completed_runs(grid: Grid, plans, root: Path) -> list[tuple[str, int, Path]]:
    """``(arm, seed, folder)`` of every completed run of ``grid`` under ``root``, in grid order; a run folder that
    is a link, or lies under one, is left out (it may lead out of ``root``)."""
    out = []
    for p in plans:
        if not p.runnable:
            continue
        for seed in grid.seeds:
            d = run_dir(root, p.arm.name, seed)
            if foreign(root, d) is None and is_complete(d, run_spec(grid, p, seed)):
                out.append((p.arm.name, seed, d))
    return out


def _not_ours(d: Path) -> str | None:
    """Why the existing folder ``d`` is not one the lab made (None: it is, it is empty but for its lock, or it does
    not exist): it holds files and no ``lab.json``."""
    if not d.is_dir() or d.is_symlink() or regular_file(d / LAB_FILE):
        return None
    if not any(e.name != LOCK_FILE for e in d.iterdir()):
        return None
    return (
        f"{d} holds files and no {LAB_FILE}, so tim lab did not make it, and it removes only run folders it made. "
        "Move it away (or give another --root) to run this seed"
    )


def _empty(d: Path) -> None:
    """Remove everything in ``d`` but its lock file (which we hold: a new file would be a new, free lock). Only for
    a real folder of the lab's (:func:`foreign`, ``lab.json``): links inside are removed, never followed."""
    if d.is_symlink() or not regular_file(d / LAB_FILE):
        raise UnsafePathError(f"run folder {d} has no {LAB_FILE} of the lab's; it is not emptied")
    for entry in d.iterdir():
        if entry.name == LOCK_FILE:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


@dataclass
class _Flight:
    """The runs in flight, and whether the lab is stopping (then no run starts)."""

    guard: threading.Lock = field(default_factory=threading.Lock)
    procs: set = field(default_factory=set)
    stopping: bool = False


def run_grid(
    grid: Grid,
    plans: list[ArmPlan],
    root: Path,
    *,
    only: set[str] | None = None,
    seeds: list[int] | None = None,
    timeout_s: float | None = None,
    jobs: int = 1,
    log=print,
    python: str = sys.executable,
) -> list[RunRecord]:
    slots = core_slots(jobs) if jobs > 1 else [None]
    try:
        root.mkdir(parents=True, exist_ok=True)
        lab_lock = claim(root, lock_file=LAB_LOCK)
    except RunFolderBusy as e:
        raise LabBusy(
            f"another tim lab is running on the run folders {root}: {describe(e.holder)}. Wait for it to end, "
            f"stop it, or give this one another --root (lock file {root / LAB_LOCK})."
        ) from None
    except OSError as e:
        raise GridError(
            f"run folders {root}: {e.strerror or e}; give --root a folder this user can write"
        ) from None
    claims: dict[Path, RunLock] = {}  # the run folders this lab holds and will run
    flight = _Flight()
    stop_on = _StopOnSignals()
    try:
        records, pending = _prepare(grid, plans, root, only, seeds, python, claims, log)
        records += _run_pending(pending, slots, timeout_s, claims, flight, log)
    finally:
        stop_on.restore()
        for lock in claims.values():  # folders claimed but never run (the lab was stopped)
            lock.release()
        lab_lock.release()
    return records


def _prepare(grid, plans, root, only, seeds, python, claims, log) -> tuple[list[RunRecord], list[tuple]]:
    """Claim, check and empty every run folder to run (in grid order); record the others."""
    records: list[RunRecord] = []
    chosen = [p for p in plans if only is None or p.arm.name in only]
    if grid.order == "seed":  # every arm of a seed before the next seed
        todo = [(p, s) for s in (seeds or grid.seeds) for p in chosen]
    else:
        todo = [(p, s) for p in chosen for s in (seeds or grid.seeds)]
    pending = []  # (tag, arm, seed, run folder, spec, command), in grid order
    for i, (p, seed) in enumerate(todo, start=1):
        d = run_dir(root, p.arm.name, seed)
        tag = f"[{i}/{len(todo)}] {p.arm.name} seed {seed}"
        if not p.runnable:
            log(f"{tag}: not run, {p.reason}")
            records.append(RunRecord(p.arm.name, seed, d, "not run"))
            continue
        spec = run_spec(grid, p, seed)
        # Before anything is made or read there: a link out of the root is never followed, and in a folder
        # of someone's not even a lock file is made (one a tim train left is taken: its run may be live).
        linked = foreign(root, d)
        why = linked or _not_ours(d)
        if linked or (why and not regular_file(d / LOCK_FILE)):
            log(f"{tag}: refused, left as it is: {why}")
            records.append(RunRecord(p.arm.name, seed, d, f"failed (refused: {why})"))
            continue
        d.mkdir(parents=True, exist_ok=True)
        try:
            lock = claim(d)
        except RunFolderBusy as e:  # a live run: neither reused nor removed
            log(f"{tag}: busy, skipped: {e}")
            records.append(RunRecord(p.arm.name, seed, d, f"busy (in use by {describe(e.holder)})"))
            continue
        except UnsafePathError as e:  # run.lock is a link or a special file
            log(f"{tag}: refused, left as it is: {e}")
            records.append(RunRecord(p.arm.name, seed, d, f"failed (refused: {e})"))
            continue
        if is_complete(d, spec):
            lock.release()
            log(f"{tag}: reused {d}")
            records.append(RunRecord(p.arm.name, seed, d, "reused"))
            continue
        if why:  # a run folder of someone's (a tim train --run-dir): the lab removes only what it made
            lock.release()
            log(f"{tag}: refused, left as it is: {why}")
            records.append(RunRecord(p.arm.name, seed, d, f"failed (refused: {why})"))
            continue
        claims[d] = lock
        if any(e.name != LOCK_FILE for e in d.iterdir()):
            log(f"{tag}: removing the incomplete or outdated {d}")
            _empty(d)
        cmd = [
            python,
            "-m",
            "tim_megatron.cli",
            "train",
            spec["base"],
            *spec["overrides"],
            "--run-dir",
            str(d),
        ]
        pending.append((tag, p.arm.name, seed, d, spec, cmd))
    return records, pending


def _run_pending(pending, slots, timeout_s, claims, flight, log) -> list[RunRecord]:
    free: queue.SimpleQueue = queue.SimpleQueue()  # the slots no run holds; one worker thread per slot
    for slot in slots:
        free.put(slot)

    def one(item) -> RunRecord:
        tag, arm, seed, d, spec, cmd = item
        slot = free.get()
        try:
            env = slot_env(slot) if slot is not None else {}
            started = {**spec, "rules": rule_hashes()}  # the rules' content as the run starts
            write_atomic(d / LAB_FILE, json.dumps(started, indent=1), root=d, what="lab spec")
            write_atomic(d / "slot.json", json.dumps({"jobs": len(slots), **env}), root=d, what="core slot")
            t0 = time.perf_counter()
            pinned = ["taskset", "--cpu-list", ",".join(map(str, slot)), *cmd] if slot is not None else cmd
            status = _call(pinned, d / "train.log", timeout_s, env, flight, claims[d].fd)
            secs = time.perf_counter() - t0
            where = f", cores {env['VLLM_CPU_OMP_THREADS_BIND']}" if env else ""
            log(f"{tag}: {status} in {secs:.0f} s ({d}{where})")
            return RunRecord(arm, seed, d, status, secs)
        finally:
            claims.pop(d).release()
            free.put(slot)

    # The workers start the runs and wait for them: a run's parent-death signal follows the thread that
    # started it, and a worker lives until its run has exited.
    pool = ThreadPoolExecutor(max_workers=len(slots))
    try:
        return list(pool.map(one, pending))
    except BaseException:  # Ctrl-C or SIGTERM on tim lab: stop every run in flight and start no other
        _stop(flight)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # quick once stopped; then no worker touches `claims`


class _StopOnSignals:
    """While the lab runs, SIGTERM raises :class:`LabStopped` in the main thread and SIGINT KeyboardInterrupt,
    so either stops the runs in flight. Signals after the first are ignored: the stop (bounded by
    ``STOP_GRACE_S``) runs to its end, to the SIGKILL of what is left. A signal the process ignores (SIGINT in
    a background job) stays ignored; off the main thread nothing changes."""

    def __init__(self):
        self.old = {}
        self.raised = False
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self.old[sig] = signal.signal(sig, self._raise)

    def _raise(self, signum, _frame):
        if self.raised:
            return
        self.raised = True
        raise KeyboardInterrupt if signum == signal.SIGINT else LabStopped(signum)

    def restore(self) -> None:
        for sig, handler in self.old.items():
            signal.signal(sig, handler)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)  # its own session: the run and its children, nothing else


def _stop(flight: _Flight, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to every run in flight (it stops cleanly), SIGKILL to whatever is left after ``grace_s``."""
    with flight.guard:
        flight.stopping = True
        procs = list(flight.procs)
    for proc in procs:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        _signal_group(proc, signal.SIGKILL)  # the leader's stragglers too


def _call(
    cmd: list[str],
    log_path: Path,
    timeout_s: float | None,
    extra_env: dict[str, str],
    flight: _Flight,
    lock_fd: int,
) -> str:
    env = {**os.environ, **extra_env, "WANDB_MODE": "disabled"}
    with open_append(log_path, what="run log") as out:  # a fresh file: the folder was emptied
        with flight.guard:
            if flight.stopping:
                return "not run (the lab was stopped)"
            # pass_fds: the run shares the lab's lock on its folder, so the folder stays held until the run
            # exits, even should the lab die first; bound_to_parent: it dies with the lab.
            proc = subprocess.Popen(
                bound_to_parent(cmd),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                pass_fds=(lock_fd,),
            )
            flight.procs.add(proc)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
            return "timeout"
        finally:
            with flight.guard:
                flight.procs.discard(proc)
    if flight.stopping:
        return f"stopped with the lab (exit {code})"
    return "completed" if code == 0 else f"failed (exit {code}, see {log_path})"
