"""Run a grid: every runnable (arm, seed) through the real ``tim train``, one subprocess at a time.

Each run lives in ``<root>/<arm>/seed<k>/`` with ``lab.json`` (the base recipe and the exact override list).
A run whose folder says completed with the same overrides is reused, so running a grid again only runs
what is missing or changed (an arm that needed a feature added since, a killed run). An incomplete folder, or
one made with other overrides, is removed and the run starts over (lab runs keep no intermediate
checkpoints). wandb is off; the run's console output goes to ``train.log`` beside its metrics.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
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
    log=print,
    python: str = sys.executable,
) -> list[RunRecord]:
    records = []
    todo = [(p, s) for p in plans for s in (seeds or grid.seeds) if only is None or p.arm.name in only]
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
        d.mkdir(parents=True)
        (d / LAB_FILE).write_text(json.dumps(spec, indent=1))
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
        t0 = time.perf_counter()
        status = _call(cmd, d / "train.log", timeout_s)
        secs = time.perf_counter() - t0
        log(f"{tag}: {status} in {secs:.0f} s ({d})")
        records.append(RunRecord(p.arm.name, seed, d, status, secs))
    return records


def _call(cmd: list[str], log_path: Path, timeout_s: float | None) -> str:
    env = {**os.environ, "WANDB_MODE": "disabled"}
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
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
        except BaseException:  # Ctrl-C on tim lab: stop the run it is waiting on, then stop
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            raise
    return "completed" if code == 0 else f"failed (exit {code}, see {log_path})"
