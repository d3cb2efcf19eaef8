"""No checkpoint file may run code: every pickle in a checkpoint folder is checked before a library reads it.

A checkpoint folder can come from elsewhere (a copied run, a shared file system). Checksums prove that its
files are the ones written, not who wrote them: whoever can write the folder can recompute them. Unpickling
runs whatever callables a pickle names, so every pickled object in the folder is read here first with a
loader that allows only plain data, and a file that names anything else is refused:

* ``.metadata`` (torch.distributed.checkpoint's index, which torch reads with plain ``pickle.load``): only the
  index's own dataclasses, ``torch.Size``, dtypes and the layout helper may appear (:data:`METADATA_GLOBALS`).
* The index's byte items (non-tensor objects stored inside ``*.distcp``, which torch's load planner reads with
  ``torch.load`` with ``weights_only`` off): each is read with ``torch.load(weights_only=True)``.
* Every ``*.pt`` file (megatron's ``common.pt``, sharded objects, RNG files of older checkpoints): read with
  ``torch.load(weights_only=True)``; RNG files also admit numpy arrays (:data:`NUMPY_GLOBALS`).
* Tensor items are read by torch with ``weights_only=True`` already; items stored with a transform
  (compression, encryption) are refused, since this project never writes them.

Before any of that, the folder may hold only regular files and real folders (:func:`special_entries`): a FIFO
would block every reader forever, a device would never end, and a link would let the folder's author pick
which of the reader's files gets read. Every index item's declared offset and length (tensors' too) are
checked against its data file's size before anything is read (:func:`_item_range`), so an index cannot ask for
a petabyte.

After the scan, megatron-core and torch read the same bytes with their own loaders, so they can only build
what the scan allowed. What stays trusted: the installed libraries, and a folder that is not changed while a
load is in progress.
"""

from __future__ import annotations

import io
import os
import pickle
import stat
from pathlib import Path

import numpy as np
import torch

from tim_megatron.safe_files import UnsafePathError, describe, open_regular

METADATA_GLOBALS = frozenset(
    {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        *(
            ("torch", name)
            for name in ("bfloat16", "float16", "float32", "float64", "int64", "int32", "uint8")
        ),
        *(("torch", name) for name in ("int8", "int16", "bool", "float8_e4m3fn", "float8_e5m2")),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        *(
            ("torch.distributed.checkpoint.metadata", name)
            for name in (
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        *(
            ("torch.distributed.checkpoint.planner", name)
            for name in ("SavePlan", "TensorWriteData", "WriteItem", "WriteItemType")
        ),
    }
)
"""(module, name) pairs a ``.metadata`` file may name: what torch.distributed.checkpoint writes, nothing that
runs code."""

NUMPY_GLOBALS = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
"""What an RNG file of an older checkpoint needs beyond tensors: numpy's array reconstruction (numpy's own
generator state is an array of uint32)."""

MAX_METADATA_BYTES = 256 * 2**20
"""A ``.metadata`` index larger than this is refused before it is read (the 30B model's is a few MB)."""
MAX_ITEM_BYTES = 256 * 2**20
"""A byte item (a non-tensor object in a ``*.distcp`` file: common state, a few kB) declaring more is refused
before it is read."""


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file names a callable or type that plain data does not need: it could run code."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in METADATA_GLOBALS:
            raise UnsafeCheckpointError(f"it names {module}.{name}, which a checkpoint index never holds")
        return super().find_class(module, name)


def special_entries(folder: str | Path) -> list[str]:
    """``"<relative path>: <what it is>"`` for every entry under ``folder`` that is neither a regular file nor a
    real folder (a link, FIFO, socket or device), found without following links or opening anything."""
    folder = Path(folder)
    found = []
    for here, dirs, files in os.walk(folder):  # os.walk does not descend into linked folders
        for name in sorted(dirs + files):
            p = Path(here) / name
            try:
                mode = os.lstat(p).st_mode
            except FileNotFoundError:
                continue
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                found.append(f"{p.relative_to(folder)}: {describe(p)}")
    return sorted(found)


def read_metadata(path: Path):
    """Unpickle a torch.distributed.checkpoint ``.metadata`` file, allowing only :data:`METADATA_GLOBALS`."""
    try:
        f = open_regular(path, max_bytes=MAX_METADATA_BYTES, what="checkpoint index")
    except UnsafePathError as e:
        raise UnsafeCheckpointError(str(e)) from None
    with f:
        try:
            return _MetadataUnpickler(f).load()
        except UnsafeCheckpointError:
            raise
        except Exception as e:  # a truncated or garbled index: not loadable, whatever it is
            raise UnsafeCheckpointError(f"unreadable ({type(e).__name__}: {e})") from None


def load_plain(source, *, numpy: bool = False):
    """``torch.load`` with ``weights_only=True`` (numpy arrays allowed if ``numpy``); refusals re-raised as
    :class:`UnsafeCheckpointError` naming what was refused."""
    try:
        with torch.serialization.safe_globals(NUMPY_GLOBALS if numpy else []):
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        named = next((line.strip() for line in first if "GLOBAL" in line or "Unsupported" in line), None)
        raise UnsafeCheckpointError(named or "it holds objects that plain data does not need") from None
    except Exception as e:
        raise UnsafeCheckpointError(f"unreadable ({type(e).__name__}: {e})") from None


def scan_checkpoint(folder: str | Path) -> list[str]:
    """Every file of ``folder`` that would let a load run code, with the reason (empty: safe to load)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    folder = Path(folder)
    problems = [f"{p} (a checkpoint holds only regular files and folders)" for p in special_entries(folder)]
    if problems:  # nothing else is opened: a FIFO would block the reader
        return problems
    for pt in sorted(folder.rglob("*.pt")):
        try:
            load_plain(pt, numpy=pt.parent.name == "rng")
        except UnsafeCheckpointError as e:
            problems.append(f"{pt.relative_to(folder)}: {e}")
    for index in sorted(folder.glob("*.metadata")):
        try:
            md = read_metadata(index)
            if not hasattr(md, "state_dict_metadata") or not isinstance(md.storage_data, dict):
                raise UnsafeCheckpointError(f"not a checkpoint index ({type(md).__name__})")
        except UnsafeCheckpointError as e:
            problems.append(f"{index.name}: {e}")
            continue
        problems += _scan_items(folder, md, BytesStorageMetadata)
    return problems


def _scan_items(folder: Path, md, bytes_type) -> list[str]:
    problems = []
    root = folder.resolve()
    sizes: dict[Path, int] = {}
    for key, info in md.storage_data.items():
        fqn = getattr(key, "fqn", str(key))
        if getattr(info, "transform_descriptors", None):
            problems.append(
                f"{fqn}: stored with transforms {info.transform_descriptors} (never written here)"
            )
            continue
        target = (folder / str(info.relative_path)).resolve()
        if not target.is_relative_to(root):
            problems.append(f"{fqn}: its data file {info.relative_path!r} lies outside the checkpoint")
            continue
        is_bytes = isinstance(md.state_dict_metadata.get(fqn), bytes_type)
        try:
            # every item's range, tensors' too: torch reads what the index declares
            if target not in sizes:
                with open_regular(target, what="checkpoint data file") as f:
                    sizes[target] = os.fstat(f.fileno()).st_size
            offset, length = _item_range(info, sizes[target], limit=MAX_ITEM_BYTES if is_bytes else None)
            if is_bytes:  # a tensor is read by torch with weights_only=True
                load_plain(io.BytesIO(_read_item(target, offset, length)))
        except (OSError, ValueError, TypeError, OverflowError) as e:
            problems.append(f"{fqn}: unreadable ({e})")
        except UnsafeCheckpointError as e:
            problems.append(f"{fqn} (in {info.relative_path}): {e}")
    return problems


def _item_range(info, size: int, *, limit: int | None) -> tuple[int, int]:
    """An index item's ``(offset, length)``, refused unless it lies inside its data file of ``size`` bytes (and,
    with ``limit``, is no longer than that)."""
    offset, length = int(info.offset), int(info.length)
    if offset < 0 or length < 0 or offset + length > size:
        raise UnsafeCheckpointError(
            f"declares bytes {offset}..{offset + length} of {info.relative_path!r}, which has {size} bytes; "
            "allowed: a range inside the file"
        )
    if limit is not None and length > limit:
        raise UnsafeCheckpointError(
            f"declares {length} bytes; allowed: at most {limit} for a non-tensor item (MAX_ITEM_BYTES)"
        )
    return offset, length


def _read_item(target: Path, offset: int, length: int) -> bytes:
    with open_regular(target, what="checkpoint data file") as f:
        f.seek(offset)
        blob = f.read(length)
    if len(blob) != length:
        raise UnsafeCheckpointError(f"{target.name} ended after {len(blob)} of {length} bytes")
    return blob
