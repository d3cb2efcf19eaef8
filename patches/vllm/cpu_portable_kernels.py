"""vLLM's CPU kernels for unquantized models, the same on every x86 CPU of the project's kind (vLLM 0.32, CPU).

vLLM chooses some CPU kernels by instruction set: on an Intel CPU with AMX tiles it runs the AMX variants, on an
AMD EPYC (AVX-512, no AMX) the vector ones. The same recipe then runs other code, with other rounding, on two
machines of one kind, and the AMX variants have limits of their own (the AMX MLA backend refuses float32 and
empties ``kv_b_proj`` so that the first weight reload fails; see :mod:`tim_megatron.rollout.cpu_kernels`, which
names the attention backend). This patch makes the three AMX-only choices an unquantized model meets take the
AVX-512 path vLLM takes on a CPU without AMX:

* the paged-attention kernel's instruction set (``cpu_attn._get_attn_isa``): ``amx`` becomes ``vec``, which is
  what the same function returns on x86 without AMX for the same dtype and block size;
* the unquantized MoE experts: the AMX grouped GEMM (``X86CPUUnquantizedExperts``) is not offered, so the
  portable vector grouped GEMM (``CPUUnquantizedExperts``) is chosen, as without AMX;
* small linear layers (MoE routers): the AMX "SGL" GEMM (``check_cpu_sgl_kernel``) is not used, so they go to
  oneDNN, as without AMX.

On a CPU without AMX the patch changes nothing. Quantized kernels (FP8, INT8, MXFP4), which also have AMX
variants, are not reached: the engine refuses quantized checkpoints (:mod:`tim_megatron.rollout.vllm_engine`).
Applied by the rollout engine on CPU only, before its model is built.
"""

from __future__ import annotations

from patches.guard import check_version
from patches.specs import vllm_patch

SPEC = vllm_patch(
    name="vllm-cpu-portable-kernels",
    reason="vLLM picks AMX kernels on Intel CPUs with AMX and vector kernels elsewhere, so one recipe runs other "
    "code (and other rounding) on two CPUs of the same kind.",
    targets=(
        "vllm.v1.attention.backends.cpu_attn._get_attn_isa",
        "vllm.model_executor.layers.fused_moe.experts.cpu_moe.X86CPUUnquantizedExperts._supports_current_device",
        "vllm.model_executor.layers.utils.check_cpu_sgl_kernel",
    ),
)

PORTABLE_ATTENTION_ISA = "vec"
"""What ``_get_attn_isa`` returns on x86 without AMX where it returns ``amx`` with AMX (same dtype, block size)."""


def needed() -> bool:
    import torch

    return not torch.cuda.is_available()


def _never() -> bool:
    return False


def _no_sgl_kernel(n: int, k: int, dtype) -> bool:
    return False


def apply() -> bool:
    """Install the three choices; True when this call changed anything (idempotent)."""
    check_version(SPEC)
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.v1.attention.backends import cpu_attn

    original = cpu_attn._get_attn_isa
    if getattr(original, "__tim_patch__", None) == SPEC.name:
        return False

    def _get_attn_isa(*args, **kwargs) -> str:
        isa = original(*args, **kwargs)
        return PORTABLE_ATTENTION_ISA if isa == "amx" else isa

    _get_attn_isa.__tim_patch__ = SPEC.name
    cpu_attn._get_attn_isa = _get_attn_isa
    cpu_moe.X86CPUUnquantizedExperts._supports_current_device = staticmethod(_never)
    layer_utils.check_cpu_sgl_kernel = _no_sgl_kernel
    return True
