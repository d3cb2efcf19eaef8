"""The raw library's train step: the reference our train step is measured against (``make bench``'s trainer
bench and ``make gpu-check``'s trainer section).

``GPTModel(..., labels=...)`` (megatron-core's own head and cross-entropy) on the trainer's model, backward,
``finalize_model_grads``, the trainer's megatron optimizer step. Nothing of ours runs inside it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def bare_megatron_step(trainer, *, ids: torch.Tensor, mask: torch.Tensor) -> Callable[[], None]:
    """A function running one bare megatron-core step of ``trainer``'s model on ``ids`` (sequences x length),
    the loss summed over ``mask`` and divided by its count. Tensors go to the trainer's device once, here."""
    from megatron.core.distributed import finalize_model_grads

    from patches.megatron.cpu_shims import cuda_placement_to_cpu
    from tim_megatron.trainer.attention import uses_explicit_mask
    from tim_megatron.trainer.model import causal_mask, unwrap

    dev = trainer._device()
    seqs, length = ids.shape
    ids = ids.to(dev)
    pos = torch.arange(length, device=dev).unsqueeze(0).expand(seqs, -1)
    labels = torch.roll(ids, -1, 1)
    # as the trainer runs it: the mask as a tensor only for the materialized attention (flash needs none)
    attn = causal_mask(length, dev) if uses_explicit_mask(unwrap(trainer.model)) else None
    weights = mask.to(dev)
    den = float(mask.sum())

    def step() -> None:
        trainer.model.train()
        trainer.model.zero_grad_buffer()
        with cuda_placement_to_cpu():
            trainer.optimizer.zero_grad()
        loss = trainer.model(input_ids=ids, position_ids=pos, attention_mask=attn, labels=labels).float()
        (loss * weights).sum().div(den).backward()
        finalize_model_grads([trainer.model])
        with cuda_placement_to_cpu():
            trainer.optimizer.step()

    return step
