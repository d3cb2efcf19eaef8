"""The latent RMSNorms of DeepSeek-V2/V3 attention with the epsilon of the model's own code (vLLM).

DeepSeek's reference code (its ``modeling_deepseek.py``, which DeepSeek-V2/V3, Kimi-K2 and Moonlight ship, and
HF transformers' ``DeepseekV2Attention`` / ``DeepseekV3Attention``) builds the two norms inside multi-head latent
attention, ``q_a_layernorm`` (after the q down-projection) and ``kv_a_layernorm`` (after the kv one), with the
norm's default epsilon, 1e-6, whatever ``config.rms_norm_eps`` says; only the decoder layers' norms take
``rms_norm_eps``. vLLM 0.32 builds both latent norms with ``config.rms_norm_eps``. For a checkpoint whose
``rms_norm_eps`` is not 1e-6, such as Moonlight-16B-A3B's 1e-5, vLLM then computes another function than the
model's own code: on the tiny DeepSeek models, 1e-5 in the latent norms moves logprobs by up to 1e-2. The patch
sets the two norms' epsilon to :data:`LATENT_NORM_EPS` after vLLM builds a DeepSeek-V2/V3 attention; the trainer
builds its latent norms the same way (``tim_megatron.trainer.mla.LatentRMSNorm``). Applied by the rollout engine
before its model is built, on CPU and GPU; other models are left as they are.
"""

from __future__ import annotations

from patches.guard import check_version
from patches.specs import vllm_patch
from tim_megatron.attention_kinds import LATENT_NORM_EPS

MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")
"""HF ``model_type`` values whose latent norms are built with :data:`LATENT_NORM_EPS`."""

SPEC = vllm_patch(
    name="vllm-mla-latent-norm-eps",
    reason="vLLM builds DeepSeek's q_a_layernorm and kv_a_layernorm with config.rms_norm_eps; the model's own "
    "code uses 1e-6, so checkpoints with another rms_norm_eps (Moonlight: 1e-5) score other logprobs.",
    targets=(
        "vllm.model_executor.models.deepseek_v2.DeepseekV2MLAAttention.__init__",
        "vllm.model_executor.models.deepseek_v2.DeepseekV2Attention.__init__",
    ),
)


def set_latent_eps(attention, config) -> int:
    """Give ``attention``'s latent norms :data:`LATENT_NORM_EPS` when ``config`` is a DeepSeek-V2/V3 model;
    returns how many norms it set."""
    if getattr(config, "model_type", None) not in MODEL_TYPES:
        return 0
    count = 0
    for name in ("q_a_layernorm", "kv_a_layernorm"):
        norm = getattr(attention, name, None)
        if norm is not None:
            norm.variance_epsilon = LATENT_NORM_EPS
            count += 1
    return count


def apply() -> bool:
    """Wrap both attention classes' ``__init__``; True when this call changed them (idempotent)."""
    check_version(SPEC)
    from vllm.model_executor.models import deepseek_v2

    changed = False
    for cls in (deepseek_v2.DeepseekV2MLAAttention, deepseek_v2.DeepseekV2Attention):
        original = cls.__init__
        if getattr(original, "__tim_patch__", None) == SPEC.name:
            continue

        def __init__(self, *args, _original=original, **kwargs):
            _original(self, *args, **kwargs)
            config = kwargs.get("config")
            if config is None:  # (vllm_config, config, ...) positionally
                config = args[1] if len(args) > 1 else None
            set_latent_eps(self, config)

        __init__.__tim_patch__ = SPEC.name
        __init__.__wrapped__ = original
        cls.__init__ = __init__
        changed = True
    return changed
