"""megatron-core's MLA decoder as the trainer builds it (the DeepSeek-V3 family's config and layer specs, with
tim_megatron.trainer.mla's core attention) against HF transformers' DeepSeek-V3 made from the same family's config
arguments, on a tiny dense model in float32, in a fresh process (megatron-core keeps global state).

    python tests/workers/mla_worker.py OUT.json

Variants, each a 2-layer model with the same weights on both sides (HF's random init, copied tensor by tensor):
``q_lora`` (q_a/q_b with the q latent norm), ``no_q_lora`` (one q projection, as DeepSeek-V2-Lite and Moonlight),
``yarn`` (YaRN RoPE, factor 4 over an original context of 16 positions, ``mscale_all_dim`` set, so the softmax
scale carries YaRN's correction; compared at 48 positions, beyond the original 16); and a control,
``yarn_vs_plain_rope``: the YaRN model against a megatron side built with plain RoPE. Weights are initialized with
std 0.1 so that attention is sharp and a wrong position encoding shows. Writes, per variant, the largest
|difference| of the per-token logprobs and of the logits, and the sequence length compared.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VOCAB, HIDDEN, LAYERS, HEADS, FFN = 64, 128, 2, 4, 256
NOPE, ROPE, V, KV_RANK = 32, 64, 32, 512

VARIANTS = {
    "q_lora": {"q_lora_rank": 64, "rope_scaling": None, "length": 24},
    "no_q_lora": {"q_lora_rank": None, "rope_scaling": None, "length": 24},
    "yarn": {
        "q_lora_rank": 64,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "length": 48,
    },
    # Moonlight's rms_norm_eps (1e-5): the decoder norms take it, the latent norms keep 1e-6 (DeepSeek's code and
    # HF). The latent projections are scaled down so their outputs are small enough for the epsilon to show.
    "rms_norm_eps_1e-5": {
        "q_lora_rank": 64,
        "rope_scaling": None,
        "length": 24,
        "eps": 1e-5,
        "latent_scale": 0.02,
    },
}


def dims_of(q_lora_rank, rope_scaling, eps=1e-6):
    """The variant as the DeepSeek-V3 family's dims of a dense model (the attention is what is compared)."""
    from tim_megatron.recipe.schema import ModelDims

    yarn = rope_scaling or {}
    return ModelDims(
        family="deepseek_v3",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        head_dim=NOPE + ROPE,
        num_experts=0,
        num_experts_per_tok=0,
        moe_intermediate_size=0,
        q_lora_rank=q_lora_rank or 0,
        kv_lora_rank=KV_RANK,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V,
        qk_norm="none",
        max_position_embeddings=64,
        rope_theta=10000.0,
        rms_norm_eps=eps,
        rope_scaling="yarn" if yarn else "none",
        yarn_factor=yarn.get("factor", 1.0),
        yarn_original_max_position_embeddings=yarn.get("original_max_position_embeddings", 0),
        yarn_beta_fast=yarn.get("beta_fast", 32.0),
        yarn_beta_slow=yarn.get("beta_slow", 1.0),
        yarn_mscale=yarn.get("mscale", 1.0),
        yarn_mscale_all_dim=yarn.get("mscale_all_dim", 0.0),
    )


def hf_model(dims, latent_scale=1.0):
    """HF transformers' DeepSeek-V3 from the family's own config arguments, with random weights."""
    from transformers import DeepseekV3ForCausalLM

    from tim_megatron.trainer.families.deepseek_v3 import hf_config

    cfg = hf_config(dims)
    cfg.initializer_range = 0.1  # sharp attention: a wrong position encoding would show in the logprobs
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1 so that a misplaced one shows
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape))
            if name.endswith(("q_a_proj.weight", "kv_a_proj_with_mqa.weight")):
                p.mul_(latent_scale)
    return model


def megatron_model(dims):
    """megatron-core's GPTModel as the trainer builds it (:func:`tim_megatron.trainer.model.build_model`), without
    transformer-engine."""
    from tim_megatron.recipe.schema import ModelConfig, ParallelismConfig
    from tim_megatron.trainer.model import BuildOptions, build_model

    return build_model(dims, ModelConfig(dims=dims), ParallelismConfig(), BuildOptions(use_te=False)).eval()


def copy_weights(hf, gpt, q_lora_rank) -> int:
    sd = hf.state_dict()
    pairs = {
        "embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": sd["model.norm.weight"],
        "output_layer.weight": sd["lm_head.weight"],
    }
    for i in range(LAYERS):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a, sa = h + "self_attn.", m + "self_attention."
        pairs.update(
            {
                m + "input_layernorm.weight": sd[h + "input_layernorm.weight"],
                sa + "linear_kv_down_proj.weight": sd[a + "kv_a_proj_with_mqa.weight"],
                sa + "kv_layernorm.weight": sd[a + "kv_a_layernorm.weight"],
                sa + "linear_kv_up_proj.weight": sd[a + "kv_b_proj.weight"],
                sa + "linear_proj.weight": sd[a + "o_proj.weight"],
                m + "pre_mlp_layernorm.weight": sd[h + "post_attention_layernorm.weight"],
                m + "mlp.linear_fc1.weight": torch.cat(
                    [sd[h + "mlp.gate_proj.weight"], sd[h + "mlp.up_proj.weight"]]
                ),
                m + "mlp.linear_fc2.weight": sd[h + "mlp.down_proj.weight"],
            }
        )
        if q_lora_rank:
            pairs.update(
                {
                    sa + "linear_q_down_proj.weight": sd[a + "q_a_proj.weight"],
                    sa + "q_layernorm.weight": sd[a + "q_a_layernorm.weight"],
                    sa + "linear_q_up_proj.weight": sd[a + "q_b_proj.weight"],
                }
            )
        else:
            pairs[sa + "linear_q_proj.weight"] = sd[a + "q_proj.weight"]
    params = dict(gpt.named_parameters())
    missing = sorted(set(params) - set(pairs))
    extra = sorted(set(pairs) - set(params))
    if missing or extra:
        raise RuntimeError(f"weight table: megatron-only {missing}, HF-only {extra}")
    with torch.no_grad():
        for name, value in pairs.items():
            params[name].copy_(value)
    return len(pairs)


def compare(name: str, spec: dict, *, megatron_rope_scaling="same", latent_eps: float | None = None) -> dict:
    """``megatron_rope_scaling``: the megatron side's RoPE scaling when it should differ from HF's (a control);
    ``latent_eps``: the megatron side's latent-norm epsilon when it should differ from its own (a control)."""
    from tim_megatron.trainer.mla import LatentRMSNorm

    eps = spec.get("eps", 1e-6)
    hf = hf_model(dims_of(spec["q_lora_rank"], spec["rope_scaling"], eps), spec.get("latent_scale", 1.0))
    scaling = spec["rope_scaling"] if megatron_rope_scaling == "same" else megatron_rope_scaling
    gpt = megatron_model(dims_of(spec["q_lora_rank"], scaling, eps))
    latent = [m for m in gpt.modules() if isinstance(m, LatentRMSNorm)]
    assert len(latent) == LAYERS * (2 if spec["q_lora_rank"] else 1), len(latent)
    if latent_eps is not None:
        for m in latent:
            m.eps = latent_eps
    tensors = copy_weights(hf, gpt, spec["q_lora_rank"])
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (2, spec["length"]), generator=g)
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    with torch.no_grad():
        want = hf(input_ids=ids).logits.float()
        got = gpt(input_ids=ids, position_ids=pos, attention_mask=None).float()
    lp_want = torch.log_softmax(want[:, :-1], -1).gather(-1, ids[:, 1:, None])
    lp_got = torch.log_softmax(got[:, :-1], -1).gather(-1, ids[:, 1:, None])
    return {
        "variant": name,
        "tensors": tensors,
        "length": ids.shape[1],
        "logprob_max_abs_diff": float((lp_got - lp_want).abs().max()),
        "logits_max_abs_diff": float((got - want).abs().max()),
        "logits_max_abs": float(want.abs().max()),
    }


def main(out_file: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from patches.megatron import cpu_shims
    from tests.conftest import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    from patches.megatron import mla_without_te

    handles = [m.apply() for m in (cpu_shims, mla_without_te) if m.needed()]
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    try:
        results = [compare(name, spec) for name, spec in VARIANTS.items()]
        # The control: the same YaRN model against a megatron side with plain RoPE must differ.
        results.append(compare("yarn_vs_plain_rope", VARIANTS["yarn"], megatron_rope_scaling=None))
        # The control: megatron-core's own latent norms (rms_norm_eps) against HF's must differ.
        results.append(
            compare("latent_norms_at_rms_norm_eps", VARIANTS["rms_norm_eps_1e-5"], latent_eps=1e-5)
        )
    finally:
        for h in reversed(handles):
            h.revert()
    Path(out_file).write_text(json.dumps(results, indent=1))
    for r in results:
        print(r, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
