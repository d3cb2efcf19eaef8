"""Applying the megatron-core patches a run's modes name (:attr:`tim_megatron.modes.RunModes.patches`).

A patch applies at one of three moments of the trainer's build: before the parallel groups exist (module-level
replacements), once they exist (those that read the tensor-parallel group), and on the built model (hooks and
kernels on its modules). Each patch module checks the megatron-core version it targets and fails loudly on
another; the process-wide ones also say whether this environment needs them (``needed()``: no
transformer-engine, no CUDA), and are applied only then.
"""

from __future__ import annotations

from patches.megatron import (
    cpu_shims,
    expert_bias_grad,
    invariant_kernels,
    mla_tp_rope_grad,
    mla_without_te,
    no_te_router_gemm,
    ordered_reductions,
    router_replay,
    sliding_window_mask,
    sync_free_grad_norm,
)
from tim_megatron.modes import RunModes

BEFORE_INIT = {
    "cpu_shims": cpu_shims,
    "no_te_router_gemm": no_te_router_gemm,
    "sync_free_grad_norm": sync_free_grad_norm,
    "mla_without_te": mla_without_te,
    "sliding_window_mask": sliding_window_mask,
    "expert_bias_grad": expert_bias_grad,
    "ordered_reductions": ordered_reductions,
}
"""Process-wide replacements, applied before the parallel groups exist, when the environment needs them."""
AFTER_INIT = {"mla_tp_rope_grad": mla_tp_rope_grad}
"""Applied once the tensor-parallel group exists."""
ON_MODEL = ("router_replay", "invariant_kernels")
"""Applied to the built model."""

KNOWN = (*BEFORE_INIT, *AFTER_INIT, *ON_MODEL)


def _check(modes: RunModes) -> None:
    unknown = [p for p in modes.patches if p not in KNOWN]
    if unknown:
        raise ValueError(f"modes.patches = {unknown}: no such patch; allowed: {', '.join(KNOWN)}")


def before_init(modes: RunModes) -> list:
    """Pin exact mode's CPU reductions (MKL reads them at the process's first GEMM) and apply the process-wide
    patches; returns their handles."""
    _check(modes)
    if modes.exact:
        from tim_megatron.exact.kernels import pin_cpu_reductions

        pin_cpu_reductions()
    handles = []
    for name in modes.patches:
        if name == "no_te_router_gemm":
            import megatron.core.transformer.moe.moe_utils
        if name == "sync_free_grad_norm":
            import megatron.core.optimizer  # noqa: F401  (binds its fallbacks, or apex's / transformer-engine's)
        patch = BEFORE_INIT.get(name)
        if patch is not None and patch.needed():
            handles.append(patch.apply())
    return handles


def after_init(modes: RunModes) -> list:
    """The patches that read the parallel groups; returns their handles."""
    return [AFTER_INIT[name].apply() for name in modes.patches if name in AFTER_INIT]


def on_model(modes: RunModes, gpt, *, device: str):
    """Router replay's hooks, the expert biases' gradient reduction and exact mode's row-invariant kernels (for
    ``device``, admitted there: :func:`tim_megatron.exact.kernels.admit_kernels`) on the built model; returns the
    kernels' :class:`~tim_megatron.exact.kernels.Admission` in exact mode, else None."""
    if "router_replay" in modes.patches:
        router_replay.attach(gpt)
    if "expert_bias_grad" in modes.patches:
        expert_bias_grad.unmark_sequence_parallel(gpt)
    if "invariant_kernels" in modes.patches:
        from tim_megatron.exact.kernels import admit_kernels

        kernels, admission = admit_kernels(device)
        invariant_kernels.apply(gpt, kernels)
        return admission
    return None
