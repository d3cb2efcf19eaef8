"""The ``tim`` command line in a child process, as the tests that drive it from outside run it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIM = [sys.executable, "-m", "tim_megatron.cli"]


def run_tim(
    *args: str,
    cwd: Path = ROOT,
    timeout: int = 120,
    env: dict | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess:
    """``tim ARGS`` from this checkout (``PYTHONPATH`` = the repository) in ``cwd``, its output captured as text;
    ``env`` adds to the environment, ``preexec_fn`` runs in the child before the CLI (a resource limit)."""
    return subprocess.run(
        [*TIM, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        preexec_fn=preexec_fn,
    )


def new_recipe(
    source: Path, name: str, hf: Path, recipes_root: Path, *extra: str, timeout: int = 300
) -> subprocess.CompletedProcess:
    """``tim new-recipe SOURCE NAME HF --recipes-root RECIPES_ROOT EXTRA...`` (see :func:`run_tim`)."""
    return run_tim(
        "new-recipe", str(source), name, str(hf), "--recipes-root", str(recipes_root), *extra, timeout=timeout
    )
