"""The phases of one RL step. ``tim_megatron.loop`` calls them in order; each returns its metrics.

Every rank runs every phase and calls the same methods: its rollout engine generates its engine's block of
the step's prompts (:mod:`tim_megatron.rollout.base`), and the rows this rank trains stay with it
(:func:`tim_megatron.rl.batch.rank_rows`). Metrics are reduced over the data-parallel group from
sufficient statistics, so every rank ends a phase with the same numbers whatever the layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from tim_megatron import metric_names as names
from tim_megatron.algo import (
    correction_metrics,
    group_advantages,
    mismatch_metrics,
    mismatch_stats,
    objective_surrogate,
    policy_loss_metrics,
    response_metrics,
    response_stats,
    routing_agreement_metrics,
    routing_agreement_stats,
)
from tim_megatron.algo.aggregation import local_denominator
from tim_megatron.algo.injection import step_seed
from tim_megatron.algo.mismatch import ratio_split_metrics, ratio_split_stats
from tim_megatron.algo.stats import Stats, safe_div, std_from_sums
from tim_megatron.comm import comm_device
from tim_megatron.data.rewards import reward as score
from tim_megatron.data.sources import PromptSource
from tim_megatron.modes import Routing
from tim_megatron.observer import NO_OBSERVER, StepObserver
from tim_megatron.recipe import Recipe
from tim_megatron.rl.batch import StepBatch, from_samples, global_width, rank_rows
from tim_megatron.rl.objective import LossRows, make_loss_fn, token_weights
from tim_megatron.rl.offpolicy import Generated
from tim_megatron.rl.plumbing import (
    engine_block,
    global_rank,
    max_over_world,
    reduce_dp,
    sum_over_dp,
    sum_over_engines,
)
from tim_megatron.rollout.base import GenerationStats, RolloutEngine, Sample
from tim_megatron.rollout.faults import FaultTally, agreed
from tim_megatron.rollout.sync import WeightSync
from tim_megatron.trainer.megatron_trainer import MegatronTrainer, SeqBatch
from tim_megatron.trainer.parallel import dp_group

EVAL_INDEX_BASE = 1 << 24
"""Added to a validation prompt's index in its sample seeds: the policy evaluation of step s draws other random
numbers than step s's training rollout (whose prompt indices lie below this)."""


def _tell_generated(observer: StepObserver, *, step: int, rollout: RolloutEngine, mine, groups, gen) -> None:
    observer.generated(
        step=step,
        engine=rollout.engine_index,
        prompts=len(mine),
        sequences=sum(len(g) for g in groups),
        stats=gen,
    )


def fault_metrics(rollout: RolloutEngine) -> dict[str, float]:
    """This step's ``faults/*`` metrics summed over the ranks (every rank calls)."""
    local = rollout.faults()
    keys = sorted(k for k in local if k not in FaultTally.HIGHEST)
    highest = sorted(k for k in local if k in FaultTally.HIGHEST)
    values = sum_over_engines(rollout, [local[k] for k in keys]) if keys else []
    values += max_over_world([local[k] for k in highest]) if highest else []
    return FaultTally.reduced(dict(zip(keys + highest, values, strict=True)))


def _generate(
    *,
    items: list,
    rollout: RolloutEngine,
    prompts: PromptSource,
    step: int,
    observer: StepObserver,
    index_base: int = 0,
    before_update: bool = False,
    **how,
):
    """Generate for this engine's block of ``items`` and tell the observer: its items, groups and stats.
    ``index_base`` offsets the prompts' global indices (their sample seeds)."""
    mine, first = engine_block(items, rollout)
    ids = prompts.encode(mine)
    groups, gen = agreed(
        rollout,
        lambda: rollout.generate(ids, step=step, first_index=index_base + first, **how),
        phase="generate",
        before_update=before_update,
    )
    _tell_generated(observer, step=step, rollout=rollout, mine=mine, groups=groups, gen=gen)
    return mine, groups, gen


def sample_block(
    *, recipe: Recipe, rollout: RolloutEngine, prompts: PromptSource, step: int
) -> Callable[[], tuple[list[list[Sample]], GenerationStats]]:
    """This engine's generation of step ``step``, as a call that touches the engine alone (no collective, no
    tokenizer, no trainer): the overlapped off-policy schedule runs it on a thread beside the update. The prompts
    are encoded here, on the caller's thread. :func:`rollouts` with ``sampled=`` finishes the batch."""
    mine, first = engine_block(prompts.step_items(step, recipe.data.prompts_per_step), rollout)
    ids = prompts.encode(mine)
    return lambda: rollout.generate(ids, step=step, first_index=first)


def probe_sequences(*, prompts: PromptSource, rollout: RolloutEngine, step: int) -> list[list[int]]:
    """Probe sequences for an eager sync check when a step has none of its own: up to 8 prompts of this engine's
    block of step ``step``."""
    mine, _ = engine_block(prompts.step_items(step, prompts.data.prompts_per_step), rollout)
    return prompts.encode(mine[:8])


def stored_rows_disagree(
    *, batch: StepBatch, prompts: PromptSource, step: int, prompts_per_step: int
) -> str | None:
    """Whether a batch read back from a checkpoint (a pending off-policy batch) is what step ``step`` sampled: each
    row's prompt tokens are its prompt's, and its reward is what the reward function gives its response (as
    :func:`rollouts` scored it). The first disagreement in words, or None."""
    items = prompts.step_items(step, prompts_per_step)
    encoded: dict[int, list[int]] = {}
    for i in range(len(batch)):
        g = int(batch.row[i]) // batch.group_size
        if not 0 <= g < len(items):
            return (
                f"row {int(batch.row[i])} is outside step {step}'s {len(items)} prompts x {batch.group_size}"
            )
        if g not in encoded:
            (encoded[g],) = prompts.encode([items[g]])
        p, n = int(batch.prompt_lens[i]), int(batch.lengths[i])
        if batch.input_ids[i, :p].tolist() != encoded[g]:
            return f"row {int(batch.row[i])}'s prompt tokens are not those of step {step}'s prompt {g}"
        want = score(items[g].reward, prompts.decode(batch.input_ids[i, p:n].tolist()), items[g].answer)
        if float(batch.rewards[i]) != float(torch.tensor(want, dtype=batch.rewards.dtype)):
            return f"row {int(batch.row[i])}'s reward is {float(batch.rewards[i]):g}; its response scores {want:g}"
    return None


def rollouts(
    *,
    recipe: Recipe,
    trainer: MegatronTrainer,
    rollout: RolloutEngine,
    prompts: PromptSource,
    step: int,
    observer: StepObserver = NO_OBSERVER,
    sampled: tuple[list[list[Sample]], GenerationStats] | None = None,
) -> tuple[StepBatch, dict, list[list[int]]]:
    """Every engine samples ``rollout.n`` responses for its block of the step's prompts and scores them where they
    are; this rank keeps the rows it trains. Also returns this engine's probe sequences for an eager sync check:
    one sample of each of up to 8 prompts of its own block (the same on all of the engine's ranks, which must
    submit identical requests; the rows this rank trains may come from another engine). ``sampled``: this
    engine's samples of the step, already drawn by :func:`sample_block` (on the overlapped schedule's thread)."""
    r, tr, ro = recipe, trainer, rollout
    total = r.data.prompts_per_step
    items = prompts.step_items(step, total)
    if sampled is None:
        mine, groups, gen = _generate(
            items=items, rollout=ro, prompts=prompts, step=step, observer=observer, before_update=True
        )
    else:
        (mine, _), (groups, gen) = engine_block(items, ro), sampled
        _tell_generated(observer, step=step, rollout=ro, mine=mine, groups=groups, gen=gen)
    rewards = [
        [score(it.reward, prompts.decode(s.response_ids), it.answer) for s in g]
        for it, g in zip(mine, groups, strict=True)
    ]
    blk = from_samples(
        groups,
        rewards,
        total_rows=total * r.rollout.n,
        num_moe_layers=tr.num_moe_layers(),
        top_k=tr.dims.num_experts_per_tok,
    )
    batch = rank_rows(blk, layout=ro.layout, rank=global_rank(), dp_rank=tr.dp_rank, dp_size=tr.dp_size)
    metrics = generation_metrics(trainer=tr, rollout=ro, gens=[gen])
    metrics.update(reward_metrics(batch))
    probe = [g[0].prompt_ids + g[0].response_ids for g in groups[:8]]
    return batch, metrics, probe


def generation_metrics(
    *, trainer: MegatronTrainer, rollout: RolloutEngine, gens: list[GenerationStats]
) -> dict[str, float]:
    """``rollout/*`` (and in exact mode ``exact/*``) of this engine's generation calls ``gens`` (each engine counted
    once; times: the slowest engine's sum). Every rank calls (collectives)."""
    ro = rollout
    tokens, prompt_tokens = sum_over_engines(
        ro, [float(sum(g.response_tokens for g in gens)), float(sum(g.prompt_tokens for g in gens))]
    )
    (slowest,) = max_over_world([sum(g.seconds for g in gens)])
    metrics = {
        "rollout/tokens_per_s": tokens / slowest if slowest > 0 else float("nan"),
        "rollout/response_tokens": tokens,
        "rollout/prompt_tokens": prompt_tokens,
        "rollout/seconds_slowest_engine": slowest,
    }
    if trainer.modes.exact:
        # Every rank is in exact mode: the max is a collective all of them join.
        decoded = max(sum(g.response_tokens for g in gens), 1)
        forwards, cache, read, copied = max_over_world(
            [
                float(sum(g.extra.get("forwards", 0) for g in gens)),
                float(max((g.extra.get("kv_cache_bytes", 0) for g in gens), default=0)),
                sum(g.extra.get("kv_read_bytes", 0) for g in gens) / decoded,
                sum(g.extra.get("kv_copied_bytes", 0) for g in gens) / decoded,
            ]
        )
        metrics["exact/forwards"] = forwards
        metrics["exact/kv_cache_mib"] = cache / 2**20
        # Per decoded token (the rank with the most): keys and values read in place, and copied (slot refills).
        metrics["exact/kv_read_kib_per_token"] = read / 2**10
        metrics["exact/kv_copied_kib_per_token"] = copied / 2**10
    return metrics


def reward_metrics(batch: StepBatch) -> dict[str, float]:
    """``reward/*`` and ``batch/width`` of the step's rows (this rank's ``batch``; every rank calls)."""
    rw = batch.rewards.view(-1, batch.group_size)
    n, s, s2, equal = sum_over_dp(
        [
            float(len(batch)),
            float(batch.rewards.sum()),
            float((batch.rewards.double() ** 2).sum()),
            float((rw.max(-1).values == rw.min(-1).values).sum()),
        ]
    )
    rmax, neg_rmin = max_over_world([float(batch.rewards.max()), -float(batch.rewards.min())])
    mean = s / n
    return {
        names.REWARD: mean,
        "reward/std": max(s2 / n - mean * mean, 0.0) ** 0.5,
        "reward/max": rmax,
        "reward/min": -neg_rmin,
        "reward/groups_all_equal_frac": equal / (n / batch.group_size),
        "batch/width": float(global_width(batch)),
    }


def validate(
    *, recipe: Recipe, rollout, prompts: PromptSource, step: int, observer: StepObserver = NO_OBSERVER
) -> dict:
    """Greedy accuracy on the validation prompts, each engine taking its block of them; with
    ``run.val_samples``, also the policy's mean reward over that many samples per prompt, drawn without the
    sampling injection (the trained policy's outcome, where the training reward is the sampler's)."""
    items = prompts.validation_items(recipe.data.val_prompts)
    if not items:
        return {}
    mine, groups, _ = _generate(
        items=items, rollout=rollout, prompts=prompts, step=step, observer=observer, n=1, greedy=True
    )
    correct = sum(
        score(it.reward, prompts.decode(g[0].response_ids), it.answer)
        for it, g in zip(mine, groups, strict=True)
    )
    (total,) = sum_over_engines(rollout, [float(correct)])
    out = {names.VAL_ACCURACY: total / len(items)}
    k = recipe.run.val_samples
    if k:
        mine, groups, _ = _generate(
            items=items,
            rollout=rollout,
            prompts=prompts,
            step=step,
            observer=observer,
            index_base=EVAL_INDEX_BASE,
            n=k,
            injection=False,
        )
        reward = sum(
            score(it.reward, prompts.decode(s.response_ids), it.answer)
            for it, g in zip(mine, groups, strict=True)
            for s in g
        )
        (policy,) = sum_over_engines(rollout, [float(reward)])
        out[names.VAL_POLICY_REWARD] = policy / (len(items) * k)
    return out


# --------------------------------------------------------------------------------- trainer-side logprobs


@dataclass
class OldPass:
    old: torch.Tensor
    """``[n, L]`` trainer logprobs at the old weights for this rank's rows (NaN-free; 0 off-response)."""
    rollout: torch.Tensor
    """``[n, L]`` rollout logprobs the objective uses (the sampling distribution's)."""
    entropy: torch.Tensor | None
    trainer_routing: torch.Tensor | None
    recomputed: bool
    sync: dict = field(default_factory=dict)
    """Metrics of the previous sync's check on these samples (when one ran), and exact mode's check."""
    behaviour: torch.Tensor | None = None
    """``[n, L]`` pi_s, the trainer's logprobs at the weights that sampled these rows, when those weights are older
    than ``old``'s (an off-policy batch, :mod:`tim_megatron.rl.offpolicy`); None: ``old`` is pi_s itself."""
    age: int = 0
    """Updates between the sampling of these rows and ``old``'s weights (partial rollouts: of their oldest token)."""
    sampled_routing: torch.Tensor | None = None
    """``[layers, n, L, k]`` the experts the trainer chose by itself at the sampling weights (recorded by the pi_s
    pass; per position, partial rollouts: by the pass that scored the token it produced), when ``behaviour`` is
    set and routing is recorded; None: ``trainer_routing`` is at the sampling weights."""

    @property
    def sampled_at(self) -> torch.Tensor:
        """pi_s: the trainer's logprobs at the sampling weights."""
        return self.old if self.behaviour is None else self.behaviour

    @property
    def routing_at_sampling(self) -> torch.Tensor | None:
        """The trainer's own experts at the sampling weights: those the engine's are compared with."""
        return self.trainer_routing if self.behaviour is None else self.sampled_routing


def scored_as_sampled(
    *,
    recipe: Recipe,
    trainer: MegatronTrainer,
    rollout: RolloutEngine,
    sync: WeightSync,
    sampled: tuple[int, StepBatch, dict, list[list[int]]],
    step: int,
    observer: StepObserver = NO_OBSERVER,
    keep_pass: bool,
) -> Generated:
    """A batch sampled for a later step, scored by the trainer at the weights it holds now (pi_s, with the checks an
    on-policy step runs), as a :class:`tim_megatron.rl.offpolicy.Generated` sampled at step ``step`` (version
    ``step - 1``). ``sampled``: (its step, batch, metrics, probe), as :func:`rollouts` gave them. ``keep_pass``:
    keep the trainer pass for reuse (only when these are also the weights of the step that trains it)."""
    s, b, m, p = sampled
    op = old_logprobs(
        recipe=recipe, trainer=trainer, rollout=rollout, sync=sync, batch=b, step=step, observer=observer
    )
    return Generated(
        step=s,
        version=step - 1,
        batch=b,
        behaviour=op.old,
        metrics={**m, **op.sync},
        probe=p,
        routing=op.trainer_routing,
        old_pass=op if keep_pass else None,
    )


def old_logprobs(
    *,
    recipe: Recipe,
    trainer: MegatronTrainer,
    rollout: RolloutEngine,
    sync: WeightSync,
    batch: StepBatch,
    step: int,
    observer: StepObserver = NO_OBSERVER,
) -> OldPass:
    """Recompute the old policy's logprobs on this rank's rows; check the last sync, or in exact mode that every
    sampled token's logprob is the old pass's bit for bit (the run stops at the first that is not)."""
    r, tr = recipe, trainer
    mask = batch.response_mask
    routes = tr.modes.routing
    seq = SeqBatch(
        batch.input_ids, batch.lengths, batch.routed_experts if routes.old_pass_uses_rollout_routes else None
    )
    exact = tr.modes.exact
    recomputed = not r.rl.correction.bypass
    checks: dict = {}
    if recomputed:
        old, ent, recorded = _trainer_pass(trainer=tr, batch=batch, seq=seq)
        if exact:
            from tim_megatron.rollout.exact_sampler import check_exact

            checks = check_exact(
                step=step,
                rows=batch.row,
                prompt_lens=batch.prompt_lens,
                old=old,
                sampled=batch.policy_logprobs * mask,
                mask=mask,
                group=dp_group(),
            )
        checks.update(
            sync.check_samples(
                trainer_logprobs=old,
                rollout_logprobs=batch.rollout_logprobs,
                mask=mask,
                engine=batch.engine,
                engines=rollout.layout.engines,
                observer=observer,
            )
        )
    else:
        old, ent, recorded = batch.rollout_logprobs.clone(), None, None
    sampled = (
        batch.rollout_logprobs.clone()
    )  # the sampling distribution's logprobs (``rollout`` is the engine)
    if r.rl.correction.bypass:
        old = sampled.clone()
    return OldPass(
        old=old,
        rollout=sampled,
        entropy=ent,
        trainer_routing=trainer_routing(trainer=tr, batch=batch, recorded=recorded),
        recomputed=recomputed,
        sync=checks,
    )


def trainer_routing(*, trainer: MegatronTrainer, batch: StepBatch, recorded):
    """The routing the trainer chooses by itself, for the routing metrics: what its pass recorded, or, where that
    pass replayed the rollout's routes (R3), one more pass with free routing."""
    if trainer.modes.routing.free_routing_probe and batch.routed_experts is not None:
        return trainer.logprobs(SeqBatch(batch.input_ids, batch.lengths), routing="record")[1]
    return recorded


def _trainer_pass(*, trainer: MegatronTrainer, batch: StepBatch, seq: SeqBatch):
    """The trainer's logprobs (0 off-response), entropy and recorded routing on this rank's rows, at its current
    weights; in exact mode at the sampler's shapes (its micro-batches are these rows in order, at this width)."""
    tr = trainer
    width = tr.exact_width(int(batch.prompt_lens.max())) if tr.modes.exact else None
    out, recorded = tr.logprobs(seq, with_entropy=True, routing=tr.modes.routing.old_pass, width=width)
    return out.logprobs * batch.response_mask, out.entropy, recorded


def current_logprobs(
    *,
    trainer: MegatronTrainer,
    batch: StepBatch,
    behaviour: torch.Tensor,
    sampled: OldPass | None,
    age: int,
    sampled_routing: torch.Tensor | None = None,
) -> OldPass:
    """An off-policy batch at the step that trains it: pi_t, the trainer's logprobs at the current weights, beside
    ``behaviour`` (pi_s, from the pass at the sampling weights) and ``sampled_routing`` (the experts that pass
    chose, when recorded). ``age`` 0 (sampled at this step's weights, with that pass, ``sampled``, still in
    memory): that pass itself, so the staleness part is exactly 0."""
    if age == 0 and sampled is not None:
        return replace(sampled, sync={})
    tr, routes = trainer, trainer.modes.routing
    seq = SeqBatch(
        batch.input_ids, batch.lengths, batch.routed_experts if routes.old_pass_uses_rollout_routes else None
    )
    old, ent, recorded = _trainer_pass(trainer=tr, batch=batch, seq=seq)
    return OldPass(
        old=old,
        rollout=batch.rollout_logprobs.clone(),
        entropy=ent,
        trainer_routing=trainer_routing(trainer=tr, batch=batch, recorded=recorded),
        recomputed=True,
        behaviour=behaviour,
        age=age,
        sampled_routing=sampled_routing,
    )


def advantages(*, recipe: Recipe, batch: StepBatch) -> torch.Tensor:
    return group_advantages(rewards=batch.rewards, group_size=batch.group_size, estimator=recipe.rl.advantage)


# ------------------------------------------------------------------------------------------- metrics


def loss_weights(*, recipe: Recipe, batch: StepBatch, old: OldPass, step: int) -> tuple[torch.Tensor, Stats]:
    """The per-token loss weights (the off-policy correction's, times an objective injection's), and their
    statistics summed over the data-parallel group (for :func:`step_metrics`). The correction's ratio is the one
    ``rl.correction.target`` names: pi_t / mu_s (total), pi_t / pi_s (staleness) or pi_s / mu_s (TIM)."""
    num, den = {
        "total": (old.old, old.rollout),
        "staleness": (old.old, old.sampled_at),
        "tim": (old.sampled_at, old.rollout),
    }[recipe.rl.correction.target]
    weights, stats = token_weights(
        recipe,
        old=num,
        rollout=den,
        mask=batch.response_mask,
        step=step,
        rows=batch.row,
        total_rows=batch.total_rows,
        global_width=global_width(batch),
    )
    return weights, reduce_dp(stats)


def step_metrics(
    *, recipe: Recipe, batch: StepBatch, old: OldPass, adv: torch.Tensor, correction: Stats
) -> dict:
    """Mismatch, correction, surrogate, routing and response metrics. ``correction``: from :func:`loss_weights`."""
    r, dg, op, local, cstats = recipe, recipe.diagnostics, old, batch, correction
    mask = local.response_mask
    out: dict = {}
    if op.recomputed:
        out.update(
            mismatch_metrics(
                reduce_dp(
                    mismatch_stats(
                        train_logprobs=op.old,
                        infer_logprobs=op.rollout,
                        mask=mask,
                        bucket_edges=dg.bucket_edges,
                        rho_thresholds=dg.rho_thresholds,
                    )
                ),
                a="old",
                b="rollout",
                bucket_edges=dg.bucket_edges,
                rho_thresholds=dg.rho_thresholds,
            )
        )
        out.update(
            ratio_split_metrics(
                reduce_dp(
                    ratio_split_stats(current=op.old, behaviour=op.sampled_at, rollout=op.rollout, mask=mask)
                )
            )
        )
        out[names.OFFPOLICY_AGE] = float(op.age)
    out.update(correction_metrics(cstats, mode=r.rl.correction.mode, level=r.rl.correction.level))
    if "inj_w" in cstats:
        n = cstats.sum("tokens")
        out["objective/injection_weight_mean"] = safe_div(cstats.sum("inj_w"), n)
        out["objective/injection_weight_std"] = std_from_sums(cstats.sum("inj_w"), cstats.sum("inj_w2"), n)
    j = reduce_dp(
        objective_surrogate(
            advantages=adv,
            old_logprobs=op.old,
            mask=mask,
            delta=dg.surrogate_delta,
            pi_low=dg.objective_injection.pi_low,
        )
    )
    out["objective/J"] = float(j.sum("J"))
    out["objective/J_per_token"] = safe_div(j.sum("J"), j.sum("tokens"))
    out["objective/low_prob_token_frac"] = safe_div(j.sum("low_tokens"), j.sum("tokens"))
    out.update(
        response_metrics(reduce_dp(response_stats(mask=mask, entropy=op.entropy, truncated=local.truncated)))
    )
    out.update(routing_metrics(batch=local, old=op))
    return out


def routing_metrics(*, batch: StepBatch, old: OldPass) -> dict[str, float]:
    """Expert agreement over the positions whose routing produced a response token (the last token's own routing
    is never used): ``routing/rollout_vs_trainer/*``, the engine against the trainer at the same (sampling)
    weights, and off-policy ``routing/trainer_sampled_vs_current/*``, the trainer at the sampling weights against
    the trainer now (how far the policy's move changed the routing)."""
    mask = batch.response_mask
    pos_mask = torch.zeros_like(mask)
    pos_mask[:, :-1] = mask[:, 1:]
    out: dict[str, float] = {}

    def agree(a: torch.Tensor, b: torch.Tensor, prefix: str) -> None:
        w = min(a.shape[2], b.shape[2], pos_mask.shape[1])  # a record may be wider (partial rollouts' routes)
        rs = routing_agreement_stats(
            rollout_experts=a[:, :, :w].long().flatten(1, 2),
            trainer_experts=b[:, :, :w].long().flatten(1, 2),
            mask=pos_mask[:, :w].flatten(),
        )
        out.update(routing_agreement_metrics(reduce_dp(rs), prefix=prefix))

    at_sampling = old.routing_at_sampling
    if at_sampling is not None and batch.routed_experts is not None:
        agree(batch.routed_experts, at_sampling, "routing/rollout_vs_trainer/")
    if old.behaviour is not None and old.sampled_routing is not None and old.trainer_routing is not None:
        agree(old.sampled_routing, old.trainer_routing, "routing/trainer_sampled_vs_current/")
    return out


def update_routes(*, recipe: Recipe, routing: Routing, batch: StepBatch, old: OldPass):
    """The experts the update's forwards replay, ``[layers, n, L, k]`` (None: the trainer routes by itself). R3:
    the engine's, per token those of the engine that sampled it. R2: the trainer's own, from the pass PPO's ratio
    is taken against: pi_t's (``rl.proximal: current``), or pi_s's (``sampled``: the routes its denominator was
    computed with, per token at the weights that sampled it). ``routing``: the run's (``trainer.modes.routing``)."""
    routes = routing
    if routes.update != "replay":
        return None
    if not routes.update_routes_from_old_pass:
        return batch.routed_experts
    if recipe.rl.proximal == "sampled" and old.behaviour is not None:
        if old.sampled_routing is None:
            raise RuntimeError(
                "router replay r2 with rl.proximal = sampled: this batch's pass at its sampling weights recorded "
                "no routes to replay"
            )
        return old.sampled_routing
    return old.trainer_routing


# -------------------------------------------------------------------------------------------- update


@dataclass
class UpdateTally:
    """What a step's optimizer updates add up to on this rank, and the metrics every rank reports of them."""

    loss_stats: Stats = field(default_factory=Stats)
    current: Stats = field(default_factory=Stats)
    """Mismatch statistics of the current policy against the rollout, from the first epoch's forwards."""
    applied: int = 0
    updates: int = 0
    replayed: int = 0
    """Tokens trained with the rollout's routes replayed (R2/R3)."""
    norms: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)

    def add(self, res, *, replayed: int) -> None:
        self.loss_stats.merge(res.stats)
        self.applied += int(res.applied)
        self.updates += 1
        self.replayed += replayed
        self.losses.append(res.loss)
        self.scales.append(res.loss_scale)
        if res.grad_norm == res.grad_norm:  # not NaN
            self.norms.append(res.grad_norm)

    def metrics(self, *, recipe: Recipe, dp_size: int, lr: float) -> dict:
        """The loss, mismatch and update metrics, reduced over the data-parallel group (every rank calls it)."""
        dg = recipe.diagnostics
        out = policy_loss_metrics(reduce_dp(self.loss_stats))
        out.update(
            mismatch_metrics(
                reduce_dp(self.current),
                a="current",
                b="rollout",
                bucket_edges=dg.bucket_edges,
                rho_thresholds=dg.rho_thresholds,
            )
        )
        total_loss = torch.tensor([sum(self.losses)], dtype=torch.float64, device=comm_device(dp_group()))
        if dist.is_initialized() and dp_size > 1:
            dist.all_reduce(total_loss, group=dp_group())
        norms = self.norms
        out.update(
            {
                "actor/loss": float(total_loss) / max(self.updates, 1),
                "actor/grad_norm": sum(norms) / len(norms) if norms else float("nan"),
                "actor/grad_norm_max": max(norms) if norms else float("nan"),
                names.LR: lr,
                "actor/updates": self.updates,
                "actor/updates_skipped": self.updates - self.applied,
                "actor/loss_scale": self.scales[-1] if self.scales else float("nan"),
                "remedy/replayed_tokens": float(self.replayed),
            }
        )
        return out


def minibatch_rows(*, recipe: Recipe, n_local: int, step: int, epoch: int) -> list[torch.Tensor]:
    """This rank's rows of each minibatch of one epoch, in order: its block shuffled with a seed every rank shares,
    minibatch m the m-th equal slice (sorted), so every rank runs equally many equal-sized micro-batches."""
    per = n_local // recipe.rl.minibatches
    perm = torch.randperm(
        n_local, generator=torch.Generator().manual_seed(step_seed(recipe.run.seed, step, 100 + epoch))
    )
    return [perm[m * per : (m + 1) * per].sort().values for m in range(recipe.rl.minibatches)]


def update(
    *,
    recipe: Recipe,
    trainer: MegatronTrainer,
    batch: StepBatch,
    old: OldPass,
    adv: torch.Tensor,
    weights: torch.Tensor,
    lr: float,
    step: int,
    observer: StepObserver = NO_OBSERVER,
) -> dict:
    """``rl.ppo_epochs`` passes over the step, each split into ``rl.minibatches`` optimizer updates
    (:func:`minibatch_rows`: stratified over the data-parallel ranks, so expert-parallel dispatch exchanges equal
    blocks)."""
    r, tr, op, local = recipe, trainer, old, batch
    proximal = op.old if r.rl.proximal == "current" else op.sampled_at  # what PPO's ratio is against
    loss_rows = LossRows(
        old=proximal, rollout=op.rollout, mask=local.response_mask, advantages=adv, weights=weights
    )
    routing = tr.modes.routing.update
    routed = update_routes(recipe=r, routing=tr.modes.routing, batch=local, old=op)
    tally = UpdateTally()
    for epoch in range(r.rl.ppo_epochs):
        for idx in minibatch_rows(recipe=r, n_local=len(local), step=step, epoch=epoch):
            (den,) = sum_over_dp([local_denominator(mask=local.response_mask[idx], mode=r.rl.aggregation)])
            seq = SeqBatch(
                local.input_ids[idx], local.lengths[idx], routed[:, idx] if routing == "replay" else None
            )
            fn = make_loss_fn(
                r, loss_rows.rows(idx), denominator=den, current_stats=tally.current if epoch == 0 else None
            )
            res = tr.train_step(seq, fn, lr=lr, routing=routing)
            observer.trained(step=step, times=res.times)
            tally.add(res, replayed=int(seq.lengths.sum()) if routing == "replay" else 0)
    return tally.metrics(recipe=r, dp_size=tr.dp_size, lr=lr)
