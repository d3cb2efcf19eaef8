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
* a sigmoid router's scores (GLM-4.5, DeepSeek-V3): the sigmoid inside megatron-core's
  ``topk_routing_with_score_function`` gives an element other bits on its scalar tail path, so each sigmoid
  router gets its own ``routing``: megatron-core's code (the same code object) resolving ``torch.sigmoid`` to the
  invariant one (:class:`_InvariantTorch`), everything else (top-k, group limit, replay, bias, aux losses) as it
  is;
* every MLP's activation (dense MLPs, every expert, shared experts): the value from
  :meth:`ExactKernels.elementwise` (torch's SiLU gives an element other bits on its scalar tail path than on its
  vector path, and which path an element takes depends on its place in the tensor and the thread count); the
  gradient through the stock activation, as for the linears;
* every local ``DotProductAttention``: scores and probabilities-times-values through :meth:`ExactKernels.bmm`,
  with the query heads of one key/value group stacked as rows (no repeated keys), the causal mask applied as
  ``-inf`` and the softmax in float32 (megatron's ``attention_softmax_in_fp32``).

* every MoE layer's combine (the sum of a token's top-k expert outputs, megatron-core's ``unpermute``): on a GPU
  in one fixed order (:func:`_fixed_order`); its ``scatter_add_`` adds by atomics there.

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

from patches.guard import check_version
from patches.specs import megatron_core_patch
from tim_megatron.exact.kernels import attend

SPEC = megatron_core_patch(
    name="megatron-invariant-kernels",
    reason="a CPU GEMM gives a row other bits at another row count, and torch's SiLU gives an element other bits "
    "on its scalar tail path, so the training forward and a cached decode step compute a token's logprob "
    "differently; and megatron-core's local attention has no fixed-width KV cache with per-sequence positions.",
    targets=(
        "megatron.core.tensor_parallel.layers.ColumnParallelLinear._forward_impl",
        "megatron.core.tensor_parallel.layers.RowParallelLinear._forward_impl",
        "megatron.core.transformer.moe.router.TopKRouter.gating",
        "megatron.core.transformer.moe.router.TopKRouter.routing (sigmoid routers: globals of one copy)",
        "megatron.core.transformer.moe.moe_utils.topk_routing_with_score_function (globals of one copy)",
        "megatron.core.transformer.dot_product_attention.DotProductAttention.forward",
        "megatron.core.models.common.embeddings.rotary_pos_embedding.RotaryEmbedding.forward",
        "megatron.core.transformer.mlp.MLP.activation_func (instance attribute)",
        "megatron.core.transformer.moe.token_dispatcher.MoEAllGatherTokenDispatcher.combine_preprocess (copy)",
        "megatron.core.transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher.combine_postprocess (copy)",
        "megatron.core.transformer.transformer_config.TransformerConfig.activation_func (this model's configs)",
    ),
)

_MARK = "_tim_invariant"


def _modules(model):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.moe.router import TopKRouter

    from patches.megatron.modules import unwrap

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


def _mlps(model) -> list:
    from megatron.core.transformer.mlp import MLP

    from patches.megatron.modules import unwrap

    return [m for m in unwrap(model).modules() if isinstance(m, MLP)]


class _Activation:
    """An MLP activation whose value comes from :meth:`ExactKernels.elementwise` and whose gradient from the stock
    op. Megatron's gated MLP calls ``config.activation_func`` and the plain one ``self.activation_func``."""

    def __init__(self, kernels, stock):
        self.kernels = kernels
        self.stock = stock

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            value = self.kernels.elementwise(self.stock, x)
        return _with_reference(lambda: self.stock(x), value, x)


def _route_activations(model, kernels) -> int:
    """Give every MLP (and the configs its gated path reads) an :class:`_Activation`; returns how many MLPs."""
    mlps = _mlps(model)
    configs = {id(m.config): m.config for m in mlps}
    for cfg in configs.values():
        if not isinstance(cfg.activation_func, _Activation):
            cfg.activation_func = _Activation(kernels, cfg.activation_func)
    for m in mlps:
        if not isinstance(m.activation_func, _Activation):
            m.activation_func = _Activation(kernels, m.activation_func)
    return len(mlps)


def _check_activations(model) -> None:
    for m in _mlps(model):
        if m.config.bias_activation_fusion or getattr(m.config, "use_te_activation_func", False):
            raise ValueError(
                "exact mode: bias_activation_fusion / use_te_activation_func run fused activation kernels that the "
                "row-invariant kernels do not cover; both must be off"
            )


def _unroute_activations(model) -> None:
    mlps = _mlps(model)
    for owner in [*{id(m.config): m.config for m in mlps}.values(), *mlps]:
        if isinstance(owner.activation_func, _Activation):
            owner.activation_func = owner.activation_func.stock


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


class _InvariantTorch:
    """``torch`` as megatron-core's routing code sees it in a sigmoid router's own copy: ``sigmoid`` gives the value
    of :meth:`ExactKernels.elementwise` and the gradient of the stock op; every other name is torch's."""

    def __init__(self, kernels):
        self._kernels = kernels

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            value = self._kernels.elementwise(torch.sigmoid, x)
        return _with_reference(lambda: torch.sigmoid(x), value, x)

    def __getattr__(self, name):
        return getattr(torch, name)


def _sigmoid_routing(router, kernels):
    """``routing`` for one sigmoid router: its class's own function (megatron-core's ``TopKRouter.routing``), its
    call of ``topk_routing_with_score_function`` resolved to a copy whose ``torch.sigmoid`` is invariant. The
    copies differ from the originals only in their globals, taken when the router is routed (no code is restated,
    nothing module-wide is changed). The aux-loss scores (``compute_routing_scores_for_aux_loss``, training only)
    keep the stock sigmoid: they enter the loss, not a logprob."""
    from megatron.core.transformer.moe import moe_utils

    topk = _copy(moe_utils.topk_routing_with_score_function, torch=_InvariantTorch(kernels))
    return _copy(type(router).routing, topk_routing_with_score_function=topk)


def _copy(fn, **names):
    """``fn`` with the same code, defaults and closure, its globals ``names`` replaced (a copy, not a patch)."""
    out = types.FunctionType(
        fn.__code__, {**fn.__globals__, **names}, fn.__name__, fn.__defaults__, fn.__closure__
    )
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


_COMBINES = ("combine_preprocess", "combine_postprocess")
"""The dispatcher methods that call megatron-core's ``unpermute`` (all-gather: pre; all-to-all: post)."""


def _fixed_order(unpermute):
    """megatron-core's ``unpermute`` with torch's deterministic algorithms on for the call when the tokens are on a
    GPU: it then adds each token's expert outputs with ``index_add_`` in the order of the sorted indices (one fixed
    order, expert by expert, whatever else the batch holds), where ``scatter_add_`` adds them by atomics in the
    order the threads arrive (on an H200, five runs over the same inputs gave other bits). On a CPU the call is
    as it is: ``scatter_add_`` there adds in index order."""

    def call(permuted_tokens, *args, **kwargs):
        if not permuted_tokens.is_cuda:
            return unpermute(permuted_tokens, *args, **kwargs)
        was, warn_only = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            return unpermute(permuted_tokens, *args, **kwargs)
        finally:
            torch.use_deterministic_algorithms(was, warn_only=warn_only)

    call._tim_fixed_order = True
    return call


def _dispatchers(model) -> list:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from patches.megatron.modules import unwrap

    return [m.token_dispatcher for m in unwrap(model).modules() if isinstance(m, MoELayer)]


def _check_dispatcher(dispatcher) -> None:
    from megatron.core.transformer.moe.token_dispatcher import (
        MoEAllGatherTokenDispatcher,
        MoEAlltoAllTokenDispatcher,
    )

    if not isinstance(dispatcher, MoEAllGatherTokenDispatcher | MoEAlltoAllTokenDispatcher):
        raise ValueError(
            f"exact mode: token dispatcher {type(dispatcher).__name__}; allowed the all-gather and all-to-all "
            "dispatchers (their combine is megatron-core's unpermute, which exact mode keeps in a fixed order)"
        )
    if dispatcher.config.moe_permute_fusion:
        raise ValueError(
            "exact mode: moe_permute_fusion runs a fused unpermute the fixed-order combine does not cover"
        )


def route_combine(dispatcher) -> None:
    """One dispatcher's combine through :func:`_fixed_order`: its class's own ``combine_*`` functions, copied with
    ``unpermute`` resolved to the fixed-order call (instance attributes; nothing module-wide changes)."""
    _check_dispatcher(dispatcher)
    for name in _COMBINES:
        fn = getattr(type(dispatcher), name)
        if "unpermute" in fn.__code__.co_names:
            setattr(
                dispatcher,
                name,
                types.MethodType(_copy(fn, unpermute=_fixed_order(fn.__globals__["unpermute"])), dispatcher),
            )


def route_router(router, kernels) -> None:
    """Route one ``TopKRouter``: its logits (``gating``) and, for a sigmoid router, its scores (``routing``)."""
    _check_router(router)
    router._tim_kernels = kernels
    setattr(router, _MARK, True)
    router.gating = types.MethodType(_gating, router)
    if router.score_function == "sigmoid":
        router.routing = types.MethodType(_sigmoid_routing(router, kernels), router)


def _check_router(router) -> None:
    if router.score_function not in ("softmax", "sigmoid"):
        raise ValueError(
            f"exact mode: router score function {router.score_function!r}; allowed softmax, sigmoid"
        )
    if router.config.moe_router_fusion:
        raise ValueError(
            "exact mode: moe_router_fusion runs a fused routing kernel the invariant kernels do not cover"
        )
    if router.routing_type == "sinkhorn":
        raise ValueError("exact mode: sinkhorn routing is not covered by the invariant kernels")


@dataclass
class _Decode:
    """One decode forward's entries, seen by one attention layer."""

    cache: object
    layer: int
    rows: torch.Tensor
    positions: torch.Tensor


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
        ctx = attend(kernels, q, k, v, masked, self.softmax_scale, value.dtype)
        ctx = ctx.reshape(b, groups, per, sq, hn).permute(3, 0, 1, 2, 4)
        return ctx.reshape(sq, b, heads * hn)
    if b != 1:
        raise RuntimeError(f"exact-mode decode: entries come as one sequence of batch 1, got batch {b}")
    cache, n = state.cache, sq
    with torch.no_grad():
        cache.write(state.layer, state.rows, state.positions, key[:, 0], value[:, 0])
    out = query.new_zeros(n, 1, heads * hn)  # padding entries' outputs stay zero (never read)
    slots = cache.slots(state.rows)
    real = (slots >= 0).nonzero().squeeze(1)
    if len(real) == 0:
        return out
    # The real entries' slots lo..hi are one block of the cache, read in place (no copy); entries of one sequence
    # are stacked as its query rows (a prefill holds many entries per sequence, a decode step one), padded to the
    # most any sequence has; slots of the block without entries, and the padding slots, see every key (finite
    # values) and are dropped.
    slots, positions = slots[real], state.positions[real]
    lo, hi = int(slots.min()), int(slots.max())
    span, local = hi - lo + 1, slots - lo
    counts = torch.bincount(local, minlength=span)
    order = torch.argsort(local, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(local)
    slot[order] = torch.arange(len(local), device=local.device) - starts[local[order]]
    depth, width = int(counts.max()), cache.width
    with torch.no_grad():
        k, v = cache.span(state.layer, lo, hi)  # [span * ng, W, hn]
    q = query.new_zeros(span, depth, groups, per, hn)
    q[local, slot] = query[real, 0].reshape(len(real), groups, per, hn)
    pos = torch.full((span, depth), width - 1, dtype=torch.long, device=query.device)
    pos[local, slot] = positions
    q = q.permute(0, 2, 3, 1, 4).reshape(span * groups, per * depth, hn)
    after = torch.arange(width, device=query.device).view(1, 1, width) > pos.view(span, depth, 1)
    masked = after.view(span, 1, 1, depth, width).expand(span, groups, per, depth, width)
    ctx = attend(
        kernels, q, k, v, masked.reshape(span * groups, per * depth, width), self.softmax_scale, query.dtype
    )
    ctx = ctx.reshape(span, groups, per, depth, hn).permute(0, 3, 1, 2, 4)[local, slot]  # [m, ng, per, hn]
    out[real, 0] = ctx.reshape(len(real), heads * hn)
    return out


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
    for m in routers:
        _check_router(m)
    _check_activations(model)  # before anything is patched: a refusal leaves the model as it was
    dispatchers = _dispatchers(model)
    for d in dispatchers:
        _check_dispatcher(d)
    for m in linears:
        m._forward_impl = types.MethodType(_linear_impl, m)
    for m in routers:
        route_router(m, kernels)
    for m in attention:
        m.forward = types.MethodType(_attention_forward, m)
        m._tim_decode = None
    for m in (*linears, *routers, *attention):
        m._tim_kernels = kernels
        setattr(m, _MARK, True)
    mlps = _route_activations(model, kernels)
    for d in dispatchers:
        route_combine(d)
    setattr(gpt, _MARK, kernels)
    gpt._tim_attention = tuple(attention)  # a decode step's layers, without a walk of the modules per step
    return {
        "linears": len(linears),
        "routers": len(routers),
        "sigmoid routers": sum(m.score_function == "sigmoid" for m in routers),
        "attention": len(attention),
        "activations": mlps,
        "combines": len(dispatchers),
    }


def kernels_of(model):
    """The kernels :func:`apply` gave ``model`` (None when not applied)."""
    from patches.megatron.modules import unwrap

    return getattr(unwrap(model), _MARK, None)


def revert(model) -> None:
    _unroute_activations(model)
    _gpt, linears, routers, attention = _modules(model)
    for m in (*linears, *routers, *attention):
        if getattr(m, _MARK, False):
            for name in (
                "_forward_impl",
                "gating",
                "routing",
                "forward",
                "_tim_decode",
                "_tim_kernels",
                _MARK,
            ):
                if name in m.__dict__:
                    delattr(m, name)
    for d in _dispatchers(model):
        for name in _COMBINES:
            d.__dict__.pop(name, None)
    gpt = _gpt
    for name in (_MARK, "_tim_attention"):
        if name in gpt.__dict__:
            delattr(gpt, name)


@contextlib.contextmanager
def decoding(model, *, cache, rows: torch.Tensor, positions: torch.Tensor):
    """Inside: a forward of ``model`` on ``[1, n]`` entry tokens is a decode step (see the module docstring)."""
    from patches.megatron.modules import unwrap

    gpt = unwrap(model)
    if kernels_of(model) is None:
        raise RuntimeError("decoding needs the invariant kernels (invariant_kernels.apply) on this model")
    attention = gpt._tim_attention
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
