"""FP32 LM head on the Megatron side: the output-layer GEMM in float32 while the rest stays bf16/fp16.

megatron-core's ``Float16Module`` casts every parameter to the model dtype. After that wrap, this patch
turns ``GPTModel.output_layer.weight`` back into a float32 parameter (so its gradient buffer, optimizer
main copy and updates are float32 too), and the chunked head in ``tim_megatron.trainer.logprobs`` runs
``linear(hidden.float(), weight_fp32)``. With tied embeddings the head shares the embedding, which stays
in the model dtype; the head GEMM then runs on a float32 copy of it.

Apply it after ``Float16Module`` and before the DDP wrapper (which sizes its grad buffers by dtype).
"""

from __future__ import annotations

import torch

from patches.guard import Handle, PatchSpec, check_version

SPEC = PatchSpec(
    name="megatron-fp32-lm-head",
    library="megatron.core",
    distributions=("megatron-core",),
    verified="==0.16.*",
    reason="Float16Module casts the whole GPTModel, LM head included, to bf16/fp16.",
    targets=(
        "megatron.core.transformer.module.Float16Module",
        "megatron.core.models.gpt.GPTModel.output_layer",
    ),
)


def apply(model) -> Handle:
    """Make this model's (untied) LM-head weight a float32 parameter. Returns a handle that undoes it."""
    check_version(SPEC)
    from tim_megatron.trainer.model import unwrap

    gpt = unwrap(model)
    h = Handle(SPEC.name)
    if gpt.share_embeddings_and_output_weights:
        return h  # tied: the head GEMM upcasts the shared weight (HeadSpec.fp32)
    w = gpt.output_layer.weight
    old_dtype = w.dtype
    w.data = w.data.to(torch.float32)

    def undo():
        w.data = w.data.to(old_dtype)

    h.undo.append(undo)
    return h
