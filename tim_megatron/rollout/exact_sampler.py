"""Exact zero-mismatch sampling (``diagnostics.vexact: exact``): the trainer samples from its own model.

Every sampled token's logged logprob equals the old-logprob pass's bit for bit, and the loop checks it
(:func:`check_exact`). What makes that hold: in exact mode every product of the trainer's forward runs on
row-invariant kernels (:mod:`tim_megatron.exact.kernels`, ``patches/megatron/invariant_kernels.py``), so a
position's bits depend only on its own sequence up to it, never on the rows, the row count or the micro-batch
around it; experts stay sparse (each token through its own top-k). Two samplers rely on that
(``diagnostics.exact_sampler``):

* ``kv-cache`` (the default, :meth:`ExactSampler._cached`): incremental decoding through the trainer's
  megatron-core model. A first forward prefills every prompt; each later one feeds every unfinished sequence's
  last token. Each attention layer keeps a key/value buffer per sequence as wide as the old-logprob pass's
  micro-batches (:meth:`MegatronTrainer.exact_width`), so a decode step attends over the very keys, at the very
  width, of the training forward's causal row. All of this rank's sequences decode together.
* ``full-forward`` (:meth:`ExactSampler._micro_batch`, the reference the cache is tested against): each
  micro-batch the old pass will run, at its width, one full forward per generated token.

Both sample through the trainer's own chunked head (:func:`tim_megatron.trainer.logprobs.token_logprobs`): this
module's :class:`_Chooser` picks each next token from a chunk's logits, and the cross-entropy line the old pass uses
computes the sampled token's logprob from the same logits. A token is drawn by a counter-based Gumbel-max
(:func:`tim_megatron.exact.draws.gumbel_argmax`), a pure function of the sample's seed, its response position and
the logits, every row of a forward at once on the head's device; so the two samplers give the same tokens and bits
for the same seeds.

Layout: one engine per data-parallel rank (its TP ranks together), generating exactly the rows that rank trains.
Under expert parallelism the ranks' decode steps run in lockstep (the expert dispatch is a collective).
Sampling injection (``diagnostics.sampling_injection``, engine ``trainer``): tokens are drawn from mu =
perturb(pi) (:func:`tim_megatron.algo.injection.perturbed_logprobs`) and ``Sample.logprobs`` are log mu;
``Sample.policy_logprobs`` keep pi's, which the exact check compares with the old pass. Greedy validation uses
pi itself.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from tim_megatron.algo.injection import perturbed_logprobs, sampling_noise
from tim_megatron.comm import comm_device
from tim_megatron.exact.draws import gumbel_argmax
from tim_megatron.exact.kv_cache import KVCache
from tim_megatron.rollout.base import (
    FleetLayout,
    GenerationStats,
    RolloutInputError,
    Sample,
    Segment,
    sample_seed,
)

if TYPE_CHECKING:
    from tim_megatron.recipe.schema import Recipe, SamplingInjection


class ExactMismatchError(RuntimeError):
    """A sampled token's logged logprob differs from the old-logprob pass's (exact mode): the run stops."""


class ExactSampler:
    """This rank's share of exact sampling: the rows its data-parallel rank trains (see the module docstring)."""

    restartable = False
    shares_trainer_weights = True

    def __init__(self, trainer, *, recipe: Recipe, eos_id: int, injection: SamplingInjection | None = None):
        """``recipe``: the run's (its rollout, data, seed and exact-sampler settings); ``injection``: the sampling
        injection (default: the recipe's ``diagnostics.sampling_injection``)."""
        self.trainer = trainer
        self.recipe = recipe
        self.eos_id = eos_id
        self.injection = injection or recipe.diagnostics.sampling_injection
        self.capture = trainer.modes.routing.exact_sampler_capture
        """Record the experts of every input position (needs the trainer's replay hooks: router_replay r2)."""
        self.layout = FleetLayout(world=trainer.env.world_size, ranks_per_engine=trainer.tp)
        self.engine_index = self.layout.engine_of(trainer.rank)
        if self.engine_index != trainer.dp_rank:
            raise RuntimeError(
                f"exact sampler: rank {trainer.rank} is in data-parallel rank {trainer.dp_rank}, but the fleet "
                f"layout puts it in engine {self.engine_index} (TP ranks must be consecutive)"
            )

    # ------------------------------------------------------------------------------------ generation

    def generate(
        self,
        prompts: list[list[int]],
        *,
        step: int,
        first_index: int = 0,
        n: int | None = None,
        greedy: bool = False,
        injection: bool = True,
        segment: Segment | None = None,
    ) -> tuple[list[list[Sample]], GenerationStats]:
        """As :meth:`~tim_megatron.rollout.base.RolloutEngine.generate`. With ``segment`` (partial rollouts) each
        prompt is a prefix to go on with at the width of its batch (``segment.longest_prompt``, so a later pass
        over the whole rows runs at the sampler's shapes), its draws at the response positions that follow the
        prefix's."""
        r = self.recipe.rollout
        n = 1 if segment is not None else r.n if n is None else n
        cap = self.recipe.data.max_prompt_tokens
        own = segment.prompt_lens if segment is not None else [len(p) for p in prompts]
        for i, (p, plen) in enumerate(zip(prompts, own, strict=True)):
            if not p or not 1 <= plen <= min(len(p), cap):
                raise RolloutInputError(
                    f"rollout: prompt {i} has {plen} tokens; allowed 1..data.max_prompt_tokens = {cap}"
                )
        t0 = time.perf_counter()
        longest = segment.longest_prompt if segment is not None else max((len(p) for p in prompts), default=0)
        width = self.trainer.exact_width(longest)  # every rank calls
        inject = None if greedy or not injection or self.injection.type == "off" else self.injection
        seqs = [list(p) for p in prompts for _ in range(n)]
        if segment is not None:
            seeds = list(segment.seeds)
            results = [
                _Row(len(s), budget=b, offset=len(s) - plen)
                for s, b, plen in zip(seqs, segment.max_tokens, own, strict=True)
            ]
        else:
            seeds = [
                sample_seed(self.recipe.run.seed, step, first_index + k // n, k % n) for k in range(len(seqs))
            ]
            results = [_Row(len(s), budget=r.max_tokens) for s in seqs]
        forwards, cache = 0, None
        with self.trainer.weights_fixed():
            if self.recipe.diagnostics.exact_sampler == "kv-cache":
                forwards, cache = self._cached(seqs, seeds, results, width, greedy, inject)
            else:
                for rows in self.trainer.micro_batches(len(seqs)):
                    forwards += self._micro_batch(
                        [seqs[i] for i in rows],
                        [seeds[i] for i in rows],
                        [results[i] for i in rows],
                        width,
                        greedy,
                        inject,
                    )
        samples = [
            Sample(
                s[: res.prompt_len],
                s[res.prompt_len :],
                res.logprobs,
                res.finish,
                prompt_index=first_index + k // n if segment is None else segment.indices[k][0],
                sample_index=k % n if segment is None else segment.indices[k][1],
                engine=self.engine_index,
                policy_logprobs=res.policy,
                routed_experts=res.routes(first=segment is None or res.offset == 0),
            )
            for k, (s, res) in enumerate(zip(seqs, results, strict=True))
        ]
        groups = [samples[k * n : (k + 1) * n] for k in range(len(prompts))]
        n_resp = sum(len(s.response_ids) for s in samples)
        n_prompt = sum(len(p) for p in prompts) * n
        stats = GenerationStats(
            seconds=time.perf_counter() - t0,
            prompt_tokens=n_prompt,
            response_tokens=n_resp,
            extra={
                "forwards": forwards,
                "width": width,
                "kv_cache_bytes": cache.nbytes() if cache else 0,
                "kv_read_bytes": cache.read_bytes if cache else 0,
                "kv_copied_bytes": cache.copied_bytes if cache else 0,
            },
        )
        return groups, stats

    def _cached(self, seqs, seeds, results, width: int, greedy: bool, inject) -> tuple[int, KVCache]:
        """Generate every row of this rank with the KV cache (in place); returns the number of forwards and the
        cache (its size and traffic).

        The first forward prefills every prompt (all prompt positions as entries); each later one feeds every
        unfinished row's last token. The row-invariant kernels make a row's bits independent of the micro-batch
        it trains in, so all rows decode together. Entries are padded (row ``cache.scratch``: neither stored nor attending) to a multiple of TP for
        sequence parallelism, plus one so that the last real entry's prediction is kept, and under expert
        parallelism to the largest count of any rank, whose forwards all run in step until every rank is done."""
        tr = self.trainer
        cache = KVCache(rows=len(seqs), width=width, dtype=tr.exact_cache_dtype())
        lockstep = tr.recipe.parallel.ep > 1 and dist.is_initialized() and dist.get_world_size() > 1
        forwards, prefill = 0, True
        while True:
            active = [row for row, res in enumerate(results) if res.finish is None]
            entries = []  # (row, position, token)
            last = []  # each active row's last entry: the one predicting its next token
            for row in active:
                seq = seqs[row]
                start = 0 if prefill else len(seq) - 1
                entries.extend((row, p, seq[p]) for p in range(start, len(seq)))
                last.append(len(entries) - 1)
            prefill = False
            count = len(entries)
            if lockstep:
                c = torch.tensor([count], device=tr._device())
                dist.all_reduce(c, op=dist.ReduceOp.MAX)
                count = int(c.item())
            if count == 0:
                return forwards, cache
            n = -(-(count + 1) // tr.tp) * tr.tp
            entries.extend((cache.scratch, 0, 0) for _ in range(n - len(entries)))
            chooser = _Chooser(
                trainer=tr,
                rows=[0] * len(active),
                lengths=[i + 1 for i in last],
                seeds=[seeds[row] for row in active],
                positions=[results[row].position for row in active],
                greedy=greedy,
                injection=inject,
                temperature=self.recipe.rollout.temperature,
            )
            rows_t, pos_t, ids = (torch.tensor(col, dtype=torch.long) for col in zip(*entries, strict=True))
            lp, routed = tr.decode_forward(
                ids.view(1, -1),
                rows=rows_t,
                positions=pos_t,
                cache=cache,
                sampler=chooser,
                record=self.capture,
            )
            forwards += 1
            if routed is not None:
                for i, (row, _p, _t) in enumerate(entries):
                    if row != cache.scratch:
                        results[row].routed.append(routed[:, i].numpy())
            for k, row in enumerate(active):
                seqs[row].append(chooser.tokens[k])
                # The old pass's cross-entropy line, on this step's logits.
                results[row].take(chooser, k, float(lp[last[k] + 1]), eos_id=self.eos_id)
                if results[row].finish is not None:
                    cache.release(row)  # the live sequences stay in one block of slots

    def _micro_batch(self, seqs, seeds, results, width: int, greedy: bool, inject) -> int:
        """Generate one micro-batch in place (``seqs`` grow); returns the number of forwards."""
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        for row, s in enumerate(seqs):
            ids[row, : len(s)] = torch.tensor(s)
        forwards = 0
        while True:
            active = [row for row, res in enumerate(results) if res.finish is None]
            if not active:
                return forwards
            chooser = _Chooser(
                trainer=self.trainer,
                rows=active,
                lengths=[len(seqs[row]) for row in active],
                seeds=[seeds[row] for row in active],
                positions=[results[row].position for row in active],
                greedy=greedy,
                injection=inject,
                temperature=self.recipe.rollout.temperature,
            )
            lp, routed = self.trainer.sample_forward(ids, chooser, record=self.capture)
            forwards += 1
            for k, row in enumerate(active):
                tok, pos = chooser.tokens[k], len(seqs[row])
                res = results[row]
                if routed is not None:  # positions up to the one that predicted this token
                    res.routed.extend(routed[:, row, len(res.routed) : pos].permute(1, 0, 2).numpy())
                seqs[row].append(tok)
                ids[row, pos] = tok
                # The logprob from the old pass's own cross-entropy line, on this forward's logits.
                res.take(chooser, k, float(lp[row, pos]), eos_id=self.eos_id)

    # ---------------------------------------------------------------------------- the rest of the protocol

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """The trainer's logprobs at T = 1 (position 0: 0.0)."""
        from tim_megatron.trainer.megatron_trainer import SeqBatch

        width = max(len(s) for s in sequences)
        ids = torch.zeros(len(sequences), width, dtype=torch.long)
        for i, s in enumerate(sequences):
            ids[i, : len(s)] = torch.tensor(s)
        with self.trainer.head_changed(temperature=1.0):
            lp, _ = self.trainer.logprobs(SeqBatch(ids, torch.tensor([len(s) for s in sequences])))
        return [lp.logprobs[i, : len(s)].tolist() for i, s in enumerate(sequences)]

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Nothing to load: the sampler runs on the trainer's parameters."""

    def sleep(self, level: int) -> None:
        """Nothing to release."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Nothing to take back."""

    def reset_prefix_cache(self) -> None:
        """Nothing kept between calls: each generation builds its own KV cache."""

    def head_dtype(self) -> str:
        from tim_megatron.trainer.logprobs import head_gemm, head_weight

        w = head_weight(self.trainer.model)
        with torch.no_grad():
            # beside the weight, on a GPU too
            probe = torch.zeros(1, w.shape[1], dtype=w.dtype, device=w.device)
            return str(head_gemm(probe, w, self.trainer.head).dtype)

    def describe(self) -> dict:
        return {
            "engine": self.engine_index,
            "ranks": list(self.layout.ranks_of(self.engine_index)),
            "rank": self.trainer.rank,
            "device": "trainer (exact)",
            "tensor_parallel_size": self.trainer.tp,
        }

    def begin_step(self, step: int) -> None:
        """Nothing counted per step."""

    def faults(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


class _Row:
    """One sequence's generation so far (in this call: ``prompt_len`` is the prefix it was given)."""

    def __init__(self, prompt_len: int, *, budget: int, offset: int = 0):
        self.prompt_len = prompt_len
        self.budget = budget
        """The most tokens this call generates for it."""
        self.offset = offset
        """Response tokens in its prefix (partial rollouts): its draws' positions continue from there."""
        self.logprobs: list[float] = []
        self.policy: list[float] = []
        self.routed: list = []
        """``[layers, k]`` expert ids per input position, when captured."""
        self.finish: str | None = None

    @property
    def position(self) -> int:
        """The response position of the next token (the draw's counter)."""
        return self.offset + len(self.logprobs)

    def routes(self, *, first: bool) -> np.ndarray | None:
        """The captured experts of the positions that sampled this call's tokens: every input position of a first
        segment (the prompt's too), and from the prefix's last position on for a continuation."""
        if not self.routed:
            return None
        start = 0 if first else self.prompt_len - 1
        return np.stack(self.routed[start:]).astype(np.int16)

    def take(self, chooser: _Chooser, k: int, policy: float, *, eos_id: int) -> None:
        """Record the token ``chooser`` picked for its ``k``-th row, with pi's logprob ``policy`` (and mu's, under
        an injection), and whether the row is done."""
        self.policy.append(policy)
        self.logprobs.append(policy if chooser.mu_logprobs is None else chooser.mu_logprobs[k])
        if chooser.tokens[k] == eos_id:
            self.finish = "stop"
        elif len(self.logprobs) >= self.budget:
            self.finish = "length"


class _Chooser:
    """A :class:`~tim_megatron.trainer.logprobs.ChunkSampler` for one forward: each active row's next token, from
    the logits of the position predicting it (its last token's)."""

    def __init__(
        self,
        *,
        trainer,
        rows: list[int],
        lengths: list[int],
        seeds: list[int],
        positions: list[int],
        greedy: bool,
        injection: SamplingInjection | None,
        temperature: float,
    ):
        self.trainer = trainer
        self.temperature = temperature
        """``rollout.temperature``: the sampling distribution's."""
        self.rows = rows
        self.pred = [length - 1 for length in lengths]  # the position whose logits predict the next token
        self.seeds = seeds
        self.positions = positions
        self.greedy = greedy
        self.injection = injection
        self.tokens: list[int] = [-1] * len(rows)
        self.mu_logprobs: list[float] | None = None if injection is None else [0.0] * len(rows)

    def wants(self, start: int, stop: int) -> bool:
        return any(start <= p < stop for p in self.pred)

    def choose(self, start: int, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        here = [k for k, p in enumerate(self.pred) if start <= p < start + logits.shape[0]]
        pos = torch.tensor([self.pred[k] - start for k in here], device=logits.device)
        rows = torch.tensor([self.rows[k] for k in here], device=logits.device)
        # [k, V] on the head's device: a copy (the cross-entropy consumes ``logits``)
        z = _full_vocab(logits[pos, rows].float())
        tr = self.trainer
        z = z * (tr.head.temperature / self.temperature)  # the head divided by its own temperature already
        seeds = torch.tensor([self.seeds[k] for k in here], dtype=torch.long)
        positions = torch.tensor([self.positions[k] for k in here], dtype=torch.long)
        scores = z if self.greedy or self.injection is None else self._mu(z, here)
        tokens = gumbel_argmax(scores, seeds=seeds, positions=positions, greedy=self.greedy)
        if self.mu_logprobs is not None:
            mu = scores.gather(1, tokens[:, None])[:, 0].tolist()
            for j, k in enumerate(here):
                self.mu_logprobs[k] = mu[j]
        for j, tok in zip(here, tokens.tolist(), strict=True):
            self.tokens[j] = tok
        targets = targets.clone()
        targets[pos, rows] = tokens.to(targets.device)
        return targets

    def _mu(self, z: torch.Tensor, here: list[int]) -> torch.Tensor:
        """log mu ``[k, V]``: the injection's sampling distribution for the rows ``here`` (``z``: their logits)."""
        inj = self.injection
        out = []
        for j, k in enumerate(here):
            noise = None
            if inj.type == "noise":
                noise = sampling_noise(
                    seed=inj.seed, sample_seed=self.seeds[k], position=self.positions[k], vocab=z.shape[-1]
                ).to(z.device)
            out.append(
                perturbed_logprobs(
                    logits=z[j],
                    kind=inj.type,
                    dtype=inj.dtype,
                    std=inj.std,
                    delta=inj.delta,
                    pi_low=inj.pi_low,
                    noise=noise,
                )
            )
        return torch.stack(out)


def _tp_group():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()


def _full_vocab(local: torch.Tensor) -> torch.Tensor:
    """``[k, V / tp]`` vocabulary slices -> ``[k, V]`` on every TP rank, on their device."""
    group, size = _tp_group()
    if size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, -1)


# ------------------------------------------------------------------------------------------------- check


def check_exact(
    *,
    step: int,
    rows: torch.Tensor,
    prompt_lens: torch.Tensor,
    old: torch.Tensor,
    sampled: torch.Tensor,
    mask: torch.Tensor,
    group=None,
    show: int = 3,
) -> dict[str, float]:
    """Every response token's sampled logprob must equal the old pass's bit for bit; every rank of ``group`` (the
    data-parallel group: each row counted once) calls.

    ``old`` and ``sampled`` are ``[n, L]`` (this rank's rows; ``rows`` their global indices). Raises
    :class:`ExactMismatchError` on every rank, naming the step, the row and the position of the first tokens that
    differ, when any rank found one; else returns the counts."""
    m = mask.bool()
    bad = (old != sampled) & m
    found = [
        f"row {int(rows[i])} response token {int(t) - int(prompt_lens[i])} (position {int(t)}): sampled "
        f"{float(sampled[i, t]).hex()} vs old {float(old[i, t]).hex()}"
        for i, t in bad.nonzero().tolist()[:show]
    ]
    counts = torch.tensor([float(bad.sum()), float(m.sum())], dtype=torch.float64, device=comm_device(group))
    everyone = [found]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, found, group=group)
    mismatched, checked = (int(x) for x in counts.tolist())
    if mismatched:
        where = "; ".join(f for part in everyone for f in part)
        raise ExactMismatchError(
            f"exact mode, step {step}: {mismatched} of {checked} sampled tokens have a rollout logprob that differs "
            f"from the old-logprob pass (rho != 1): {where}"
        )
    return {"exact/mismatched_tokens": 0.0, "exact/checked_tokens": float(checked)}
