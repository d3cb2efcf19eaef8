"""Architectures we know and refuse, each with the piece that is missing (checked on this project's stack)."""

from __future__ import annotations

_V2 = (
    "DeepSeek-V2's router differs from V3's: softmax scores, and with groups (topk_method "
    "group_limited_greedy) a group scored by its best expert, where megatron-core scores a group by the sum of its "
    "best top-k / topk_group experts. Missing piece: a deepseek_v2 family module (V2-Lite, one group, needs only "
    "the softmax router; the full V2 also a group score). DeepSeek-V3, Kimi-K2 and Moonlight "
    "(DeepseekV3ForCausalLM) are supported"
)

REFUSED: dict[str, str] = {
    "DeepseekV2ForCausalLM": f"DeepseekV2ForCausalLM (DeepSeek-V2) is not supported: {_V2}",
}
"""HF architecture -> why it is refused."""
