"""Build megatron-core's sliding-window attention mask on the CPU when there is no CUDA.

megatron-core 0.16.1's local attention (``DotProductAttention`` -> ``FusedScaleMaskSoftmax.forward_torch_softmax``)
replaces the mask of a sliding-window layer (``window_size`` with ``window_attn_skip_freq``, gpt-oss's alternating
layers) with ``transformer.utils.get_sliding_window_causal_mask``, which allocates it with ``device="cuda"``: on a
machine without CUDA every windowed layer raises at its first forward (``Torch not compiled with CUDA enabled``),
and the CPU shims cannot help (they redirect ``torch.cuda.current_device()``, not a literal device string). The
patch binds the name in ``fused_softmax`` to the same mask built on the CPU: ``True`` (masked) outside
``[i - window_size[0], i + window_size[1]]`` for query ``i``, aligned to the last key as megatron's is. Needed
wherever CUDA is absent; applied by the trainer for attention with windows (:mod:`tim_megatron.attention_kinds`).
"""

from __future__ import annotations

import functools

import torch

from patches.guard import Handle, check_version, set_attr
from patches.specs import megatron_core_patch

SPEC = megatron_core_patch(
    name="megatron-sliding-window-mask",
    reason='the sliding-window causal mask is allocated with device="cuda", so windowed layers fail without CUDA.',
    targets=("megatron.core.fusions.fused_softmax.get_sliding_window_causal_mask",),
)


@functools.lru_cache(maxsize=32)
def sliding_window_causal_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
    """megatron's boolean mask (True = masked) of a ``window_size = (left, right)`` window, on the CPU."""
    allowed = torch.ones(sq, skv, dtype=torch.bool)
    allowed = torch.triu(allowed, diagonal=skv - sq - window_size[0])
    return ~torch.tril(allowed, diagonal=skv - sq + window_size[1])


def needed() -> bool:
    return not torch.cuda.is_available()


def apply() -> Handle:
    """Bind ``fused_softmax.get_sliding_window_causal_mask`` to :func:`sliding_window_causal_mask`."""
    check_version(SPEC)
    import megatron.core.fusions.fused_softmax as fused_softmax

    h = Handle(SPEC.name)
    set_attr(h, fused_softmax, "get_sliding_window_causal_mask", sliding_window_causal_mask)
    return h
