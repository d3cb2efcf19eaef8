"""Exact mode's forward: every product through row-invariant kernels, and a cached decode through the same model.

Exact mode needs each token's logprob to be the same bits whether the training forward computes it (all positions
of a micro-batch at once) or a cached decode step does (one new position per sequence). With stock GEMMs a row's
bits change with the row count (:mod:`tim_megatron.exact.kernels`), so this patch routes, per instance of ONE
model (never the class):

* every ``ColumnParallelLinear`` / ``RowParallelLinear`` (attention, dense MLPs, every expert, shared experts):
  ``_forward_impl``'s value comes from :meth:`ExactKernels.linear`. With gradients, megatron's own implementation
  still runs for the backward (its TP/SP collectives and weight-gradient handling), and only its forward value is
  replaced, so a training forward's logprobs equal the old-logprob pass's and the first minibatch's ratio is 1;
* every ``TopKRouter.gating``: the router logits, the same way;
* every local ``DotProductAttention``: scores and probabilities-times-values through :meth:`ExactKernels.bmm`,
  with the query heads of one key/value group stacked as rows (no repeated keys), the causal mask applied as
  ``-inf`` and the softmax in float32 (megatron's ``attention_softmax_in_fp32``).

Inside :func:`decoding` the same attention runs a decode step instead: the model's input is a set of entries
(one token each, laid out as one sequence of batch 1), each with its own cache row and position. Each layer first
writes the entries' keys and values into the :class:`~tim_megatron.exact.kv_cache.KVCache`, then every entry
attends over its row's whole fixed-width buffer with the positions after its own masked, so the entries of one
prompt can be prefilled in a single forward (a sequence's buffer is read once per layer, whatever the number of
its entries). The rotary embedding gives each entry the angles of its own position,
taken from the table the training forward builds for the same width.

With the experts' GEMMs row-invariant, the sparse path (each token through its own top-k experts only) no longer
depends on how many tokens an expert got, so exact mode keeps megatron's ``SequentialMLP`` as it is.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass

import torch

from patches.guard import PatchSpec, check_version
from tim_megatron.versions import MEGATRON_CORE

SPEC = PatchSpec(
    name="megatron-invariant-kernels",
    library="megatron.core",
    distributions=("megatron-core",),
    verified=MEGATRON_CORE.spec,
    reason="a CPU GEMM gives a row other bits at another row count, so the training forward and a cached decode "
    "step compute a token's logprob differently; and megatron-core's local attention has no fixed-width KV cache "
    "with per-sequence positions.",
    targets=(
        "megatron.core.tensor_parallel.layers.ColumnParallelLinear._forward_impl",
        "megatron.core.tensor_parallel.layers.RowParallelLinear._forward_impl",
        "megatron.core.transformer.moe.router.TopKRouter.gating",
        "megatron.core.transformer.dot_product_attention.DotProductAttention.forward",
        "megatron.core.models.common.embeddings.rotary_pos_embedding.RotaryEmbedding.forward",
    ),
)

_MARK = "_tim_invariant"


def _modules(model):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.moe.router import TopKRouter

    from tim_megatron.trainer.model import unwrap

    gpt = unwrap(model)
    linears, routers, attention = [], [], []
    for m in gpt.modules():
        if isinstance(m, ColumnParallelLinear | RowParallelLinear):
            linears.append(m)
        elif isinstance(m, TopKRouter):
            routers.append(m)
        elif isinstance(m, DotProductAttention):
            attention.append(m)
    return gpt, linears, routers, attention


class _Substitute(torch.autograd.Function):
    """Forward: ``value``; backward: the gradient goes to ``reference`` (the stock computation of the same math)."""

    @staticmethod
    def forward(ctx, reference, value):
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _with_reference(reference_fn, value: torch.Tensor, *inputs) -> torch.Tensor:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        return _Substitute.apply(reference_fn(), value)
    return value


def _linear_impl(self, input, weight, bias=None, *args, **kwargs):
    sp = kwargs.get("sequence_parallel", args[2] if len(args) > 2 else False)
    group = kwargs.get("tp_group")
    with torch.no_grad():
        total = input
        if sp:
            from megatron.core.tensor_parallel.mappings import _gather_along_first_dim

            total = _gather_along_first_dim(input, group)
        value = self._tim_kernels.linear(total, weight)
        if bias is not None:
            value = value + bias
    stock = type(self)._forward_impl
    return _with_reference(lambda: stock(self, input, weight, bias, *args, **kwargs), value, input, weight)


def _gating(self, input):
    cfg = self.config
    dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(cfg.moe_router_dtype, input.dtype)
    with torch.no_grad():
        value = self._tim_kernels.linear(input.to(dtype), self.weight.to(dtype))
        if self.bias is not None:
            value = value + self.bias.to(dtype)
    stock = type(self).gating
    return _with_reference(lambda: stock(self, input), value, input, self.weight)


@dataclass
class _Decode:
    """One decode forward's entries, seen by one attention layer."""

    cache: object
    layer: int
    rows: torch.Tensor
    positions: torch.Tensor


def attend(kernels, q, k, v, masked, scale: float) -> torch.Tensor:
    """Scaled dot-product attention of ``q [B, Mq, hn]`` over ``k, v [B, W, hn]``; ``masked [B or 1, Mq, W]``
    (True: excluded). Shared by the training forward and the decode step, so both compute a row the same way."""
    scores = kernels.bmm(q, k.transpose(1, 2)) * scale
    scores = scores.float().masked_fill(masked, float("-inf"))
    probs = kernels.softmax(scores).to(v.dtype)
    return kernels.bmm(probs, v)


def _attention_forward(
    self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
):
    if packed_seq_params is not None or attention_bias is not None:
        raise RuntimeError("exact-mode attention: packed sequences and attention biases are not supported")
    sq, b, heads, hn = query.shape
    groups = key.shape[2]
    per = heads // groups
    kernels = self._tim_kernels
    state: _Decode | None = self._tim_decode
    if state is None:
        # [sq, b, ng * per, hn] -> [b * ng, per * sq, hn]: the heads sharing a key/value group stacked as rows.
        q = query.reshape(sq, b, groups, per, hn).permute(1, 2, 3, 0, 4).reshape(b * groups, per * sq, hn)
        k = key.permute(1, 2, 0, 3).reshape(b * groups, key.shape[0], hn)
        v = value.permute(1, 2, 0, 3).reshape(b * groups, value.shape[0], hn)
        mask = attention_mask.reshape(attention_mask.shape[-2], attention_mask.shape[-1])
        masked = mask.unsqueeze(0).expand(per, *mask.shape).reshape(1, per * sq, mask.shape[-1])
        ctx = attend(kernels, q, k, v, masked, self.softmax_scale)
        ctx = ctx.reshape(b, groups, per, sq, hn).permute(3, 0, 1, 2, 4)
        return ctx.reshape(sq, b, heads * hn)
    if b != 1:
        raise RuntimeError(f"exact-mode decode: entries come as one sequence of batch 1, got batch {b}")
    cache, n = state.cache, sq
    with torch.no_grad():
        cache.write(state.layer, state.rows, state.positions, key[:, 0], value[:, 0])
    # Entries of one sequence share its buffer: gather each sequence's buffer once and stack its entries as rows
    # (a prefill holds many entries per sequence, a decode step one), padded to the longest; the padding slots see
    # every key (finite values) and are dropped.
    seqs, which = torch.unique(state.rows, return_inverse=True)
    order = torch.argsort(which, stable=True)
    counts = torch.bincount(which, minlength=len(seqs))
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(which)
    slot[order] = torch.arange(n, device=which.device) - starts[which[order]]
    depth = int(counts.max())
    with torch.no_grad():
        keys, values = cache.read(state.layer, seqs)  # [u, W, ng, hn]
    u, width = len(seqs), keys.shape[1]
    q = query.new_zeros(u, depth, groups, per, hn)
    q[which, slot] = query[:, 0].reshape(n, groups, per, hn)
    pos = torch.full((u, depth), width - 1, dtype=torch.long, device=query.device)
    pos[which, slot] = state.positions
    q = q.permute(0, 2, 3, 1, 4).reshape(u * groups, per * depth, hn)
    k = keys.permute(0, 2, 1, 3).reshape(u * groups, width, hn)
    v = values.permute(0, 2, 1, 3).reshape(u * groups, width, hn)
    after = torch.arange(width, device=query.device).view(1, 1, width) > pos.view(
        u, depth, 1
    )  # [u, depth, W]
    masked = after.view(u, 1, 1, depth, width).expand(u, groups, per, depth, width)
    ctx = attend(kernels, q, k, v, masked.reshape(u * groups, per * depth, width), self.softmax_scale)
    ctx = ctx.reshape(u, groups, per, depth, hn).permute(0, 3, 1, 2, 4)[which, slot]  # [n, ng, per, hn]
    return ctx.reshape(n, 1, heads * hn)


def _check_attention(module) -> None:
    cfg = module.config
    problems = []
    if cfg.apply_query_key_layer_scaling:
        problems.append("apply_query_key_layer_scaling")
    if getattr(cfg, "softmax_type", "vanilla") != "vanilla":
        problems.append(f"softmax_type = {cfg.softmax_type}")
    if cfg.window_size is not None:
        problems.append("sliding-window attention")
    if module.attention_dropout.p:
        problems.append(f"attention dropout {module.attention_dropout.p}")
    if problems:
        raise ValueError(f"exact-mode attention does not support {', '.join(problems)}")


def apply(model, kernels) -> dict[str, int]:
    """Route ``model``'s linears, routers and attention through ``kernels``; returns how many of each."""
    check_version(SPEC)
    gpt, linears, routers, attention = _modules(model)
    if not attention:
        raise ValueError(
            "exact mode needs megatron-core's local DotProductAttention (transformer-engine attention is not "
            "covered by the row-invariant kernels)"
        )
    for m in attention:
        _check_attention(m)
    for m in linears:
        m._forward_impl = types.MethodType(_linear_impl, m)
    for m in routers:
        m.gating = types.MethodType(_gating, m)
    for m in attention:
        m.forward = types.MethodType(_attention_forward, m)
        m._tim_decode = None
    for m in (*linears, *routers, *attention):
        m._tim_kernels = kernels
        setattr(m, _MARK, True)
    setattr(gpt, _MARK, kernels)
    return {"linears": len(linears), "routers": len(routers), "attention": len(attention)}


def kernels_of(model):
    """The kernels :func:`apply` gave ``model`` (None when not applied)."""
    from tim_megatron.trainer.model import unwrap

    return getattr(unwrap(model), _MARK, None)


def revert(model) -> None:
    _gpt, linears, routers, attention = _modules(model)
    for m in (*linears, *routers, *attention):
        if getattr(m, _MARK, False):
            for name in ("_forward_impl", "gating", "forward", "_tim_decode", "_tim_kernels", _MARK):
                if name in m.__dict__:
                    delattr(m, name)
    gpt = _gpt
    if _MARK in gpt.__dict__:
        delattr(gpt, _MARK)


@contextlib.contextmanager
def decoding(model, *, cache, rows: torch.Tensor, positions: torch.Tensor):
    """Inside: a forward of ``model`` on ``[1, n]`` entry tokens is a decode step (see the module docstring)."""
    gpt, _linears, _routers, attention = _modules(model)
    if kernels_of(model) is None:
        raise RuntimeError("decoding needs the invariant kernels (invariant_kernels.apply) on this model")
    rope = gpt.rotary_pos_emb
    stock = type(rope).forward

    def per_entry(max_seq_len, *args, **kwargs):
        if max_seq_len != len(positions):
            raise RuntimeError(
                f"exact-mode decode: rotary table for {max_seq_len} entries, have {len(positions)}"
            )
        return stock(rope, cache.width, *args, **kwargs)[positions]

    for i, m in enumerate(attention):
        m._tim_decode = _Decode(cache=cache, layer=i, rows=rows, positions=positions)
    rope.forward = per_entry
    try:
        yield
    finally:
        for m in attention:
            m._tim_decode = None
        del rope.forward
