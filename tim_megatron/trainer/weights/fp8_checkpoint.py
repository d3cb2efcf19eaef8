"""Whole-checkpoint conversion between bf16/fp32 and DeepSeek-V3's block FP8 (the format: :mod:`.fp8`):
``tim dequantize`` and the tests' tiny FP8 checkpoints.

The source folder is read under :mod:`.model_files`' rule (its shards and side files are its own regular files,
checked before anything is converted), and every tensor written is finite: a conversion that would write a NaN or
an infinity stops, naming the tensor. Nothing is written outside the new folder, and a failed conversion leaves
nothing behind."""

from __future__ import annotations

import torch

from tim_megatron.trainer.weights.fp8 import SCALE_SUFFIX, quantizable, quantize
from tim_megatron.trainer.weights.rewrite import rewrite_checkpoint


def convert_checkpoint(src, dst, *, to: str, block: tuple[int, int] = (128, 128)) -> int:
    """Write a copy of the HF checkpoint ``src`` at ``dst`` (which must not exist): ``to="fp8"`` quantizes its
    linear weights in DeepSeek-V3's block-FP8 format; ``to="bfloat16"`` dequantizes a block-FP8 checkpoint (the
    form vLLM serves and the trainer trains). Written under :func:`~.rewrite.rewrite_checkpoint`'s rules (the
    source checked first, shard by shard into a folder renamed into place). Returns the number of tensors
    written."""
    if to not in ("fp8", "bfloat16"):
        raise ValueError(f"to = {to!r}: allowed: fp8, bfloat16")

    def config(ck, cfg: dict) -> None:
        if to == "fp8":
            if ck.fp8 is not None:
                raise ValueError(f"{ck.folder}: already block-FP8 (quantization_config is set)")
            cfg["quantization_config"] = {
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "quant_method": "fp8",
                "weight_block_size": list(block),
            }
        else:
            if ck.fp8 is None:
                raise ValueError(
                    f"{ck.folder}: not a block-FP8 checkpoint (no quantization_config); nothing to dequantize"
                )
            cfg.pop("quantization_config")
            cfg["torch_dtype"] = "bfloat16"

    def tensors(ck, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if to == "fp8" and quantizable(name, t):
            q, scale = quantize(t, block)
            return {name: q, name + SCALE_SUFFIX: scale}
        if to == "bfloat16" and name + SCALE_SUFFIX in ck.weight_map:  # dequantized by ck.get
            return {name: t.to(torch.bfloat16)}
        return {name: t.contiguous()}

    return rewrite_checkpoint(src, dst, config=config, tensors=tensors)
