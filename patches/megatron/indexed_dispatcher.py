"""Give a built model's MoE layers the ``indexed`` token dispatcher (:mod:`tim_megatron.trainer.dispatch`).

megatron-core 0.16's ``MoELayer`` builds its dispatcher from ``config.moe_token_dispatcher_type`` (``allgather``,
``alltoall`` or ``flex``) and has no hook for another. The trainer builds the model with the all-gather dispatcher
(cheap to build, and buildable on CPU where the all-to-all one creates CUDA streams) and :func:`install` replaces
each layer's ``token_dispatcher`` with an ``IndexedTokenDispatcher`` on the same process groups. The layer then
calls it through megatron's dispatcher interface (``dispatch_preprocess`` ... ``combine_postprocess``), which is
what ties this patch to the verified megatron-core version.
"""

from __future__ import annotations

from patches.guard import check_version
from patches.specs import megatron_core_patch

SPEC = megatron_core_patch(
    name="megatron-indexed-dispatcher",
    reason=(
        "megatron-core's MoE dispatchers permute with masked_select, read the tokens per expert on the host and "
        "combine with index_add_ (sort-based in deterministic mode): host syncs and extra copies in every MoE layer."
    ),
    targets=(
        "megatron.core.transformer.moe.moe_layer.MoELayer.token_dispatcher",
        "megatron.core.transformer.moe.token_dispatcher.MoETokenDispatcher",
    ),
)


def moe_layers(model) -> list:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from patches.megatron.modules import unwrap

    return [m for m in unwrap(model).modules() if isinstance(m, MoELayer)]


def install(model, cls) -> int:
    """Replace the token dispatcher of every MoE layer of ``model`` (built, not yet wrapped in DDP) with one of
    ``cls`` (the trainer's ``IndexedTokenDispatcher``: :func:`tim_megatron.trainer.dispatch.indexed_dispatcher_class`,
    handed in so that this patch imports nothing of the trainer); returns how many layers (0 for a dense model)."""
    check_version(SPEC)
    from megatron.core.process_groups_config import ProcessGroupCollection

    layers = moe_layers(model)
    for layer in layers:
        old = layer.token_dispatcher
        pgs = ProcessGroupCollection(ep=old.ep_group, expt_tp=old.tp_group, tp_ep=old.tp_ep_group)
        layer.token_dispatcher = cls(
            layer.num_local_experts, layer.local_expert_indices, config=layer.config, pg_collection=pgs
        )
    return len(layers)
