"""Off-policy rollouts by a bounded lag k (``rollout.max_staleness``), in sequence on one machine.

At step t the weights are theta_{t-1} (t - 1 updates applied). Each step samples, with those weights, the batch it
will train k steps later, B_{t+k}, and the trainer scores it at once: pi_s, its logprobs at the sampling weights
(the old-logprob pass of an on-policy step, with the same sync and exact-mode checks). The step then trains B_t,
sampled k steps earlier, after one more trainer pass at the current weights, pi_t. The first step samples B_1 ..
B_{1+k}, all with theta_0, so B_t's age (updates between its sampling and its training) is min(t - 1, k), and a batch
older than k is never trained (:meth:`Pending.take` refuses it).

The ratio a correction sees, pi_t / mu_s, then splits per token into staleness, pi_t / pi_s (the policy moved) and
TIM, pi_s / mu_s (the engine computes otherwise at the same weights): :func:`tim_megatron.algo.mismatch.
ratio_split_stats`. No old weights are kept: pi_s is computed while its weights are current.

The batches waiting to be trained are part of the loop's state: a checkpoint after step t holds B_{t+1} .. B_{t+k}
with their pi_s (:meth:`Pending.state`, written per rank beside the RNG state), so a resumed run trains the samples
an uninterrupted one would have.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from tim_megatron.rl.batch import StepBatch


class StalenessError(RuntimeError):
    """A batch older than ``rollout.max_staleness`` was about to be trained, or one is missing."""


@dataclass
class Generated:
    """A batch sampled ahead of the step that trains it, with what was measured when it was sampled."""

    step: int
    """The step that trains it (its prompts and sampling seeds are that step's)."""
    version: int
    """Updates applied to the weights that sampled it."""
    batch: StepBatch
    """This rank's rows of it."""
    behaviour: torch.Tensor
    """``[n, L]`` pi_s: the trainer's logprobs at the sampling weights (0 off-response)."""
    metrics: dict[str, float]
    """The sampling step's rollout and reward metrics, and its sync and exact checks."""
    probe: list[list[int]]
    """This engine's probe sequences from it, for the eager sync check of the step that trains it."""
    routing: torch.Tensor | None = None
    """``[layers, n, L, k]`` the experts the trainer chose by itself in the pi_s pass (when routing is recorded):
    what R2 replays with ``rl.proximal: sampled``, and what the engine's routes are compared with."""
    old_pass: object | None = field(default=None, repr=False)
    """The sampling-time trainer pass (an ``OldPass``) while it is in memory; a batch trained at its own sampling
    step (age 0) reuses it. Not checkpointed."""

    def age(self, step: int) -> int:
        """Updates between its sampling and its training at ``step``."""
        return step - 1 - self.version


@dataclass
class Pending:
    """The batches sampled ahead, by the step that trains them (at most k + 1 at a time)."""

    k: int
    """The lag bound, ``rollout.max_staleness``."""
    batches: dict[int, Generated] = field(default_factory=dict)

    def to_sample(self, step: int) -> list[int]:
        """The steps whose batches step ``step`` samples: those in [step, step + k] not sampled yet (step 1:
        all of them; later steps: step + k)."""
        return [s for s in range(step, step + self.k + 1) if s not in self.batches]

    def add(self, g: Generated) -> None:
        self.batches[g.step] = g

    def copy(self) -> Pending:
        """The same batches in a new mapping (a batch is never changed once added)."""
        return Pending(k=self.k, batches=dict(self.batches))

    def take(self, step: int) -> Generated:
        """Remove and return the batch step ``step`` trains; :class:`StalenessError` if it is missing or older
        than k."""
        g = self.batches.pop(step, None)
        if g is None:
            raise StalenessError(
                f"step {step}: no batch was sampled for it (pending: {sorted(self.batches)})"
            )
        if not 0 <= g.age(step) <= self.k:
            raise StalenessError(
                f"step {step}: its batch was sampled with the weights of update {g.version}, {g.age(step)} updates "
                f"ago; rollout.max_staleness = {self.k} allows 0 to {self.k}"
            )
        return g

    # ------------------------------------------------------------------------------------------ state

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """This rank's pending batches as tensors and plain data (a checkpoint writes them per rank)."""
        tensors: dict[str, torch.Tensor] = {}
        plain: dict = {"k": self.k, "batches": []}
        for s, g in sorted(self.batches.items()):
            entry = {
                "step": g.step,
                "version": g.version,
                "metrics": g.metrics,
                "probe": g.probe,
                "group_size": g.batch.group_size,
                "total_rows": g.batch.total_rows,
            }
            for f in fields(StepBatch):
                v = getattr(g.batch, f.name)
                if isinstance(v, torch.Tensor):
                    tensors[f"{s}.batch.{f.name}"] = v.detach().cpu().contiguous()
            tensors[f"{s}.behaviour"] = g.behaviour.detach().cpu().contiguous()
            if g.routing is not None:
                tensors[f"{s}.routing"] = g.routing.detach().cpu().contiguous()
            plain["batches"].append(entry)
        return tensors, plain

    @classmethod
    def from_state(
        cls,
        tensors: dict[str, torch.Tensor],
        plain: object,
        *,
        k: int,
        step: int | None = None,
        total_rows: int | None = None,
        group_size: int | None = None,
        where: str = "the checkpoint",
    ) -> Pending:
        """What :meth:`state` wrote; ``k`` must be the run's (a checkpoint does not change its lag).

        Everything is checked before it is used (:class:`StalenessError` naming the file's part and what was
        expected): the plain record's types; with ``step`` (the checkpoint's), that it holds exactly the batches of
        steps ``step + 1 .. step + k``, each sampled with the weights its step was sampled with (its age follows
        from the step); with ``total_rows`` and ``group_size`` (the recipe's), each batch's; every tensor present
        with its dtype and the rows' shape, token ids and lengths in range, finite log-probs (at most 0) on
        response tokens, rewards finite. ``where`` names the file in the messages."""
        if not isinstance(plain, dict):
            raise StalenessError(
                f"{where}: its pending batches' record is not a mapping; the file is damaged"
            )
        if plain.get("k") != k:
            raise StalenessError(
                f"the checkpoint's pending batches were sampled with rollout.max_staleness = "
                f"{short_repr(plain.get('k'))}; this run has {k}: resume with the recorded value"
            )
        entries = plain.get("batches")
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise StalenessError(f"{where}: its pending batches' list is damaged (not a list of records)")
        out = cls(k=k)
        for e in entries:
            g = _batch_from_state(tensors, e, where=where)
            if g.step in out.batches:
                raise StalenessError(f"{where}: step {g.step}'s pending batch is recorded twice")
            out.add(g)
        if step is not None:
            _check_versions(out, step=step, where=where)
        for g in out.batches.values():
            if total_rows is not None and g.batch.total_rows != total_rows:
                raise StalenessError(
                    f"{where}: step {g.step}'s pending batch says it is part of {g.batch.total_rows} rows; this "
                    f"run's steps have {total_rows} (data.prompts_per_step x rollout.n)"
                )
            if group_size is not None and g.batch.group_size != group_size:
                raise StalenessError(
                    f"{where}: step {g.step}'s pending batch has groups of {g.batch.group_size}; this run samples "
                    f"rollout.n = {group_size} per prompt"
                )
        return out


def short_repr(value: object) -> str:
    """A recorded value in an error: its ``repr``, cut at 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def sampled_version(s: int, *, k: int) -> int:
    """The weights' version (updates applied) that sample step ``s``'s batch: step ``max(s - k, 1)`` samples it."""
    return max(s - k, 1) - 1


def _check_versions(p: Pending, *, step: int, where: str) -> None:
    expected = list(range(step + 1, step + p.k + 1))
    if sorted(p.batches) != expected:
        raise StalenessError(
            f"{where}: after step {step} the pending batches are those of steps {expected}; the file holds "
            f"{sorted(p.batches)}"
        )
    for s, g in p.batches.items():
        if g.version != sampled_version(s, k=p.k):
            raise StalenessError(
                f"{where}: step {s}'s pending batch says it was sampled with the weights of update {g.version}; "
                f"with rollout.max_staleness = {p.k} it was sampled with those of update "
                f"{sampled_version(s, k=p.k)}"
            )


_FLOATS = ("rollout_logprobs", "rewards")
_INTS = ("input_ids", "lengths", "prompt_lens", "row", "engine", "finish")
_OPTIONAL_INTS = ("token_version",)
_BOOLS = ("response_mask", "truncated")
_WIDE = ("input_ids", "response_mask", "rollout_logprobs", "policy_logprobs", "token_version", "behaviour")
"""The ``[n, L]`` tensors of a pending batch (the rest are ``[n]``, but ``routed_experts``)."""


def _kind(t: torch.Tensor) -> str:
    if t.dtype == torch.bool:
        return "bool"
    return "floating-point" if t.dtype.is_floating_point else "integer"


def _batch_from_state(tensors: dict[str, torch.Tensor], e: dict, *, where: str) -> Generated:
    """One pending batch from its record and tensors, checked (see :meth:`Pending.from_state`)."""
    s = e.get("step")
    if type(s) is not int:
        raise StalenessError(f"{where}: a pending batch's step is {short_repr(s)}; a step is an integer")
    for key in ("version", "group_size", "total_rows"):
        if type(e.get(key)) is not int or e[key] < (0 if key == "version" else 1):
            raise StalenessError(f"{where}: step {s}'s pending batch has {key} = {short_repr(e.get(key))}")
    metrics, probe = e.get("metrics"), e.get("probe")
    if not isinstance(metrics, dict) or not all(
        isinstance(n, str) and type(v) in (int, float) for n, v in metrics.items()
    ):
        raise StalenessError(
            f"{where}: step {s}'s pending batch's metrics are not a mapping of names to numbers"
        )
    if not isinstance(probe, list) or not all(
        isinstance(q, list) and all(type(t) is int for t in q) for q in probe
    ):
        raise StalenessError(f"{where}: step {s}'s pending batch's probe is not a list of token-id lists")

    def tensor(name: str, *, required: bool = True) -> torch.Tensor | None:
        t = tensors.get(f"{s}.{name}")
        if t is None and required:
            raise StalenessError(f"{where}: step {s}'s pending batch has no tensor {name!r}")
        return t

    kw = {f.name: tensor(f"batch.{f.name}", required=False) for f in fields(StepBatch)}
    kw.pop("group_size"), kw.pop("total_rows")
    behaviour = tensor("behaviour")
    for name in (*_FLOATS, *_INTS, *_BOOLS):
        if kw.get(name) is None:
            raise StalenessError(f"{where}: step {s}'s pending batch has no tensor 'batch.{name}'")
    ids = kw["input_ids"]
    if ids.dim() != 2:
        raise StalenessError(f"{where}: step {s}'s pending batch's input_ids have shape {list(ids.shape)}")
    n, width = ids.shape
    for name, t in [*kw.items(), ("behaviour", behaviour)]:
        if t is None or name == "routed_experts":
            continue
        shape = [n, width] if name in _WIDE else [n]
        kind = (
            "bool" if name in _BOOLS else "integer" if name in (*_INTS, *_OPTIONAL_INTS) else "floating-point"
        )
        if list(t.shape) != shape or _kind(t) != kind:
            raise StalenessError(
                f"{where}: step {s}'s pending batch's {name} is {t.dtype} {list(t.shape)}; expected a {kind} "
                f"tensor of shape {shape}"
            )
    if ((kw["lengths"] < 1) | (kw["lengths"] > width) | (kw["prompt_lens"] < 1)).any() or (
        kw["prompt_lens"] > kw["lengths"]
    ).any():
        raise StalenessError(f"{where}: step {s}'s pending batch has lengths outside its rows")
    if (ids < 0).any():
        raise StalenessError(f"{where}: step {s}'s pending batch has negative token ids")
    mask = kw["response_mask"]
    for name in ("rollout_logprobs", "behaviour", "policy_logprobs"):
        t = behaviour if name == "behaviour" else kw[name]
        if t is None:
            continue
        on = t[mask]
        if not bool(torch.isfinite(on).all()) or bool((on > 0).any()):
            raise StalenessError(
                f"{where}: step {s}'s pending batch has log-probs that are not finite or above 0 ({name})"
            )
    if not bool(torch.isfinite(kw["rewards"]).all()):
        raise StalenessError(f"{where}: step {s}'s pending batch has rewards that are not finite")
    if n % e["group_size"]:
        raise StalenessError(
            f"{where}: step {s}'s pending batch has {n} rows, not whole groups of {e['group_size']}"
        )
    routing = tensor("routing", required=False)
    for name, routes in (("routed_experts", kw.get("routed_experts")), ("routing", routing)):
        if routes is not None and (
            routes.dim() != 4 or list(routes.shape[1:3]) != [n, width] or _kind(routes) != "integer"
        ):
            raise StalenessError(
                f"{where}: step {s}'s pending batch's {name} are {routes.dtype} {list(routes.shape)}; expected "
                f"integer expert ids [layers, {n}, {width}, top_k]"
            )
    batch = StepBatch(**kw, group_size=e["group_size"], total_rows=e["total_rows"])
    return Generated(
        step=s,
        version=e["version"],
        batch=batch,
        behaviour=behaviour,
        metrics=metrics,
        probe=probe,
        routing=routing,
    )
