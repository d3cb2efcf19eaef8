"""A shape-invariant routed-expert path for exact mode (``diagnostics.vexact: exact``).

megatron-core's ``SequentialMLP`` runs each expert's GEMMs on the tokens routed to it, so an expert's row
count M is the number of its tokens in the micro-batch. Which tokens those are depends on every other token of
the micro-batch, and the CPU GEMM (MKL, torch 2.13) does not give a row the same bits for every M: measured
here (``python -m tim_megatron.bench exact``), the last ``M % 4`` rows of a float32 ``linear`` differ from the
same rows inside a larger M whenever M < 12. A token's expert output can then change with what sits after it,
which breaks the exact sampler (it samples position t while later positions are still padding).

This patch gives each MoE layer of one model a dense path: every local expert runs on ALL tokens of the
micro-batch (M fixed, a token's row index fixed), with the token's routing probability as the per-token scale
(zero for the experts it was not routed to), and the experts' outputs are summed in expert order. With the
row count and the row index fixed, a row's result no longer depends on the other rows (measured: 0 of 512 rows
changed when every other row did). The math is the sparse path's: an expert that a token was not routed to
contributes an exact zero. The cost: every expert computes every token (``num_experts / top_k`` times the
routed-expert FLOPs).

The dispatcher's collectives are kept: it must be megatron's ``allgather`` dispatcher (tokens of the TP x EP
group gathered before the experts, reduce-scattered after), so TP, EP and sequence parallelism work unchanged.
The override is per layer instance (the model's own MoE layers), never on the class.
"""

from __future__ import annotations

import types

import torch

from patches.guard import check_version
from patches.specs import megatron_core_patch

SPEC = megatron_core_patch(
    name="megatron-shape-invariant-moe",
    reason="SequentialMLP's expert GEMM row counts depend on the routing of the whole micro-batch, and a CPU "
    "GEMM row's bits depend on the row count: a token's output changes with the tokens around it.",
    targets=(
        "megatron.core.transformer.moe.moe_layer.MoELayer.routed_experts_compute",
        "megatron.core.transformer.moe.token_dispatcher.MoEAllGatherTokenDispatcher",
        "megatron.core.transformer.moe.experts.SequentialMLP",
    ),
)

_MARK = "_tim_shape_invariant"


def _moe_layers(model) -> list:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from patches.megatron.modules import unwrap

    return [m for m in unwrap(model).modules() if isinstance(m, MoELayer)]


def _dense_routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
    """Replaces ``dispatch_postprocess -> experts -> combine_preprocess`` for gathered tokens ``[N, H]``."""
    d = self.token_dispatcher
    lo, hi = d.local_expert_indices[0], d.local_expert_indices[-1] + 1
    routed = d.routing_map[:, lo:hi]
    d.routing_map = None
    d.local_probs = probs[:, lo:hi]  # token_combine casts to its dtype
    scale = d.local_probs * routed.to(d.local_probs.dtype)  # the router's probs are already 0 off-route
    # Under TP/EP the dispatcher gathers into megatron's global buffer, which the next layer overwrites; the
    # sparse path copies out of it (permute), so must this one, or backward reads the next layer's tokens.
    hidden_states = hidden_states.clone()
    out = None
    for i, expert in enumerate(self.experts.local_experts):
        y, bias = expert(hidden_states, scale[:, i])
        if bias is not None:
            raise RuntimeError("shape-invariant MoE: expert biases are not supported")
        out = y if out is None else out + y
    return out, None


def apply(model) -> int:
    """Switch every MoE layer of ``model`` to the dense path; returns how many layers (0 for a dense model)."""
    check_version(SPEC)
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    layers = _moe_layers(model)
    for i, layer in enumerate(layers):
        if not isinstance(layer.token_dispatcher, MoEAllGatherTokenDispatcher):
            raise ValueError(
                f"shape-invariant MoE needs trainer.moe_dispatcher = allgather; MoE layer {i} uses "
                f"{type(layer.token_dispatcher).__name__}"
            )
        if type(layer.experts) is not SequentialMLP:  # a subclass (the grouped experts) runs its own GEMMs
            raise ValueError(
                f"shape-invariant MoE needs SequentialMLP experts (trainer.experts = loop); MoE layer {i} uses "
                f"{type(layer.experts).__name__}"
            )
        if layer.use_shared_expert or layer.config.moe_latent_size:
            raise ValueError("shape-invariant MoE: shared experts and latent projections are not supported")
        layer.routed_experts_compute = types.MethodType(_dense_routed_experts_compute, layer)
        setattr(layer, _MARK, True)
    return len(layers)


def is_applied(model) -> bool:
    """True when every MoE layer of ``model`` runs the dense path (vacuously true for a dense model)."""
    return all(getattr(m, _MARK, False) for m in _moe_layers(model))


def revert(model) -> int:
    """Back to megatron's own routed-expert path (benchmarks and probes compare the two)."""
    layers = [m for m in _moe_layers(model) if getattr(m, _MARK, False)]
    for layer in layers:
        del layer.routed_experts_compute
        delattr(layer, _MARK)
    return len(layers)
