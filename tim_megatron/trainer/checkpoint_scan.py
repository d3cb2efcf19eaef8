"""No checkpoint file may run code: every pickle in a checkpoint folder is checked before a library reads it.

A checkpoint folder can come from elsewhere (a copied run, a shared file system). Checksums prove that its
files are the ones written, not who wrote them: whoever can write the folder can recompute them. Unpickling
runs whatever callables a pickle names, so every pickled object in the folder is read here first with a
loader that allows only plain data, and a file that names anything else is refused:

* ``.metadata`` (torch.distributed.checkpoint's index, which torch reads with plain ``pickle.load``): only the
  index's own dataclasses, ``torch.Size``, dtypes and the layout helper may appear (:data:`METADATA_GLOBALS`).
* The index's byte items (non-tensor objects stored inside ``*.distcp``, which torch's load planner reads with
  ``torch.load(weights_only=False)``): each is read with ``torch.load(weights_only=True)``.
* Every ``*.pt`` file (megatron's ``common.pt``, sharded objects, RNG files of older checkpoints): read with
  ``torch.load(weights_only=True)``; RNG files also admit numpy arrays (:data:`NUMPY_GLOBALS`).
* Tensor items are read by torch with ``weights_only=True`` already; items stored with a transform
  (compression, encryption) are refused, since this project never writes them.

After the scan, megatron-core and torch read the same bytes with their own loaders, so they can only build
what the scan allowed. What stays trusted: the installed libraries, and a folder that is not changed while a
load is in progress.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import numpy as np
import torch

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


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file names a callable or type that plain data does not need: it could run code."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in METADATA_GLOBALS:
            raise UnsafeCheckpointError(f"it names {module}.{name}, which a checkpoint index never holds")
        return super().find_class(module, name)


def read_metadata(path: Path):
    """Unpickle a torch.distributed.checkpoint ``.metadata`` file, allowing only :data:`METADATA_GLOBALS`."""
    if path.stat().st_size > MAX_METADATA_BYTES:
        raise UnsafeCheckpointError(f"{path.stat().st_size} bytes, more than {MAX_METADATA_BYTES}")
    with open(path, "rb") as f:
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
    problems = []
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
        if not isinstance(md.state_dict_metadata.get(fqn), bytes_type):
            continue  # a tensor: torch reads it with weights_only=True
        try:
            with open(target, "rb") as f:
                f.seek(int(info.offset))
                blob = f.read(int(info.length))
            load_plain(io.BytesIO(blob))
        except (OSError, ValueError) as e:
            problems.append(f"{fqn}: unreadable ({e})")
        except UnsafeCheckpointError as e:
            problems.append(f"{fqn} (in {info.relative_path}): {e}")
    return problems
