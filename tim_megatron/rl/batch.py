"""A step's rollouts as padded tensors: an engine's block, then this rank's share of the training rows.

Rows are numbered globally (prompt index x group size + sample index), so every layout orders them the same
way. Each engine builds a :class:`StepBatch` of its own block (:func:`from_samples`); :func:`rank_rows`
turns it into the rows this data-parallel rank trains. When every rank's rows lie inside its own engine's block
(the usual layout: rollout and trainer tensor-parallel sizes equal) nothing moves between ranks; otherwise the
engines' blocks are gathered once and each rank keeps its rows.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from tim_megatron.comm import comm_device
from tim_megatron.rollout.base import Sample

FINISH = {"stop": 0, "length": 1, "abort": 2}
"""Finish reasons as small integers (dumps and cross-layout comparisons)."""
WIDE = ("input_ids", "response_mask", "rollout_logprobs", "policy_logprobs", "token_version")
"""The ``[n, L]`` fields of a :class:`StepBatch` (``routed_experts`` is ``[layers, n, L, k]``, the rest ``[n]``)."""


@dataclass
class StepBatch:
    input_ids: torch.Tensor
    """``[n, L]`` prompt + response token ids, right-padded with 0 (L: the longest of these rows)."""
    lengths: torch.Tensor
    """``[n]`` prompt + response lengths."""
    prompt_lens: torch.Tensor
    """``[n]``."""
    response_mask: torch.Tensor
    """``[n, L]`` True at response token positions."""
    rollout_logprobs: torch.Tensor
    """``[n, L]`` the rollout engine's logprob of each response token (0 elsewhere)."""
    rewards: torch.Tensor
    """``[n]``."""
    truncated: torch.Tensor
    """``[n]`` the response hit the generation budget."""
    row: torch.Tensor
    """``[n]`` global row index: prompt index x group size + sample index."""
    engine: torch.Tensor
    """``[n]`` the rollout engine that generated each row."""
    finish: torch.Tensor
    """``[n]`` finish reason (see ``FINISH``)."""
    group_size: int
    total_rows: int
    """Rows in the whole step (all engines)."""
    routed_experts: torch.Tensor | None = None
    """``[layers, n, L, top_k]`` experts the rollout used for each input position, when captured."""
    policy_logprobs: torch.Tensor | None = None
    """``[n, L]`` the trainer policy's logprob of each response token when it was sampled (exact sampler only)."""
    token_version: torch.Tensor | None = None
    """``[n, L]`` partial rollouts: the version (updates applied) of the weights that sampled each response token
    (-1 elsewhere); None: one version for the whole batch."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]

    def rows(self, idx) -> StepBatch:
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "routed_experts":
                kw[f.name] = None if v is None else v[:, idx]
            elif isinstance(v, torch.Tensor):
                kw[f.name] = v[idx]
            else:
                kw[f.name] = v
        return StepBatch(**kw).trimmed()

    def trimmed(self) -> StepBatch:
        """The same rows, with the padding beyond the longest one cut off."""
        w = int(self.lengths.max()) if len(self) else 0
        if w == self.width:
            return self
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        for k in WIDE:
            if kw[k] is not None:
                kw[k] = kw[k][:, :w]
        if self.routed_experts is not None:
            kw["routed_experts"] = self.routed_experts[:, :, :w]
        return StepBatch(**kw)


def from_samples(
    groups: list[list[Sample]],
    rewards: list[list[float]],
    *,
    total_rows: int,
    num_moe_layers: int = 0,
    top_k: int = 0,
) -> StepBatch:
    """One engine's block (whole prompt groups, each sample knowing its global prompt and sample index)."""
    flat = [s for g in groups for s in g]
    n = len(flat)
    group_size = len(groups[0]) if groups else 0
    width = max((len(s.prompt_ids) + len(s.response_ids) for s in flat), default=0)
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.bool)
    lp = torch.zeros(n, width)
    lengths = torch.zeros(n, dtype=torch.long)
    plens = torch.zeros(n, dtype=torch.long)
    policy = torch.zeros(n, width) if any(s.policy_logprobs is not None for s in flat) else None
    version = (
        torch.full((n, width), -1, dtype=torch.long) if any(s.versions is not None for s in flat) else None
    )
    routed = None
    if any(s.routed_experts is not None for s in flat):
        routed = (
            torch.arange(top_k, dtype=torch.int16).view(1, 1, 1, top_k).repeat(num_moe_layers, n, width, 1)
        )
    for i, s in enumerate(flat):
        p, r = len(s.prompt_ids), len(s.response_ids)
        ids[i, : p + r] = torch.tensor(s.prompt_ids + s.response_ids)
        mask[i, p : p + r] = True
        lp[i, p : p + r] = torch.tensor(s.logprobs)
        if policy is not None:
            policy[i, p : p + r] = torch.tensor(s.policy_logprobs)
        if version is not None and s.versions is not None:
            version[i, p : p + r] = torch.tensor(s.versions, dtype=torch.long)
        lengths[i], plens[i] = p + r, p
        if routed is not None and s.routed_experts is not None and len(s.routed_experts):
            e = torch.from_numpy(s.routed_experts.astype("int16"))  # [positions, layers, k]
            routed[:, i, : e.shape[0]] = e.permute(1, 0, 2)
    return StepBatch(
        input_ids=ids,
        lengths=lengths,
        prompt_lens=plens,
        response_mask=mask,
        rollout_logprobs=lp,
        rewards=torch.tensor([x for g in rewards for x in g], dtype=torch.float32),
        truncated=torch.tensor([s.truncated for s in flat], dtype=torch.bool),
        row=torch.tensor([s.prompt_index * group_size + s.sample_index for s in flat], dtype=torch.long),
        engine=torch.tensor([s.engine for s in flat], dtype=torch.long),
        finish=torch.tensor([FINISH.get(s.finish_reason, 2) for s in flat], dtype=torch.long),
        group_size=group_size,
        total_rows=total_rows,
        routed_experts=routed,
        policy_logprobs=policy,
        token_version=version,
    )


def cat_padded(tensors: list[torch.Tensor], *, pad_dim: int, cat_dim: int) -> torch.Tensor:
    """``torch.cat`` along ``cat_dim`` of tensors whose ``pad_dim`` differs: each is padded with zeros at the end
    of ``pad_dim`` to the widest. A tensor with no ``pad_dim`` (fewer dims) is concatenated as it is."""
    width = max((t.shape[pad_dim] for t in tensors if t.dim() > pad_dim), default=0)

    def pad(t: torch.Tensor) -> torch.Tensor:
        if t.dim() <= pad_dim or t.shape[pad_dim] == width:
            return t
        shape = list(t.shape)
        shape[pad_dim] = width - t.shape[pad_dim]
        return torch.cat([t, torch.zeros(shape, dtype=t.dtype)], pad_dim)

    return torch.cat([pad(t) for t in tensors], cat_dim)


def concat(parts: list[StepBatch]) -> StepBatch:
    """Rows of several batches (same step), padded to the widest."""
    parts = [p for p in parts if len(p)]
    kw = {}
    for f in fields(StepBatch):
        vals = [getattr(p, f.name) for p in parts]
        if f.name in WIDE:
            kw[f.name] = None if vals[0] is None else cat_padded(vals, pad_dim=1, cat_dim=0)
        elif f.name == "routed_experts":
            kw[f.name] = None if vals[0] is None else cat_padded(vals, pad_dim=2, cat_dim=1)
        elif isinstance(vals[0], torch.Tensor):
            kw[f.name] = torch.cat(vals)
        else:
            kw[f.name] = vals[0]
    return StepBatch(**kw)


def rank_rows(block: StepBatch, *, layout, rank: int, dp_rank: int, dp_size: int) -> StepBatch:
    """The rows data-parallel rank ``dp_rank`` trains: rows [d N / D, (d + 1) N / D) of the step, in row order.

    Gathers the engines' blocks only when some rank's rows are not all inside its own engine's block (the
    decision is the same on every rank). Groups never straddle ranks: the recipe keeps prompts_per_step a multiple
    of parallel.dp.
    """
    n = block.total_rows
    per = n // dp_size
    need = range(dp_rank * per, (dp_rank + 1) * per)
    have = set(block.row.tolist())
    local = torch.tensor([1.0 if set(need) <= have else 0.0], device=comm_device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(local, op=dist.ReduceOp.MIN)
    if local.item() > 0:
        source = block
    else:
        box = [None] * dist.get_world_size()
        dist.all_gather_object(box, block if layout.is_leader(rank) else None)
        source = concat([b for b in box if b is not None])
    pos = {int(r): i for i, r in enumerate(source.row.tolist())}
    idx = torch.tensor([pos[r] for r in need], dtype=torch.long)
    return source.rows(idx)


def global_width(batch: StepBatch) -> int:
    """The step's widest row over all ranks (what a single engine's batch would be padded to)."""
    w = torch.tensor([batch.width], dtype=torch.float64, device=comm_device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(w, op=dist.ReduceOp.MAX)
    return int(w.item())


def broadcast_object(obj, src: int = 0):
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]
