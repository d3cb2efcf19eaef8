"""A throwaway ``tim train`` run in a subprocess, for the benchmarks that read its metrics."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def train_rows(*, recipe: str, steps: int, overrides: list[str]) -> tuple[list[dict], float]:
    """Run ``tim train RECIPE run.steps=STEPS *OVERRIDES`` with its output in a temporary folder (removed after);
    its ``metrics.jsonl`` rows and the subprocess's wall time in seconds. A failed run raises RuntimeError with
    the tail of its stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "tim_megatron.cli",
            "train",
            recipe,
            f"run.steps={steps}",
            f"run.output_dir={tmp}",
            *overrides,
        ]
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd[2:])} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in next(Path(tmp).rglob("metrics.jsonl")).read_text().splitlines()]
    return rows, wall
