"""The comparisons behind every verdict of ``make gpu-check``: pure functions on tensors and numbers.

The rules are fixed in advance and printed with each verdict:

* Megatron in float32 against HF transformers in float32 (TF32 off): the largest per-token logprob gap
  within :data:`FP32_MAX_GAP`. A wrong weight mapping or a mis-wired layer moves logprobs by whole nats;
  kernel order in float32 moves them by about 1e-6.
* Megatron in bfloat16 against HF in float32: bfloat16 has its own, real error, so the yardstick is measured
  in the same run, on the same tokens: HF transformers itself in bfloat16 against float32. Megatron passes
  when its mean gap is within :data:`BF16_FACTOR` times HF's own (a mis-wired model is far outside it).
* Our train step against a bare megatron-core step: within :data:`STEP_RATIO_TARGET` (``make bench``'s target).
* Peak memory of a train step against ``tim plan``: the plan is meant as an upper bound, so a step that
  needs more than it (``measured / planned > 1``) fails.
* A checkpoint round trip: the restored model's logprobs equal the saved model's exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tim_megatron.outcome import Status

FP32_MAX_GAP = 1e-3
BF16_FACTOR = 3.0
STEP_RATIO_TARGET = 1.10
ROUTING_AGREEMENT_MIN = 0.9


@dataclass(frozen=True)
class Gap:
    """|logprob_a - logprob_b| over the compared tokens."""

    max: float
    mean: float
    p99: float
    tokens: int


def logprob_gap(*, got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor) -> Gap:
    """The per-token gap between two logprob tensors of the same shape, over ``mask``."""
    if got.shape != want.shape or got.shape != mask.shape:
        raise ValueError(
            f"shapes differ: got {tuple(got.shape)}, want {tuple(want.shape)}, mask {tuple(mask.shape)}"
        )
    d = (got.double() - want.double()).abs()[mask.bool()]
    if d.numel() == 0:
        raise ValueError("the mask selects no tokens")
    return Gap(
        max=float(d.max()), mean=float(d.mean()), p99=float(torch.quantile(d, 0.99)), tokens=int(d.numel())
    )


def judge_fp32(gap: Gap, *, limit: float = FP32_MAX_GAP) -> tuple[Status, str]:
    return ("ok" if gap.max <= limit else "fail"), f"max <= {limit:g}"


def judge_bf16(gap: Gap, *, yardstick: Gap, factor: float = BF16_FACTOR) -> tuple[Status, str]:
    """``gap``: the engine in bf16 vs HF fp32; ``yardstick``: HF bf16 vs HF fp32 on the same tokens."""
    bound = factor * yardstick.mean
    ok = gap.mean <= bound
    return (
        "ok" if ok else "fail"
    ), f"mean <= {factor:g} x HF's own bf16 gap {yardstick.mean:.2e} = {bound:.2e}"


def judge_step_ratio(
    ours_s: float, bare_s: float, *, target: float = STEP_RATIO_TARGET
) -> tuple[float, Status, str]:
    ratio = ours_s / bare_s
    return ratio, ("ok" if ratio <= target else "fail"), f"<= {target:g}x"


def judge_memory(measured: float, planned: float) -> tuple[float, Status, str]:
    """(measured / planned, status, rule): the plan must not underestimate."""
    ratio = measured / planned
    return ratio, ("ok" if ratio <= 1.0 else "fail"), "measured <= tim plan"


def judge_exact(diff: float) -> tuple[Status, str]:
    return ("ok" if diff == 0.0 else "fail"), "bit-identical"


def topk_agreement(*, got: torch.Tensor, want: torch.Tensor) -> float:
    """Share of (token, layer) entries whose top-k expert sets are equal (order ignored). ``[..., k]`` each."""
    if got.shape != want.shape:
        raise ValueError(f"shapes differ: {tuple(got.shape)} vs {tuple(want.shape)}")
    same = (got.sort(-1).values == want.sort(-1).values).all(-1)
    return float(same.float().mean())
