"""Count a sampled token's rank eagerly on CPU (vLLM's sampler, CPU backend).

vLLM 0.32's sampler computes each sampled token's rank (how many vocabulary entries have a logprob at least as
high) with ``batched_count_greater_than``, a ``torch.compile``d ``(x >= values).sum(-1)``: on GPU the compiled
kernel avoids a large temporary. On the CPU backend the first call of every process compiles it with Inductor,
about 2.2 s per engine start on a 2-core VM (cache warm) for one comparison and one sum; the loop never reads
the rank. The patch points the sampler at the same expression run eagerly: the same integers, no compile.
Applied by the rollout engine on CPU only, before its first generation.
"""

from __future__ import annotations

from patches.guard import check_version
from patches.specs import vllm_patch

SPEC = vllm_patch(
    name="vllm-cpu-eager-token-rank",
    reason="the sampled-token rank is a torch.compile'd count whose Inductor compile costs ~2 s at every CPU engine "
    "start (vllm.v1.sample.ops.logprobs.batched_count_greater_than).",
    targets=(
        "vllm.v1.sample.ops.logprobs.batched_count_greater_than",
        "vllm.v1.sample.sampler.batched_count_greater_than",
    ),
)


def count_at_least(x, values):
    """Per row, the entries of ``x`` at least the row's ``values`` (``[B, 1]``): vLLM's expression, eager."""
    return (x >= values).sum(-1)


def needed() -> bool:
    import torch

    return not torch.cuda.is_available()


def apply() -> bool:
    """Point vLLM's sampler at :func:`count_at_least`; True when this call changed it (idempotent)."""
    check_version(SPEC)
    import vllm.v1.sample.sampler as sampler

    if sampler.batched_count_greater_than is count_at_least:
        return False
    sampler.batched_count_greater_than = count_at_least
    return True
