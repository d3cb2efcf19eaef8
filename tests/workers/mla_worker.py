"""megatron-core's MLA decoder (with tim_megatron.trainer.mla's core attention) against HF transformers'
DeepSeek-V3, on a tiny dense model in float32, in a fresh process (megatron-core keeps global state).

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


def hf_model(q_lora_rank, rope_scaling, eps=1e-6, latent_scale=1.0):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if rope_scaling:
        rope = {**rope_scaling, "rope_theta": 10000.0}
    cfg = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        moe_intermediate_size=64,
        num_hidden_layers=LAYERS,
        first_k_dense_replace=LAYERS,  # every layer dense: the attention is what is compared
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=KV_RANK,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        max_position_embeddings=64,
        rope_parameters=rope,
        rope_interleave=True,
        rms_norm_eps=eps,
        tie_word_embeddings=False,
        attention_bias=False,
        initializer_range=0.1,  # sharp attention: a wrong position encoding would show in the logprobs
    )
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1 so that a misplaced one shows
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape))
            if name.endswith(("q_a_proj.weight", "kv_a_proj_with_mqa.weight")):
                p.mul_(latent_scale)
    return model


def megatron_model(q_lora_rank, rope_scaling, eps=1e-6):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import MLATransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from tim_megatron.trainer.mla import mla_layer_spec
    from tim_megatron.trainer.model import plain_layers
    from tim_megatron.trainer.norm import SequenceParallelRMSNorm

    yarn = rope_scaling or {}
    config = MLATransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=FFN,
        layernorm_epsilon=eps,
        **plain_layers(),
        use_cpu_initialization=True,
        perform_initialization=False,
        params_dtype=torch.float32,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=KV_RANK,
        qk_head_dim=NOPE,
        qk_pos_emb_head_dim=ROPE,
        v_head_dim=V,
        rope_type="yarn" if yarn else "rope",
        rotary_base=10000,
        rotary_scaling_factor=yarn.get("factor", 1.0),
        original_max_position_embeddings=yarn.get("original_max_position_embeddings", 64),
        beta_fast=yarn.get("beta_fast", 32.0),
        beta_slow=yarn.get("beta_slow", 1.0),
        mscale=yarn.get("mscale", 1.0),
        mscale_all_dim=yarn.get("mscale_all_dim", 0.0),
    )
    spec = TransformerBlockSubmodules(
        layer_specs=[mla_layer_spec(num_experts=None, use_te=False) for _ in range(LAYERS)],
        layer_norm=SequenceParallelRMSNorm,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=64,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    ).eval()


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
    hf = hf_model(spec["q_lora_rank"], spec["rope_scaling"], eps, spec.get("latent_scale", 1.0))
    scaling = spec["rope_scaling"] if megatron_rope_scaling == "same" else megatron_rope_scaling
    gpt = megatron_model(spec["q_lora_rank"], scaling, eps)
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
