"""Shared test helpers.

Tests that need a real component (megatron-core, vLLM, Slurm, ...) call :func:`require`. Locally a missing
component skips the test; under ``CI=true`` it fails, so CI can never pass by skipping.
"""

from __future__ import annotations

import contextlib
import os
import signal

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(condition: bool, what: str) -> None:
    if condition:
        return
    if IN_CI:
        pytest.fail(f"CI=true and {what} is missing: this test must run in CI", pytrace=False)
    pytest.skip(f"{what} is missing")


@pytest.fixture(autouse=True)
def _tim_cache(tmp_path_factory, monkeypatch):
    """One tiny-checkpoint cache per test session (built once, reused by every test)."""
    root = os.environ.get("TIM_TEST_CACHE") or str(tmp_path_factory.getbasetemp() / "tim-cache")
    os.environ["TIM_TEST_CACHE"] = root
    monkeypatch.setenv("TIM_CACHE", root)
    yield


def kill_tree(proc) -> None:
    """SIGKILL a process and everything it started, like a node dying.

    torchrun starts its workers in their own sessions and megatron's checkpoint writers run in child
    processes, so killing the process group is not enough.
    """
    import psutil

    family = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
    for pid in family:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    psutil.wait_procs([psutil.Process(p) for p in family if psutil.pid_exists(p)], timeout=30)
