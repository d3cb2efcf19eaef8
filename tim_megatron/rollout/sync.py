"""Weight sync from the Megatron trainer into the running vLLM engine, verified every time.

The trainer's export (HF checkpoint names and shapes, gathered over TP/EP one parameter at a time) is
streamed into vLLM's in-place ``reload_weights`` as one lazy iterator, so peak extra memory is one full
parameter and vLLM processes each layer as soon as its last tensor arrives. Every rank runs the export
(it is collective); rank 0, which hosts the engine, consumes it.

Two checks, both loud:

1. structure: the stream must carry every tensor of the checkpoint manifest exactly once, with the
   manifest's shape (a dropped, duplicated, renamed or reshaped tensor fails);
2. numbers: vLLM's token probabilities must equal the trainer's within the recipe's tolerance for at least 80%
   of the checked tokens
   (a transposed square matrix or any other wrong-but-well-shaped load fails).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist


class WeightSyncError(RuntimeError):
    """The rollout engine does not hold the trainer's weights."""


@dataclass
class SyncReport:
    tensors: int
    bytes: int
    seconds: float
    verify_seconds: float = 0.0
    agreement: Agreement | None = None
    """The probe verification's result, when one ran."""
    tolerance: float = float("nan")


def manifest(model_path: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape of an HF checkpoint (without reading the data), less the tensors its model
    family deliberately does not load (e.g. GLM-4.5's multi-token-prediction layer): those are never synced."""
    from safetensors import safe_open

    from tim_megatron.trainer.families import family_for_hf
    from tim_megatron.trainer.hf_config import read_hf_config
    from tim_megatron.trainer.weights import HFCheckpoint

    cfg = read_hf_config(model_path)
    family = family_for_hf(cfg)
    dims = family.read_dims(cfg)
    ck = HFCheckpoint(model_path)
    out = {}
    for fname in sorted(set(ck.weight_map.values())):
        with safe_open(Path(model_path) / fname, "pt") as f:
            for k in f.keys():  # noqa: SIM118 - safe_open is not iterable
                if not family.ignored_hf(k, dims):
                    out[k] = tuple(f.get_slice(k).get_shape())
    return out


class _Checked:
    """Wraps the weight stream, recording what passes through."""

    def __init__(self, stream: Iterable[tuple[str, torch.Tensor]], expected: dict[str, tuple[int, ...]]):
        self.stream = stream
        self.expected = expected
        self.seen: dict[str, int] = {}
        self.bad_shape: list[str] = []
        self.unknown: list[str] = []
        self.bytes = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.stream:
            self.seen[name] = self.seen.get(name, 0) + 1
            shape = self.expected.get(name)
            if shape is None:
                self.unknown.append(name)
            elif tuple(t.shape) != shape:
                self.bad_shape.append(f"{name}: {tuple(t.shape)} != {shape}")
            self.bytes += t.numel() * t.element_size()
            yield name, t

    def problems(self) -> list[str]:
        out = []
        missing = sorted(set(self.expected) - set(self.seen))
        if missing:
            out.append(f"{len(missing)} tensor(s) never sent, e.g. {missing[:3]}")
        dup = sorted(k for k, c in self.seen.items() if c > 1)
        if dup:
            out.append(f"{len(dup)} tensor(s) sent more than once, e.g. {dup[:3]}")
        if self.unknown:
            out.append(f"{len(self.unknown)} tensor(s) not in the checkpoint layout, e.g. {self.unknown[:3]}")
        if self.bad_shape:
            out.append(f"{len(self.bad_shape)} tensor(s) with the wrong shape, e.g. {self.bad_shape[:3]}")
        return out


def push_weights(
    engine, stream: Iterable[tuple[str, torch.Tensor]], *, expected: dict[str, tuple[int, ...]] | None
) -> SyncReport:
    """Load ``stream`` into ``engine`` (rank 0) or just drain it (other ranks, for the collectives)."""
    t = time.perf_counter()
    if engine is None:
        n = 0
        for _ in stream:
            n += 1
        return SyncReport(tensors=n, bytes=0, seconds=time.perf_counter() - t)
    checked = _Checked(stream, expected or {})
    engine.wake_up()
    engine.reload(iter(checked))
    problems = checked.problems()
    if problems:
        raise WeightSyncError("weight sync is partial or malformed: " + "; ".join(problems))
    return SyncReport(
        tensors=sum(checked.seen.values()), bytes=checked.bytes, seconds=time.perf_counter() - t
    )


QUANTILE = 0.8
"""A sync passes when at most 20% of the checked tokens disagree by more than the tolerance."""
_EDGES = torch.logspace(-12, 0, 12 * 24 + 1, dtype=torch.float64)  # |dp| histogram: 24 bins per decade


@dataclass
class Agreement:
    """How closely two engines' token probabilities agree on the same tokens.

    The verdict is on the 80th percentile of |p_vllm - p_trainer|. A wrong or stale sync moves a broad share
    of tokens; a real MoE mismatch event (a router near-tie broken differently on the two sides for one
    prompt) moves a few tokens a lot, which is a TIM signal to log, not a sync failure.
    """

    p80_abs_prob_diff: float
    mean_abs_prob_diff: float
    max_abs_prob_diff: float
    max_abs_logprob_diff: float
    frac_above: float
    """Share of tokens whose |dp| exceeds the tolerance."""
    tokens: int


def agreement(
    *, a_logprobs: torch.Tensor, b_logprobs: torch.Tensor, mask: torch.Tensor, tolerance: float, group=None
) -> Agreement:
    """Token-probability agreement over the masked tokens, reduced over ``group`` from sums, maxima and a histogram."""
    m = mask.bool()
    a, b = a_logprobs.double()[m], b_logprobs.double()[m]
    dp = (a.exp() - b.exp()).abs()
    sums = torch.tensor([float(dp.sum()), float(m.sum()), float((dp > tolerance).sum())], dtype=torch.float64)
    hist = torch.bincount(torch.bucketize(dp, _EDGES), minlength=len(_EDGES) + 1).double()
    mx = torch.tensor(
        [float(dp.max()) if dp.numel() else 0.0, float((a - b).abs().max()) if dp.numel() else 0.0],
        dtype=torch.float64,
    )
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums, group=group)
        dist.all_reduce(hist, group=group)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
    n = int(sums[1])
    p80 = 0.0
    if n:
        k = int(torch.searchsorted(torch.cumsum(hist, 0), QUANTILE * n))
        p80 = (
            float(_EDGES[min(k, len(_EDGES) - 1)]) if k > 0 else 0.0
        )  # the bin's upper edge: never an underestimate
    return Agreement(
        p80, float(sums[0]) / max(n, 1), float(mx[0]), float(mx[1]), float(sums[2]) / max(n, 1), n
    )


def failed(ag: Agreement, tolerance: float) -> bool:
    return not ag.p80_abs_prob_diff <= tolerance


def describe(ag: Agreement) -> str:
    return (
        f"80% of {ag.tokens} tokens within {ag.p80_abs_prob_diff:.3g}, {100 * ag.frac_above:.1f}% beyond the tolerance, "
        f"mean {ag.mean_abs_prob_diff:.3g}, max {ag.max_abs_prob_diff:.3g} (logprobs up to {ag.max_abs_logprob_diff:.3g})"
    )


def verify_sync(engine, trainer, probe: list[list[int]], *, tolerance: float) -> tuple[Agreement, float]:
    """Compare vLLM's and the trainer's probabilities of every token of ``probe`` (all ranks call).

    The verdict is on the 80th percentile of |p_vllm - p_trainer| (see :class:`Agreement`). Returns
    (agreement, seconds); raises WeightSyncError on every rank when it exceeds ``tolerance``.
    """
    from tim_megatron.trainer.engine import SeqBatch

    t = time.perf_counter()
    width = max(len(s) for s in probe)
    ids = torch.zeros(len(probe), width, dtype=torch.long)
    for i, s in enumerate(probe):
        ids[i, : len(s)] = torch.tensor(s)
    lengths = torch.tensor([len(s) for s in probe])
    head = trainer.head
    trainer.with_head(temperature=1.0)  # vLLM's prompt logprobs are at T = 1
    try:
        rows = trainer.shard(len(probe))
        lp, _ = trainer.logprobs(SeqBatch(ids[rows], lengths[rows]))
    finally:
        trainer.head = head
    scored = torch.zeros(len(probe), width, dtype=torch.float64)
    if engine is not None:
        for i, row in enumerate(engine.score(probe)):
            scored[i, : len(row)] = torch.tensor(row, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(scored, src=0)
    mask = (torch.arange(width)[None] >= 1) & (torch.arange(width)[None] < lengths[:, None])
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group() if ps.model_parallel_is_initialized() else None
    ag = agreement(
        a_logprobs=lp.logprobs, b_logprobs=scored[rows], mask=mask[rows], tolerance=tolerance, group=group
    )
    seconds = time.perf_counter() - t
    if failed(ag, tolerance):
        raise WeightSyncError(
            f"after the weight sync vLLM's token probabilities differ from the trainer's on the probe batch "
            f"({describe(ag)}), tolerance {tolerance:g}: the rollout engine does not hold the trainer's weights"
        )
    return ag, seconds


def sync_and_verify(
    engine, trainer, *, expected, probe: list[list[int]] | None, tolerance: float, dtype: torch.dtype | None
) -> SyncReport:
    report = push_weights(engine, trainer.export_hf(dtype=dtype), expected=expected)
    if probe:
        report.agreement, report.verify_seconds = verify_sync(engine, trainer, probe, tolerance=tolerance)
        report.tolerance = tolerance
    return report
