"""Let megatron-core's router run without transformer-engine, on CPU and on CUDA.

megatron-core 0.16.1's ``moe_utils`` imports ``te_general_gemm`` inside a ``try`` that also imports
transformer-engine's fused kernels; when transformer-engine is missing the name is never bound, yet
``RouterGatingLinearFunction`` tests ``te_general_gemm is not None`` in its forward and backward, so every MoE
router raises ``NameError``. Binding it to ``None`` sends both to the plain ``torch.mm`` path the code already
has. Needed wherever transformer-engine is absent (every CPU run, and a CUDA run with megatron-core's local
layer spec); a no-op where transformer-engine is installed.
"""

from __future__ import annotations

import importlib.util
import sys

from patches.guard import Handle, check_version, set_attr
from patches.specs import megatron_core_patch

SPEC = megatron_core_patch(
    name="megatron-no-te-router-gemm",
    reason="the MoE router references te_general_gemm, which is unbound when transformer-engine is missing.",
    targets=("megatron.core.transformer.moe.moe_utils.te_general_gemm",),
)


def needed() -> bool:
    """True when ``moe_utils`` left ``te_general_gemm`` unbound (transformer-engine did not import); before
    megatron's MoE code is imported, when transformer-engine is not installed (so ``tim doctor`` imports nothing)."""
    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    if moe_utils is not None:
        return not hasattr(moe_utils, "te_general_gemm")
    return importlib.util.find_spec("transformer_engine") is None


def apply() -> Handle:
    """Bind ``moe_utils.te_general_gemm = None``; call only when :func:`needed`."""
    check_version(SPEC)
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        raise RuntimeError(
            f"{SPEC.name} must not be applied: te_general_gemm is bound ({moe_utils.__name__})"
        )
    h = Handle(SPEC.name)
    set_attr(h, moe_utils, "te_general_gemm", None)
    return h
