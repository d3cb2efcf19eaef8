"""Architectures we know and refuse, each with the piece that is missing (checked on this project's stack)."""

from __future__ import annotations

_MLA = (
    "it needs multi-head latent attention (MLA). megatron-core 0.16.1 builds MLA's core attention with separate "
    "key and value head sizes, which only transformer-engine's attention accepts (the local DotProductAttention "
    "fails with 'unexpected keyword argument k_channels'), and transformer-engine is CUDA-only, so the trainer "
    "cannot run it on CPU and no test here could check it. vLLM's CPU MLA backend does run (for "
    "kv_lora_rank + qk_rope_head_dim = 576 only). Missing piece: an MLA family module (weight table for "
    "q_a/q_b/kv_a/kv_b projections, interleaved RoPE, group-limited routing) verified on a GPU with "
    "transformer-engine"
)

REFUSED: dict[str, str] = {
    "DeepseekV3ForCausalLM": f"DeepseekV3ForCausalLM (DeepSeek-V3, Moonlight) is not supported: {_MLA}",
    "DeepseekV2ForCausalLM": f"DeepseekV2ForCausalLM (DeepSeek-V2) is not supported: {_MLA}",
}
"""HF architecture -> why it is refused."""
