"""Architectures we know and refuse, each with the piece that is missing (checked on this project's stack)."""

from __future__ import annotations

_MLA = (
    "it needs multi-head latent attention (MLA) as a model family. The trainer's MLA attention runs on CPU "
    "(megatron-core's MLASelfAttention with tim_megatron/trainer/mla.py's core attention; it equals HF "
    "transformers' DeepSeek-V3 attention in float32, q-LoRA and YaRN included), but the family module is not "
    "built: the config.json reader, the weight table (q_a/q_b/kv_a/kv_b projections, TP and EP splits), "
    "group-limited routing, vLLM's CPU MLA engine (kv_lora_rank + qk_rope_head_dim = 576 only), FP8 checkpoints "
    "and MLA's compressed KV cache in the plans"
)

REFUSED: dict[str, str] = {
    "DeepseekV3ForCausalLM": f"DeepseekV3ForCausalLM (DeepSeek-V3, Moonlight) is not supported: {_MLA}",
    "DeepseekV2ForCausalLM": f"DeepseekV2ForCausalLM (DeepSeek-V2) is not supported: {_MLA}",
}
"""HF architecture -> why it is refused."""
