"""From a recipe to per-token weights and the loss of one minibatch, using only ``tim_megatron.algo``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tim_megatron.algo import (
    biased_distortion,
    gspo_loss,
    mismatch_stats,
    rollout_correction,
    token_clip_loss,
    unbiased_noise,
)
from tim_megatron.algo.injection import step_seed
from tim_megatron.algo.stats import Stats
from tim_megatron.recipe.schema import Recipe


@dataclass
class LossRows:
    """One rank's rows of a step, as the loss needs them (all ``[n, L]`` except ``advantages [n]``)."""

    old: torch.Tensor
    rollout: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    weights: torch.Tensor

    def rows(self, idx) -> LossRows:
        return LossRows(
            self.old[idx], self.rollout[idx], self.mask[idx], self.advantages[idx], self.weights[idx]
        )

    def to(self, device: torch.device) -> LossRows:
        """The same rows on ``device`` (the trainer's logprobs live there: a GPU in a GPU run)."""
        return LossRows(
            *(
                t.to(device, non_blocking=True)
                for t in (self.old, self.rollout, self.mask, self.advantages, self.weights)
            )
        )


def token_weights(
    recipe: Recipe,
    *,
    old: torch.Tensor,
    rollout: torch.Tensor,
    mask: torch.Tensor,
    step: int,
    rows: torch.Tensor,
    total_rows: int,
    global_width: int,
) -> tuple[torch.Tensor, Stats]:
    """Rollout correction (TIS/MIS/IcePop) times the objective injection (phi or xi), for this rank's rows."""
    c = recipe.rl.correction
    w, cstats = rollout_correction(
        old_logprobs=old,
        rollout_logprobs=rollout,
        mask=mask,
        mode=c.mode,
        level=c.level,
        c=c.c,
        low=c.low,
        high=c.high,
    )
    inj = recipe.diagnostics.objective_injection
    injected = None
    if inj.type == "biased":
        injected = biased_distortion(old_logprobs=old, mask=mask, delta=inj.delta, pi_low=inj.pi_low)
    elif inj.type == "unbiased":
        # Drawn for the whole step's [N, L], then cut to this rank's rows (``rows``: their global indices) and
        # width: the same noise whatever the parallel layout.
        xi = unbiased_noise(
            shape=(total_rows, global_width), sigma=inj.sigma, seed=step_seed(inj.seed, step, 1)
        )
        injected = xi[rows, : old.shape[1]].to(w.device)
    if injected is not None:
        w = w * injected
        v = injected[mask.bool()].double()
        cstats.add_sum("inj_w", v.sum())
        cstats.add_sum("inj_w2", (v * v).sum())
    return w * mask, cstats


def make_loss_fn(
    recipe: Recipe,
    inputs: LossRows,
    *,
    denominator: float,
    current_stats: Stats | None = None,
    loss_stats: Stats | None = None,
):
    """The loss of a minibatch's rows: called by the trainer per micro-batch with its current logprobs, which
    are on the trainer's device; the rows' loss inputs (host tensors) follow them there."""
    rl = recipe.rl
    dg = recipe.diagnostics

    def loss_fn(logprobs: torch.Tensor, rows: torch.Tensor, s: int):
        sub = inputs.rows(rows).to(logprobs.device)
        old, roll, mask, w = sub.old[:, :s], sub.rollout[:, :s], sub.mask[:, :s], sub.weights[:, :s]
        if logprobs.shape[1] != s or old.shape[1] != s:
            raise ValueError(
                f"micro-batch logprobs have {logprobs.shape[1]} positions and its rows {old.shape[1]}; "
                f"both must be the {s} the trainer passed"
            )
        kw = dict(
            logprobs=logprobs,
            old_logprobs=old,
            advantages=sub.advantages,
            mask=mask,
            token_weights=w,
            aggregation=rl.aggregation,
            denominator=denominator,
            norm_length=recipe.rollout.max_tokens,
        )
        if rl.loss == "gspo":
            loss, st = gspo_loss(clip_low=rl.seq_clip.low, clip_high=rl.seq_clip.high, **kw)
        else:
            loss, st = token_clip_loss(
                clip_low=rl.clip.low, clip_high=rl.clip.high, dual_clip=rl.clip.dual, **kw
            )
        if current_stats is not None:
            current_stats.merge(
                mismatch_stats(
                    train_logprobs=logprobs.detach(),
                    infer_logprobs=roll,
                    mask=mask,
                    bucket_edges=dg.bucket_edges,
                    rho_thresholds=dg.rho_thresholds,
                )
            )
        if loss_stats is not None:
            loss_stats.add_sum("loss_sum", loss.detach())
        return loss, st

    return loss_fn


def plain_loss_fn(old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, denominator: float):
    """The plain token-clip loss of fixed rows, as the trainer calls a loss (current logprobs, row indices,
    width): :func:`token_clip_loss` with its default clip and no token weights, over ``old`` and ``mask``
    ``[N, L]`` and ``advantages [N]``. For the benchmarks and tests that drive the trainer without a recipe."""

    def loss_fn(logprobs: torch.Tensor, rows: torch.Tensor, s: int):
        return token_clip_loss(
            logprobs=logprobs,
            old_logprobs=old[rows, :s],
            advantages=advantages[rows],
            mask=mask[rows, :s],
            denominator=denominator,
        )

    return loss_fn
