"""Which of torch's AdamW kernels megatron-core's optimizer steps with, where it falls back to torch's AdamW.

Without apex or transformer-engine, megatron-core 0.16 (``optimizer/__init__.py``, its Adam import fallback) builds
``torch.optim.AdamW`` with no kernel named, so torch takes its ``foreach`` kernel on CUDA, which allocates a
temporary of 4 bytes per parameter for the step (25.5 GiB at the 1.245e9 parameters of the 1-layer 30B shape: the
peak ``tim plan`` did not count). torch's ``fused`` kernel computes the same update in one kernel per tensor group
with no such temporary. This sets the kernel on every torch Adam inside megatron's optimizer wrappers (the chained
optimizers, each wrapper's ``.optimizer``) by the flags torch's constructor would have set (``fused``, ``foreach``
in each parameter group), and moves each existing ``step`` where that kernel keeps it (fused: a float32 tensor on
the parameter's device; foreach: a float32 CPU scalar). Nothing else of the state changes, so the moments and
master weights are the same bits under either kernel; a load (which takes the saved groups' flags) is followed by
:func:`set_kernel` again.
"""

from __future__ import annotations

import torch

from patches.guard import check_version
from patches.specs import megatron_core_patch

SPEC = megatron_core_patch(
    name="megatron-torch-adam-kernel",
    reason=(
        "without apex or transformer-engine megatron-core builds torch's AdamW without naming its kernel, and the "
        "foreach kernel torch then picks allocates a temporary of 4 bytes per parameter."
    ),
    targets=("megatron.core.optimizer.MegatronOptimizer.optimizer (torch.optim.AdamW param_groups)",),
)
KERNELS = ("fused", "foreach")


def torch_adams(optimizer) -> list[torch.optim.Optimizer]:
    """The torch Adam/AdamW optimizers inside megatron's wrapper (a chained one holds several)."""
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    inner = [getattr(o, "optimizer", None) for o in chained]
    return [o for o in inner if type(o) in (torch.optim.AdamW, torch.optim.Adam)]


def fused_supported(optimizer: torch.optim.Optimizer) -> str | None:
    """Why torch's fused kernel cannot step ``optimizer`` (None: it can): a parameter on a device it has no fused
    kernel for, or not floating point."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    devices = _get_fused_kernels_supported_devices()
    for g in optimizer.param_groups:
        for p in g["params"]:
            if p.device.type not in devices or not torch.is_floating_point(p):
                return f"a {p.dtype} parameter on {p.device} (fused kernels: {', '.join(devices)})"
    return None


def kernel_of(optimizer) -> str | None:
    """The kernel every torch Adam inside ``optimizer`` steps with (None: none inside; ``mixed`` if they differ)."""
    found = {
        "fused" if g.get("fused") else "foreach" if g.get("foreach") is not False else "for-loop"
        for o in torch_adams(optimizer)
        for g in o.param_groups
    }
    return None if not found else found.pop() if len(found) == 1 else "mixed"


def set_kernel(optimizer, kernel: str) -> int:
    """Step every torch Adam inside ``optimizer`` with ``kernel`` (``fused`` or ``foreach``); returns how many.
    ``ValueError`` when ``fused`` cannot run on its parameters."""
    if kernel not in KERNELS:
        raise ValueError(f"Adam kernel {kernel!r}; allowed: {', '.join(KERNELS)}")
    adams = torch_adams(optimizer)
    if not adams:
        return 0
    check_version(SPEC)
    for o in adams:
        if kernel == "fused" and (why := fused_supported(o)):
            raise ValueError(f"trainer.optimizer_kernel = fused: torch's fused AdamW cannot step {why}")
        for g in o.param_groups:
            g["fused"], g["foreach"] = kernel == "fused", kernel == "foreach"
            if g.get("capturable") or g.get("differentiable"):
                raise ValueError(
                    f"trainer.optimizer_kernel = {kernel}: the optimizer is capturable or differentiable"
                )
            for p in g["params"]:
                step = o.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor):
                    where = p.device if kernel == "fused" else torch.device("cpu")
                    o.state[p]["step"] = step.detach().to(device=where, dtype=torch.float32).clone()
    return len(adams)
