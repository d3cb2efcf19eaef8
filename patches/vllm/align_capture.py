"""Record what ``tim align`` compares inside vLLM's model: per decoder layer the residual stream after attention
and after the MLP/MoE block, the router's logits with the top-k expert ids and gating weights it chose; the final
norm's output.

Forward hooks on the decoder layers, their ``post_attention_layernorm`` and the final norm (vLLM's fused
add-and-norm returns the residual stream as its second output), plus one wrap per MoE router of
``BaseRouter._select_experts`` (the single place every fused-MoE family computes its top-k ids and weights from the
logits), all on this worker's model object. Nothing changes what the model computes; nothing is recorded until
:func:`install`, and :func:`uninstall` removes every hook and wrap. State lives on the worker
(``worker._tim_align``), not in a global.

Rows are placed by the ``positions`` argument of each model forward, so a prefill split into chunks is
reassembled in position order. One sequence per forward (``tim align`` scores them one at a time, with the prefix
cache reset) keeps the rows of different sequences apart.
"""

from __future__ import annotations

import torch

from patches.guard import check_version
from patches.specs import vllm_patch

SPEC = vllm_patch(
    name="vllm-align-capture",
    reason="vLLM exposes no per-layer activations or router outputs of its model; tim align records them.",
    targets=(
        "vllm.model_executor.layers.fused_moe.router.base_router.BaseRouter._select_experts",
        "vllm.model_executor.models.*.model.layers[i].post_attention_layernorm",
    ),
)


class _Recorder:
    """What one worker records between :func:`begin` and :func:`end`."""

    def __init__(self, layer_of_router: dict[int, int]):
        self.layer_of_router = layer_of_router
        self.calls: list[dict] = []
        self.enabled = False

    def put(self, key: tuple, value: torch.Tensor) -> None:
        if self.enabled and self.calls:
            self.calls[-1][key] = value.detach().float().cpu().clone()


def _stream(output) -> torch.Tensor:
    """A decoder layer's output as the residual stream: vLLM returns (hidden, residual) unsummed."""
    if isinstance(output, tuple):
        hidden, residual = output[0], output[1]
        return hidden if residual is None else hidden + residual
    return output


def _install(worker) -> int:
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    model = worker.model_runner.model
    inner = model.model
    layers = list(inner.layers)
    runners = [m for m in model.modules() if isinstance(m, MoERunner)]
    rec = _Recorder({})
    handles: list = []
    wrapped: list = []
    worker._tim_align = (rec, handles, wrapped)  # filled as it goes: a failure part-way undoes what was done

    def pre_forward(_mod, args, kwargs):
        if rec.enabled:
            positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
            rec.calls.append({"positions": positions.detach().cpu().clone()})

    handles.append(model.register_forward_pre_hook(pre_forward, with_kwargs=True))
    for i, layer in enumerate(layers):

        def after_layer(_mod, _args, output, i=i):
            rec.put(("mlp", i), _stream(output))

        def after_attention(_mod, args, output, i=i):
            # fused add-and-norm: (normed, residual stream); plain norm: its input is the residual stream
            rec.put(("attention", i), output[1] if isinstance(output, tuple) else args[0])

        handles.append(layer.register_forward_hook(after_layer))
        handles.append(layer.post_attention_layernorm.register_forward_hook(after_attention))

    def after_norm(_mod, _args, output):
        rec.put(("final_norm", 0), output[0] if isinstance(output, tuple) else output)

    handles.append(inner.norm.register_forward_hook(after_norm))
    for mod in runners:
        router, layer = mod.router, mod.layer_id
        original = router._select_experts

        def select(hidden_states, router_logits, *args, layer=layer, original=original, **kwargs):
            weights, ids = original(hidden_states, router_logits, *args, **kwargs)
            rec.put(("router_logits", layer), router_logits)
            rec.put(("topk", layer), ids.to(torch.int64))
            rec.put(("gates", layer), weights)
            return weights, ids

        router._select_experts = select
        wrapped.append(router)
    return len(wrapped)


def _install_or_undo(worker) -> int:
    """:func:`_install`, leaving nothing behind when it fails part-way."""
    try:
        return _install(worker)
    except Exception:
        if hasattr(worker, "_tim_align"):
            _uninstall(worker)
        raise


def _uninstall(worker) -> None:
    _rec, handles, wrapped = worker._tim_align
    for h in handles:
        h.remove()
    for router in wrapped:
        del router._select_experts  # the instance attribute goes; the class's method is back
    del worker._tim_align


def _begin(worker) -> None:
    rec = worker._tim_align[0]
    rec.calls = []
    rec.enabled = True


def _end(worker) -> dict[tuple, torch.Tensor]:
    """Every recorded tensor of the sequence, rows in position order (row p: position p)."""
    rec = worker._tim_align[0]
    rec.enabled = False
    out: dict[tuple, list] = {}
    order: list[torch.Tensor] = []
    for call in rec.calls:
        positions = call.pop("positions")
        order.append(positions)
        n = positions.numel()
        for key, value in call.items():
            out.setdefault(key, []).append(value[:n])
    rec.calls = []
    if not order:
        return {}
    positions = torch.cat(order)
    rank = torch.argsort(positions)
    return {key: torch.cat(parts)[rank] for key, parts in out.items()}


def install(llm) -> int:
    """Hook the engine's model on every worker; returns the number of MoE routers wrapped."""
    check_version(SPEC)
    return llm.collective_rpc(_install_or_undo)[0]


def uninstall(llm) -> None:
    llm.collective_rpc(_uninstall)


def begin(llm) -> None:
    llm.collective_rpc(_begin)


def end(llm) -> dict[tuple, torch.Tensor]:
    """This rank's worker's record (every rank of a TP engine holds the full residual stream and router outputs)."""
    return llm.collective_rpc(_end)[0]
