"""In-process unit test of rl/objective.py's plain loss (the one the benchmarks and trainer workers use)."""

from __future__ import annotations

import torch

from tim_megatron.algo import token_clip_loss
from tim_megatron.rl.objective import plain_loss_fn


def test_plain_loss_fn_is_token_clip_on_the_micro_batch_rows_and_width():
    g = torch.Generator().manual_seed(0)
    old = torch.log(torch.rand(5, 7, generator=g).clamp(0.05))
    new = old + 0.3 * torch.randn(5, 7, generator=g)
    adv = torch.randn(5, generator=g)
    mask = torch.rand(5, 7, generator=g) > 0.3
    rows, s = torch.tensor([3, 0, 4]), 6
    loss, stats = plain_loss_fn(old, adv, mask, 11.0)(new[rows, :s], rows, s)
    want, want_stats = token_clip_loss(
        logprobs=new[rows, :s],
        old_logprobs=old[rows, :s],
        advantages=adv[rows],
        mask=mask[rows, :s],
        denominator=11.0,
    )
    assert torch.equal(loss, want)
    assert all(torch.equal(stats.sums[k], v) for k, v in want_stats.sums.items())
