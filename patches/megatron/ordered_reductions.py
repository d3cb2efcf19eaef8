"""Sums across ranks in a fixed order for exact mode (``diagnostics.vexact: exact``) over groups of 3 or more ranks.

megatron-core's tensor- and expert-parallel reductions (``tensor_parallel.mappings._reduce`` for the row-parallel
linears, ``_reduce_scatter_along_first_dim`` for the allgather dispatcher's combine over the TP x EP group) call
the backend's all-reduce and reduce-scatter. Over two ranks the result is ``a + b`` on both, exact in either order.
Over three or more the order of the partial sums is the backend's: gloo's ring and NCCL's algorithms pick it by
buffer size and rank count, so a one-token decode step and the whole prefill sum the same row in different orders
and the exact sampler's logprob can differ from the training forward's in the last bit.

This patch replaces both functions, for groups of three or more ranks, with an all-gather of every rank's partial
result and a left fold in rank order on each rank (``((x0 + x1) + x2) + ...``): every rank gets the same bits,
whatever the buffer size, the row's place in it or the backend. The all-gather moves ``world`` times the data of a
reduce-scatter; exact mode is a diagnostic. Groups of one or two ranks keep megatron's own path. Applied only in
exact mode, before the parallel groups exist; each function is replaced on the ``mappings`` module, where
megatron's autograd functions look it up.
"""

from __future__ import annotations

import torch

from patches.guard import Handle, check_version, set_attr
from patches.specs import megatron_core_patch

SPEC = megatron_core_patch(
    name="megatron-ordered-reductions",
    reason="over 3 or more ranks, the backend's all-reduce and reduce-scatter add the ranks' partial results in "
    "an order that depends on the buffer size: a decode step and the prefill sum a row differently.",
    targets=(
        "megatron.core.tensor_parallel.mappings._reduce",
        "megatron.core.tensor_parallel.mappings._reduce_scatter_along_first_dim",
    ),
)

NATIVE_UP_TO = 2
"""Groups of at most this many ranks keep the backend's reduction (a + b is the same in either order)."""


def needed() -> bool:
    """Always, in exact mode (the groups' sizes are known only later; groups of <= 2 ranks take the native path)."""
    return True


def ordered_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` added left to right, in list order, into a new tensor."""
    out = parts[0].clone()
    for p in parts[1:]:
        out.add_(p)
    return out


def _gathered(input_: torch.Tensor, group) -> list[torch.Tensor]:
    x = input_.contiguous()
    parts = [torch.empty_like(x) for _ in range(group.size())]
    torch.distributed.all_gather(parts, x, group=group)
    return parts


def apply() -> Handle:
    """Replace ``mappings._reduce`` and ``mappings._reduce_scatter_along_first_dim``; returns the handle."""
    check_version(SPEC)
    from megatron.core.tensor_parallel import mappings

    native_reduce = mappings._reduce
    native_scatter = mappings._reduce_scatter_along_first_dim

    def _reduce(input_, group):
        assert group is not None, "group should not be None"
        if group.size() <= NATIVE_UP_TO:
            return native_reduce(input_, group)
        input_.copy_(ordered_sum(_gathered(input_, group)))  # in place, as megatron's all-reduce
        return input_

    def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        assert group is not None, "group should not be None"
        world = group.size()
        if world <= NATIVE_UP_TO:
            return native_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = ordered_sum(_gathered(input_, group))
        rank = group.rank()
        if input_split_sizes is None:
            if input_.size(0) % world:
                raise ValueError(
                    f"reduce-scatter of {input_.size(0)} rows over {world} ranks: the first dimension must divide"
                )
            per = input_.size(0) // world
            return total[rank * per : (rank + 1) * per].contiguous()
        start = sum(input_split_sizes[:rank])
        return total[start : start + input_split_sizes[rank]].contiguous()

    h = Handle(SPEC.name)
    set_attr(h, mappings, "_reduce", _reduce)
    set_attr(h, mappings, "_reduce_scatter_along_first_dim", _reduce_scatter_along_first_dim)
    return h
