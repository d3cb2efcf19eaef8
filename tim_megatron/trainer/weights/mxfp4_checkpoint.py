"""Whole-checkpoint conversion between bf16/fp32 and gpt-oss's MXFP4 (the format: :mod:`.mxfp4`): ``tim dequantize``
and the tests' tiny MXFP4 checkpoints, under the same rules as :mod:`.fp8_checkpoint` (the source's files checked
first, every tensor written finite, nothing written outside the new folder, nothing left behind by a failure)."""

from __future__ import annotations

import torch

from tim_megatron.trainer.weights.mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX, quantize
from tim_megatron.trainer.weights.rewrite import rewrite_checkpoint


def quantizable(name: str, t: torch.Tensor) -> bool:
    """What gpt-oss's MXFP4 release stores in MXFP4: the experts' two fused projection weights."""
    return t.dim() == 3 and name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))


MODULES_NOT_CONVERTED = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
]
"""The published ``quantization_config.modules_to_not_convert``."""


def convert_checkpoint(src, dst, *, to: str) -> int:
    """Write a copy of the HF checkpoint ``src`` at ``dst`` (which must not exist): ``to="bfloat16"`` dequantizes an
    MXFP4 checkpoint (``tim dequantize``), ``to="mxfp4"`` quantizes the experts of a gpt-oss checkpoint (tests).
    Written under :func:`~.rewrite.rewrite_checkpoint`'s rules. Returns the number
    of tensors written."""
    if to not in ("bfloat16", "mxfp4"):
        raise ValueError(f"to = {to!r}: allowed: bfloat16, mxfp4")

    def config(ck, cfg: dict) -> None:
        if to == "bfloat16":
            if not ck.mxfp4:
                raise ValueError(
                    f"{ck.folder}: not an MXFP4 checkpoint (quantization_config.quant_method is not mxfp4)"
                )
            cfg.pop("quantization_config")
            cfg["torch_dtype"] = "bfloat16"
        else:
            if ck.mxfp4 or ck.fp8 is not None:
                raise ValueError(f"{ck.folder}: already quantized (quantization_config is set)")
            cfg["quantization_config"] = {
                "modules_to_not_convert": MODULES_NOT_CONVERTED,
                "quant_method": "mxfp4",
            }

    def tensors(ck, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:  # an MXFP4 pair comes dequantized
        if to == "mxfp4" and quantizable(name, t):
            blocks, scales = quantize(t)
            return {name + BLOCKS_SUFFIX: blocks, name + SCALES_SUFFIX: scales}
        if to == "bfloat16" and ck.quantized(name):
            return {name: t.to(torch.bfloat16)}
        return {name: t.contiguous()}

    return rewrite_checkpoint(src, dst, config=config, tensors=tensors)
