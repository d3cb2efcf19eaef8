"""Whole-checkpoint conversion between bf16/fp32 and gpt-oss's MXFP4 (the format: :mod:`.mxfp4`): ``tim dequantize``
and the tests' tiny MXFP4 checkpoints, under the same rules as :mod:`.fp8_checkpoint` (the source's files checked
first, every tensor written finite, nothing written outside the new folder, nothing left behind by a failure)."""

from __future__ import annotations

import torch

from tim_megatron.trainer.weights.mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX, quantize


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
    Every file of ``src`` is checked first; then shard by shard into a temporary folder renamed into place at the
    end, so an interrupted conversion leaves nothing at ``dst``; every tensor written is finite. Returns the number
    of tensors written."""
    import json
    import os
    import shutil
    import tempfile
    from pathlib import Path

    from safetensors.torch import save_file

    from tim_megatron.safe_files import write_atomic
    from tim_megatron.trainer.hf_config import read_hf_config
    from tim_megatron.trainer.weights.convert import HFCheckpoint
    from tim_megatron.trainer.weights.fp8_checkpoint import _copy_side_files, _finite, _is_side_file
    from tim_megatron.trainer.weights.model_files import INDEX, model_file, side_files

    if to not in ("bfloat16", "mxfp4"):
        raise ValueError(f"to = {to!r}: allowed: bfloat16, mxfp4")
    src, dst = Path(src), Path(dst)
    if dst.exists() or dst.is_symlink():
        raise FileExistsError(f"{dst} already exists; refusing to overwrite it (pick another folder)")
    ck = HFCheckpoint(src)
    ck.check_files()
    sides = side_files(src, _is_side_file)
    cfg = read_hf_config(model_file(src, "config.json", what="config"))
    if to == "bfloat16":
        if not ck.mxfp4:
            raise ValueError(
                f"{src}: not an MXFP4 checkpoint (quantization_config.quant_method is not mxfp4)"
            )
        cfg.pop("quantization_config")
        cfg["torch_dtype"] = "bfloat16"
    else:
        if ck.mxfp4 or ck.fp8 is not None:
            raise ValueError(f"{src}: already quantized (quantization_config is set)")
        cfg["quantization_config"] = {
            "modules_to_not_convert": MODULES_NOT_CONVERTED,
            "quant_method": "mxfp4",
        }
    shards: dict[str, list[str]] = {}
    for name in sorted(ck.keys()):
        shards.setdefault(ck.shard_of(name), []).append(name)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        weight_map: dict[str, str] = {}
        for shard, names in sorted(shards.items()):
            out: dict[str, torch.Tensor] = {}
            for name in names:
                t = ck.get(name)  # an MXFP4 pair comes dequantized
                if to == "mxfp4" and quantizable(name, t):
                    out[name + BLOCKS_SUFFIX], out[name + SCALES_SUFFIX] = quantize(t)
                elif to == "bfloat16" and ck.quantized(name):
                    out[name] = t.to(torch.bfloat16)
                else:
                    out[name] = t.contiguous()
            for name, t in out.items():
                _finite(name, t, ck.folder)
            save_file(out, tmp / shard, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(out, shard))
        if len(shards) > 1 or model_file(src, INDEX, missing_ok=True) is not None:
            index = {"metadata": {}, "weight_map": weight_map}
            write_atomic(tmp / INDEX, json.dumps(index, indent=2), root=tmp, what="index")
        _copy_side_files(sides, tmp, cfg)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing is left behind, at dst or beside it
        raise
    return len(weight_map)
