"""A converted copy of an HF checkpoint, under one set of rules for every format (:mod:`.fp8_checkpoint`,
:mod:`.mxfp4_checkpoint`): the source's shards and side files are checked first (:mod:`.model_files`), the copy is
written shard by shard (one in memory at a time) into a temporary folder renamed into place at the end, every
tensor written is finite, and a failure leaves nothing behind, at the destination or beside it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tim_megatron.trainer.weights.model_files import INDEX, WeightLoadError, model_file, side_files


def rewrite_checkpoint(
    src,
    dst,
    *,
    config: Callable[[object, dict], None],
    tensors: Callable[[object, str, torch.Tensor], dict[str, torch.Tensor]],
) -> int:
    """Write a copy of the checkpoint ``src`` at ``dst`` (which must not exist). ``config(ck, cfg)`` checks the
    source (an :class:`~tim_megatron.trainer.weights.convert.HFCheckpoint`) and edits its config.json in place,
    before anything is written; ``tensors(ck, name, t)`` gives the tensors to write for source tensor ``name``
    (as ``ck.get`` reads it). Returns the number of tensors written."""
    import json
    import os
    import shutil
    import tempfile
    from pathlib import Path

    from safetensors.torch import save_file

    from tim_megatron.safe_files import write_atomic
    from tim_megatron.trainer.hf_config import read_hf_config
    from tim_megatron.trainer.weights.convert import HFCheckpoint

    src, dst = Path(src), Path(dst)
    if dst.exists() or dst.is_symlink():
        raise FileExistsError(f"{dst} already exists; refusing to overwrite it (pick another folder)")
    ck = HFCheckpoint(src)
    ck.check_files()
    sides = side_files(src, is_side_file)
    cfg = read_hf_config(model_file(src, "config.json", what="config"))
    config(ck, cfg)
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
                out.update(tensors(ck, name, ck.get(name)))
            for name, t in out.items():
                finite(name, t, ck.folder)
            save_file(out, tmp / shard, metadata={"format": "pt"})  # shard: a plain file name (read_index)
            weight_map.update(dict.fromkeys(out, shard))
        if len(shards) > 1 or model_file(src, INDEX, missing_ok=True) is not None:
            index = {"metadata": {}, "weight_map": weight_map}
            write_atomic(tmp / INDEX, json.dumps(index, indent=2), root=tmp, what="index")
        copy_side_files(sides, tmp, cfg)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return len(weight_map)


def is_side_file(name: str) -> bool:
    """What is copied beside the converted shards: everything but the weights, the index and the config."""
    return not name.endswith(".safetensors") and name not in ("config.json", INDEX)


def copy_side_files(sides: list, dst, cfg: dict) -> None:
    """The source's side files, and the edited config.json, into ``dst``."""
    import json

    from tim_megatron.safe_files import read_bytes, write_atomic

    for name, path in sides:
        write_atomic(dst / name, read_bytes(path, what="side file"), root=dst, what="side file")
    write_atomic(dst / "config.json", json.dumps(cfg, indent=2) + "\n", root=dst, what="config")


def finite(name: str, t: torch.Tensor, src) -> torch.Tensor:
    """``t``, once every value is finite (a bfloat16 cast can overflow; a source tensor can hold NaN)."""
    if t.is_floating_point():
        bad = ~torch.isfinite(t.float())
        if bool(bad.any()):
            raise WeightLoadError(
                f"{src}: tensor {name!r} would be written with {int(bad.sum())} non-finite value(s) (first at "
                f"{[int(i) for i in bad.nonzero()[0]]}); allowed: finite weights"
            )
    return t
