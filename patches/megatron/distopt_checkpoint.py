"""Make megatron-core's distributed optimizer save, load and resume exactly (its checkpoint path, 0.16.1).

Three defects, all seen on an H200 and reproduced on one CPU rank with the distributed optimizer forced on:

1. The default sharding of its state (``fully_sharded_model_space``, deprecated) refuses to save
   (``ShardedTensor.flattened_range is not supported``): :data:`SHARDING` asks for ``dp_reshardable``.
2. ``DistributedOptimizer.state_dict`` asserts exactly one Adam ``step`` among its states, so a fresh optimizer
   (no step yet) cannot describe what it is about to load: :func:`prime` fills the states first with megatron's
   own zero-gradient helper (as its FSDP loader does); the load then replaces every value (moments, fp32 master
   weights, step) and the model's weights are not touched.
3. ``load_state_dict`` (without apex or transformer-engine) puts one ``step`` tensor object in every parameter's
   state, and its per-parameter load copies in the primed step, not the saved one. torch's Adam adds 1 to that
   one tensor once per parameter, so the first update after a resume moved the logprobs by 7.3 nats.
   :func:`restore_steps` gives each parameter its own step, with the value the checkpoint recorded.

Nothing of megatron is replaced: these run around its calls. Optimizers other than the distributed one are left
alone (they save and resume exactly already).
"""

from __future__ import annotations

import torch

from patches.guard import check_version
from patches.specs import megatron_core_patch

SPEC = megatron_core_patch(
    name="megatron-distributed-optimizer-checkpoint",
    reason="the distributed optimizer's default checkpoint format cannot save, a fresh one cannot load, and a "
    "loaded one shares one stale Adam step across all parameters.",
    targets=(
        "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.sharded_state_dict",
        "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.load_state_dict",
    ),
)

SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}
"""The ``metadata`` of ``sharded_state_dict``: one tensor per rank's buffer, saved and loaded in parallel,
reshardable across DP only. The other optimizers ignore it."""


def _distributed(optimizer) -> list[tuple[int, object]]:
    """``(index among the chained optimizers, optimizer)`` of each distributed optimizer inside ``optimizer``."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    found = [(i, o) for i, o in enumerate(chained) if isinstance(o, DistributedOptimizer)]
    if found:
        check_version(SPEC)
    return found


def prime(optimizer) -> None:
    """Before ``sharded_state_dict(is_loading=True)``: give a fresh distributed optimizer states to load into."""
    for _, o in _distributed(optimizer):
        if not o.optimizer.state:
            o._init_optimizer_states_with_dummy_values()


def restore_steps(optimizer, loaded: dict) -> None:
    """After ``load_state_dict(loaded)``: each parameter's own Adam step, with the value ``loaded`` records.
    Raises ``ValueError`` when an optimizer's parameter groups record other than one step."""
    found = _distributed(optimizer)
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    per_optimizer = loaded if len(chained) > 1 else {0: loaded}  # several: one state dict per optimizer
    for idx, o in found:
        steps = {float(g["step"]) for g in per_optimizer[idx]["optimizer"]["param_groups"] if "step" in g}
        if len(steps) != 1:
            raise ValueError(f"optimizer {idx} records Adam steps {sorted(steps)}; want one")
        (step,) = steps
        for state in o.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = torch.tensor(step, dtype=state["step"].dtype, device=state["step"].device)
