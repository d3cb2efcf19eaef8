"""The phases of one RL step. ``tim_megatron.loop`` calls them in order; each returns its metrics.

Every rank runs every phase (the trainer's work is collective); rank 0 alone owns the rollout engine.
Metrics are reduced over the data-parallel group from sufficient statistics, so every rank ends a phase
with the same numbers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tim_megatron.algo import (
    add_drift,
    add_noise,
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
from tim_megatron.algo.stats import Stats, safe_div, std_from_sums
from tim_megatron.data.rewards import reward as score
from tim_megatron.data.sources import encode_prompt
from tim_megatron.rl.batch import StepBatch, broadcast, broadcast_object, from_samples
from tim_megatron.rl.objective import Shard, make_loss_fn, token_weights
from tim_megatron.trainer.engine import SeqBatch


@dataclass
class Timer:
    times: dict[str, float] = field(default_factory=dict)

    def __call__(self, name: str):
        timer = self

        class _T:
            def __enter__(self):
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                timer.times[f"time/{name}"] = (
                    timer.times.get(f"time/{name}", 0.0) + time.perf_counter() - self.t
                )

        return _T()


def _dp_group():
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group() if ps.model_parallel_is_initialized() else None


def _reduce(s: Stats) -> Stats:
    return s.all_reduce(_dp_group())


# ------------------------------------------------------------------------------------------- rollouts


def rollouts(run, step: int) -> tuple[StepBatch, dict]:
    """Sample ``rollout.n`` responses for each of the step's prompts and score them (rank 0), then broadcast."""
    r = run.recipe
    items = run.source.step_items(step, r.data.prompts_per_step)
    metrics = {}
    batch = None
    if r.diagnostics.vexact == "trainer_sampler":
        from tim_megatron.trainer.sampler import sample_with_trainer

        prompts = [encode_prompt(run.tokenizer, it.prompt) for it in items]
        groups = sample_with_trainer(run.trainer, prompts, step=step, eos_id=run.tokenizer.eos_token_id)
        rewards = [
            [score(it.reward, _text(run, s), it.answer) for s in g]
            for it, g in zip(items, groups, strict=True)
        ]
        batch = from_samples(groups, rewards)
    elif run.engine is not None:
        prompts = [encode_prompt(run.tokenizer, it.prompt) for it in items]
        groups, gen = run.engine.generate(prompts, step=step)
        rewards = [
            [score(it.reward, _text(run, s), it.answer) for s in g]
            for it, g in zip(items, groups, strict=True)
        ]
        batch = from_samples(
            groups,
            rewards,
            num_moe_layers=run.trainer.num_moe_layers(),
            top_k=run.trainer.dims.num_experts_per_tok,
        )
        metrics = {"rollout/tokens_per_s": gen.tokens_per_s, "rollout/response_tokens": gen.response_tokens}
        run.sample_texts = [(items[0].prompt, _text(run, groups[0][0]), items[0].answer)]
    batch = broadcast(batch)
    metrics = broadcast_object(metrics)
    rw = batch.rewards.view(-1, batch.group_size)
    metrics.update(
        {
            "reward/mean": float(batch.rewards.mean()),
            "reward/std": float(batch.rewards.std(unbiased=False)),
            "reward/max": float(batch.rewards.max()),
            "reward/groups_all_equal_frac": float((rw.max(-1).values == rw.min(-1).values).float().mean()),
            "batch/width": float(batch.input_ids.shape[1]),
        }
    )
    return batch, metrics


def _text(run, s) -> str:
    return run.tokenizer.decode(s.response_ids, skip_special_tokens=True)


# --------------------------------------------------------------------------------- trainer-side logprobs


@dataclass
class OldPass:
    rows: slice
    old: torch.Tensor
    """``[n, L]`` trainer logprobs at the old weights for this rank's rows (NaN-free; 0 off-response)."""
    rollout: torch.Tensor
    """``[n, L]`` rollout logprobs the objective uses (after VeXact replacement and injections)."""
    entropy: torch.Tensor | None
    trainer_routing: torch.Tensor | None
    recomputed: bool


def old_logprobs(run, batch: StepBatch, step: int) -> OldPass:
    """Recompute the old policy's logprobs on this rank's rows; apply VeXact and logprob injections."""
    r = run.recipe
    tr = run.trainer
    rows = tr.shard(len(batch))
    local = batch.rows(rows)
    mask = local.response_mask
    dg = r.diagnostics
    replay = r.remedies.router_replay
    routing = {"r3": "replay", "r2": "record"}.get(replay, "record" if run.capture_agreement else "off")
    seq = SeqBatch(local.input_ids, local.lengths, local.routed_experts if replay == "r3" else None)
    inj = dg.logprob_injection
    quant = inj.mantissa_bits if inj.type == "precision" else None
    recomputed = not (r.rl.correction.bypass and dg.vexact == "off")
    if recomputed:
        out, recorded = tr.logprobs(
            seq, with_entropy=True, quantize_bits=quant, routing=routing if tr.replay_enabled else "off"
        )
        old, ent = out.logprobs * mask, out.entropy
    else:
        old, ent, recorded, out = local.rollout_logprobs.clone(), None, None, None
    rollout = local.rollout_logprobs.clone()
    if run.verify_on_next_step and recomputed and run.recipe.diagnostics.vexact != "trainer_sampler":
        verify_last_sync(run, old=old, rollout=rollout, mask=mask)
    if dg.vexact != "off":
        # Zero mismatch by construction: the rollout logprobs ARE the trainer's, same forward, same layout.
        rollout = old.clone()
    if inj.type == "precision":
        rollout = out.quantized * mask
    elif inj.type == "noise":
        rollout = (
            add_noise(logprobs=rollout, std=inj.std, seed=step_seed(inj.seed, step, 2) + rows.start) * mask
        )
    elif inj.type == "drift":
        rollout = (
            add_drift(logprobs=rollout, drift=inj.drift, reference_logprobs=old, pi_low=inj.drift_pi_low)
            * mask
        )
    if r.rl.correction.bypass:
        old = rollout.clone()
    trainer_routing = recorded
    if replay == "r3" and run.capture_agreement and local.routed_experts is not None:
        _, trainer_routing = tr.logprobs(
            SeqBatch(local.input_ids, local.lengths), routing="record"
        )  # free routing, for the metric
    return OldPass(
        rows=rows,
        old=old,
        rollout=rollout,
        entropy=ent,
        trainer_routing=trainer_routing,
        recomputed=recomputed,
    )


def verify_last_sync(run, *, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> None:
    """The previous step's weight sync, checked on this step's samples: vLLM drew them with the synced
    weights, and the trainer has just recomputed their logprobs with its own. Costs nothing extra."""
    from tim_megatron.rollout.sync import WeightSyncError, agreement, describe, failed

    r = run.recipe
    ag = agreement(
        a_logprobs=old, b_logprobs=rollout, mask=mask, tolerance=r.sync_tolerance, group=_dp_group()
    )
    run.last_sync_check = ag
    run.verify_on_next_step = False
    if failed(ag, r.sync_tolerance):
        raise WeightSyncError(
            f"the weights synced after the previous step are not the trainer's: on this step's samples {describe(ag)}; "
            f"tolerance {r.sync_tolerance:g} for 80% of tokens"
        )


def advantages(run, batch: StepBatch) -> torch.Tensor:
    return group_advantages(
        rewards=batch.rewards, group_size=batch.group_size, estimator=run.recipe.rl.advantage
    )


# ------------------------------------------------------------------------------------------- metrics


def tim_metrics(
    run, batch: StepBatch, op: OldPass, adv: torch.Tensor, step: int
) -> tuple[dict, torch.Tensor, Stats]:
    """Mismatch, correction, surrogate, routing and response metrics; returns the per-token loss weights too."""
    r, dg = run.recipe, run.recipe.diagnostics
    local = batch.rows(op.rows)
    mask = local.response_mask
    out: dict = {}
    if op.recomputed:
        out.update(
            mismatch_metrics(
                _reduce(
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
    weights, cstats = token_weights(
        r, old=op.old, rollout=op.rollout, mask=mask, step=step, rows=op.rows, total_rows=len(batch)
    )
    cstats = _reduce(cstats)
    out.update(correction_metrics(cstats, mode=r.rl.correction.mode, level=r.rl.correction.level))
    if "inj_w" in cstats:
        n = cstats.sum("tokens")
        out["objective/injection_weight_mean"] = safe_div(cstats.sum("inj_w"), n)
        out["objective/injection_weight_std"] = std_from_sums(cstats.sum("inj_w"), cstats.sum("inj_w2"), n)
    j = _reduce(
        objective_surrogate(
            advantages=adv[op.rows],
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
        response_metrics(_reduce(response_stats(mask=mask, entropy=op.entropy, truncated=local.truncated)))
    )
    if op.trainer_routing is not None and local.routed_experts is not None:
        # Positions whose routing produced a response token (the last token's own routing is never used).
        pos_mask = torch.zeros_like(mask)
        pos_mask[:, :-1] = mask[:, 1:]
        rs = routing_agreement_stats(
            rollout_experts=local.routed_experts.long().flatten(1, 2),
            trainer_experts=op.trainer_routing.long().flatten(1, 2),
            mask=pos_mask.flatten(),
        )
        out.update(routing_agreement_metrics(_reduce(rs)))
    return out, weights, mask


# -------------------------------------------------------------------------------------------- update


def update(
    run, batch: StepBatch, op: OldPass, adv: torch.Tensor, weights: torch.Tensor, lr: float, step: int
) -> dict:
    """``rl.ppo_epochs`` passes over the step, each split into ``rl.minibatches`` optimizer updates.

    Minibatches are stratified over data-parallel ranks: every rank shuffles its own block of rows with the
    same seed and minibatch m takes the m-th slice of each block, so all ranks run the same number of
    equal-sized micro-batches (expert-parallel dispatch exchanges equal blocks).
    """
    r = run.recipe
    tr = run.trainer
    local = batch.rows(op.rows)
    n_local = len(local)
    per = n_local // r.rl.minibatches
    shard = Shard(
        old=op.old, rollout=op.rollout, mask=local.response_mask, advantages=adv[op.rows], weights=weights
    )
    replay = r.remedies.router_replay
    routing = "replay" if replay in ("r2", "r3") and tr.replay_enabled else "off"
    routed = op.trainer_routing if replay == "r2" else local.routed_experts
    loss_stats, current = Stats(), Stats()
    applied, norms, losses, scales, updates, replayed = 0, [], [], [], 0, 0
    for epoch in range(r.rl.ppo_epochs):
        perm = torch.randperm(
            n_local, generator=torch.Generator().manual_seed(step_seed(r.run.seed, step, 100 + epoch))
        )
        for m in range(r.rl.minibatches):
            idx = perm[m * per : (m + 1) * per].sort().values
            global_rows = torch.cat([idx + k * n_local for k in range(tr.dp_size)])
            den = local_denominator(mask=batch.response_mask[global_rows], mode=r.rl.aggregation)
            seq = SeqBatch(
                local.input_ids[idx], local.lengths[idx], routed[:, idx] if routing == "replay" else None
            )
            fn = make_loss_fn(
                r, shard.rows(idx), denominator=den, current_stats=current if epoch == 0 else None
            )
            res = tr.train_step(seq, fn, lr=lr, routing=routing)
            if routing == "replay":
                replayed += int(seq.lengths.sum())
            loss_stats.merge(res.stats)
            applied += int(res.applied)
            updates += 1
            losses.append(res.loss)
            scales.append(res.loss_scale)
            if res.grad_norm == res.grad_norm:  # not NaN
                norms.append(res.grad_norm)
    dg = r.diagnostics
    out = policy_loss_metrics(_reduce(loss_stats))
    out.update(
        mismatch_metrics(
            _reduce(current),
            a="current",
            b="rollout",
            bucket_edges=dg.bucket_edges,
            rho_thresholds=dg.rho_thresholds,
        )
    )
    total_loss = torch.tensor([sum(losses)], dtype=torch.float64)
    if dist.is_initialized() and tr.dp_size > 1:
        dist.all_reduce(total_loss, group=_dp_group())
    out.update(
        {
            "actor/loss": float(total_loss) / max(updates, 1),
            "actor/grad_norm": sum(norms) / len(norms) if norms else float("nan"),
            "actor/grad_norm_max": max(norms) if norms else float("nan"),
            "actor/lr": lr,
            "actor/updates": updates,
            "actor/updates_skipped": updates - applied,
            "actor/loss_scale": scales[-1] if scales else float("nan"),
            "remedy/replayed_tokens": float(replayed),
        }
    )
    return out
