"""``tim export-hf``: a run's checkpoint as an HF checkpoint folder (safetensors, config, tokenizer).

The export never deletes what it did not create. ``OUT`` must be absent or empty; with ``overwrite`` it may
also be an earlier export (a folder holding ``tim_export.json``), which is replaced. A folder that holds the
run, or lies inside it outside an earlier export, is refused in every case. The model folder's config and
tokenizer files are copied only when they are its own regular files (a link out of it or a FIFO is refused by
name). Everything is checked before the model loads. The export is written into a fresh temporary sibling of
``OUT`` and renamed into place, so an interrupted export leaves ``OUT`` as it was.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

import torch

from tim_megatron.safe_files import read_bytes, write_atomic

SHARD_BYTES = 4 * 2**30
MARKER = "tim_export.json"
"""The file every export writes: an existing ``OUT`` holding it was made by ``tim export-hf``."""


class ExportError(ValueError):
    """An output folder the export may not write; the message names it, why, and what to do."""


def check_out(run_dir: Path, out: Path, *, overwrite: bool) -> Path:
    """The absolute folder to export into, after refusing any ``out`` whose replacement would lose data."""
    run = Path(run_dir).resolve()
    target = Path(out).expanduser().resolve()
    if target == run or run.is_relative_to(target):
        raise ExportError(
            f"OUT {out} {'is' if target == run else 'holds'} the run folder {run_dir}: exporting there would "
            f"delete the run. Choose a new folder, e.g. {Path(run_dir) / 'hf'}, or a path outside the run."
        )
    if target.is_relative_to(run / "checkpoints"):
        raise ExportError(
            f"OUT {out} lies inside the run's checkpoints; choose a folder outside checkpoints/"
        )
    if target.exists() and not target.is_dir():
        raise ExportError(f"OUT {out} is a file, not a folder; choose a new folder")
    if target.is_dir() and any(target.iterdir()):
        if not (target / MARKER).is_file():
            raise ExportError(
                f"OUT {out} exists and is not empty, and it is not an earlier export (no {MARKER}): nothing "
                "is deleted. Choose a new or empty folder."
            )
        if not overwrite:
            raise ExportError(
                f"OUT {out} holds an earlier export; pass --overwrite to replace it, or choose a new folder"
            )
    return target


def export_run(
    run_dir: Path,
    out: Path,
    *,
    dtype: str | None = None,
    overwrite: bool = False,
    trust_unverified: bool = False,
) -> Path:
    from tim_megatron.run_dir import load_run
    from tim_megatron.run_setup import model_path_for
    from tim_megatron.trainer.checkpoint import latest_good_checkpoint, load_checkpoint
    from tim_megatron.trainer.megatron_trainer import MegatronTrainer

    target = check_out(run_dir, out, overwrite=overwrite)
    loaded = load_run(run_dir)
    ckpt = latest_good_checkpoint(Path(run_dir) / "checkpoints", trust_unverified=trust_unverified)
    if ckpt is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoint to export (checkpoints/latest is missing)")
    src = model_path_for(loaded.recipe)
    _side_files(Path(src))  # its files are checked before the model loads
    tr = MegatronTrainer.of_run(loaded.recipe, model_path=src)
    meta = load_checkpoint(tr, ckpt)
    want = (
        {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        if dtype
        else None
    )
    shards, current, size = [], {}, 0
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
        check_out(
            run_dir, out, overwrite=overwrite
        )  # again: the folder may have changed while the model loaded
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = _sibling(target, "export")
        try:
            _write(
                tmp,
                shards,
                src=Path(src),
                info={"run_dir": str(run_dir), "checkpoint": str(ckpt), "step": meta["step"]},
            )
            _publish(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _sibling(target: Path, kind: str) -> Path:
    """A new, uniquely named folder beside ``target`` (mode from the umask, like any folder the user makes)."""
    while True:
        p = target.parent / f".{target.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            p.mkdir()
            return p
        except FileExistsError:
            continue


def _write(tmp: Path, shards: list[dict], *, src: Path, info: dict) -> None:
    from safetensors.torch import save_file

    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    index = {}
    for fname, shard in zip(names, shards, strict=True):
        save_file(shard, str(tmp / fname), metadata={"format": "pt"})
        index.update({k: fname for k in shard})
    if len(shards) > 1:
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": index}, indent=1)
        )
    for name, path in _side_files(src):
        write_atomic(tmp / name, read_bytes(path, what="side file"), root=tmp, what="side file")
    (tmp / MARKER).write_text(json.dumps(info, indent=1))


def _side_files(src: Path) -> list[tuple[str, Path]]:
    """The model folder's config and tokenizer files that an export carries, each a regular file of the folder
    (:mod:`tim_megatron.trainer.weights.model_files`): a link out of it, or a FIFO, is refused by name."""
    from tim_megatron.trainer.weights.model_files import side_files

    return side_files(
        src,
        lambda n: (
            Path(n).suffix in (".json", ".txt", ".model", ".jinja") and not n.startswith("model.safetensors")
        ),
    )


def _publish(tmp: Path, target: Path) -> None:
    """Rename ``tmp`` to ``target``; an earlier export there (already checked) is moved aside, then removed."""
    old = None
    if target.exists():
        old = _sibling(target, "old")
        os.replace(target, old / target.name)
    os.replace(tmp, target)
    if old is not None:
        shutil.rmtree(old)
