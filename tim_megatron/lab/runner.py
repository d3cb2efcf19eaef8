"""Run a grid: every runnable (arm, seed) through the real ``tim train``, in ``jobs`` subprocesses at a time.

Each run lives in ``<root>/<arm>/seed<k>/`` with ``lab.json`` (the base recipe and the exact override list).
A run whose folder says completed with the same overrides is reused, so running a grid again only runs
what is missing or changed (an arm that needed a feature added since, a killed run). An incomplete folder, or
one made with other overrides, is removed and the run starts over (lab runs keep no intermediate
checkpoints). wandb is off; the run's console output goes to ``train.log`` beside its metrics.

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

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tim_megatron.lab.grid import ArmPlan, Grid

LAB_FILE = "lab.json"


@dataclass
class RunRecord:
    arm: str
    seed: int
    path: Path
    status: str
    """completed, failed, timeout, reused, or not run."""
    seconds: float = 0.0


def run_dir(root: Path, arm: str, seed: int) -> Path:
    return root / arm / f"seed{seed}"


def run_spec(grid: Grid, plan: ArmPlan, seed: int) -> dict:
    return {"base": str(grid.base.resolve()), "overrides": grid.run_overrides(plan.arm, seed)}


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


def is_complete(d: Path, spec: dict) -> bool:
    try:
        meta = json.loads((d / "run.json").read_text())
        lab = json.loads((d / LAB_FILE).read_text())
    except (OSError, ValueError):
        return False
    return meta.get("status") == "completed" and lab == spec and (d / "metrics.jsonl").exists()


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
    records: list[RunRecord] = []
    todo = [(p, s) for p in plans for s in (seeds or grid.seeds) if only is None or p.arm.name in only]
    pending = []  # (tag, arm, seed, run folder, spec, command), in grid order
    for i, (p, seed) in enumerate(todo, start=1):
        d = run_dir(root, p.arm.name, seed)
        tag = f"[{i}/{len(todo)}] {p.arm.name} seed {seed}"
        if not p.runnable:
            log(f"{tag}: not run, {p.reason}")
            records.append(RunRecord(p.arm.name, seed, d, "not run"))
            continue
        spec = run_spec(grid, p, seed)
        if is_complete(d, spec):
            log(f"{tag}: reused {d}")
            records.append(RunRecord(p.arm.name, seed, d, "reused"))
            continue
        if d.exists():
            log(f"{tag}: removing the incomplete or outdated {d}")
            shutil.rmtree(d)
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

    free: queue.SimpleQueue = queue.SimpleQueue()  # the slots no run holds; one worker thread per slot
    for slot in slots:
        free.put(slot)

    def one(item) -> RunRecord:
        tag, arm, seed, d, spec, cmd = item
        slot = free.get()
        try:
            env = slot_env(slot) if slot is not None else {}
            d.mkdir(parents=True)
            (d / LAB_FILE).write_text(json.dumps(spec, indent=1))
            (d / "slot.json").write_text(json.dumps({"jobs": len(slots), **env}))
            t0 = time.perf_counter()
            pinned = ["taskset", "--cpu-list", ",".join(map(str, slot)), *cmd] if slot is not None else cmd
            status = _call(pinned, d / "train.log", timeout_s, env, running)
            secs = time.perf_counter() - t0
            where = f", cores {env['VLLM_CPU_OMP_THREADS_BIND']}" if env else ""
            log(f"{tag}: {status} in {secs:.0f} s ({d}{where})")
            return RunRecord(arm, seed, d, status, secs)
        finally:
            free.put(slot)

    running: set[subprocess.Popen] = set()
    pool = ThreadPoolExecutor(max_workers=len(slots))
    try:
        records += list(pool.map(one, pending))
    except BaseException:  # Ctrl-C on tim lab: stop every run in flight and start no other
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in list(running):
            os.killpg(proc.pid, signal.SIGTERM)
        raise
    pool.shutdown()
    return records


def _call(
    cmd: list[str], log_path: Path, timeout_s: float | None, extra_env: dict[str, str], running: set
) -> str:
    env = {**os.environ, **extra_env, "WANDB_MODE": "disabled"}
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        running.add(proc)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # its own session: the run and its children, nothing else
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return "timeout"
        finally:
            running.discard(proc)
    return "completed" if code == 0 else f"failed (exit {code}, see {log_path})"
