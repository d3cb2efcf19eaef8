"""The levers of issue 57 (items 1-6), each switched off alone: what the ``moe layer`` profile measures our step
without.

A lever is either switched on the built trainer and back (:class:`Lever` with ``off``: a context manager over the
trainer) or needs a trainer built otherwise (``rebuild``: the recipe settings of the old path, built after the
profiled trainer is closed). ``available`` says why a lever cannot be measured here ('' when it can): the trainer
did not take the new path (CPU, exact mode, a setting), or the old path is not in this tree. A lever that is not
available is reported as a skip with that reason, so a lever added to :data:`LEVERS` by name shows up in the report
before its code is in place.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import get_args

import torch


@dataclass(frozen=True)
class Lever:
    name: str
    """What is switched off, in words."""
    item: int
    """Its item in issue 57."""
    phase: str
    """The phase of the step it acts on (:data:`~tim_megatron.gpu_check.phases.PHASES`)."""
    available: Callable[[object], str]
    """``available(trainer)``: '' where it can be switched off here, else why not."""
    off: Callable[[object], contextlib.AbstractContextManager] | None = None
    """``with off(trainer):`` the trainer steps without it (switched back after)."""
    rebuild: Callable[[], tuple[str, ...]] | None = None
    """``rebuild()``: recipe settings that build our trainer without it (after the profiled one is closed)."""


# ------------------------------------------------------------------------------------- item 1: Adam, norm


def _adam_available(tr) -> str:
    from patches.megatron.torch_adam_kernel import kernel_of

    k = kernel_of(tr.optimizer)
    if k is None:
        return "megatron's optimizer holds no torch AdamW here (apex or transformer-engine provides Adam)"
    return "" if k == "fused" else f"the trainer steps with {k} AdamW here (trainer.optimizer_kernel)"


@contextlib.contextmanager
def _foreach_adam(tr) -> Iterator[None]:
    from patches.megatron.torch_adam_kernel import set_kernel

    set_kernel(tr.optimizer, "foreach")
    try:
        yield
    finally:
        set_kernel(tr.optimizer, tr.optimizer_kernel)


def _norm_handle_index(tr) -> int | None:
    from patches.megatron.sync_free_grad_norm import SPEC

    names = [getattr(h, "name", None) for h in tr._handles]
    return names.index(SPEC.name) if SPEC.name in names else None


def _norm_available(tr) -> str:
    if _norm_handle_index(tr) is None:
        return "not applied here (megatron's own fallback runs: the patch applies on CUDA without apex or TE)"
    return ""


@contextlib.contextmanager
def _per_parameter_norm(tr) -> Iterator[None]:
    from patches.megatron import sync_free_grad_norm

    i = _norm_handle_index(tr)
    tr._handles[i].revert()
    try:
        yield
    finally:
        tr._handles[i] = sync_free_grad_norm.apply()


# ---------------------------------------------------------------------------------- item 2: finite check


def float64_sum_finite(tr) -> bool:
    """The finite check ``MegatronTrainer._grads_finite`` replaced: the float64 sum of every gradient buffer (each
    buffer copied to float64 first), one host read."""
    from tim_megatron.trainer.model import unwrap

    buffers = list(getattr(tr.model, "buffers", [])) + list(getattr(tr.model, "expert_parallel_buffers", []))
    grads = [b.grad_data for b in buffers if b.grad_data is not None]
    if not grads:
        for p in unwrap(tr.model).parameters():
            g = getattr(p, "main_grad", None)
            grads.append(p.grad if g is None else g)
    total = torch.zeros((), dtype=torch.float64, device=tr._device())
    for g in grads:
        if g is not None:
            total += g.sum(dtype=torch.float64)
    return math.isfinite(float(total))


@contextlib.contextmanager
def _float64_finite(tr) -> Iterator[None]:
    tr._grads_finite = lambda: float64_sum_finite(tr)
    try:
        yield
    finally:
        del tr._grads_finite


# ------------------------------------------------------------------------------------------- item 3: head


def _head_available(tr) -> str:
    if tr.head.kernels is not None:
        return "exact mode's head is the checkpointed chunk already"
    return (
        "" if getattr(tr.head, "fused", False) else "the trainer's head is the checkpointed chunk (fused off)"
    )


# -------------------------------------------------------------------------------- items 4, 5: rebuilt


def _setting_values(key: str) -> tuple[str, ...]:
    from tim_megatron.recipe.schema import TrainerConfig

    field = TrainerConfig.model_fields.get(key.split(".")[-1])
    return get_args(field.annotation) if field is not None else ()


def _experts_available(tr) -> str:
    from tim_megatron.trainer import experts

    if not hasattr(experts, "stacked_experts_class"):
        return "no stacked experts in this tree (item 4)"
    if tr.kernels.experts != "grouped":
        return f"the trainer runs the {tr.kernels.experts} experts path (trainer.experts)"
    return ""


def _dispatcher_setting(tr) -> str:
    return tr.modes.dispatcher or tr.recipe.trainer.moe_dispatcher


def _dispatcher_available(tr) -> str:
    if "indexed" not in _setting_values("trainer.moe_dispatcher"):
        return "trainer.moe_dispatcher has no indexed dispatcher in this tree (item 5)"
    from tim_megatron.trainer.dispatch import resolve_dispatcher

    got = resolve_dispatcher(_dispatcher_setting(tr), on_gpu=torch.cuda.is_available())
    return (
        "" if got == "indexed" else f"the trainer runs megatron's {got} dispatcher (trainer.moe_dispatcher)"
    )


def _megatron_dispatcher() -> tuple[str, ...]:
    """megatron-core's own dispatcher at one rank: all-to-all on CUDA (what ``auto`` took before ``indexed``),
    all-gather on CPU."""
    return (f"trainer.moe_dispatcher={'alltoall' if torch.cuda.is_available() else 'allgather'}",)


# ---------------------------------------------------------------------------------------- item 6: compile


def _compile_available(tr) -> str:
    c = getattr(tr, "compiled", None)
    if c is None:
        return "this trainer has no trainer.compile handle"
    return "" if c.active else c.functions


@contextlib.contextmanager
def _eager(tr) -> Iterator[None]:
    tr.compiled.disable()
    try:
        yield
    finally:
        tr.compiled.enable()


LEVERS: tuple[Lever, ...] = (
    Lever("torch's fused AdamW -> foreach", 1, "Adam", _adam_available, off=_foreach_adam),
    Lever(
        "sync-free grad norm -> megatron's fallback",
        1,
        "grad norm + clip",
        _norm_available,
        off=_per_parameter_norm,
    ),
    Lever("one-read finite check -> float64 sum", 2, "finite check", lambda tr: "", off=_float64_finite),
    Lever(
        "head as one function -> checkpointed chunks",
        3,
        "head + loss",
        _head_available,
        off=lambda tr: tr.head_changed(fused=False),
    ),
    Lever(
        "stacked grouped experts -> the loop",
        4,
        "backward",
        _experts_available,
        rebuild=lambda: ("trainer.experts=loop",),
    ),
    Lever(
        "indexed dispatcher -> megatron's",
        5,
        "forward",
        _dispatcher_available,
        rebuild=_megatron_dispatcher,
    ),
    Lever("compiled norm/RoPE/SwiGLU -> eager", 6, "forward", _compile_available, off=_eager),
)
"""Every lever, in the issue's order. Item 4 replaced the per-expert grouped path (no setting brings it back), so
its lever measures the only other path, the loop over experts: an upper bound of what item 4 gained."""
