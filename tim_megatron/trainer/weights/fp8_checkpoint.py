"""Whole-checkpoint conversion between bf16/fp32 and DeepSeek-V3's block FP8 (the format: :mod:`.fp8`):
``tim dequantize`` and the tests' tiny FP8 checkpoints."""

from __future__ import annotations

import torch

from tim_megatron.trainer.weights.fp8 import SCALE_SUFFIX, quantizable, quantize


def _copy_side_files(src, dst, cfg: dict) -> None:
    import json
    import shutil
    from pathlib import Path

    src, dst = Path(src), Path(dst)
    for f in src.iterdir():
        if (
            f.is_file()
            and f.suffix != ".safetensors"
            and f.name not in ("config.json", "model.safetensors.index.json")
        ):
            shutil.copy2(f, dst / f.name)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def convert_checkpoint(src, dst, *, to: str, block: tuple[int, int] = (128, 128)) -> int:
    """Write a copy of the HF checkpoint ``src`` at ``dst`` (which must not exist): ``to="fp8"`` quantizes its
    linear weights in DeepSeek-V3's block-FP8 format; ``to="bfloat16"`` dequantizes a block-FP8 checkpoint (the
    form vLLM serves and the trainer trains). Shard by shard, into a temporary folder renamed into place at the end,
    so an interrupted conversion leaves nothing at ``dst``. Returns the number of tensors written."""
    import os
    import shutil
    import tempfile
    from pathlib import Path

    from tim_megatron.trainer.hf_config import read_hf_config
    from tim_megatron.trainer.weights.convert import HFCheckpoint

    if to not in ("fp8", "bfloat16"):
        raise ValueError(f"to = {to!r}: allowed: fp8, bfloat16")
    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise FileExistsError(f"{dst} already exists; refusing to overwrite it (pick another folder)")
    ck = HFCheckpoint(src)
    cfg = read_hf_config(src)
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
            ck, tmp, to=to, block=block, indexed=(src / "model.safetensors.index.json").exists()
        )
        _copy_side_files(src, tmp, cfg)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing is left behind, at dst or beside it
        raise
    return n


def _write_shards(ck, out_dir, *, to: str, block: tuple[int, int], indexed: bool) -> int:
    """Each source shard converted into a shard of the same name in ``out_dir`` (one shard in memory at a time),
    and the index when the source has one or there are several."""
    import json

    from safetensors.torch import save_file

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
        save_file(out, out_dir / shard, metadata={"format": "pt"})
        weight_map.update({k: shard for k in out})
    if len(shards) > 1 or indexed:
        index = {"metadata": {}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return len(weight_map)
