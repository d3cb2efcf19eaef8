"""Rotate every head of a 3-D query on CPU (vLLM's rotary embedding, CPU backend).

vLLM 0.32's CPU ``rotary_embedding`` kernel is right for ``[tokens, heads x head_size]`` tensors and for a single
head, but wrong for ``[tokens, heads, head_size]`` tensors with more than one head: every head comes out rotated
by the wrong angles (``tests/test_mla.py`` measures errors of about 3-6 against ``forward_native``). Models that
pass 2-D tensors (Qwen3, Mixtral, OLMoE, GLM-4.5) are unaffected. Multi-head latent attention (DeepSeek-V2/V3)
passes the query's rotated part as ``[tokens, heads, qk_rope_head_dim]``, so on CPU its logprobs were off by
about 0.6 nats while every other part of the model matched HF transformers. The patch hands the kernel the same
data as ``[tokens, heads x head_size]`` (a copy when the tensor is a strided slice, written back in place, as
the kernel's callers expect). Applied by the rollout engine on CPU only, before its model is built.
"""

from __future__ import annotations

from patches.guard import check_version
from patches.specs import vllm_patch

SPEC = vllm_patch(
    name="vllm-cpu-rope-heads",
    reason="the CPU rotary-embedding kernel mis-rotates [tokens, heads, head_size] tensors with more than one head "
    "(multi-head latent attention's query).",
    targets=("vllm.model_executor.layers.rotary_embedding.base.RotaryEmbedding.forward_cpu",),
)


def needed() -> bool:
    import torch

    return not torch.cuda.is_available()


def _flat(t):
    """``[tokens, heads, size]`` as ``[tokens, heads x size]`` (a view when possible), and whether it is a copy."""
    flat = t.reshape(t.shape[0], -1)
    return flat, flat.data_ptr() != t.data_ptr() or not t.is_contiguous()


def apply() -> bool:
    """Wrap ``RotaryEmbedding.forward_cpu``; True when this call changed it (idempotent)."""
    check_version(SPEC)
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    original = RotaryEmbedding.forward_cpu
    if getattr(original, "__tim_patch__", None) == SPEC.name:
        return False

    def forward_cpu(self, positions, query, key=None):
        if query.dim() != 3 and (key is None or key.dim() != 3):
            return original(self, positions, query, key)
        q, q_copied = _flat(query) if query.dim() == 3 else (query, False)
        k, k_copied = _flat(key) if key is not None and key.dim() == 3 else (key, False)
        original(self, positions, q, k)
        if q_copied:
            query.copy_(q.view_as(query))
        if k_copied:
            key.copy_(k.view_as(key))
        return query, key

    forward_cpu.__tim_patch__ = SPEC.name
    RotaryEmbedding.forward_cpu = forward_cpu
    return True
