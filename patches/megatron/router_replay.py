"""Routing replay (R2/R3) through megatron-core's native ``RouterReplay``, with explicit per-call state.

megatron-core 0.16 gives every ``TopKRouter`` a ``RouterReplay`` when the config has
``moe_enable_routing_replay=True``, and drives all of them through class-level static methods over a
global list of instances (``RouterReplay.global_router_replay_instances``). This patch:

* removes a model's instances from that global list right after the model is built (:func:`attach`),
  so several models in one process (trainer, reference, tests) never share replay state;
* drives only the given model's routers, through a context manager (:func:`replay`) that sets the
  action and the target indices on entry and clears both on exit, even on error. Nothing is left
  set between calls.

Actions: ``record`` stores the top-k expert ids each router chose; ``replay`` makes each router use the
given ids (its probabilities are still the router's own scores gathered at those ids, so gradients reach
the router weights).

Indices are per MoE layer, ``[tokens, top_k]`` in the router's own token order: sequence-major
``[seq_local, batch]`` flattened, where ``seq_local`` is this TP rank's slice under sequence parallelism.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from patches.guard import check_version
from patches.specs import megatron_core_patch

SPEC = megatron_core_patch(
    name="megatron-router-replay",
    reason="megatron-core's RouterReplay keeps replay state in a class-level global list and static setters.",
    targets=(
        "megatron.core.transformer.moe.router_replay.RouterReplay",
        "megatron.core.transformer.moe.router.TopKRouter.router_replay",
    ),
)


def _routers(model) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    from patches.megatron.modules import unwrap

    return [m for m in unwrap(model).modules() if isinstance(m, TopKRouter)]


def attach(model) -> int:
    """Detach this model's RouterReplay instances from the global registry; return how many routers."""
    check_version(SPEC)
    from megatron.core.transformer.moe.router_replay import RouterReplay

    routers = _routers(model)
    missing = [i for i, r in enumerate(routers) if getattr(r, "router_replay", None) is None]
    if missing:
        raise RuntimeError(
            f"router replay: routers {missing} have no RouterReplay; build the model with moe_enable_routing_replay=True"
        )
    mine = {id(r.router_replay) for r in routers}
    RouterReplay.global_router_replay_instances[:] = [
        inst for inst in RouterReplay.global_router_replay_instances if id(inst) not in mine
    ]
    return len(routers)


@dataclass
class Recording:
    """Filled on exit of a ``record`` context: one ``[tokens, top_k]`` tensor per MoE layer."""

    indices: list[torch.Tensor] = field(default_factory=list)


@contextlib.contextmanager
def replay(model, *, action: str, indices: list[torch.Tensor] | None = None):
    """Record (``action='record'``) or replay (``action='replay'``) routing for the forward passes inside."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = _routers(model)
    rec = Recording()
    if action == "replay":
        if indices is None or len(indices) != len(routers):
            raise ValueError(
                f"router replay: got {0 if indices is None else len(indices)} index tensors for {len(routers)} MoE layers"
            )
        for r, idx in zip(routers, indices, strict=True):
            r.router_replay.set_target_indices(idx.long())
            r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    elif action == "record":
        for r in routers:
            r.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    else:
        raise ValueError(f"router replay action {action!r}: allowed record, replay")
    try:
        yield rec
        if action == "record":
            rec.indices = [r.router_replay.get_recorded_indices() for r in routers]
    finally:
        for r in routers:
            r.router_replay.clear_router_replay_action()
            r.router_replay.clear_indices()


def is_clean(model) -> bool:
    """True when no router holds an action or indices (what every exit leaves)."""
    for r in _routers(model):
        rr = r.router_replay
        if (
            rr.router_replay_action is not None
            or rr.target_topk_idx is not None
            or rr.recorded_topk_idx is not None
            or rr.replay_backward_list
        ):
            return False
    return True
