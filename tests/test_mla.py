"""Multi-head latent attention in the trainer on CPU (issue 26, first part): megatron-core's own
``MLASelfAttention``, with tim_megatron.trainer.mla's core attention and the patch that lets it build without
transformer-engine, against HF transformers' DeepSeek-V3 in float32, with and without q-LoRA, and with YaRN at
positions beyond the original context. Run in a fresh process (tests/workers/mla_worker.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import importable, require

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mla(tmp_path_factory) -> dict[str, dict]:
    require(importable("megatron.core", "transformers"), "megatron-core and transformers")
    out = tmp_path_factory.mktemp("mla") / "mla.json"
    res = subprocess.run(
        [sys.executable, str(ROOT / "tests/workers/mla_worker.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return {r["variant"]: r for r in json.loads(out.read_text())}


@pytest.mark.parametrize("variant", ["q_lora", "no_q_lora", "yarn"])
def test_megatron_mla_equals_hf_deepseek_v3_in_fp32(mla, variant):
    r = mla[variant]
    # every tensor copied, none left over: q_a, q_a norm, q_b (or q), kv_a, kv_a norm, kv_b, o, two layer norms,
    # the MLP's two, per layer; embeddings, final norm and head
    assert r["tensors"] == (25 if variant != "no_q_lora" else 21)
    assert r["logprob_max_abs_diff"] <= 1e-5, r
    assert r["logits_max_abs_diff"] <= 1e-5 * max(1.0, r["logits_max_abs"]), r


def test_yarn_is_compared_beyond_the_original_context_and_matters_there(mla):
    """48 positions against an original context of 16; the same model with plain RoPE on the megatron side is off
    by nats, so the comparison above does test YaRN (and attention is sharp enough to show a wrong encoding)."""
    assert mla["yarn"]["length"] == 48 > 16
    assert mla["yarn_vs_plain_rope"]["logprob_max_abs_diff"] > 0.1


def test_the_mla_patch_is_version_guarded_and_refuses_where_transformer_engine_exists(monkeypatch):
    import megatron.core.transformer.multi_latent_attention as m

    from patches.guard import check_version
    from patches.megatron import mla_without_te

    check_version(mla_without_te.SPEC)  # the installed megatron-core is the verified one
    monkeypatch.setattr(m, "TELinear", type("TELinear", (), {}))  # a real class: transformer-engine present
    with pytest.raises(RuntimeError, match="must not be applied: TELinear is a real class"):
        mla_without_te.apply()


def test_vllm_cpu_rope_rotates_every_head_of_a_3d_query_with_the_patch():
    """vLLM 0.32's CPU rotary kernel mis-rotates ``[tokens, heads, size]`` tensors with more than one head (MLA's
    query slice); with patches/vllm/cpu_rope_heads.py it equals vLLM's own ``forward_native``, also for a strided
    slice written back in place."""
    require(importable("vllm"), "vLLM")
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from patches.vllm import cpu_rope_heads

    original = RotaryEmbedding.forward_cpu
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(
            64,
            max_position=64,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
            is_neox_style=False,
        )
        g = torch.Generator().manual_seed(0)
        pos = torch.arange(6)
        full, key = torch.randn(6, 4, 96, generator=g), torch.randn(6, 1, 64, generator=g)
        want_q, want_k = rope.forward_native(pos, full[..., 32:].clone(), key.clone())
        bare = full.clone()
        original(rope, pos, bare[..., 32:], key.clone())
        assert (bare[..., 32:] - want_q).abs().max() > 1  # the kernel alone: wrong angles
        try:
            cpu_rope_heads.apply()
            q, k = full.clone(), key.clone()
            rope.forward_cpu(pos, q[..., 32:], k)
            assert (q[..., 32:] - want_q).abs().max() < 1e-5 and (k - want_k).abs().max() < 1e-5
            assert torch.equal(q[..., :32], full[..., :32])  # the rest of the row untouched
        finally:
            RotaryEmbedding.forward_cpu = original
