"""megatron-core's gradient norm, clip and parameter copy without a host sync per parameter, where neither apex nor
transformer-engine is installed.

Without them megatron-core 0.16 falls back to ``megatron.core.utils.local_multi_tensor_l2_norm`` and
``local_multi_tensor_scale`` (``optimizer/clip_grads.py`` and ``optimizer/optimizer.py`` bind them at import). The
norm takes one ``torch.norm`` per gradient and builds a tensor from the list of their 0-d CUDA results, which waits
for the device once per parameter (266 waits at one layer of Qwen3-30B-A3B's shape), then converts the result to a
Python float and back; the scale (the clip, and the copy of the fp32 main parameters into the model's) writes
``src * scale`` into a temporary per parameter before copying it. This patch binds, in both modules:

* the norm: ``torch._foreach_norm`` over the list, then the norm of their stack, all on the device (one kernel
  launch per tensor group, no wait); megatron's own code then takes one ``.item()`` per step for the total;
* the scale: ``torch._foreach_mul_`` in place when source and destination are the same tensors (the clip), and
  ``torch._foreach_copy_`` of the scaled source otherwise (a scale of 1 is a plain copy, the parameter copy).

The scale gives the fallback's values bit for bit; the norm sums the same squares in another order (float32, a
relative difference of order 1e-7). Applied on CUDA only (the waits are the device's; on CPU the fallback's numbers
stay what every CPU run has measured), and only where the fallback is bound.
"""

from __future__ import annotations

import sys

import torch

from patches.guard import Handle, check_version, set_attr
from patches.specs import megatron_core_patch

SPEC = megatron_core_patch(
    name="megatron-sync-free-grad-norm",
    reason=(
        "without apex or transformer-engine the grad norm waits for the device once per parameter and the clip "
        "and parameter copy allocate a temporary per parameter."
    ),
    targets=(
        "megatron.core.optimizer.clip_grads.l2_norm_impl",
        "megatron.core.optimizer.clip_grads.multi_tensor_scale_impl",
        "megatron.core.optimizer.optimizer.multi_tensor_scale_impl",
    ),
)
MODULES = ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer")


def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for ``local_multi_tensor_l2_norm``: the l2 norm of every tensor of ``tensor_lists`` as a ``[1]``
    float32 tensor on their device, with no host sync. ``per_tensor`` norms are not built (megatron asks for none)."""
    if per_tensor:
        raise NotImplementedError(f"{SPEC.name}: per-tensor norms (megatron-core 0.16 asks for none)")
    tensors = [t for group in tensor_lists for t in group]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).reshape(1), None


def scale(chunk_size, noop_flag, tensor_lists, factor):
    """Drop-in for ``local_multi_tensor_scale``: ``dst = src * factor`` for each pair, fused, no temporary when
    ``src`` is ``dst`` (the clip); a factor of 1 copies (the parameter copy)."""
    src, dst = tensor_lists
    if not src:
        return
    if all(a is b for a, b in zip(src, dst, strict=True)):
        if factor != 1.0:
            torch._foreach_mul_(dst, factor)
        return
    torch._foreach_copy_(dst, src if factor == 1.0 else torch._foreach_mul(src, factor))


def needed() -> bool:
    """On CUDA, when megatron-core's optimizer modules bind the local fallbacks (or will: neither apex nor
    transformer-engine is importable)."""
    if not torch.cuda.is_available():
        return False
    utils = sys.modules.get("megatron.core.utils")
    bound = [sys.modules.get(m) for m in MODULES]
    if utils is not None and all(m is not None for m in bound):
        return any(
            getattr(m, "multi_tensor_scale_impl", None) is utils.local_multi_tensor_scale for m in bound
        )
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is None and importlib.util.find_spec("apex") is None


def apply() -> Handle:
    """Bind :func:`l2_norm` and :func:`scale` where megatron-core bound its local fallbacks; refuses to touch
    anything else (apex's or transformer-engine's kernels)."""
    check_version(SPEC)
    import importlib

    from megatron.core import utils

    h = Handle(SPEC.name)
    for name in MODULES:
        module = importlib.import_module(name)
        if getattr(module, "multi_tensor_scale_impl", None) is not utils.local_multi_tensor_scale:
            raise RuntimeError(
                f"{SPEC.name}: {name} does not use megatron's local fallback; nothing to replace"
            )
        set_attr(h, module, "multi_tensor_scale_impl", scale)
        if hasattr(module, "l2_norm_impl"):
            if module.l2_norm_impl is not utils.local_multi_tensor_l2_norm:
                raise RuntimeError(f"{SPEC.name}: {name}.l2_norm_impl is not megatron's local fallback")
            set_attr(h, module, "l2_norm_impl", l2_norm)
    return h
