"""Block-quantized FP8 checkpoints (DeepSeek-V3/R1, Kimi-K2): read the format, dequantize, and quantize.

The published format (``config.json``: ``quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size:
[128, 128], activation_scheme: dynamic}``): each quantized linear weight ``W`` of shape ``[rows, cols]`` is stored
as ``float8_e4m3fn`` under its own name, beside a float32 ``<name>_scale_inv`` of shape
``[ceil(rows / 128), ceil(cols / 128)]``; the weight is ``W[i, j] = q[i, j] * scale_inv[i // 128, j // 128]`` (the
last block of a row or column may be partial: ``[576, 7168]`` has ``[5, 56]`` scales). Embeddings, norms, the
router and its correction bias are stored unquantized.

:func:`dequantize` is what loading does (to float32, then the trainer's dtype); export and sync write the
trainer's own dtype, so nothing downstream sees FP8. :func:`quantize` writes the same format (tests build tiny
FP8 checkpoints with it; :mod:`.fp8_checkpoint` converts whole checkpoints). Any other ``quantization_config``
is refused by key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SCALE_SUFFIX = "_scale_inv"
"""The per-block scale tensor of ``<name>`` is ``<name>_scale_inv``."""

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
"""448: the largest finite float8_e4m3fn; a block's largest entry is scaled to it."""

E4M3_RELATIVE_ERROR = 2.0**-4
"""Rounding to e4m3 (3 mantissa bits) moves a normal value by at most half a unit in the last place: 1/16 of
its size. Values below e4m3's smallest normal (2^-6 of the block scale) round to a grid of step 2^-9 scales."""


class QuantizationConfigError(ValueError):
    """A ``quantization_config`` this project cannot load, named by key."""


@dataclass(frozen=True)
class BlockFP8:
    """The block-FP8 format of a checkpoint."""

    block: tuple[int, int]
    """``weight_block_size``: rows and columns of weight per scale."""


def block_fp8_of(cfg: dict[str, Any], *, where: str = "config.json") -> BlockFP8 | None:
    """The checkpoint's block-FP8 format from its ``config.json``, ``None`` when unquantized; a named error for a
    quantization this project does not load."""
    q = cfg.get("quantization_config")
    if q is None:
        return None
    allowed = "fp8 with fmt e4m3 and weight_block_size [rows, cols] (DeepSeek-V3 / Kimi-K2's block FP8), or no quantization_config"
    if not isinstance(q, dict):
        raise QuantizationConfigError(f"{where}: quantization_config = {q!r}: allowed: an object ({allowed})")
    method = q.get("quant_method")
    if method != "fp8":
        raise QuantizationConfigError(
            f"{where}: quantization_config.quant_method = {method!r} is not supported; allowed: {allowed}"
        )
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationConfigError(
            f"{where}: quantization_config.fmt = {fmt!r} is not supported; allowed: e4m3 (float8_e4m3fn)"
        )
    if q.get("scale_fmt") not in (None, "float32"):
        raise QuantizationConfigError(
            f"{where}: quantization_config.scale_fmt = {q.get('scale_fmt')!r} is not supported; allowed: float32 "
            "scales (no scale_fmt key)"
        )
    block = q.get("weight_block_size")
    if not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)
    ):
        raise QuantizationConfigError(
            f"{where}: quantization_config.weight_block_size = {block!r}: allowed: two integers >= 1 (block-wise "
            "FP8; per-tensor FP8 has no block size and is not supported)"
        )
    return BlockFP8(block=(block[0], block[1]))


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The ``_scale_inv`` shape of a ``[rows, cols]`` weight."""
    rows, cols = shape
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])


def _per_element(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    rows, cols = shape
    return scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def dequantize(
    q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], *, name: str = ""
) -> torch.Tensor:
    """``q * scale_inv`` per block, in float32. A non-finite scale, or a product that is not finite (a NaN
    among the FP8 values, a scale so large that float32 overflows), is refused by name: no weight is NaN or
    infinite."""
    name = name or "tensor"
    if q.dim() != 2 or tuple(scale_inv.shape) != scale_shape(tuple(q.shape), block):
        raise ValueError(
            f"{name}: an FP8 weight of shape {tuple(q.shape)} needs {SCALE_SUFFIX} of shape "
            f"{scale_shape(tuple(q.shape), block) if q.dim() == 2 else '(2-D weights only)'} for blocks {list(block)}, "
            f"got {tuple(scale_inv.shape)}"
        )
    scale_inv = scale_inv.float()
    _require_finite(scale_inv, f"{name}{SCALE_SUFFIX}", "finite scales")
    w = q.float() * _per_element(scale_inv, tuple(q.shape), block)
    _require_finite(w, f"{name} (dequantized)", "FP8 values and scales whose products are finite in float32")
    return w


def _require_finite(t: torch.Tensor, name: str, allowed: str) -> None:
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        at = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(
            f"{name} holds {int(bad.sum())} non-finite value(s), the first {float(t[tuple(at)])} at {at}; "
            f"allowed: {allowed}"
        )


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[rows, cols]`` weight as (``float8_e4m3fn`` values, float32 ``scale_inv``): each block's largest
    magnitude maps to 448, as DeepSeek's own conversion does. An all-zero block gets scale 1."""
    w = w.float()
    rows, cols = w.shape
    br, bc = scale_shape((rows, cols), block)
    padded = torch.zeros(br * block[0], bc * block[1])
    padded[:rows, :cols] = w
    amax = padded.abs().reshape(br, block[0], bc, block[1]).amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (w / _per_element(scale_inv, (rows, cols), block)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale_inv


def block_error_bound(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Per element, the most that quantizing ``w`` with :func:`quantize` can move it: 1/16 of the value
    (rounding a normal e4m3 number), and at least half of e4m3's subnormal step (2^-10 of the block's scale)."""
    _, scale_inv = quantize(w, block)
    scale = _per_element(scale_inv, tuple(w.shape), block)
    return torch.maximum(w.float().abs() * E4M3_RELATIVE_ERROR, scale * 2.0**-10)


_UNQUANTIZED = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight")
"""What DeepSeek-V3's FP8 release keeps unquantized: embeddings, the head, every norm, the router."""


def quantizable(name: str, t: torch.Tensor) -> bool:
    """A linear weight of the kind the published block-FP8 checkpoints store in FP8."""
    return t.dim() == 2 and name.endswith(".weight") and not any(k in name for k in _UNQUANTIZED)
