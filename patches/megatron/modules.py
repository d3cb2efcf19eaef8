"""Reaching megatron-core's model through its wrappers (shared by the patches and the trainer)."""

from __future__ import annotations


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model
