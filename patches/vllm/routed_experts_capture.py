"""Capture the experts vLLM routes every token to, on the CPU build (for R3 routing replay).

vLLM's native capture (``enable_return_routed_experts``) needs Model Runner V2, hence Triton, hence a GPU.
On CPU this patch hooks the same place the native capture uses, ``BaseRouter.capture_fn`` (called with
the logical top-k ids right after routing), and wraps the model's ``forward`` to record, for every
forward step, which request and which position each row of the flattened batch belongs to (from the
model runner's ``input_batch.req_ids``, ``query_start_loc`` and the ``positions`` argument).

State lives on the worker object (``worker._tim_capture``), created by :func:`install` and dropped by
:func:`uninstall`; nothing is global. Capture costs nothing until installed.

Rows of a cached prompt prefix are never recomputed, so they are never captured; :func:`collect` returns
what was captured and the rollout engine fills such positions from the request that computed them.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from patches.guard import check_version
from patches.specs import vllm_patch

SPEC = vllm_patch(
    name="vllm-cpu-routed-experts-capture",
    reason="vLLM's routed-expert capture requires Model Runner V2 (Triton, GPU only).",
    targets=(
        "vllm.model_executor.layers.fused_moe.router.base_router.BaseRouter.capture_fn",
        "vllm.v1.worker.cpu_model_runner.CPUModelRunner.model.forward",
    ),
)


class _Capture:
    def __init__(self, num_layers: int, model_name: str):
        self.num_layers = num_layers
        self.model_name = model_name
        self.steps: list[dict] = []
        self.enabled = False

    def on_topk(self, moe_layer: int, topk_ids: torch.Tensor) -> None:
        if self.enabled and self.steps:
            self.steps[-1]["layers"][moe_layer] = topk_ids.to(torch.int16).cpu().clone()


def _install(worker, num_layers: int) -> int:
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    runner = worker.model_runner
    model = runner.model
    cap = _Capture(num_layers, type(model).__name__)
    runners = [mod for mod in model.modules() if isinstance(mod, MoERunner)]
    # Decoder layer ids of the MoE layers, in order: a model with leading dense layers (GLM-4.5) has MoE layers
    # 1..L-1, and the trainer numbers its routers 0..n-1 in the same order.
    order = {lid: i for i, lid in enumerate(sorted({mod.layer_id for mod in runners}))}
    if len(order) != len(runners):
        raise RuntimeError(
            f"routed-experts capture: {len(runners)} MoE runners share layer ids {sorted(order)}"
        )
    n = 0
    for mod in runners:
        idx = order[mod.layer_id]
        mod.router.set_capture_fn(lambda ids, idx=idx: cap.on_topk(idx, ids))
        n += 1
    orig = model.forward

    def forward(*args, **kwargs):
        if cap.enabled:
            positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
            ib = runner.input_batch
            k = ib.num_reqs
            qsl = runner.query_start_loc.cpu[: k + 1].clone()
            cap.steps.append(
                {
                    "req_ids": list(ib.req_ids[:k]),
                    "qsl": qsl,
                    "pos": positions.detach().cpu().clone(),
                    "layers": {},
                }
            )
        return orig(*args, **kwargs)

    model.forward = forward
    worker._tim_capture = (cap, orig)
    return n


def _model_name(worker) -> str:
    return type(worker.model_runner.model).__name__


def _uninstall(worker) -> None:
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    _cap, orig = worker._tim_capture
    model = worker.model_runner.model
    for mod in model.modules():
        if isinstance(mod, MoERunner):
            mod.router.set_capture_fn(None)
    model.forward = orig
    del worker._tim_capture


def _begin(worker) -> None:
    cap, _ = worker._tim_capture
    cap.steps = []
    cap.enabled = True


def _end(worker) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per internal request id: (positions [n], experts [n, layers, k]) sorted by position."""
    cap, _ = worker._tim_capture
    cap.enabled = False
    rows: dict[str, dict[int, np.ndarray]] = defaultdict(dict)
    for st in cap.steps:
        if len(st["layers"]) != cap.num_layers:
            raise RuntimeError(
                f"routed-experts capture saw {len(st['layers'])} of {cap.num_layers} MoE layers in a step of "
                f"{cap.model_name}: its MoE router does not report its top-k to the capture hook"
            )
        stacked = torch.stack(
            [st["layers"][i] for i in range(cap.num_layers)], 1
        ).numpy()  # [tokens, layers, k]
        pos = st["pos"].numpy()
        qsl = st["qsl"].tolist()
        for i, rid in enumerate(st["req_ids"]):
            for r in range(qsl[i], qsl[i + 1]):
                rows[rid][int(pos[r])] = stacked[r]
    cap.steps = []
    out = {}
    for rid, d in rows.items():
        p = np.array(sorted(d), dtype=np.int64)
        out[rid] = (p, np.stack([d[int(x)] for x in p]))
    return out


def install(llm, num_layers: int) -> int:
    """Hook every MoE router of the engine's model; returns the number of routers hooked."""
    check_version(SPEC)
    counts = llm.collective_rpc(_install, args=(num_layers,))
    if not counts or counts[0] != num_layers:
        name = llm.collective_rpc(_model_name)[0]
        uninstall(llm)
        raise RuntimeError(
            f"routed-experts capture hooked {counts} routers of {name}; the model has {num_layers} MoE layers"
        )
    return counts[0]


def uninstall(llm) -> None:
    llm.collective_rpc(_uninstall)


def begin(llm) -> None:
    llm.collective_rpc(_begin)


def end(llm) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return llm.collective_rpc(_end)[0]
