"""Re-prepack CPU MoE expert weights after an in-place weight reload (vLLM CPU backend).

The bug (vLLM 0.32, CPU): ``UnquantizedFusedMoEMethod._setup_kernel`` calls the experts' own
``process_weights_after_loading`` (which VNNI-prepacks ``w13_weight``/``w2_weight`` for the CPU
grouped-GEMM kernel) only on the first load. On later loads, the RL weight-update path
(``reload_weights``) copies the new weights in checkpoint layout into the parameters and skips the prepack,
so the CPU kernel reads raw weights as if they were packed. No error is raised; every MoE layer computes
garbage. Observed here: reloading the unchanged checkpoint moved logprobs by up to 7 nats.

The fix runs the skipped prepack for every CPU-experts MoE layer right after a reload. It is applied
by the rollout engine after each ``reload_weights``, and every weight sync is then verified against the
trainer's logprobs, which would catch a double prepack as loudly as a missing one.
"""

from __future__ import annotations

from patches.guard import check_version
from patches.specs import vllm_patch

SPEC = vllm_patch(
    name="vllm-cpu-moe-reload-prepack",
    reason="in-place reload skips the CPU MoE VNNI prepack (UnquantizedFusedMoEMethod._setup_kernel, is_weight_update).",
    targets=(
        "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method.UnquantizedFusedMoEMethod._setup_kernel",
        "vllm.model_executor.layers.fused_moe.experts.cpu_moe.CPUExperts.process_weights_after_loading",
    ),
)


def _cpu_experts_layers(model):
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    for mod in model.modules():
        qm = getattr(mod, "quant_method", None)
        if isinstance(qm, UnquantizedFusedMoEMethod) and getattr(qm, "moe_kernel", None) is not None:
            experts = qm.moe_kernel.fused_experts
            if type(experts).__module__.endswith("experts.cpu_moe"):
                yield mod, experts


def _reprepack(worker) -> int:
    n = 0
    for layer, experts in _cpu_experts_layers(worker.model_runner.model):
        experts.process_weights_after_loading(layer)
        n += 1
    return n


def needed() -> bool:
    import torch

    return not torch.cuda.is_available()


def after_reload(llm) -> int:
    """Prepack every CPU MoE layer's freshly reloaded weights; returns the number of layers fixed."""
    check_version(SPEC)
    return llm.collective_rpc(_reprepack)[0]
