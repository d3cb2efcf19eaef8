"""``tim doctor``: will a job run here? One line per check, each ok / warn / fail with the fix.

The checks are data: :data:`CHECKS` lists small functions, each taking the shared, read-only
:class:`Context` (the recipe, if one was given, and the environment) and returning one or more
:class:`Outcome`. A check that raises is reported as a fail naming the exception, so one broken library
never hides the others. ``tim doctor`` exits 1 when any check fails.

What fails and what only warns: a fail is something that stops the job or makes its numbers wrong (a
missing or broken package, a patch whose version guard refuses where it applies, a recipe that does not
resolve or does not fit, a GPU that torch cannot use or two ranks would share, vLLM's CPU build on a CUDA
machine, a partition that does not exist). A warn is fine on a laptop or a login node but worth knowing
before a long job: no Slurm answering, no GPU outside an allocation, no transformer-engine, little free
disk, a device already in use by another process, an NCCL setting that falls back to sockets.

Heavy imports (megatron-core, vLLM, transformer-engine, Apex) are probed in a child process: an import
that crashes or prints cannot take the doctor down or garble its lines.
"""

from __future__ import annotations

from tim_megatron.doctor.base import (
    Check,
    Context,
    context_for,
    format_result,
    run_checks,
    summary,
)
from tim_megatron.doctor.devices import check_cpu, check_cuda, check_gpus, check_kernels, check_nccl
from tim_megatron.doctor.recipe_checks import check_model, check_plan, check_recipe
from tim_megatron.doctor.services import check_hf_cache, check_slurm, check_wandb
from tim_megatron.doctor.stack import (
    check_apex,
    check_dependencies,
    check_megatron,
    check_patches,
    check_python,
    check_rollout_backend,
    check_torch,
    check_transformer_engine,
)
from tim_megatron.outcome import Outcome, exit_code

CHECKS: tuple[Check, ...] = (
    check_python,
    check_torch,
    check_cuda,
    check_cpu,
    check_gpus,
    check_nccl,
    check_megatron,
    check_rollout_backend,
    check_transformer_engine,
    check_apex,
    check_dependencies,
    check_patches,
    check_slurm,
    check_wandb,
    check_hf_cache,
    check_recipe,
    check_model,
    check_kernels,
    check_plan,
)
"""Every check ``tim doctor`` runs, in the order it prints them."""

__all__ = [
    "CHECKS",
    "Check",
    "Context",
    "Outcome",
    "context_for",
    "exit_code",
    "format_result",
    "run_checks",
    "summary",
]
