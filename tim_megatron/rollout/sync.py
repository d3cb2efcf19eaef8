"""Weight sync from the Megatron trainer into every rollout engine, verified engine by engine.

The trainer's export (HF checkpoint names and shapes, gathered over TP/EP one parameter at a time) runs on
every rank (it is collective), and every rank loads it into its own engine in place, by reference: trainer and
engine share the process, so on GPU the tensors never leave the device. Peak extra memory is one full
parameter, and vLLM processes each layer as soon as its last tensor arrives.

Two checks, both loud, both per engine:

1. structure, on every rank: the stream must carry every tensor of the checkpoint manifest exactly once, with the
   manifest's shape (a dropped, duplicated, renamed or reshaped tensor fails). The verdict is all-reduced, so every
   rank stops together and the error names the engine(s);
2. numbers: each engine's token probabilities must equal the trainer's within the recipe's tolerance for at least
   80% of the tokens that ENGINE produced (a transposed square matrix, a stale or skipped load fails). Judged on the
   next step's own samples (free: the trainer recomputes them anyway), and on a probe right after the first and
   the last sync, in which every engine scores rows of its own block. One stale engine among eight is 12.5% of a
   step's tokens: a global percentile would pass it, a per-engine one does not.

:class:`WeightSync` owns the state between steps (whether the next step's samples must be checked, the
agreement to log); the loop only calls :meth:`WeightSync.push` and :meth:`WeightSync.check_samples`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from tim_megatron.comm import comm_device
from tim_megatron.observer import NO_OBSERVER, StepObserver
from tim_megatron.rollout.faults import agree_on_engines, agreed
from tim_megatron.trainer.parallel import dp_group


class WeightSyncError(RuntimeError):
    """A rollout engine does not hold the trainer's weights."""

    def __init__(self, message: str, engines: list[int]):
        super().__init__(message)
        self.engines = list(engines)
        """The engines that failed, by index."""

    def __reduce__(self):  # the engines travel with a pickled error (a rank's error sent to another)
        return (type(self), (str(self), self.engines))


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


class Checked:
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


# ------------------------------------------------------------------------------------------ agreement


QUANTILE = 0.8
"""A sync passes when at most 20% of an engine's checked tokens disagree by more than the tolerance."""
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


def engine_agreements(
    *,
    a_logprobs: torch.Tensor,
    b_logprobs: torch.Tensor,
    mask: torch.Tensor,
    engine: torch.Tensor,
    engines: int,
    tolerance: float,
    group=None,
) -> list[Agreement]:
    """One :class:`Agreement` per engine over the masked tokens of the rows it produced (``engine [n]``), reduced
    over ``group`` from sums, maxima and a histogram (exact whatever the split of rows over ranks)."""
    m = mask.bool()
    dp_all = (a_logprobs.double().exp() - b_logprobs.double().exp()).abs()
    dl_all = (a_logprobs.double() - b_logprobs.double()).abs()
    bins = len(_EDGES) + 1
    on = comm_device(group)
    sums = torch.zeros(engines, 3, dtype=torch.float64, device=on)
    hist = torch.zeros(engines, bins, dtype=torch.float64, device=on)
    mx = torch.zeros(engines, 2, dtype=torch.float64, device=on)
    for k in range(engines):
        sel = m & (engine.view(-1, 1) == k)
        dp, dl = dp_all[sel], dl_all[sel]
        if dp.numel():
            sums[k] = torch.tensor(
                [float(dp.sum()), float(dp.numel()), float((dp > tolerance).sum())], device=on
            )
            hist[k] = (
                torch.bincount(torch.bucketize(dp, _EDGES.to(dp.device)), minlength=bins).double().to(on)
            )
            mx[k] = torch.tensor([float(dp.max()), float(dl.max())], device=on)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums, group=group)
        dist.all_reduce(hist, group=group)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
    out = []
    for k in range(engines):
        n = int(sums[k, 1])
        p80 = 0.0
        if n:
            j = int(torch.searchsorted(torch.cumsum(hist[k], 0), QUANTILE * n))
            p80 = float(_EDGES[min(j, len(_EDGES) - 1)]) if j > 0 else 0.0  # the bin's upper edge
        out.append(
            Agreement(
                p80,
                float(sums[k, 0]) / max(n, 1),
                float(mx[k, 0]),
                float(mx[k, 1]),
                float(sums[k, 2]) / max(n, 1),
                n,
            )
        )
    return out


def agreement(
    *, a_logprobs: torch.Tensor, b_logprobs: torch.Tensor, mask: torch.Tensor, tolerance: float, group=None
) -> Agreement:
    """Token-probability agreement over all masked tokens, as if one engine had produced them."""
    return engine_agreements(
        a_logprobs=a_logprobs,
        b_logprobs=b_logprobs,
        mask=mask,
        engine=torch.zeros(mask.shape[0], dtype=torch.long),
        engines=1,
        tolerance=tolerance,
        group=group,
    )[0]


def failed(ag: Agreement, tolerance: float) -> bool:
    """Not judged (no tokens) counts as failed: an engine that was never checked is not verified."""
    return ag.tokens == 0 or not ag.p80_abs_prob_diff <= tolerance


def describe(ag: Agreement) -> str:
    return (
        f"80% of {ag.tokens} tokens within {ag.p80_abs_prob_diff:.3g}, {100 * ag.frac_above:.1f}% beyond the tolerance, "
        f"mean {ag.mean_abs_prob_diff:.3g}, max {ag.max_abs_prob_diff:.3g} (logprobs up to {ag.max_abs_logprob_diff:.3g})"
    )


def verdict(agreements: list[Agreement], tolerance: float, *, where: str) -> None:
    """Raise naming every engine that fails (the same on every rank: the agreements are already reduced)."""
    bad = [(k, ag) for k, ag in enumerate(agreements) if failed(ag, tolerance)]
    if bad:
        lines = "; ".join(f"engine {k}: {describe(ag)}" for k, ag in bad)
        names = ", ".join(str(k) for k, _ in bad)
        raise WeightSyncError(
            f"rollout engine {names} does not hold the trainer's weights ({where}; tolerance {tolerance:g} for 80% "
            f"of each engine's tokens): {lines}",
            engines=[k for k, _ in bad],
        )


def agreement_metrics(prefix: str, agreements: list[Agreement]) -> dict[str, float]:
    """``sync/engine<k>/...`` per engine, and the worst engine under ``sync/<prefix>_...``."""
    out: dict[str, float] = {}
    for k, ag in enumerate(agreements):
        out[f"sync/engine{k}/p80_abs_prob_diff"] = ag.p80_abs_prob_diff
        out[f"sync/engine{k}/mean_abs_prob_diff"] = ag.mean_abs_prob_diff
        out[f"sync/engine{k}/max_abs_prob_diff"] = ag.max_abs_prob_diff
    worst = max(agreements, key=lambda ag: ag.p80_abs_prob_diff)
    out[f"sync/{prefix}_p80_abs_prob_diff"] = worst.p80_abs_prob_diff
    out[f"sync/{prefix}_mean_abs_prob_diff"] = max(ag.mean_abs_prob_diff for ag in agreements)
    out[f"sync/{prefix}_max_abs_prob_diff"] = max(ag.max_abs_prob_diff for ag in agreements)
    out[f"sync/{prefix}_frac_above_tolerance"] = max(ag.frac_above for ag in agreements)
    return out


# --------------------------------------------------------------------------------------- faults (tests)


def faulty(stream: Iterable[tuple[str, torch.Tensor]], kind: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``diagnostics.sync_fault``: what a broken transport would deliver. ``corrupt`` swaps the two halves of every
    attention output projection (well-shaped, so only the numbers can tell); ``skip`` is handled by the caller."""
    for name, t in stream:
        if kind == "corrupt" and name.endswith("self_attn.o_proj.weight"):
            t = torch.roll(t, shifts=t.shape[0] // 2, dims=0)
        yield name, t


# ------------------------------------------------------------------------------------------ the object


@dataclass
class SyncReport:
    tensors: int
    bytes: int
    seconds: float


def _leaders_gather(obj, layout, rank: int) -> list:
    """Each engine's ``obj`` (from its first rank), in engine order, on every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    box = [None] * dist.get_world_size()
    dist.all_gather_object(box, obj if layout.is_leader(rank) else None)
    return [box[layout.ranks_of(k)[0]] for k in range(layout.engines)]


class WeightSync:
    """Pushes the trainer's weights into every engine and verifies each engine; owns the state between steps."""

    def __init__(self, recipe, *, expected: dict[str, tuple[int, ...]], rank: int):
        self.recipe = recipe
        self.expected = expected
        self.rank = rank
        self.tolerance = recipe.sync_tolerance
        self.check = recipe.rollout.sync_check
        self.fault = recipe.diagnostics.sync_fault
        self.syncs = 0
        self.pending = False
        """The last sync is to be checked on the next step's samples."""

    # ------------------------------------------------------------------------------------- push

    def push(
        self,
        rollout,
        trainer,
        *,
        probe: Callable[[], list[list[int]]] | None,
        last: bool = False,
        after_load: Callable[[], None] | None = None,
        observer: StepObserver = NO_OBSERVER,
    ) -> dict[str, float]:
        """Load the trainer's weights into every engine, check the structure everywhere, and run the eager probe
        check when due (``probe()`` gives this engine's probe sequences, the same on all its ranks).

        The engine's weights must be awake; ``after_load`` runs between the load and the probe check (the memory
        choreography, :class:`tim_megatron.rl.colocation.Colocation`, wakes the KV cache there)."""
        if rollout.shares_trainer_weights:
            return {}
        first = self.syncs == 0
        eager = self.check == "probe" or (self.check in ("every", "first") and first)
        eager = eager or (self.check == "every" and last)
        number, seen = self.syncs + 1, {}
        try:
            rep = seen["load"] = self.load(rollout, trainer.export_hf())
            if after_load is not None:
                after_load()
            # cached KV was computed with the old weights
            agreed(rollout, rollout.reset_prefix_cache, phase="sync")
            self.syncs += 1
            self.pending = self.check == "every" and not last
            out = self._report_metrics(rollout, rep)
            if eager and probe is not None:
                t = time.perf_counter()
                ags = seen["agreements"] = self.probe_agreements(rollout, trainer, probe())
                out.update(agreement_metrics("probe", ags))
                out["sync/verify_seconds"] = time.perf_counter() - t
                verdict(ags, self.tolerance, where="probe batch right after the sync")
        except WeightSyncError as e:
            observer.synced(sync=number, check="probe", error=e, **seen)
            raise
        observer.synced(sync=number, check="probe", metrics=out, **seen)
        return out

    def load(self, rollout, stream: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        """Load ``stream`` (collective on every rank) into this rank's engine; the structural verdict is shared."""
        t = time.perf_counter()
        checked = Checked(stream, self.expected)
        fault = self.fault.kind if self.fault.engine == rollout.engine_index else "off"
        if fault == "skip":
            for _ in checked:  # the export is collective: drain it, load nothing
                pass
            agree_on_engines(rollout, None, phase="sync")  # the other ranks' loads are agreed on
        else:
            stream = faulty(checked, fault) if fault != "off" else checked
            agreed(rollout, lambda: rollout.update_weights(stream), phase="sync")
        problems = checked.problems()
        layout = rollout.layout
        flags = torch.zeros(layout.engines, dtype=torch.float64, device=comm_device())
        if problems:
            flags[rollout.engine_index] = 1.0
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags.any():
            bad = [k for k in range(layout.engines) if flags[k] > 0]
            mine = f" here (rank {self.rank}): " + "; ".join(problems) if problems else ""
            raise WeightSyncError(
                f"weight sync into rollout engine {', '.join(map(str, bad))} is partial or malformed{mine}",
                engines=bad,
            )
        return SyncReport(sum(checked.seen.values()), checked.bytes, time.perf_counter() - t)

    def _report_metrics(self, rollout, rep: SyncReport) -> dict[str, float]:
        layout = rollout.layout
        per = torch.zeros(layout.engines, 2, dtype=torch.float64, device=comm_device())
        if layout.is_leader(self.rank):
            per[rollout.engine_index] = torch.tensor(
                [rep.seconds, rep.bytes / 2**20], dtype=torch.float64, device=per.device
            )
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(per)
        out = {"sync/tensors": float(rep.tensors)}
        for k in range(layout.engines):
            out[f"sync/engine{k}/seconds"] = float(per[k, 0])
            out[f"sync/engine{k}/mbytes"] = float(per[k, 1])
        out["sync/seconds"] = float(per[:, 0].max())
        out["sync/mbytes"] = float(per[:, 1].sum())
        return out

    def probe_agreements(self, rollout, trainer, seqs: list[list[int]]) -> list[Agreement]:
        """Every engine scores its own probe rows; the trainer scores all of them; judged per engine."""
        from tim_megatron.trainer.megatron_trainer import SeqBatch

        layout = rollout.layout
        scored = agreed(rollout, lambda: rollout.score(seqs) if seqs else [], phase="score")
        blocks = _leaders_gather((seqs, scored), layout, self.rank)
        rows, vllm, engine = [], [], []
        for k, (s, sc) in enumerate(blocks):
            rows += s
            vllm += sc
            engine += [k] * len(s)
        i = 0
        while len(rows) % trainer.dp_size:  # a multiple of the data-parallel size; repeats count twice
            rows.append(rows[i])
            vllm.append(vllm[i])
            engine.append(engine[i])
            i += 1
        width = max(len(s) for s in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        scores = torch.zeros(len(rows), width, dtype=torch.float64)
        for i, (s, sc) in enumerate(zip(rows, vllm, strict=True)):
            ids[i, : len(s)] = torch.tensor(s)
            scores[i, : len(sc)] = torch.tensor(sc, dtype=torch.float64)
        lengths = torch.tensor([len(s) for s in rows])
        mask = (torch.arange(width)[None] >= 1) & (torch.arange(width)[None] < lengths[:, None])
        mine = trainer.rank_rows(len(rows))
        with trainer.head_changed(temperature=1.0):  # vLLM's prompt logprobs are at T = 1
            lp, _ = trainer.logprobs(SeqBatch(ids[mine], lengths[mine]))
        return engine_agreements(
            a_logprobs=lp.logprobs,
            b_logprobs=scores[mine],
            mask=mask[mine],
            engine=torch.tensor(engine)[mine],
            engines=layout.engines,
            tolerance=self.tolerance,
            group=dp_group(),
        )

    # ----------------------------------------------------------------------------- next-step data

    def check_samples(
        self,
        *,
        trainer_logprobs: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        mask: torch.Tensor,
        engine: torch.Tensor,
        engines: int,
        observer: StepObserver = NO_OBSERVER,
    ) -> dict[str, float]:
        """The previous sync, checked on this step's own samples (this rank's rows; all ranks call): each engine
        drew them with the synced weights, and the trainer has just recomputed their logprobs with its own."""
        if not self.pending:
            return {}
        self.pending = False
        ags = engine_agreements(
            a_logprobs=trainer_logprobs,
            b_logprobs=rollout_logprobs,
            mask=mask,
            engine=engine,
            engines=engines,
            tolerance=self.tolerance,
            group=dp_group(),
        )
        try:
            verdict(
                ags,
                self.tolerance,
                where="the weights synced after the previous step, on this step's samples",
            )
        except WeightSyncError as e:
            observer.synced(sync=self.syncs, check="samples", error=e)
            raise
        out = agreement_metrics("data", ags)
        observer.synced(sync=self.syncs, check="samples", metrics=out)
        return out
