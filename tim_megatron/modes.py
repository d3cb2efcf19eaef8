"""A run's modes, derived once from the recipe (and its model's dims) as a frozen object.

Every part of a run that behaves differently by mode reads a field of :class:`RunModes` instead of decoding the
recipe's strings itself:

- ``backend``: what samples the responses (``vllm`` or ``trainer``, :mod:`tim_megatron.rollout.backends`;
  :func:`rollout_backend`);
- ``exact``: exact mode (``diagnostics.vexact = exact``): row-invariant kernels, pinned CPU reductions, the
  exact sampler, the all-gather dispatcher;
- ``routing``: what router replay (R2, R3) means for the old-logprob pass and for the update
  (:class:`Routing`);
- ``attention``: the attention kind (:mod:`tim_megatron.attention_kinds`);
- ``patches``: the megatron-core patches the trainer applies, in the order it applies them (each still checks
  its library version and whether the environment needs it).

The recipe's validators (``recipe/``) keep their own checks on the raw fields: they run before modes exist, and
ask ``recipe/decisions.py`` the two decisions they need (:func:`rollout_backend`, :func:`captures_routes`, which
this module re-exports). ``tests/test_modes.py`` fails
on a read of the mode fields anywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from tim_megatron.attention_kinds import AttentionKind, attention_kind
from tim_megatron.recipe.decisions import captures_routes, rollout_backend

if TYPE_CHECKING:
    from tim_megatron.recipe.schema import Recipe

__all__ = ["Routing", "RunModes", "captures_routes", "modes_of", "rollout_backend"]


RoutingMode = Literal["off", "record", "replay"]
"""How a trainer forward routes tokens: its own router (``off``), its own router with the choices recorded
(``record``), or the choices given to it (``replay``)."""


@dataclass(frozen=True)
class Routing:
    """Router replay's meaning in each phase of a step (``remedies.router_replay``: off, R2 or R3)."""

    replay: Literal["off", "r2", "r3"]
    """``remedies.router_replay`` as the recipe gives it."""
    hooks: bool
    """The trainer's replay hooks are attached: replay is on and the model has experts."""
    capture: bool
    """The rollout engine records its routing (for R3 or for the agreement metric) and the model has experts."""

    @property
    def exact_sampler_capture(self) -> bool:
        """The exact sampler records its routing: with capture on and the replay hooks attached (it reads the routes
        through them; without replay it has none to record)."""
        return self.capture and self.hooks

    @property
    def old_pass(self) -> RoutingMode:
        """The old-logprob pass: R3 replays the rollout's routing, R2 records the trainer's own for the update,
        and with capture on (for the agreement metric) the trainer's own routing is recorded."""
        if not self.hooks:
            return "off"
        return {"r3": "replay", "r2": "record"}.get(self.replay, "record" if self.capture else "off")

    @property
    def old_pass_uses_rollout_routes(self) -> bool:
        """R3: the old pass is given the routing the rollout engine chose."""
        return self.replay == "r3"

    @property
    def free_routing_probe(self) -> bool:
        """R3 with capture: one more forward with the trainer's free routing, for the agreement metric."""
        return self.replay == "r3" and self.capture

    @property
    def update(self) -> RoutingMode:
        """The update's forwards replay the routing when R2 or R3 is on (and the hooks are attached)."""
        return "replay" if self.replay in ("r2", "r3") and self.hooks else "off"

    @property
    def update_routes_from_old_pass(self) -> bool:
        """R2: the update replays the old pass's recorded routing (R3: the rollout engine's)."""
        return self.replay == "r2"

    @property
    def engine_routes(self) -> bool:
        """R3: the trainer is compared to the engine with the engine's routing replayed (``tim align``,
        preflight)."""
        return self.replay == "r3"


@dataclass(frozen=True)
class RunModes:
    """A run's modes (module docstring)."""

    backend: str
    """What samples the responses: ``vllm`` or ``trainer`` (the exact sampler)."""
    exact: bool
    """Exact mode: every sampled token's logprob equals the training forward's bit for bit."""
    routing: Routing
    """Router replay per phase."""
    attention: AttentionKind
    """The model's attention kind."""
    patches: tuple[str, ...]
    """The megatron-core patches for this run, in the order the trainer applies them."""

    @property
    def dispatcher(self) -> str | None:
        """The MoE token dispatcher exact mode requires (all-gather: a token's rows stay in order), or None for
        the recipe's own."""
        return "allgather" if self.exact else None


def modes_of(recipe: Recipe) -> RunModes:
    """The modes of ``recipe`` (its ``model.dims`` are the checked model's: the trainer compares them)."""
    d = recipe.model.dims
    exact = recipe.diagnostics.vexact == "exact"
    replay = recipe.remedies.router_replay
    routing = Routing(
        replay=replay,
        hooks=replay != "off" and d.is_moe,
        capture=captures_routes(recipe) and d.is_moe,
    )
    kind = attention_kind(d)
    patches = ["cpu_shims", "no_te_router_gemm", "sync_free_grad_norm", *kind.patches(tp=recipe.parallel.tp)]
    if d.linear_biases and d.is_moe:
        patches.append("expert_bias_grad")  # megatron-core adds an expert's fc2 bias in place
    if routing.hooks:
        patches.append("router_replay")
    if exact:
        patches += ["ordered_reductions", "invariant_kernels"]
    return RunModes(
        backend=rollout_backend(recipe),
        exact=exact,
        routing=routing,
        attention=kind,
        patches=tuple(patches),
    )
