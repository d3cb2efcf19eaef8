"""Reading an HF model folder that may come from elsewhere (a download, a copy, a folder someone else prepared).

Such a folder names its own files: its index names the shards to read, and ``tim dequantize`` and ``tim
export-hf`` copy its side files (tokenizer, chat template) into their output. So that the folder cannot choose
which of the reader's files are read or copied, nor block the reader:

* a file is read only when it is a regular file in the folder, or a link to a regular file inside the folder,
  or, in a Hugging Face hub snapshot (``.../models--ORG--NAME/snapshots/REV/``, whose every file is such a
  link), a link into that repository's own ``blobs/`` folder; FIFOs, devices, sockets and links anywhere else
  are refused by name (:func:`model_file`);
* the shards an index names are plain file names ending in ``.safetensors``: no folders, ``..`` or absolute
  paths (:func:`read_index`);
* a safetensors file's declared lengths (its header length, its tensors' data offsets) are checked against its
  size before the file is opened, so a truncated file is a named error (:func:`safetensors_names`).

The general primitives (open without following links or blocking, write inside a folder) are
:mod:`tim_megatron.safe_files`; this module is the model-folder policy built on them.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

from tim_megatron.safe_files import UnsafePathError, describe, open_regular, read_bytes, regular_file

INDEX = "model.safetensors.index.json"

MAX_INDEX_BYTES = 256 << 20
"""A trillion-parameter model's index is tens of MB; anything far larger is not an index."""

MAX_HEADER_BYTES = 100_000_000
"""safetensors' own limit on a header."""


class WeightLoadError(ValueError):
    """A checkpoint whose tensors cannot be loaded as they are; the message names the file or tensor."""


class ModelFolderError(UnsafePathError, WeightLoadError):
    """A model folder's file this project refuses to read: a link out of the folder, a special file, a shard
    name outside the folder. An :class:`UnsafePathError` and a :class:`WeightLoadError` both."""


def _hub_blobs(root: Path) -> Path | None:
    """``blobs/`` of the hub repository whose snapshot ``root`` (resolved) is, when it is a real folder."""
    snapshots, repo = root.parent, root.parent.parent
    if snapshots.name != "snapshots" or not repo.name.startswith("models--"):
        return None
    blobs = repo / "blobs"
    try:
        return blobs if stat.S_ISDIR(os.lstat(blobs).st_mode) else None
    except OSError:
        return None


def model_file(folder: str | os.PathLike, name: str, *, what: str = "file", missing_ok: bool = False):
    """The path to open for the file ``name`` of model folder ``folder``: the file itself, or what its link
    resolves to when that is allowed (see the module); ``None`` for a missing file with ``missing_ok``."""
    folder = Path(folder)
    shown = folder / name
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ModelFolderError(f"{what} {name!r} of {folder}: allowed: a file name in the folder")
    try:
        mode = os.lstat(shown).st_mode
    except FileNotFoundError:
        if missing_ok:
            return None
        raise FileNotFoundError(f"{what} {shown} is missing") from None
    if stat.S_ISREG(mode):
        return shown
    if not stat.S_ISLNK(mode):
        raise ModelFolderError(f"{what} {shown} is {describe(shown)}; allowed: a regular file")
    root = Path(os.path.realpath(folder))
    target = Path(os.path.realpath(shown))
    blobs = _hub_blobs(root)
    inside = target.is_relative_to(root) or (blobs is not None and target.is_relative_to(blobs))
    if inside and regular_file(target):
        return target
    leads = f"to {describe(target)}" if inside else f"outside {folder}"
    raise ModelFolderError(
        f"{what} {shown} is {describe(shown)}, which leads {leads}; allowed: a regular file in the folder, a "
        "link to one inside it, or a Hugging Face hub snapshot's link into its own blobs/"
    )


def side_files(folder: str | os.PathLike, keep: Callable[[str], bool]) -> list[tuple[str, Path]]:
    """``(name, path to read)`` of each file of ``folder`` whose name ``keep`` accepts, sorted; subfolders are
    skipped (never copied), and any other entry that :func:`model_file` refuses is refused by name."""
    folder = Path(folder)
    out = []
    for name in sorted(os.listdir(folder)):
        if not keep(name) or os.path.isdir(folder / name):
            continue
        out.append((name, model_file(folder, name, what="side file")))
    return out


def check_model_folder(folder: str | os.PathLike) -> None:
    """Every entry of ``folder`` but its subfolders is readable under :func:`model_file`'s rule (for readers,
    such as vLLM, that open the folder's files themselves)."""
    side_files(folder, lambda name: True)


def read_index(folder: str | os.PathLike, path: Path) -> dict[str, str]:
    """The ``weight_map`` of ``folder``'s index (read from ``path``): tensor name -> shard file name."""
    shown = Path(folder) / INDEX
    try:
        data = json.loads(read_bytes(path, what="index", max_bytes=MAX_INDEX_BYTES))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise WeightLoadError(f"{shown}: not a JSON index ({type(e).__name__}: {e})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise WeightLoadError(
            f"{shown}: allowed: a JSON object with a weight_map of tensor name -> shard file"
        )
    for tensor, shard in weight_map.items():
        if not (
            isinstance(shard, str)
            and shard.endswith(".safetensors")
            and shard == os.path.basename(shard)
            and shard not in (".", "..")
            and "\\" not in shard
            and "\0" not in shard
        ):
            raise ModelFolderError(
                f"{shown}: weight_map[{tensor!r}] = {shard!r}; allowed: the name of a .safetensors file in "
                f"{folder} (no folders, '..' or absolute paths)"
            )
    return weight_map


def safetensors_names(path: Path, *, shown: Path) -> set[str]:
    """The tensor names in the safetensors file at ``path`` (``shown`` in messages), after checking that its
    header length and its tensors' data offsets fit in the file."""
    with open_regular(path, what="weights file") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise WeightLoadError(
                f"{shown}: {size} bytes, too short for a safetensors file (8 bytes of header length first); "
                "truncated?"
            )
        n = int.from_bytes(head, "little")
        if n > size - 8 or n > MAX_HEADER_BYTES:
            raise WeightLoadError(
                f"{shown}: declares a header of {n} bytes, but {size - 8} bytes follow the length (allowed: at "
                f"most those, and at most {MAX_HEADER_BYTES}); the file is truncated or not safetensors"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise WeightLoadError(
            f"{shown}: its header is not JSON ({type(e).__name__}); not a safetensors file"
        ) from None
    if not isinstance(header, dict):
        raise WeightLoadError(f"{shown}: its header is not a JSON object; not a safetensors file")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise WeightLoadError(
                f"{shown}: tensor {name!r} has data_offsets {offsets!r}; not a safetensors file"
            )
        end = max(end, offsets[1])
    if end > size - 8 - n:
        raise WeightLoadError(
            f"{shown}: its header declares {end} bytes of tensor data, but the file holds {size - 8 - n}; the "
            "file is truncated"
        )
    return {k for k in header if k != "__metadata__"}
