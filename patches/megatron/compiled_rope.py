"""megatron-core's unfused rotary embedding through ``torch.compile`` (``trainer.compile``, issue 57 item 6).

Without transformer-engine (``apply_rope_fusion`` off, as every model of this project builds) megatron-core 0.16's
``apply_rotary_pos_emb`` (``models/common/embeddings/rope_utils.py``) calls the module's
``_apply_rotary_pos_emb_bshd`` for q and k of every layer: a cosine, a sine, two casts, a chunk, a negation, a
concatenation, two products and a sum, each its own kernel and its own activation saved for the backward. This
binds that module global to a compiled form of the same function (:mod:`tim_megatron.trainer.compile` compiles it),
which ``apply_rotary_pos_emb`` looks up at every call; the original is restored by the handle. Nothing else of
megatron changes: the fused (transformer-engine) and packed-sequence (``thd``) paths are untouched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from patches.guard import Handle, check_version, set_attr
from patches.specs import megatron_core_patch

SPEC = megatron_core_patch(
    name="megatron-compiled-rope",
    reason=(
        "megatron's unfused rotary embedding runs as about ten separate kernels per q and k of every layer; "
        "trainer.compile runs it as one compiled function."
    ),
    targets=("megatron.core.models.common.embeddings.rope_utils._apply_rotary_pos_emb_bshd",),
)
TARGET = "_apply_rotary_pos_emb_bshd"


def needed() -> bool:
    """On CUDA, where ``trainer.compile: auto`` applies it (a recipe may still turn it off; never in exact mode)."""
    return torch.cuda.is_available()


def _own(fn, module) -> bool:
    return callable(fn) and getattr(fn, "__module__", None) == module.__name__


def original() -> Callable:
    """megatron-core's own ``_apply_rotary_pos_emb_bshd`` (what :func:`apply` compiles), also while a compiled form
    of it is bound; refuses a module whose function was replaced by anything else."""
    check_version(SPEC)
    from megatron.core.models.common.embeddings import rope_utils

    fn = getattr(rope_utils, TARGET, None)
    fn = getattr(fn, "_torchdynamo_orig_callable", fn)  # a compiled form of it, bound by an open trainer
    if not _own(fn, rope_utils):
        raise RuntimeError(f"{SPEC.name}: {rope_utils.__name__}.{TARGET} is not megatron-core's own ({fn!r})")
    return fn


def apply(compiled: Callable) -> Handle:
    """Bind ``rope_utils._apply_rotary_pos_emb_bshd`` to ``compiled`` (a compiled form of :func:`original`). Where
    an open trainer bound the same ``compiled`` already, nothing changes (and the handle undoes nothing)."""
    original()
    from megatron.core.models.common.embeddings import rope_utils

    h = Handle(SPEC.name)
    if getattr(rope_utils, TARGET) is not compiled:
        set_attr(h, rope_utils, TARGET, compiled)
    return h
