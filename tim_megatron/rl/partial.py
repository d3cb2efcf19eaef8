"""Partial rollouts (``rollout.partial.tokens_per_step`` = T > 0, with ``rollout.max_staleness`` = k >= 1): a step
generates a bounded number of tokens of each sequence, and a sequence still running goes on at the next step,
under the weights of the next update.

The schedule. B_s, the batch of step s's prompts, is trained at step s. It is begun at step max(s - k, 1) and
advanced at every step u from then on: at u < s each of its running sequences gets up to T more tokens, at u = s
every sequence still running is finished (to its stop or ``rollout.max_tokens``) before the update. Step 1 begins
B_1 .. B_{1+k}, every later step t begins B_{t+k}. A token generated at step u is sampled by the weights of u - 1
updates, its *version*, and trained at step s: its age s - u is at most k. Each step makes one engine call per batch
in flight (B_t first, then the later ones in order), each request its sequence's prompt and tokens so far
(:class:`~tim_megatron.rollout.base.Segment`), seeded by (run seed, s, u, prompt, sample)
(:func:`~tim_megatron.rollout.base.segment_seed`): the same tokens whatever the batching, the schedule or a resume.
The engine's prefix cache was reset at the sync before the step (:mod:`tim_megatron.rollout.sync`), so no KV of
older weights is reused.

pi_s. After its call, the trainer scores each batch's advanced sequences at the weights that sampled the new
tokens, the current ones (one pass per batch and step; on the overlapped schedule from the copy of those weights
the update did not change, :mod:`tim_megatron.rl.overlap`), and keeps the new tokens' logprobs: every token's
pi_s is computed while its weights are current, and no old weights are kept. The pass runs the same checks as an
on-policy step's old-logprob pass on the new tokens: the previous sync's on the first pass after it, and in exact
mode every new token's sampled logprob against the pass, bit for bit (TIM is then exactly 0 for every token of
every version). At step s the trainer scores B_s once more at the current weights (pi_t), and the ratio splits per
token into staleness, log pi_t - log pi_s, and TIM, log pi_s - log mu_s (:func:`tim_megatron.algo.mismatch.
ratio_split_stats`).

Routes. For position p, the routes kept are those of the call that sampled token p + 1 (the prompt's positions:
those of the first call): the engine's (what R3 replays, in every trainer pass of the batch) and the trainer's own,
recorded by the pass that scored token p + 1 (what R2 replays with ``rl.proximal: sampled``, and what the engine's
are compared with). A continued request recomputes its prefix under the new weights, and may route it otherwise;
those routes are not kept.

State. On each rank: the engine's block of every batch in flight (tokens, rollout logprobs, versions, finish,
engine routes) and, for the rows this rank trains, pi_s and the trainer's routes. A checkpoint after step t holds
B_{t+1} .. B_{t+k} as they are (:meth:`PartialRollouts.state`, per rank beside the RNG state), checked on load
(:meth:`PartialRollouts.from_state`), so a resumed run goes on with the same sequences and trains the same samples.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from tim_megatron.rl.batch import FINISH, StepBatch, from_samples, rank_rows
from tim_megatron.rl.offpolicy import StalenessError, short_repr
from tim_megatron.rollout.base import GenerationStats, Sample, Segment, segment_seed

RUNNING = "running"
"""A sequence's finish reason while it is still being generated."""
_FINISH_CODES = {**FINISH, RUNNING: 3}


# ------------------------------------------------------------------------------------------------ state


@dataclass(frozen=True)
class InFlight:
    """A batch being generated: this engine's block of step ``step``'s rows, and what was measured of this rank's
    rows so far. Never changed in place: each step makes a new one (a checkpoint's view taken before a step stays
    as it was)."""

    step: int
    """The step that trains it (its prompts are that step's)."""
    begun: int
    """The step that began it: max(step - k, 1)."""
    rows: tuple[Sample, ...]
    """This engine's block of the step's rows in global row order, each with the version of every token
    (``versions``); ``finish_reason`` is :data:`RUNNING` while it is being generated."""
    behaviour: torch.Tensor
    """``[n_local, max_tokens]`` pi_s of each response token of the rows this rank trains (global rows ``first_row``
    on), 0 where not scored yet."""
    scored: torch.Tensor
    """``[n_local]`` response tokens of each of this rank's rows scored so far."""
    first_row: int
    """The global index of this rank's first row."""
    routing: torch.Tensor | None = None
    """``[layers, n_local, width, k]`` int16: the experts the trainer chose by itself at the sampling weights, for
    position p those of the pass that scored token p + 1 (None when routing is not recorded)."""
    old_pass: object | None = field(default=None, repr=False)
    """The pass that scored every row of this batch at this step's weights, when it did (the first step's batch,
    generated whole at its step): the trained batch reuses it (staleness exactly 0). Not checkpointed."""

    def running(self) -> list[int]:
        return [i for i, s in enumerate(self.rows) if s.finish_reason == RUNNING]


@dataclass
class PartialRollouts:
    """The batches in flight, by the step that trains them (at most k + 1 at a time)."""

    k: int
    """The lag bound, ``rollout.max_staleness``."""
    tokens_per_step: int
    """T, ``rollout.partial.tokens_per_step``."""
    batches: dict[int, InFlight] = field(default_factory=dict)

    def to_begin(self, step: int) -> list[int]:
        """The batches step ``step`` begins: those of steps [step, step + k] not begun yet."""
        return [s for s in range(step, step + self.k + 1) if s not in self.batches]

    def budget(self, s: int, step: int, *, have: int, max_tokens: int) -> int:
        """How many tokens step ``step`` may generate for a running sequence of batch ``s`` that holds ``have``:
        the rest of ``max_tokens`` at the batch's own step, else up to T."""
        rest = max_tokens - have
        return rest if s == step else min(self.tokens_per_step, rest)

    def copy(self) -> PartialRollouts:
        """The same batches in a new mapping (the batches themselves are never changed in place)."""
        return PartialRollouts(k=self.k, tokens_per_step=self.tokens_per_step, batches=dict(self.batches))

    # ------------------------------------------------------------------------------------------ state

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """This rank's batches in flight as tensors and plain data (a checkpoint writes them per rank)."""
        tensors: dict[str, torch.Tensor] = {}
        plain: dict = {"k": self.k, "tokens_per_step": self.tokens_per_step, "partial": True, "batches": []}
        for s, g in sorted(self.batches.items()):
            tensors.update({f"{s}.{name}": t for name, t in _rows_to_tensors(g.rows).items()})
            tensors[f"{s}.behaviour"] = g.behaviour.contiguous()
            tensors[f"{s}.scored"] = g.scored.contiguous()
            if g.routing is not None:
                tensors[f"{s}.routing"] = g.routing.contiguous()
            plain["batches"].append({"step": g.step, "begun": g.begun, "first_row": g.first_row})
        return tensors, plain

    @classmethod
    def from_state(
        cls,
        tensors: dict[str, torch.Tensor],
        plain: object,
        *,
        k: int,
        tokens_per_step: int,
        max_tokens: int,
        max_prompt_tokens: int,
        group_size: int,
        step: int | None = None,
        first_row: int | None = None,
        where: str = "the checkpoint",
    ) -> PartialRollouts:
        """What :meth:`state` wrote, every part checked before it is used (:class:`StalenessError` naming the file,
        the step and what was expected): k and T must be the run's; with ``step`` (the checkpoint's), the batches
        are exactly those of steps ``step + 1 .. step + k``, each begun at max(s - k, 1), and every sequence holds,
        for each step from its batch's beginning, T tokens of that step's version, but its last part, which is
        shorter only if it ended there (a running sequence's last part is step ``step``'s); token ids, lengths
        and finish reasons in range, finite log-probs (at most 0), pi_s of every token scored, routes' shapes.
        The prompts are checked against the run's data by :func:`stored_prompts_disagree`."""
        if not isinstance(plain, dict) or not plain.get("partial"):
            raise StalenessError(
                f"{where} holds no partial rollouts in flight, but this run has rollout.partial.tokens_per_step = "
                f"{tokens_per_step}: resume with the recorded rollout.partial (0 when the record has none)"
            )
        for key, want in (("k", k), ("tokens_per_step", tokens_per_step)):
            if plain.get(key) != want:
                name = "rollout.max_staleness" if key == "k" else "rollout.partial.tokens_per_step"
                raise StalenessError(
                    f"the checkpoint's partial rollouts were generated with {name} = {short_repr(plain.get(key))}; "
                    f"this run has {want}: resume with the recorded value"
                )
        entries = plain.get("batches")
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise StalenessError(f"{where}: its partial batches' list is damaged (not a list of records)")
        out = cls(k=k, tokens_per_step=tokens_per_step)
        limits = _Limits(
            max_tokens=max_tokens, max_prompt_tokens=max_prompt_tokens, group_size=group_size, step=step
        )
        for e in entries:
            g = _batch_from_state(tensors, e, limits=limits, k=k, t=tokens_per_step, where=where)
            if g.step in out.batches:
                raise StalenessError(f"{where}: step {g.step}'s partial batch is recorded twice")
            if first_row is not None and g.first_row != first_row:
                raise StalenessError(
                    f"{where}: step {g.step}'s partial batch was scored for the rows from {g.first_row}; this rank "
                    f"trains those from {first_row} (the layout changed under the checkpoint)"
                )
            out.batches[g.step] = g
        if step is not None:
            want = list(range(step + 1, step + k + 1))
            if sorted(out.batches) != want:
                raise StalenessError(
                    f"{where}: after step {step} the batches in flight are those of steps {want}; the file holds "
                    f"{sorted(out.batches)}"
                )
        return out


def _rows_to_tensors(rows: tuple[Sample, ...]) -> dict[str, torch.Tensor]:
    """A block's rows as padded tensors: token ids, lengths, rollout (and policy) logprobs, versions, finish,
    indices and the engine's routes."""
    n = len(rows)
    width = max((len(s.prompt_ids) + len(s.response_ids) for s in rows), default=1)
    most = max((len(s.response_ids) for s in rows), default=0)
    ids = torch.zeros(n, width, dtype=torch.long)
    lp = torch.zeros(n, most)
    version = torch.full((n, most), -1, dtype=torch.long)
    policy = torch.zeros(n, most) if any(s.policy_logprobs is not None for s in rows) else None
    routed = None
    if any(s.routed_experts is not None for s in rows):
        e0 = next(s.routed_experts for s in rows if s.routed_experts is not None)
        routed = torch.zeros(n, max(width - 1, 1), *e0.shape[1:], dtype=torch.int16)
    for i, s in enumerate(rows):
        seq = s.prompt_ids + s.response_ids
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        r = len(s.response_ids)
        lp[i, :r] = torch.tensor(s.logprobs)
        version[i, :r] = torch.tensor(s.versions or [], dtype=torch.long)
        if policy is not None and s.policy_logprobs is not None:
            policy[i, :r] = torch.tensor(s.policy_logprobs)
        if routed is not None and s.routed_experts is not None and len(s.routed_experts):
            routed[i, : len(s.routed_experts)] = torch.from_numpy(s.routed_experts.astype(np.int16))
    out = {
        "ids": ids,
        "prompt_lens": torch.tensor([len(s.prompt_ids) for s in rows], dtype=torch.long),
        "response_lens": torch.tensor([len(s.response_ids) for s in rows], dtype=torch.long),
        "logprobs": lp,
        "versions": version,
        "finish": torch.tensor([_FINISH_CODES.get(s.finish_reason, 2) for s in rows], dtype=torch.long),
        "prompt_index": torch.tensor([s.prompt_index for s in rows], dtype=torch.long),
        "sample_index": torch.tensor([s.sample_index for s in rows], dtype=torch.long),
        "engine": torch.tensor([s.engine for s in rows], dtype=torch.long),
    }
    if policy is not None:
        out["policy"] = policy
    if routed is not None:
        out["routed"] = routed
    return out


@dataclass(frozen=True)
class _Limits:
    max_tokens: int
    max_prompt_tokens: int
    group_size: int
    step: int | None


def _batch_from_state(tensors, e: dict, *, limits: _Limits, k: int, t: int, where: str) -> InFlight:
    s = e.get("step")
    if type(s) is not int or s < 1:
        raise StalenessError(
            f"{where}: a partial batch's step is {short_repr(s)}; a step is an integer from 1"
        )
    for key in ("begun", "first_row"):
        if type(e.get(key)) is not int or e[key] < (1 if key == "begun" else 0):
            raise StalenessError(f"{where}: step {s}'s partial batch has {key} = {short_repr(e.get(key))}")
    if e["begun"] != max(s - k, 1):
        raise StalenessError(
            f"{where}: step {s}'s partial batch says it was begun at step {e['begun']}; with rollout.max_staleness "
            f"= {k} it is begun at step {max(s - k, 1)}"
        )

    def tensor(name: str, kind: str, dims: int, *, required: bool = True) -> torch.Tensor | None:
        x = tensors.get(f"{s}.{name}")
        if x is None:
            if required:
                raise StalenessError(f"{where}: step {s}'s partial batch has no tensor {name!r}")
            return None
        got = (
            "floating-point" if x.dtype.is_floating_point else "bool" if x.dtype == torch.bool else "integer"
        )
        if got != kind or x.dim() != dims:
            raise StalenessError(
                f"{where}: step {s}'s partial batch's {name} is {x.dtype} {list(x.shape)}; expected a {kind} tensor "
                f"of {dims} dimensions"
            )
        return x

    ids = tensor("ids", "integer", 2)
    plen, rlen = tensor("prompt_lens", "integer", 1), tensor("response_lens", "integer", 1)
    lp, version = tensor("logprobs", "floating-point", 2), tensor("versions", "integer", 2)
    finish = tensor("finish", "integer", 1)
    pidx, sidx, eng = (tensor(n, "integer", 1) for n in ("prompt_index", "sample_index", "engine"))
    policy = tensor("policy", "floating-point", 2, required=False)
    routed = tensor("routed", "integer", 4, required=False)
    behaviour, scored = tensor("behaviour", "floating-point", 2), tensor("scored", "integer", 1)
    routing = tensor("routing", "integer", 4, required=False)
    n, width = ids.shape
    most = lp.shape[1]
    for name, x, shape in (
        ("prompt_lens", plen, [n]),
        ("response_lens", rlen, [n]),
        ("finish", finish, [n]),
        ("prompt_index", pidx, [n]),
        ("sample_index", sidx, [n]),
        ("engine", eng, [n]),
        ("versions", version, [n, most]),
        ("policy", policy, [n, most]),
    ):
        if x is not None and list(x.shape) != shape:
            raise StalenessError(
                f"{where}: step {s}'s partial batch's {name} has shape {list(x.shape)}; expected {shape}"
            )
    if n % limits.group_size or most > limits.max_tokens:
        raise StalenessError(
            f"{where}: step {s}'s partial batch has {n} rows of up to {most} response tokens; expected whole groups "
            f"of {limits.group_size} and at most rollout.max_tokens = {limits.max_tokens}"
        )
    if (
        ((plen < 1) | (plen > limits.max_prompt_tokens) | (rlen < 1) | (rlen > most)).any()
        or ((plen + rlen) > width).any()
        or (ids < 0).any()
        or ((finish < 0) | (finish > 3)).any()
    ):
        raise StalenessError(
            f"{where}: step {s}'s partial batch has lengths, token ids or finish codes out of range"
        )
    if ((pidx < 0) | (sidx < 0) | (sidx >= limits.group_size)).any() or (eng < 0).any():
        raise StalenessError(
            f"{where}: step {s}'s partial batch has prompt, sample or engine indices out of range"
        )
    code = {v: key for key, v in _FINISH_CODES.items()}
    rows = []
    for i in range(n):
        p, r = int(plen[i]), int(rlen[i])
        fin = code[int(finish[i])]
        v = version[i, :r].tolist()
        why = _versions_disagree(
            v, begun=e["begun"], last=limits.step, t=t, finish=fin, length=r, max_tokens=limits.max_tokens
        )
        if why:
            raise StalenessError(f"{where}: step {s}'s partial batch, row {i}: {why}")
        on = lp[i, :r]
        if not bool(torch.isfinite(on).all()) or bool((on > 0).any()):
            raise StalenessError(
                f"{where}: step {s}'s partial batch has log-probs that are not finite or above 0"
            )
        experts = None
        if routed is not None:
            if routed.shape[1] < p + r - 1:
                raise StalenessError(f"{where}: step {s}'s partial batch's routed experts are too short")
            experts = routed[i, : p + r - 1].numpy().copy()
        rows.append(
            Sample(
                ids[i, :p].tolist(),
                ids[i, p : p + r].tolist(),
                lp[i, :r].tolist(),
                fin,
                routed_experts=experts,
                prompt_index=int(pidx[i]),
                sample_index=int(sidx[i]),
                engine=int(eng[i]),
                policy_logprobs=None if policy is None else policy[i, :r].tolist(),
                versions=v,
            )
        )
    n_local = behaviour.shape[0]
    if list(scored.shape) != [n_local] or behaviour.shape[1] != limits.max_tokens:
        raise StalenessError(
            f"{where}: step {s}'s partial batch's pi_s is {list(behaviour.shape)} with {list(scored.shape)} counts; "
            f"expected [rows, {limits.max_tokens}] and [rows]"
        )
    if ((scored < 0) | (scored > limits.max_tokens)).any():
        raise StalenessError(f"{where}: step {s}'s partial batch's scored counts are out of range")
    by_row = {int(pidx[i]) * limits.group_size + int(sidx[i]): i for i in range(n)}
    for li in range(n_local):
        got = int(scored[li])
        on = behaviour[li, :got]
        if not bool(torch.isfinite(on).all()) or bool((on > 0).any()):
            raise StalenessError(
                f"{where}: step {s}'s partial batch has pi_s log-probs that are not finite or above 0"
            )
        i = by_row.get(e["first_row"] + li)
        if i is not None and got != int(
            rlen[i]
        ):  # a row of this engine's block: every token scored at its step
            raise StalenessError(
                f"{where}: step {s}'s partial batch, row {e['first_row'] + li}: {got} of its {int(rlen[i])} tokens "
                "have pi_s"
            )
    if routing is not None and (routing.shape[1] != n_local or routing.dim() != 4):
        raise StalenessError(
            f"{where}: step {s}'s partial batch's trainer routes have shape {list(routing.shape)}"
        )
    return InFlight(
        step=s,
        begun=e["begun"],
        rows=tuple(rows),
        behaviour=behaviour,
        scored=scored,
        first_row=e["first_row"],
        routing=routing,
    )


def _versions_disagree(
    v: list[int], *, begun: int, last: int | None, t: int, finish: str, length: int, max_tokens: int
) -> str | None:
    """Whether a sequence's token versions are what the schedule gives: T tokens of the version of each step from
    ``begun`` on, its last part shorter only where it ended (None: they are)."""
    if len(v) != length:
        return f"{len(v)} versions for {length} tokens"
    parts: list[tuple[int, int]] = []
    for x in v:
        if parts and parts[-1][0] == x:
            parts[-1] = (x, parts[-1][1] + 1)
        else:
            parts.append((x, 1))
    expected = list(range(begun - 1, begun - 1 + len(parts)))
    if [x for x, _ in parts] != expected:
        return f"its tokens' versions {[x for x, _ in parts]} are not those of the steps from {begun} on, in order"
    if last is not None and expected and expected[-1] > last - 1:
        return f"it holds tokens of version {expected[-1]}, sampled after the checkpoint's step {last}"
    if any(c != t for _, c in parts[:-1]):
        return f"a step before its last gave it other than rollout.partial.tokens_per_step = {t} tokens"
    if finish == RUNNING:
        if parts[-1][1] != t or length >= max_tokens or (last is not None and parts[-1][0] != last - 1):
            return "it is running, but its last step did not give it its full budget at the checkpoint's step"
    elif parts[-1][1] > t:
        return f"its last step gave it {parts[-1][1]} tokens, more than {t}"
    if finish == "length" and length != max_tokens:
        return f"it ended at its budget with {length} of rollout.max_tokens = {max_tokens} tokens"
    return None


def stored_prompts_disagree(g: InFlight, *, prompts, prompts_per_step: int, group_size: int) -> str | None:
    """Whether a batch in flight read back from a checkpoint holds step ``g.step``'s prompts: each row's prompt
    tokens are its prompt's, and its indices lie within the step. The first disagreement in words, or None."""
    items = prompts.step_items(g.step, prompts_per_step)
    encoded: dict[int, list[int]] = {}
    seen = set()
    for s in g.rows:
        if not 0 <= s.prompt_index < len(items):
            return f"a row's prompt {s.prompt_index} is outside step {g.step}'s {len(items)} prompts"
        key = s.prompt_index * group_size + s.sample_index
        if key in seen:
            return f"row {key} is recorded twice"
        seen.add(key)
        if s.prompt_index not in encoded:
            (encoded[s.prompt_index],) = prompts.encode([items[s.prompt_index]])
        if s.prompt_ids != encoded[s.prompt_index]:
            return f"row {key}'s prompt tokens are not those of step {g.step}'s prompt {s.prompt_index}"
    return None


# ------------------------------------------------------------------------------------------- the steps


@dataclass
class StepTally:
    """What a step's engine calls and scoring passes measured, for the step's metrics (the overlapped schedule adds
    those of the calls beside the update before they are reported)."""

    gens: list[GenerationStats] = field(default_factory=list)
    checks: dict[str, float] = field(default_factory=dict)
    finished_here: int = 0
    """Tokens generated for the trained batch at its own step (sequences it still had running)."""

    def add_checks(self, checks: dict[str, float]) -> None:
        for key, v in checks.items():
            self.checks[key] = self.checks.get(key, 0.0) + v if key == "exact/checked_tokens" else v


def begin(*, recipe, rollout, prompts, s: int, step: int, first_row: int, n_local: int) -> InFlight:
    """Batch ``s``, begun at step ``step``: this engine's block of its rows, none generated yet."""
    from tim_megatron.rl.plumbing import engine_block

    mine, first = engine_block(prompts.step_items(s, recipe.data.prompts_per_step), rollout)
    ids = prompts.encode(mine)
    n = recipe.rollout.n
    rows = tuple(
        Sample(
            list(p),
            [],
            [],
            RUNNING,
            prompt_index=first + i,
            sample_index=j,
            engine=rollout.engine_index,
            versions=[],
        )
        for i, p in enumerate(ids)
        for j in range(n)
    )
    return InFlight(
        step=s,
        begun=step,
        rows=rows,
        behaviour=torch.zeros(n_local, recipe.rollout.max_tokens),
        scored=torch.zeros(n_local, dtype=torch.long),
        first_row=first_row,
    )


def segment_call(
    *, recipe, rollout, flight: PartialRollouts, g: InFlight, step: int
) -> tuple[list[int], Callable[[], tuple[list[list[Sample]], GenerationStats]]]:
    """Step ``step``'s engine call for batch ``g``: its running rows (their indices) and a call that touches the
    engine alone (the overlapped schedule runs it on a thread)."""
    r = recipe.rollout
    picks = g.running()
    rows = [g.rows[i] for i in picks]
    seg = Segment(
        seeds=[segment_seed(recipe.run.seed, g.step, step, x.prompt_index, x.sample_index) for x in rows],
        max_tokens=[
            flight.budget(g.step, step, have=len(x.response_ids), max_tokens=r.max_tokens) for x in rows
        ],
        prompt_lens=[len(x.prompt_ids) for x in rows],
        indices=[(x.prompt_index, x.sample_index) for x in rows],
        longest_prompt=max((len(x.prompt_ids) for x in g.rows), default=0),
    )
    prefixes = [x.prompt_ids + x.response_ids for x in rows]
    return picks, lambda: rollout.generate(prefixes, step=step, first_index=0, segment=seg)


def merge(
    g: InFlight, picks: list[int], groups: list[list[Sample]], *, step: int, max_tokens: int
) -> InFlight:
    """Batch ``g`` with the tokens step ``step``'s call added to its rows ``picks`` (version ``step - 1``); a row
    that used its budget short of ``max_tokens`` is still running."""
    got = [grp[0] for grp in groups]
    if len(got) != len(picks):
        raise RuntimeError(f"a partial segment of {len(picks)} requests returned {len(got)} samples")
    rows = list(g.rows)
    for i, new in zip(picks, got, strict=True):
        rows[i] = extended(rows[i], new, version=step - 1, max_tokens=max_tokens)
    return dataclasses.replace(g, rows=tuple(rows), old_pass=None)


def extended(row: Sample, new: Sample, *, version: int, max_tokens: int) -> Sample:
    """``row`` followed by the tokens of ``new`` (a segment's output, see :class:`~tim_megatron.rollout.base.
    Segment`), each of ``version``; the routes of the positions that sampled them appended (a first segment's
    cover the prompt's positions too)."""
    if new.prompt_ids != row.prompt_ids + row.response_ids or not new.response_ids:
        raise RuntimeError(
            f"a partial segment's output for row ({row.prompt_index}, {row.sample_index}) does not continue it"
        )
    response = row.response_ids + new.response_ids
    if new.finish_reason == "length":
        finish = "length" if len(response) >= max_tokens else RUNNING
    else:
        finish = new.finish_reason
    routed = row.routed_experts
    if new.routed_experts is not None:
        routed = (
            new.routed_experts
            if routed is None or not len(routed)
            else np.concatenate([routed, new.routed_experts])
        )
    policy = None
    if new.policy_logprobs is not None:
        policy = (row.policy_logprobs or []) + new.policy_logprobs
    return dataclasses.replace(
        row,
        response_ids=response,
        logprobs=row.logprobs + new.logprobs,
        finish_reason=finish,
        routed_experts=routed,
        policy_logprobs=policy,
        versions=(row.versions or []) + [version] * len(new.response_ids),
    )


def _group(rows: tuple[Sample, ...], n: int) -> list[list[Sample]]:
    return [list(rows[i : i + n]) for i in range(0, len(rows), n)]


def local_batch(
    *, recipe, trainer, rollout, g: InFlight, rewards: list[list[float]] | None = None
) -> StepBatch:
    """This rank's rows of batch ``g`` as they are now (``rewards``: the block's, when finished; else 0)."""
    from tim_megatron.rl.plumbing import global_rank

    n = recipe.rollout.n
    groups = _group(g.rows, n)
    blk = from_samples(
        groups,
        rewards if rewards is not None else [[0.0] * len(grp) for grp in groups],
        total_rows=recipe.data.prompts_per_step * n,
        num_moe_layers=trainer.num_moe_layers(),
        top_k=trainer.dims.num_experts_per_tok,
    )
    return rank_rows(
        blk, layout=rollout.layout, rank=global_rank(), dp_rank=trainer.dp_rank, dp_size=trainer.dp_size
    )


def score(*, recipe, trainer, rollout, sync, g: InFlight, step: int, observer, tally: StepTally) -> InFlight:
    """Score the tokens step ``step`` added to batch ``g`` at the weights the trainer holds (those that sampled
    them): pi_s and the trainer's own routes of this rank's rows, with the previous sync's check (the first pass
    after it) and exact mode's bit-for-bit check on the new tokens. Every rank calls; each runs one pass over its
    rows that got tokens, padded with others to the most any rank has (equal micro-batches on every rank)."""
    from tim_megatron.rl.phases import trainer_routing
    from tim_megatron.rl.plumbing import max_over_world
    from tim_megatron.trainer.megatron_trainer import SeqBatch
    from tim_megatron.trainer.parallel import dp_group

    tr, routes = trainer, trainer.modes.routing
    b = local_batch(recipe=recipe, trainer=tr, rollout=rollout, g=g)
    new = b.response_mask & (b.token_version == step - 1)
    active = new.any(1).nonzero().flatten()
    whole = len(active) == len(b)  # every row got tokens (the first step's batch): its pass is pi_t too
    most, partly = max_over_world([float(len(active)), 0.0 if whole else 1.0])
    if most == 0:
        return g
    rest = (~new.any(1)).nonzero().flatten()  # rows with nothing new: the padding, the first of them
    idx = torch.cat([active, rest[: int(most) - len(active)]])
    sub = b.rows(idx)
    fresh = new[idx][:, : sub.width]
    width = tr.exact_width(int(b.prompt_lens.max())) if tr.modes.exact else None  # the sampler's (every rank)
    seq = SeqBatch(
        sub.input_ids, sub.lengths, sub.routed_experts if routes.old_pass_uses_rollout_routes else None
    )
    out, recorded = tr.logprobs(seq, with_entropy=not partly, routing=routes.old_pass, width=width)
    lp = out.logprobs * sub.response_mask
    checks: dict[str, float] = {}
    if tr.modes.exact:
        from tim_megatron.rollout.exact_sampler import check_exact

        checks = check_exact(
            step=step,
            rows=sub.row,
            prompt_lens=sub.prompt_lens,
            old=lp * fresh,
            sampled=sub.policy_logprobs * fresh,
            mask=fresh,
            group=dp_group(),
        )
    checks.update(
        sync.check_samples(
            trainer_logprobs=lp,
            rollout_logprobs=sub.rollout_logprobs,
            mask=fresh,
            engine=sub.engine,
            engines=rollout.layout.engines,
            observer=observer,
        )
    )
    tally.add_checks(checks)
    own = trainer_routing(trainer=tr, batch=sub, recorded=recorded)
    ii, pp = fresh.nonzero(as_tuple=True)
    local = idx[ii]
    behaviour = g.behaviour.clone()
    behaviour[local, pp - sub.prompt_lens[ii]] = lp[ii, pp]
    scored = g.scored.clone()
    scored[idx] = torch.where(fresh.any(1), (sub.lengths - sub.prompt_lens), scored[idx])
    routing = g.routing
    if own is not None:
        width_r = recipe.data.max_prompt_tokens + recipe.rollout.max_tokens
        if routing is None:
            routing = torch.zeros(own.shape[0], len(b), width_r, own.shape[-1], dtype=torch.int16)
        routing = routing.clone()
        at = torch.zeros_like(fresh)
        at[:, :-1] = fresh[:, 1:]  # position p routed the forward that sampled token p + 1
        first = fresh[torch.arange(len(sub)), sub.prompt_lens.clamp(max=sub.width - 1)]
        for i in torch.nonzero(first).flatten().tolist():
            at[i, : int(sub.prompt_lens[i]) - 1] = True  # a first part: the prompt's positions too
        ri, rp = at.nonzero(as_tuple=True)
        routing[:, idx[ri], rp] = own[:, ri, rp].to(torch.int16)
    old_pass = None
    if not partly:  # every rank scored every row of it, in order: the pass is this batch's at these weights
        from tim_megatron.rl.phases import OldPass

        old_pass = OldPass(
            old=lp,
            rollout=sub.rollout_logprobs.clone(),
            entropy=out.entropy,
            trainer_routing=own,
            recomputed=True,
            sync=checks,
        )
    return dataclasses.replace(g, behaviour=behaviour, scored=scored, routing=routing, old_pass=old_pass)


@dataclass
class Taken:
    """The batch a step trains, finished, with what was measured of it."""

    batch: StepBatch
    behaviour: torch.Tensor
    """``[n, L]`` pi_s of every token."""
    routing: torch.Tensor | None
    """``[layers, n, L, k]`` the trainer's own routes at each token's sampling weights."""
    metrics: dict[str, float]
    probe: list[list[int]]
    age: int
    """Updates since its oldest token was sampled (every rank's)."""
    old_pass: object | None


def take(*, recipe, trainer, rollout, prompts, flight: PartialRollouts, step: int) -> Taken:
    """Remove and finish the batch step ``step`` trains: rewards, this rank's rows, pi_s of every token and the
    version metrics; :class:`StalenessError` if it is missing, unfinished, or holds a token older than k."""
    from tim_megatron.data.rewards import reward as score_reward
    from tim_megatron.rl.phases import reward_metrics
    from tim_megatron.rl.plumbing import engine_block, max_over_world

    g = flight.batches.pop(step, None)
    if g is None:
        raise StalenessError(
            f"step {step}: no batch is in flight for it (in flight: {sorted(flight.batches)})"
        )
    if g.running():
        raise StalenessError(f"step {step}: {len(g.running())} of its sequences are still running")
    oldest = min((min(s.versions) for s in g.rows if s.versions), default=step - 1)
    if step - 1 - oldest > flight.k:
        raise StalenessError(
            f"step {step}: its batch holds tokens sampled with the weights of update {oldest}, {step - 1 - oldest} "
            f"updates ago; rollout.max_staleness = {flight.k} allows 0 to {flight.k}"
        )
    mine, _ = engine_block(prompts.step_items(step, recipe.data.prompts_per_step), rollout)
    groups = _group(g.rows, recipe.rollout.n)
    rewards = [
        [score_reward(it.reward, prompts.decode(s.response_ids), it.answer) for s in grp]
        for it, grp in zip(mine, groups, strict=True)
    ]
    batch = local_batch(recipe=recipe, trainer=trainer, rollout=rollout, g=g, rewards=rewards)
    n = len(batch)
    resp = batch.lengths - batch.prompt_lens
    if not torch.equal(g.scored, resp):
        raise StalenessError(f"step {step}: some of its tokens were never scored at their sampling weights")
    ii, pp = batch.response_mask.nonzero(as_tuple=True)
    behaviour = torch.zeros(n, batch.width)
    behaviour[ii, pp] = g.behaviour[ii, pp - batch.prompt_lens[ii]]
    routing = None if g.routing is None else g.routing[:, :, : batch.width].clone()
    metrics = reward_metrics(batch)
    metrics.update(version_metrics(batch=batch, step=step, k=flight.k))
    (age,) = max_over_world([float(step - 1 - oldest)])
    probe = [grp[0].prompt_ids + grp[0].response_ids for grp in groups[:8]]
    reuse = g.old_pass if int(age) == 0 else None
    return Taken(
        batch=batch,
        behaviour=behaviour,
        routing=routing,
        metrics=metrics,
        probe=probe,
        age=int(age),
        old_pass=reuse,
    )


def version_metrics(*, batch: StepBatch, step: int, k: int) -> dict[str, float]:
    """The trained tokens' ages (updates since the weights that sampled each): ``offpolicy/tokens_age_<a>_frac``
    for a = 0 .. k, their mean, and ``offpolicy/multi_version_frac``, the share of sequences holding tokens of two
    or more versions. Every rank calls (sums over the data-parallel group)."""
    from tim_megatron.rl.plumbing import sum_over_dp

    mask = batch.response_mask
    ages = (step - 1 - batch.token_version)[mask]
    counts = torch.bincount(ages.clamp(0, k), minlength=k + 1).double().tolist()
    v = torch.where(mask, batch.token_version, torch.full_like(batch.token_version, -1))
    hi = v.max(1).values
    lo = torch.where(mask, batch.token_version, torch.full_like(batch.token_version, 1 << 30)).min(1).values
    has = mask.any(1)
    multi = float(((hi > lo) & has).sum())
    sums = sum_over_dp([*counts, float(ages.sum()), multi, float(has.sum())])
    tokens = sum(sums[: k + 1])
    out = {f"offpolicy/tokens_age_{a}_frac": sums[a] / tokens if tokens else 0.0 for a in range(k + 1)}
    out["offpolicy/token_age_mean"] = sums[k + 1] / tokens if tokens else 0.0
    out["offpolicy/multi_version_frac"] = sums[k + 2] / sums[k + 3] if sums[k + 3] else 0.0
    return out


def step_metrics(*, trainer, rollout, flight: PartialRollouts, tally: StepTally) -> dict[str, float]:
    """The step's generation metrics (``rollout/*``: every call of the step), its checks, and how many sequences
    are still running and how many tokens the trained batch needed at its own step (``partial/*``)."""
    from tim_megatron.rl.phases import generation_metrics
    from tim_megatron.rl.plumbing import sum_over_engines

    out = generation_metrics(trainer=trainer, rollout=rollout, gens=tally.gens)
    running, finished = sum_over_engines(
        rollout, [float(sum(len(g.running()) for g in flight.batches.values())), float(tally.finished_here)]
    )
    out["partial/running_sequences"] = running
    out["partial/finished_at_training_tokens"] = finished
    out.update(tally.checks)
    return out


def partial_samples(parts, *, recipe, step: int, timer, observer):
    """A partial-rollout step's samples (module docstring): begin the batches due, run this step's engine call of
    every batch in flight (on the overlapped schedule those of later batches on a thread beside the update), score
    the new tokens at their sampling weights, then take the batch this step trains and score it at the current
    weights (pi_t). Returns (batch, metrics, probe, its passes, the calls beside the update or None)."""
    from tim_megatron.rl.overlap import start_ahead_calls
    from tim_megatron.rl.phases import current_logprobs
    from tim_megatron.rollout.faults import agreed

    r, tr, ro, t = recipe, parts.trainer, parts.rollout, timer
    flight: PartialRollouts = parts.state.pending
    per = r.data.prompts_per_step * r.rollout.n // tr.dp_size
    for s in flight.to_begin(step):
        flight.batches[s] = begin(
            recipe=r,
            rollout=ro,
            prompts=parts.prompts,
            s=s,
            step=step,
            first_row=tr.dp_rank * per,
            n_local=per,
        )
    later = [s for s in sorted(flight.batches) if s > step]
    overlapped = r.rollout.schedule == "overlapped"
    here = [step] if overlapped else [step, *later]
    tally = StepTally()
    done = []
    with t("rollout"):
        for s in here:
            picks, call = segment_call(recipe=r, rollout=ro, flight=flight, g=flight.batches[s], step=step)
            groups, gen = agreed(ro, call, phase="generate", before_update=True)
            tally.gens.append(gen)
            done.append((s, picks, groups))
        moved = parts.colocation.to_trainer()
    ahead = None
    if overlapped and later:
        calls = [
            (s, *segment_call(recipe=r, rollout=ro, flight=flight, g=flight.batches[s], step=step))
            for s in later
        ]
        ahead = start_ahead_calls(parts, step=step, calls=calls, finisher=finish_ahead, tally=tally)
    with contextlib.ExitStack() as on_error:  # a failure here still lets the engine end its generation
        if ahead is not None:
            on_error.callback(ahead.wait)
        with t("old_logprobs"):
            for s, picks, groups in done:
                if s == step:
                    tally.finished_here = sum(len(grp[0].response_ids) for grp in groups)
                merge_and_score(
                    parts,
                    recipe=r,
                    s=s,
                    picks=picks,
                    groups=groups,
                    step=step,
                    observer=observer,
                    tally=tally,
                )
            got = take(recipe=r, trainer=tr, rollout=ro, prompts=parts.prompts, flight=flight, step=step)
            old = current_logprobs(
                trainer=tr,
                batch=got.batch,
                behaviour=got.behaviour,
                sampled=got.old_pass,
                age=got.age,
                sampled_routing=got.routing,
            )
        on_error.pop_all()  # it went well: the step joins the generation after the update
    metrics = {**got.metrics, **moved}
    if ahead is None:
        metrics.update(step_metrics(trainer=tr, rollout=ro, flight=flight, tally=tally))
    return got.batch, metrics, got.probe, old, ahead


def finish_ahead(
    parts, *, recipe, step: int, snapshot, results, tally: StepTally, observer
) -> dict[str, float]:
    """The overlapped schedule, after the update: the later batches' calls, joined (``results``: (step, picks,
    samples) each), merged and scored from the copy of the weights that sampled them; the step's metrics."""
    tr, ro = parts.trainer, parts.rollout
    flight: PartialRollouts = parts.state.pending
    for s, picks, (groups, gen) in results:
        tally.gens.append(gen)
        with tr.weights_at(snapshot):  # the weights they were sampled with, not the updated ones
            merge_and_score(
                parts,
                recipe=recipe,
                s=s,
                picks=picks,
                groups=groups,
                step=step,
                observer=observer,
                tally=tally,
            )
    return step_metrics(trainer=tr, rollout=ro, flight=flight, tally=tally)


def merge_and_score(parts, *, recipe, s: int, picks, groups, step: int, observer, tally: StepTally) -> None:
    """Batch ``s``'s new segments (``picks``, ``groups``: one engine call's) merged into it and scored at the
    trainer's present weights, in place in the run's batches in flight."""
    flight: PartialRollouts = parts.state.pending
    g = merge(flight.batches[s], picks, groups, step=step, max_tokens=recipe.rollout.max_tokens)
    flight.batches[s] = score(
        recipe=recipe,
        trainer=parts.trainer,
        rollout=parts.rollout,
        sync=parts.sync,
        g=g,
        step=step,
        observer=observer,
        tally=tally,
    )
