"""A step's rollouts as padded tensors, identical on every rank."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from tim_megatron.rollout.engine import Sample


@dataclass
class StepBatch:
    input_ids: torch.Tensor
    """``[N, L]`` prompt + response token ids, right-padded with 0."""
    lengths: torch.Tensor
    """``[N]`` prompt + response lengths."""
    prompt_lens: torch.Tensor
    """``[N]``."""
    response_mask: torch.Tensor
    """``[N, L]`` True at response token positions."""
    rollout_logprobs: torch.Tensor
    """``[N, L]`` the rollout engine's logprob of each response token (0 elsewhere)."""
    rewards: torch.Tensor
    """``[N]``."""
    truncated: torch.Tensor
    """``[N]`` the response hit the generation budget."""
    group_size: int
    routed_experts: torch.Tensor | None = None
    """``[layers, N, L, top_k]`` experts the rollout used for each input position, when captured."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

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
        return StepBatch(**kw)


def from_samples(
    groups: list[list[Sample]], rewards: list[list[float]], *, num_moe_layers: int = 0, top_k: int = 0
) -> StepBatch:
    flat = [s for g in groups for s in g]
    n = len(flat)
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in flat)
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.bool)
    lp = torch.zeros(n, width)
    lengths = torch.zeros(n, dtype=torch.long)
    plens = torch.zeros(n, dtype=torch.long)
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
        truncated=torch.tensor([s.truncated for s in flat]),
        group_size=len(groups[0]),
        routed_experts=routed,
    )


def broadcast(batch: StepBatch | None, src: int = 0) -> StepBatch:
    """Rank ``src``'s batch on every rank (a no-op without a process group)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return batch
    box = [batch if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def broadcast_object(obj, src: int = 0):
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]
