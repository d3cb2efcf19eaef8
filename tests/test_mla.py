"""Multi-head latent attention in the trainer on CPU (issue 26, first part): megatron-core's own
``MLASelfAttention``, with tim_megatron.trainer.mla's core attention and the patch that lets it build without
transformer-engine, against HF transformers' DeepSeek-V3 in float32, with and without q-LoRA, and with YaRN at
positions beyond the original context. Run in a fresh process (tests/workers/mla_worker.py). Plus the core
attention on its own against float64, and the vLLM-side patches."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import importable, require, run_ok

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mla(tmp_path_factory) -> dict[str, dict]:
    require(importable("megatron.core", "transformers"), "megatron-core and transformers")
    out = tmp_path_factory.mktemp("mla") / "mla.json"
    run_ok([sys.executable, str(ROOT / "tests/workers/mla_worker.py"), str(out)], threads=1, timeout=600)
    return {r["variant"]: r for r in json.loads(out.read_text())}


@pytest.mark.parametrize("variant", ["q_lora", "no_q_lora", "yarn", "rms_norm_eps_1e-5"])
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


def test_the_latent_norms_keep_1e_6_when_rms_norm_eps_is_1e_5_and_it_matters(mla):
    """Moonlight-16B-A3B's rms_norm_eps is 1e-5; DeepSeek's code and HF build the q and kv latent norms with 1e-6
    (the variant above matches HF with them); megatron-core's own choice, rms_norm_eps for every norm, does not."""
    assert mla["rms_norm_eps_1e-5"]["logprob_max_abs_diff"] <= 1e-5
    assert mla["latent_norms_at_rms_norm_eps"]["logprob_max_abs_diff"] > 1e-3


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


def test_vllm_latent_norm_patch_sets_1e_6_for_deepseek_only_and_is_idempotent():
    """patches/vllm/mla_latent_norm_eps.py wraps both of vLLM's DeepSeek attentions; what it does to a built one
    is :func:`set_latent_eps`, here on vLLM's own RMSNorm. End to end, the tiny DeepSeek-V2 recipe (rms_norm_eps
    1e-5) holds vLLM against HF to 1e-5 in tests/test_families.py (5.6e-4 with the patch left out)."""
    require(importable("vllm"), "vLLM")
    from types import SimpleNamespace

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.models import deepseek_v2

    from patches.vllm import mla_latent_norm_eps as patch

    classes = (deepseek_v2.DeepseekV2MLAAttention, deepseek_v2.DeepseekV2Attention)
    originals = [c.__init__ for c in classes]
    patch.apply()
    try:
        assert patch.apply() is False  # idempotent
        assert all(c.__init__.__tim_patch__ == patch.SPEC.name for c in classes)
    finally:
        if getattr(originals[0], "__tim_patch__", None) is None:  # leave vLLM as this test found it
            for c, init in zip(classes, originals, strict=True):
                c.__init__ = init

    with set_current_vllm_config(VllmConfig()):

        def attention(q_lora=True):
            q = RMSNorm(64, eps=1e-5) if q_lora else None
            return SimpleNamespace(q_a_layernorm=q, kv_a_layernorm=RMSNorm(512, eps=1e-5))

        other = attention()
        assert patch.set_latent_eps(other, SimpleNamespace(model_type="glm_moe_dsa")) == 0
        assert other.q_a_layernorm.variance_epsilon == other.kv_a_layernorm.variance_epsilon == 1e-5
        for model_type in patch.MODEL_TYPES:
            att = attention()
            assert patch.set_latent_eps(att, SimpleNamespace(model_type=model_type)) == 2
            assert att.q_a_layernorm.variance_epsilon == att.kv_a_layernorm.variance_epsilon == 1e-6
        assert patch.set_latent_eps(attention(q_lora=False), SimpleNamespace(model_type="deepseek_v2")) == 1


def test_transformer_engines_fused_latent_norms_with_another_rms_norm_eps_are_named():
    """The transformer-engine spec (GPU) fuses the latent norms into the up-projections with rms_norm_eps, which
    cannot be set apart from the decoder norms': for Moonlight's 1e-5 that is said when the model is built, and
    nothing is said for 1e-6. (Without transformer-engine, as here, building that spec then fails.)"""
    import contextlib
    import warnings

    from tim_megatron.recipe import load_recipe
    from tim_megatron.trainer.model import block_spec

    def warned(recipe: str) -> list[str]:
        dims = load_recipe(ROOT / recipe).recipe.model.dims
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with contextlib.suppress(Exception):  # the TE spec needs transformer-engine
                block_spec(dims, True)
        return [str(w.message) for w in caught if "latent norms" in str(w.message)]

    moonlight_eps = warned("recipes/tiny-deepseek-v2/grpo.yaml")
    assert len(moonlight_eps) == 1 and "rms_norm_eps = 1e-05 with transformer-engine" in moonlight_eps[0]
    assert warned("recipes/tiny-deepseek-v3/grpo.yaml") == []


@pytest.mark.parametrize("groups", [3, 1], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_core_attention_is_causal_softmax_attention_with_its_own_value_size(dtype, groups):
    """SdpaCoreAttention against softmax attention in float64 on the same inputs: key heads of 96 channels,
    value heads of 32, 3 query heads on 3 or 1 key/value heads (grouped-query attention); queries for the whole
    sequence and for its last positions only (``sq < sk``: each sees the keys up to its own position); megatron's
    extra mask (True = masked) on top. float32 within 1e-6 relative to the output's scale; bfloat16 within one
    rounding of the exact result to bfloat16 (scores, softmax and the weighted sum in float32)."""
    from types import SimpleNamespace

    require(importable("megatron.core"), "megatron-core")
    from tim_megatron.trainer.attention import SdpaCoreAttention

    cfg = SimpleNamespace(context_parallel_size=1, attention_dropout=0.0, kv_channels=96)
    att = SdpaCoreAttention(cfg, 1, None, "self", k_channels=96, v_channels=32)
    g = torch.Generator().manual_seed(0)
    sk, b, heads = 12, 2, 3
    q_all = (torch.randn(sk, b, heads, 96, generator=g) * 2).to(dtype)
    k = (torch.randn(sk, b, groups, 96, generator=g) * 2).to(dtype).repeat_interleave(heads // groups, 2)
    v = torch.randn(sk, b, groups, 32, generator=g).to(dtype).repeat_interleave(heads // groups, 2)
    k_in, v_in = k[:, :, :: heads // groups], v[:, :, :: heads // groups]  # the groups as megatron hands them
    extra = torch.zeros(1, 1, sk, sk, dtype=torch.bool)
    extra[..., 5, 2] = True  # position 5 does not see key 2

    def exact(q: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        sq = q.shape[0]
        scores = torch.einsum("sbhd,tbhd->bhst", q.double(), k.double()) * att.scale
        masked = torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1)
        if mask is not None:
            masked = masked | mask[..., sk - sq :, :]
        probs = scores.masked_fill(masked, float("-inf")).softmax(-1)
        return torch.einsum("bhst,tbhd->sbhd", probs, v.double()).reshape(sq, b, heads * 32)

    for q, mask in ((q_all, None), (q_all, extra), (q_all[-4:], None)):
        got = att(q, k_in, v_in, None if mask is None else mask[..., sk - q.shape[0] :, :])
        want = exact(q, mask)
        assert got.shape == want.shape and got.dtype == dtype
        err = float((got.double() - want).abs().max())
        if dtype == torch.float32:
            assert err <= 1e-6 * float(want.abs().max()), err
        else:
            assert err <= float((want.to(dtype).double() - want).abs().max()) * 1.01, err
    # the masked key changes position 5 and only the positions that cannot see it are unchanged
    plain, masked = att(q_all, k, v, torch.zeros_like(extra)), att(q_all, k, v, extra)  # one kernel path
    assert not torch.equal(plain[5], masked[5])
    assert torch.equal(plain[:5], masked[:5]) and torch.equal(plain[6:], masked[6:])
    with pytest.raises(ValueError, match="packed sequences"):
        att(q_all, k, v, None, packed_seq_params=object())
