"""Whole-checkpoint conversion between bf16/fp32 and DeepSeek-V3's block FP8 (the format: :mod:`.fp8`):
``tim dequantize`` and the tests' tiny FP8 checkpoints.

The source folder is read under :mod:`.model_files`' rule (its shards and side files are its own regular files,
checked before anything is converted), and every tensor written is finite: a conversion that would write a NaN or
an infinity stops, naming the tensor. Nothing is written outside the new folder, and a failed conversion leaves
nothing behind."""

from __future__ import annotations

import torch

from tim_megatron.trainer.weights.fp8 import SCALE_SUFFIX, quantizable, quantize
from tim_megatron.trainer.weights.model_files import INDEX, WeightLoadError, model_file, side_files


def _is_side_file(name: str) -> bool:
    """What is copied beside the converted shards: everything but the weights, the index and the config."""
    return not name.endswith(".safetensors") and name not in ("config.json", INDEX)


def _copy_side_files(sides: list, dst, cfg: dict) -> None:
    import json

    from tim_megatron.safe_files import read_bytes, write_atomic

    for name, path in sides:
        write_atomic(dst / name, read_bytes(path, what="side file"), root=dst, what="side file")
    write_atomic(dst / "config.json", json.dumps(cfg, indent=2) + "\n", root=dst, what="config")


def convert_checkpoint(src, dst, *, to: str, block: tuple[int, int] = (128, 128)) -> int:
    """Write a copy of the HF checkpoint ``src`` at ``dst`` (which must not exist): ``to="fp8"`` quantizes its
    linear weights in DeepSeek-V3's block-FP8 format; ``to="bfloat16"`` dequantizes a block-FP8 checkpoint (the
    form vLLM serves and the trainer trains). Every file of ``src`` is checked first; then shard by shard, into a
    temporary folder renamed into place at the end, so an interrupted conversion leaves nothing at ``dst``.
    Returns the number of tensors written."""
    import os
    import shutil
    import tempfile
    from pathlib import Path

    from tim_megatron.trainer.hf_config import read_hf_config
    from tim_megatron.trainer.weights.convert import HFCheckpoint

    if to not in ("fp8", "bfloat16"):
        raise ValueError(f"to = {to!r}: allowed: fp8, bfloat16")
    src, dst = Path(src), Path(dst)
    if dst.exists() or dst.is_symlink():
        raise FileExistsError(f"{dst} already exists; refusing to overwrite it (pick another folder)")
    ck = HFCheckpoint(src)
    ck.check_files()
    sides = side_files(src, _is_side_file)
    cfg = read_hf_config(model_file(src, "config.json", what="config"))
    if to == "fp8":
        if ck.fp8 is not None:
            raise ValueError(f"{src}: already block-FP8 (quantization_config is set)")
        cfg["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": list(block),
        }
    else:
        if ck.fp8 is None:
            raise ValueError(
                f"{src}: not a block-FP8 checkpoint (no quantization_config); nothing to dequantize"
            )
        cfg.pop("quantization_config")
        cfg["torch_dtype"] = "bfloat16"
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        n = _write_shards(
            ck, tmp, to=to, block=block, indexed=model_file(src, INDEX, missing_ok=True) is not None
        )
        _copy_side_files(sides, tmp, cfg)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing is left behind, at dst or beside it
        raise
    return n


def _finite(name: str, t: torch.Tensor, src) -> torch.Tensor:
    """``t``, once every value is finite (a bfloat16 cast can overflow; a source tensor can hold NaN)."""
    if t.is_floating_point():
        bad = ~torch.isfinite(t.float())
        if bool(bad.any()):
            raise WeightLoadError(
                f"{src}: tensor {name!r} would be written with {int(bad.sum())} non-finite value(s) (first at "
                f"{[int(i) for i in bad.nonzero()[0]]}); allowed: finite weights"
            )
    return t


def _write_shards(ck, out_dir, *, to: str, block: tuple[int, int], indexed: bool) -> int:
    """Each source shard converted into a shard of the same name in ``out_dir`` (one shard in memory at a time),
    and the index when the source has one or there are several."""
    import json

    from safetensors.torch import save_file

    from tim_megatron.safe_files import write_atomic

    shards: dict[str, list[str]] = {}
    for name in sorted(ck.keys()):
        shards.setdefault(ck.weight_map[name], []).append(name)
    weight_map: dict[str, str] = {}
    for shard, names in sorted(shards.items()):
        out: dict[str, torch.Tensor] = {}
        for name in names:
            t = ck.get(name)
            if to == "fp8" and quantizable(name, t):
                out[name], out[name + SCALE_SUFFIX] = quantize(t, block)
            elif to == "bfloat16" and name + SCALE_SUFFIX in ck.weight_map:  # dequantized by ck.get
                out[name] = t.to(torch.bfloat16)
            else:
                out[name] = t.contiguous()
        for name, t in out.items():
            _finite(name, t, ck.folder)
        save_file(out, out_dir / shard, metadata={"format": "pt"})  # shard: a plain file name (read_index)
        weight_map.update({k: shard for k in out})
    if len(shards) > 1 or indexed:
        index = {"metadata": {}, "weight_map": weight_map}
        write_atomic(out_dir / INDEX, json.dumps(index, indent=2), root=out_dir, what="index")
    return len(weight_map)
