"""``tim export-hf``: a run's checkpoint as an HF checkpoint folder (safetensors, config, tokenizer)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

SHARD_BYTES = 4 * 2**30


def export_run(run_dir: Path, out: Path, *, dtype: str | None = None) -> Path:
    from safetensors.torch import save_file

    from tim_megatron.run_dir import load_run
    from tim_megatron.run_setup import model_path_for
    from tim_megatron.trainer.checkpoint import latest_good_checkpoint, load_checkpoint
    from tim_megatron.trainer.engine import MegatronTrainer

    loaded = load_run(run_dir)
    ckpt = latest_good_checkpoint(Path(run_dir) / "checkpoints")  # corrupt ones skipped, with a warning
    if ckpt is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoint to export (checkpoints/latest is missing)")
    src = model_path_for(loaded.recipe)
    tr = MegatronTrainer(loaded.recipe, model_path=src)
    meta = load_checkpoint(tr, ckpt)
    want = (
        {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        if dtype
        else None
    )
    shards, current, size, index = [], {}, 0, {}
    for name, t in tr.export_hf(dtype=want):
        if not tr.is_rank0:
            continue
        t = t.detach().contiguous().cpu().clone()
        if current and size + t.numel() * t.element_size() > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += t.numel() * t.element_size()
    if tr.is_rank0:
        shards.append(current)
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        names = (
            ["model.safetensors"]
            if len(shards) == 1
            else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        )
        for fname, shard in zip(names, shards, strict=True):
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            index.update({k: fname for k in shard})
        if len(shards) > 1:
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {}, "weight_map": index}, indent=1)
            )
        for f in Path(src).iterdir():
            if f.suffix in (".json", ".txt", ".model", ".jinja") and not f.name.startswith(
                "model.safetensors"
            ):
                shutil.copy(f, tmp / f.name)
        (tmp / "tim_export.json").write_text(
            json.dumps({"run_dir": str(run_dir), "checkpoint": str(ckpt), "step": meta["step"]}, indent=1)
        )
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    return out
