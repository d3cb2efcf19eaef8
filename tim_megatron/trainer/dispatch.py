"""The MoE token dispatcher ``indexed``: megatron-core's dispatch and combine as index gathers, with the token counts
kept on the device.

megatron-core 0.16's dispatchers (``token_dispatcher.py``, ``moe_utils.permute``/``unpermute``/``sort_chunks_by_idxs``)
permute the tokens with ``masked_select`` (its output size is read on the host), copy the tokens per expert to the
host (the grouped experts copy them back as group offsets), split and concatenate chunks by host lists even where
the order is the identity (one rank, all experts local), and combine the experts' rows with ``index_add_`` (sort-based
under ``torch.use_deterministic_algorithms``, which the trainer turns on by default). Their backward passes are
``index_add_`` (the permute's) and an index gather (the combine's).

Here every token has exactly ``top_k`` (token, expert) pairs, so the whole routing is a fixed-size plan
(:func:`route_plan`, from the router's ``routing_map``: one top-k over the map, two sorts of ``tokens x top_k``
integers, no host read):

- ``rows``: the token of each permuted row, grouped by expert and in token order within an expert (megatron's own
  order, so the experts get the same rows in the same order);
- ``order``: ``[tokens, top_k]``, the permuted row of each of a token's pairs, in ascending expert order.

The permute is ``x[rows]``; its backward sums each token's ``top_k`` gradient rows picked by ``order`` (the forward
of ``embedding_bag`` with one bag of ``top_k`` rows per token: the gather and the sum in one pass, no gathered copy).
The combine is that same bag sum of the experts' rows, and its backward is ``grad[rows]``. Every pass is a gather
and a fixed-order sum: deterministic without atomics or sorts of the hidden states. The sum takes each token's rows
in ascending expert order, as megatron's ``index_add_`` does, so in float32 on CPU the combined output and every
gradient equal megatron's bit for bit (``tests/test_dispatcher.py``); in bfloat16 the bag sum accumulates in float32
and rounds once, where ``index_add_`` on CPU rounds after every add (a difference of at most about one bfloat16
rounding step of the output, ``make bench BENCH=dispatch``).

With expert parallelism (or expert tensor parallelism) the dispatcher is megatron's all-to-all dispatcher with these
permutes around the collectives: the send and receive sizes are read on the host once per layer (the all-to-all
needs them), and the received chunks are put in local-expert order by one index gather (megatron splits and
concatenates them by host lists). With one rank in the expert group (EP = expert TP = 1) nothing is read on the
host in the forward or the backward: the tokens per expert go to the experts as a device tensor, which the grouped
experts turn into ``torch._grouped_mm`` offsets on the device (megatron's loop over experts still reads them, with
``tolist``).

Token dropping and padding (``moe_expert_capacity_factor``), router padding for quantization and the shared-expert
overlap are refused: each breaks "exactly ``top_k`` rows per token" or needs megatron's own dispatcher.
Chosen by ``trainer.moe_dispatcher`` (:func:`resolve_dispatcher`); installed on a built model by
``patches/megatron/indexed_dispatcher.py``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

DISPATCHERS = ("auto", "allgather", "alltoall", "indexed")
"""Values of ``trainer.moe_dispatcher``."""


def resolve_dispatcher(setting: str, *, on_gpu: bool) -> str:
    """The dispatcher a run builds: ``auto`` takes ``indexed`` on CUDA and megatron's ``allgather`` on CPU (the
    project's CPU figures were measured with it); ``alltoall`` needs CUDA streams and is refused on CPU. Exact
    mode's all-gather is decided before this (:attr:`tim_megatron.modes.RunModes.dispatcher`)."""
    if setting not in DISPATCHERS:
        raise ValueError(f"trainer.moe_dispatcher = {setting!r}; allowed: {', '.join(DISPATCHERS)}")
    if setting == "auto":
        return "indexed" if on_gpu else "allgather"
    if setting == "alltoall" and not on_gpu:
        raise ValueError(
            "trainer.moe_dispatcher = alltoall needs CUDA streams; use allgather, indexed (or auto) on CPU"
        )
    return setting


# ----------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class RoutePlan:
    """Where each (token, expert) pair of a routing goes (module docstring)."""

    rows: torch.Tensor
    """``[tokens * top_k]`` int64: the token of each permuted row (grouped by expert, tokens ascending)."""
    experts: torch.Tensor
    """``[tokens * top_k]`` int64: the expert of each permuted row."""
    order: torch.Tensor
    """``[tokens, top_k]`` int64: the permuted row of each of a token's pairs, experts ascending."""
    tokens_per_expert: torch.Tensor
    """``[experts]`` int64, on the routing map's device."""
    routing_map: torch.Tensor
    """``[tokens, experts]`` bool, the router's (for the probabilities' gradient)."""

    @property
    def top_k(self) -> int:
        return self.order.shape[1]


def route_plan(routing_map: torch.Tensor, *, top_k: int) -> RoutePlan:
    """The plan of a ``[tokens, experts]`` boolean routing map with exactly ``top_k`` experts per token; no value is
    read on the host (a map with another count per token fails a device-side assert)."""
    tokens, experts = routing_map.shape
    dev = routing_map.device
    torch._assert_async(
        (routing_map.sum(1) == top_k).all(),
        f"indexed MoE dispatcher: every token must have exactly top_k = {top_k} experts in the routing map",
    )
    # each token's experts, ascending: the largest keys of (experts - e) on the routed entries
    key = routing_map.to(torch.int32) * torch.arange(experts, 0, -1, dtype=torch.int32, device=dev)
    chosen = key.topk(top_k, dim=1).indices  # [tokens, top_k], expert ids ascending within a token
    pairs = chosen.reshape(-1)  # token-major
    by_expert = torch.argsort(pairs, stable=True)  # pairs grouped by expert, tokens ascending within one
    order = torch.argsort(by_expert).view(tokens, top_k)
    return RoutePlan(
        rows=torch.div(by_expert, top_k, rounding_mode="floor"),
        experts=pairs.index_select(0, by_expert),
        order=order,
        tokens_per_expert=routing_map.sum(0),
        routing_map=routing_map,
    )


# -------------------------------------------------------------------------------------- gathers and sums


class _Expand(torch.autograd.Function):
    """``x[rows]``; backward: each token's ``top_k`` gradient rows (gathered by ``order``) summed."""

    @staticmethod
    def forward(ctx, x, rows, order):
        ctx.save_for_backward(rows, order)
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad):
        rows, order = ctx.saved_tensors
        return _Combine.apply(grad, rows, order), None, None


class _Combine(torch.autograd.Function):
    """``y[order].sum(top_k)``: the rows of each token summed in ascending expert order (``embedding_bag``'s forward,
    one bag of ``top_k`` rows per token: no gathered copy); backward: ``grad[rows]``."""

    @staticmethod
    def forward(ctx, y, rows, order):
        ctx.save_for_backward(rows, order)
        # one bag of top_k rows per token: the gather and the sum in one pass, summed in the bag's order
        return torch.nn.functional.embedding_bag(order, y.flatten(1), mode="sum").view(
            order.shape[0], *y.shape[1:]
        )

    @staticmethod
    def backward(ctx, grad):
        rows, order = ctx.saved_tensors
        return _Expand.apply(grad, rows, order), None, None


class _PairProbs(torch.autograd.Function):
    """``probs[rows, experts]``; backward: the gradient rows put back at the routed entries of ``[tokens, experts]``
    by a gather (each token's routed entries, in expert order, are its pairs in ``order``), zeros elsewhere."""

    @staticmethod
    def forward(ctx, probs, rows, experts, order, routing_map):
        ctx.save_for_backward(order, routing_map)
        ctx.shape = probs.shape
        return probs.reshape(-1).index_select(0, rows * probs.shape[-1] + experts)

    @staticmethod
    def backward(ctx, grad):
        order, routing_map = ctx.saved_tensors
        tokens, top_k = order.shape
        per_pair = grad.index_select(0, order.reshape(-1)).view(tokens, top_k)
        slot = (routing_map.cumsum(1) - 1).clamp_(min=0)  # a routed entry's place among its token's experts
        dense = torch.where(
            routing_map, per_pair.gather(1, slot), torch.zeros((), dtype=grad.dtype, device=grad.device)
        )
        return dense.view(ctx.shape), None, None, None, None


class _Reorder(torch.autograd.Function):
    """``x[index]`` for a permutation ``index`` whose inverse is ``inverse``; backward: ``grad[inverse]``."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(index, inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        index, inverse = ctx.saved_tensors
        return _Reorder.apply(grad, inverse, index), None, None


def permute(x: torch.Tensor, plan: RoutePlan) -> torch.Tensor:
    """``[tokens, hidden]`` -> ``[tokens * top_k, hidden]``, grouped by expert (megatron's ``permute``'s rows)."""
    return _Expand.apply(x, plan.rows, plan.order)


def permute_probs(probs: torch.Tensor, plan: RoutePlan) -> torch.Tensor:
    """``[tokens, experts]`` -> ``[tokens * top_k]``: each permuted row's routing probability."""
    return _PairProbs.apply(probs, plan.rows, plan.experts, plan.order, plan.routing_map)


def unpermute(y: torch.Tensor, plan: RoutePlan) -> torch.Tensor:
    """``[tokens * top_k, hidden]`` (the experts' rows in permuted order) -> ``[tokens, hidden]``: each token's rows
    summed in ascending expert order (megatron's ``unpermute`` without probabilities: they are applied by the
    experts)."""
    return _Combine.apply(y, plan.rows, plan.order)


def chunk_order(sizes: torch.Tensor, *, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows in chunks ``(a, b)`` of ``sizes[a, b]`` rows, laid out ``a``-major, put ``b``-major (megatron's
    ``sort_chunks_by_idxs`` with the transposing order): ``(index, inverse)`` with ``out = x[index]`` and
    ``x = out[inverse]``. ``total`` is ``sizes.sum()``, given (the caller knows it on the host)."""
    flat = sizes.reshape(-1)
    flat_t = sizes.t().reshape(-1)
    src = (flat.cumsum(0) - flat).view(sizes.shape)  # first row of chunk (a, b) in the a-major layout
    dst = (flat_t.cumsum(0) - flat_t).view(sizes.t().shape)  # ... in the b-major layout
    ar = torch.arange(total, device=sizes.device)
    index = ar + torch.repeat_interleave((src.t() - dst).reshape(-1), flat_t, output_size=total)
    inverse = ar + torch.repeat_interleave((dst.t() - src).reshape(-1), flat, output_size=total)
    return index, inverse


def reorder(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``x[index]`` (a permutation of the rows), whose gradient is a gather too."""
    return _Reorder.apply(x, index, inverse)


# ----------------------------------------------------------------------------------------- the dispatcher


def _unsupported(config) -> str:
    if config.moe_expert_capacity_factor is not None or config.moe_pad_expert_input_to_capacity:
        return "token dropping / padding to capacity (moe_expert_capacity_factor)"
    if config.moe_router_padding_for_quantization:
        return "router padding for quantization"
    if config.moe_shared_expert_overlap:
        return "the shared-expert overlap"
    if config.moe_permute_fusion:
        return "transformer-engine's fused permutes (moe_permute_fusion)"
    return ""


def _indexed_dispatcher_class():
    from megatron.core.tensor_parallel import (
        all_to_all,
        gather_from_sequence_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )
    from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

    class IndexedTokenDispatcher(MoETokenDispatcher):
        """megatron-core's dispatcher interface with index-gather permutes (module docstring)."""

        def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
            super().__init__(config=config, pg_collection=pg_collection)
            problem = _unsupported(config)
            if problem:
                raise ValueError(f"trainer.moe_dispatcher = indexed does not support {problem}")
            if list(local_expert_indices) != list(
                range(local_expert_indices[0], local_expert_indices[0] + num_local_experts)
            ):
                raise ValueError(
                    f"indexed MoE dispatcher: local experts {local_expert_indices} are not contiguous"
                )
            self.num_local_experts = num_local_experts
            self.local_expert_indices = list(local_expert_indices)
            self.num_experts = config.num_moe_experts
            self.top_k = config.moe_router_topk
            self.comm = self.tp_size > 1 or self.ep_size > 1
            self.plan: RoutePlan | None = None

        # dispatch ------------------------------------------------------------------------------------------
        def dispatch_preprocess(self, hidden_states, routing_map, probs):
            self.hidden_shape = hidden_states.shape
            self.probs_dtype = probs.dtype
            x = hidden_states.view(-1, self.hidden_shape[-1])
            self.plan = route_plan(routing_map, top_k=self.top_k)
            self.tokens_per_expert = self.plan.tokens_per_expert
            return permute(x, self.plan), permute_probs(probs, self.plan)

        def _sizes(self) -> None:
            """The all-to-all's send and receive sizes (host lists: the collectives need them) and the received
            chunks' sizes (device), as megatron's all-to-all dispatcher computes them."""
            lo, n = self.local_expert_indices[0], self.num_local_experts
            mine = self.plan.tokens_per_expert
            every = (
                gather_from_sequence_parallel_region(mine, group=self.tp_ep_group)
                .reshape(self.ep_size, self.tp_size, self.num_experts)
                .transpose(0, 1)
            )  # [tp, ep, experts]: what each rank of the group sends to each expert
            local = every[:, :, lo : lo + n]  # [tp, ep, local experts]
            per_rank = local.sum(2)  # [tp, ep]
            sends = mine.reshape(self.ep_size, n).sum(1)
            host = torch.cat([sends, per_rank[self.tp_rank], per_rank.sum(1)]).tolist()  # the one host read
            ep, tp = self.ep_size, self.tp_size
            self.input_splits, self.output_splits = host[:ep], host[ep : 2 * ep]
            self.output_splits_tp = host[2 * ep : 2 * ep + tp]
            self.chunk_sizes = local.reshape(-1, n)  # [tp * ep, local experts]: the received rows' chunks
            self.tokens_per_expert = local.sum((0, 1))

        def token_dispatch(self, hidden_states, probs):
            if not self.comm:
                return hidden_states, probs
            self._sizes()
            if self.ep_size > 1:
                hidden_states = all_to_all(
                    self.ep_group, hidden_states, self.output_splits, self.input_splits
                )
                probs = all_to_all(self.ep_group, probs, self.output_splits, self.input_splits)
            return hidden_states, probs

        def dispatch_postprocess(self, hidden_states, probs):
            if self.tp_size > 1:
                sizes = self.output_splits_tp
                hidden_states = gather_from_sequence_parallel_region(
                    hidden_states, group=self.tp_group, output_split_sizes=sizes
                )
                probs = gather_from_sequence_parallel_region(
                    probs, group=self.tp_group, output_split_sizes=sizes
                )
            self.chunks = None
            if self.comm and self.num_local_experts > 1:
                index, inverse = chunk_order(self.chunk_sizes, total=hidden_states.shape[0])
                self.chunks = (index, inverse)
                hidden_states = reorder(hidden_states, index, inverse)
                probs = reorder(probs, index, inverse)
            tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
            return hidden_states, tokens_per_expert, probs

        # combine -------------------------------------------------------------------------------------------
        def combine_preprocess(self, hidden_states):
            if self.chunks is not None:
                index, inverse = self.chunks
                hidden_states = reorder(hidden_states, inverse, index)
                self.chunks = None
            if self.tp_size > 1:
                hidden_states = reduce_scatter_to_sequence_parallel_region(
                    hidden_states.to(self.probs_dtype),
                    group=self.tp_group,
                    input_split_sizes=self.output_splits_tp,
                ).to(hidden_states.dtype)
            return hidden_states

        def token_combine(self, hidden_states):
            if self.ep_size > 1:
                hidden_states = all_to_all(
                    self.ep_group, hidden_states, self.input_splits, self.output_splits
                )
            return hidden_states

        def combine_postprocess(self, hidden_states):
            out = unpermute(hidden_states, self.plan).view(self.hidden_shape)
            self.plan = None
            return out

    return IndexedTokenDispatcher


@functools.cache
def indexed_dispatcher_class():
    """The ``IndexedTokenDispatcher`` class (built on first use: megatron-core is imported only then)."""
    return _indexed_dispatcher_class()
