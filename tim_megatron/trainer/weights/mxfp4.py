"""MXFP4 checkpoints (gpt-oss-20b, gpt-oss-120b): read the format, dequantize, quantize, and write a bfloat16 copy.

The published format (``config.json``: ``quantization_config: {quant_method: mxfp4, modules_to_not_convert: [...]}``):
each expert projection of a layer, HF's ``model.layers.{L}.mlp.experts.gate_up_proj`` (``[experts, hidden,
2 x width]``) and ``...down_proj`` (``[experts, width, hidden]``), is stored as

* ``<name>_blocks``: ``uint8`` ``[experts, out, in / 32, 16]``, two e2m1 (FP4) codes per byte, the low nibble
  first: byte ``j`` of a block holds the block's values ``2 j`` (bits 0-3) and ``2 j + 1`` (bits 4-7); a code is a
  sign bit and three bits indexing ``0, 0.5, 1, 1.5, 2, 3, 4, 6``;
* ``<name>_scales``: ``uint8`` ``[experts, out, in / 32]``, one E8M0 scale per block of 32 values: ``2 ** (s - 127)``
  (``s = 255`` is E8M0's NaN);

and the weight is ``W[e, i, o] = value(code) * 2 ** (s - 127)`` with ``out`` and ``in`` swapped back (the stored
rows are output channels). Everything else (attention, router, embeddings, norms, the expert biases) is bfloat16.

:class:`~tim_megatron.trainer.weights.HFCheckpoint` reads an MXFP4 checkpoint as its dequantized weights (under the
unquantized names, :func:`logical_names`), as it reads block FP8; :mod:`.mxfp4_checkpoint` writes the bfloat16
copy that vLLM serves (``tim dequantize``: vLLM's CPU MXFP4 kernel needs AMX, and an engine serving FP4 weights
would sample from another model than the trainer trains). :func:`quantize` writes the format (tests build tiny
MXFP4 checkpoints with it).
"""

from __future__ import annotations

from typing import Any

import torch

BLOCKS_SUFFIX = "_blocks"
"""The FP4 codes of ``<name>`` are ``<name>_blocks``."""
SCALES_SUFFIX = "_scales"
"""Its per-block E8M0 scales are ``<name>_scales``."""
BLOCK = 32
"""Values per scale."""
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The value of each 4-bit e2m1 code (bit 3: the sign)."""
E8M0_BIAS = 127
E8M0_NAN = 255


def is_mxfp4(cfg: dict[str, Any]) -> bool:
    """Whether ``config.json`` says the checkpoint is MXFP4 (``quantization_config.quant_method: mxfp4``)."""
    q = cfg.get("quantization_config")
    return isinstance(q, dict) and q.get("quant_method") == "mxfp4"


def logical_names(stored: set[str] | dict[str, Any]) -> set[str]:
    """The tensor names of the unquantized model: ``<name>`` for each ``<name>_blocks`` (its scales dropped), the
    rest as they are."""
    out = set()
    for name in stored:
        if name.endswith(BLOCKS_SUFFIX):
            out.add(name.removesuffix(BLOCKS_SUFFIX))
        elif not (
            name.endswith(SCALES_SUFFIX) and name.removesuffix(SCALES_SUFFIX) + BLOCKS_SUFFIX in stored
        ):
            out.add(name)
    return out


def dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, *, name: str = "", dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``[..., out, in / 32, 16]`` codes and ``[..., out, in / 32]`` scales -> the ``[..., in, out]`` weight in
    ``dtype``. Exact: an e2m1 value times a power of two is a bfloat16 (or float32) number. A malformed pair, a NaN
    scale (255) or a result that is not finite in ``dtype`` is refused by name."""
    name = name or "tensor"
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"{name}: MXFP4 {name}{BLOCKS_SUFFIX} and {name}{SCALES_SUFFIX} must be uint8, got {blocks.dtype} and "
            f"{scales.dtype}"
        )
    if blocks.dim() < 3 or blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"{name}: MXFP4 blocks of shape {tuple(blocks.shape)} need the shape [..., out, in / {BLOCK}, "
            f"{BLOCK // 2}] and scales of their shape without the last dimension; got scales "
            f"{tuple(scales.shape)}"
        )
    bad = scales == E8M0_NAN
    if bool(bad.any()):
        at = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(
            f"{name}{SCALES_SUFFIX} holds {int(bad.sum())} E8M0 NaN scale(s) (255), the first at {at}; allowed: "
            "finite scales 0..254"
        )
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    low, high = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    values = torch.stack([low, high], -1).flatten(-2)  # [..., out, groups, 32]: low nibble first
    w = torch.ldexp(values, (scales.to(torch.int32) - E8M0_BIAS).unsqueeze(-1)).to(dtype)
    if not bool(torch.isfinite(w).all()):
        bad = ~torch.isfinite(w)
        raise ValueError(
            f"{name} (dequantized) holds {int(bad.sum())} non-finite value(s) in {dtype}, the first at "
            f"{[int(i) for i in bad.nonzero()[0]]}; allowed: scales whose products are finite in {dtype}"
        )
    return w.flatten(-2).transpose(-1, -2).contiguous()


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[..., in, out]`` weight as (codes, scales) in the layout :func:`dequantize` reads: each block of 32
    inputs gets the power of two that brings its largest magnitude to at most 6, and each value the nearest e2m1
    value (ties to the smaller magnitude). ``in`` must be a multiple of 32."""
    wt = w.float().transpose(-1, -2)  # [..., out, in]
    if wt.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs the input width ({wt.shape[-1]}) to be a multiple of {BLOCK}")
    groups = wt.reshape(*wt.shape[:-1], wt.shape[-1] // BLOCK, BLOCK)
    amax = groups.abs().amax(-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax))
    exp = exp.clamp(-E8M0_BIAS, E8M0_NAN - 1 - E8M0_BIAS)
    scaled = groups / torch.ldexp(torch.ones_like(exp), exp.to(torch.int32)).unsqueeze(-1)
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    code = (
        (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1)
    )  # the first of two equally near: smaller
    code = code + 8 * ((scaled < 0) & (code > 0))
    code = code.to(torch.uint8).reshape(*groups.shape[:-1], BLOCK // 2, 2)
    blocks = code[..., 0] | (code[..., 1] << 4)
    return blocks.contiguous(), (exp + E8M0_BIAS).to(torch.uint8).contiguous()
