"""Group-relative advantages (GRPO, Eq. 3 of the objective-level-hacking paper) and RLOO."""

from __future__ import annotations

from typing import Literal

import torch

Estimator = Literal["grpo", "grpo_no_std", "rloo"]


def group_advantages(
    *, rewards: torch.Tensor, group_size: int, estimator: Estimator = "grpo", eps: float = 1e-6
) -> torch.Tensor:
    """Per-sequence advantages from rewards laid out group after group (``[num_prompts * group_size]``).

    grpo: (R - mean) / (std + eps), with the unbiased std as in GRPO implementations; a group whose rewards
    are all equal gets advantage 0, never NaN. grpo_no_std: R - mean (Dr. GRPO). rloo: R - mean of the others.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards has shape {tuple(rewards.shape)}; expected [num_prompts * group_size={group_size}]"
        )
    r = rewards.to(torch.float64).view(-1, group_size)
    mean = r.mean(-1, keepdim=True)
    if estimator == "grpo":
        if group_size == 1:
            return torch.zeros_like(rewards, dtype=torch.float32)
        std = r.std(-1, keepdim=True, unbiased=True)
        centered = r - mean
        adv = torch.where(std > 0, centered / (std + eps), torch.zeros_like(centered))
    elif estimator == "grpo_no_std":
        adv = r - mean
    elif estimator == "rloo":
        if group_size == 1:
            return torch.zeros_like(rewards, dtype=torch.float32)
        adv = (r - mean) * group_size / (group_size - 1)
    else:
        raise ValueError(f"advantage estimator {estimator!r}: allowed grpo, grpo_no_std, rloo")
    return adv.reshape(-1).to(torch.float32)
