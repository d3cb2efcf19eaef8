"""Shared test helpers.

Tests that need a real component (megatron-core, vLLM, Slurm, ...) call :func:`require`. Locally a missing
component skips the test; under ``CI=true`` it fails, so CI can never pass by skipping.
"""

from __future__ import annotations

import os

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
