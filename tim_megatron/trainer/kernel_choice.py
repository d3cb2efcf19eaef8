"""The trainer's kernels for a run, decided in one place for the trainer, ``tim doctor`` and ``tim plan``.

:func:`choose_kernels` takes the recipe, its modes and the device the run will train on, and returns the core
attention, the expert path and the Adam kernel (:class:`KernelChoice`). The trainer builds what it returns on the
device it runs on; the doctor states it for this machine; the plan asks it for the cluster's GPUs, where the
grouped GEMM's own probe cannot run, with :func:`planned_grouped_problem` (the kernel's stated rules: bfloat16 and
16-byte rows) in its place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tim_megatron.trainer.attention import resolve_attention
from tim_megatron.trainer.experts import grouped_mm_problem, resolve_experts

if TYPE_CHECKING:
    from tim_megatron.modes import RunModes
    from tim_megatron.recipe.schema import Recipe

ADAM_KERNELS = ("auto", "fused", "foreach")


@dataclass(frozen=True)
class KernelChoice:
    """What the trainer of a run computes with."""

    attention: str
    """The core attention: the attention kind's own kernel, or ``materialized`` / ``sdpa``."""
    experts: str
    """The routed experts' path: ``loop`` or ``grouped`` (``loop`` for a dense model, which has none)."""
    optimizer: str
    """The Adam kernel where megatron falls back to torch's AdamW: ``fused`` or ``foreach``."""


def resolve_adam(setting: str, *, on_gpu: bool) -> str:
    """``trainer.optimizer_kernel`` resolved: ``auto`` is fused on CUDA and foreach on CPU (where every CPU figure
    of this project was measured with it)."""
    if setting not in ADAM_KERNELS:
        raise ValueError(f"trainer.optimizer_kernel = {setting!r}; allowed: {', '.join(ADAM_KERNELS)}")
    if setting == "auto":
        return "fused" if on_gpu else "foreach"
    return setting


def planned_grouped_problem(*, device: str, dtype: torch.dtype, widths: tuple[int, ...] = ()) -> str:
    """Why the grouped GEMM would not run on a planned CUDA device ('' when it would), from the kernel's stated
    rules, without a GPU to ask: bfloat16 only, and rows of a multiple of 16 bytes."""
    size = torch.tensor([], dtype=dtype).element_size()
    odd = [w for w in widths if (w * size) % 16]
    if odd:
        return f"rows of {odd[0]} {dtype} values are not a multiple of 16 bytes"
    if device == "cuda" and dtype != torch.bfloat16:
        return f"torch._grouped_mm's CUDA kernel takes bfloat16, not {dtype}"
    return ""


def choose_kernels(
    recipe: Recipe,
    modes: RunModes,
    *,
    on_gpu: bool,
    grouped_problem: Callable[..., str] = grouped_mm_problem,
) -> KernelChoice:
    """The kernels the trainer of ``recipe`` uses on a CUDA device (``on_gpu``) or the CPU (``ValueError`` for a
    setting that cannot run there, naming the key). ``grouped_problem``: the grouped GEMM's check (the kernel's own
    probe by default)."""
    t, d = recipe.trainer, recipe.model.dims
    experts = "loop"
    if d.is_moe:
        experts = resolve_experts(
            t.experts,
            exact=modes.exact,
            dtype=getattr(torch, recipe.trainer_dtype),
            on_gpu=on_gpu,
            widths=(d.hidden_size, d.moe_intermediate_size // recipe.parallel.etp),
            biases=d.linear_biases,
            problem=grouped_problem,
        )
    return KernelChoice(
        attention=modes.attention.fixed_kernel
        or resolve_attention(t.attention, exact=modes.exact, on_gpu=on_gpu),
        experts=experts,
        optimizer=resolve_adam(t.optimizer_kernel, on_gpu=on_gpu),
    )
