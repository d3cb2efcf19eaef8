"""Checkpoints: megatron-core distributed checkpointing of model and optimizer, plus RNG and loop state.

Layout under a run's ``checkpoints/`` folder::

    step_00000012/          one complete checkpoint (megatron dist-checkpoint files, rng/, state.json)
    latest                  text file naming the newest complete step folder

A checkpoint is written into ``.tmp_step_<N>/`` and renamed to ``step_<N>/`` only after every rank has
finished, then ``latest`` is replaced atomically. A crash at any point leaves the previous checkpoint
and ``latest`` untouched. Old checkpoints beyond ``keep`` are deleted only after the new one is in place.

Every file of a checkpoint has its sha256 and size in ``checksums.json``, written last (the ranks hash
shares of the files in parallel). Loading verifies them first: :func:`latest_good_checkpoint` skips a
corrupt or truncated checkpoint with a warning and takes the newest good one, so flipped bits never load
silently. ``state.json`` records that checksums were written, so a checkpoint whose ``checksums.json`` was
deleted counts as corrupt; one written before checksums existed loads only when the caller trusts it
(``--trust-unverified``). ``state.json`` also records the model dimensions, checked before any tensor is read.

Nothing in a checkpoint can run code when loaded: the RNG state is tensors plus JSON (``rng/rank<N>.safetensors``),
and every pickle that megatron-core or torch would read is checked first (:mod:`.checkpoint_scan`).

A checkpoints folder can come from elsewhere, so a checkpoint is read only when it holds regular files and real
folders alone (a FIFO would block the load forever, a link would read someone else's file): anything else is
refused by name (:func:`refuse_special`) before any file is opened. Writing never follows a link: ``latest`` is
replaced by an atomic rename, and a link where a step folder goes is removed, not followed.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from patches.megatron.cpu_shims import cuda_placement_to_cpu
from tim_megatron.integrity import IntegrityWarning, sha256_file
from tim_megatron.safe_files import describe, read_text, regular_file, write_atomic
from tim_megatron.trainer.checkpoint_scan import scan_checkpoint, special_entries
from tim_megatron.trainer.experts import bucket_resume_problem

LATEST = "latest"
CHECKSUMS = "checksums.json"
CHECKSUMS_KEY = "checksums"
"""The key in ``state.json`` that says the checkpoint's files have checksums."""
MAX_JSON_BYTES = 64 * 2**20
"""Largest ``state.json`` or ``checksums.json`` read (the 30B model's checksums take a few MB)."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names it, the cause and the fix."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` (a link there is replaced, never written through)."""
    write_atomic(path, text)


def _read_json(path: Path):
    return json.loads(read_text(path, max_bytes=MAX_JSON_BYTES, what="checkpoint file"))


def refuse_special(folder: str | Path) -> None:
    """:class:`CheckpointError` naming every entry of checkpoint ``folder`` that is not a regular file or a real
    folder (a FIFO, socket, device or link), found without opening anything."""
    folder = Path(folder)
    if folder.is_symlink() or not folder.is_dir():
        raise CheckpointError(f"checkpoint {folder} is {describe(folder)}; allowed: a real folder")
    found = special_entries(folder)
    if found:
        raise CheckpointError(
            f"checkpoint {folder} refused: {'; '.join(found[:4])}"
            + (f" and {len(found) - 4} more" if len(found) > 4 else "")
            + ". A checkpoint holds only regular files and folders; nothing in it was read."
        )


def _refuse_special_marker(root: Path) -> None:
    marker = root / LATEST
    if os.path.lexists(marker) and not regular_file(marker):
        raise CheckpointError(
            f"{marker} is {describe(marker)}; allowed: a regular file naming the newest step folder"
        )


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoint folders, newest first (the one ``latest`` names leads)."""
    root = Path(root)
    if not root.exists():
        return []
    done = sorted((p for p in root.glob("step_*") if (p / "state.json").exists()), reverse=True)
    marker = root / LATEST
    try:  # a link or FIFO there is not read (latest_good_checkpoint refuses it by name)
        named = root / read_text(marker, max_bytes=4096).strip() if marker.exists() else None
    except (OSError, UnicodeDecodeError, ValueError):
        named = None
    if named in done:
        done.remove(named)
        done.insert(0, named)
    return done


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint folder, or None (unverified: see :func:`latest_good_checkpoint`)."""
    done = complete_checkpoints(root)
    return done[0] if done else None


def _files(folder: Path) -> list[str]:
    return sorted(
        str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != CHECKSUMS
    )


def _my_share(names: list[str]) -> list[str]:
    """The files this rank hashes: every world-size-th, so the ranks share the work."""
    if not dist.is_initialized():
        return names
    return names[dist.get_rank() :: dist.get_world_size()]


def _gather(part):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [part]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    return parts


def _broadcast(obj):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def write_checksums(folder: Path) -> dict:
    """Hash every file of ``folder`` (shared over the ranks) and write ``checksums.json`` (rank 0)."""
    names = _broadcast(_files(folder) if _rank() == 0 else None)
    mine = {
        n: {"sha256": sha256_file(folder / n), "size": (folder / n).stat().st_size} for n in _my_share(names)
    }
    table = {k: v for part in _gather(mine) for k, v in part.items()}
    if _rank() == 0:
        write_atomic(folder / CHECKSUMS, json.dumps({"algorithm": "sha256", "files": table}, indent=1))
    return table


def _written_with_checksums(folder: Path) -> bool:
    """Whether ``state.json`` says checksums were written (every checkpoint since they exist says so)."""
    try:
        meta = _read_json(folder / "state.json")
    except (OSError, ValueError):
        return True  # unreadable: the missing checksums are a fault, not an old format
    return not isinstance(meta, dict) or CHECKSUMS_KEY in meta


def verify_checkpoint(folder: str | Path) -> list[str]:
    """Problems found in ``folder`` against its ``checksums.json`` (empty: intact). Same answer on every rank.

    A checkpoint written before checksums existed gives one problem starting with ``unverified``; one whose
    ``checksums.json`` went missing later is corrupt. :class:`CheckpointError` (before any file is opened) if the
    folder holds anything but regular files and folders.
    """
    folder = Path(folder)
    refuse_special(folder)
    try:
        table = _read_json(folder / CHECKSUMS)["files"]
        if not isinstance(table, dict):
            raise ValueError("no file table")
    except FileNotFoundError:
        if _written_with_checksums(folder):
            return [f"{CHECKSUMS} is missing, though state.json says it was written (deleted or not copied?)"]
        return [f"unverified: {folder} has no {CHECKSUMS} (written before checksums were recorded)"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{CHECKSUMS} is unreadable ({e})"]
    problems = []
    for name in _my_share(sorted(table)):
        want, p = table[name], folder / name
        if not isinstance(want, dict) or Path(name).is_absolute() or ".." in Path(name).parts:
            problems.append(f"{name!r}: not a file of the checkpoint (its checksum entry points outside it)")
        elif not p.is_file():
            problems.append(f"{name}: missing")
        elif p.stat().st_size != want.get("size"):
            problems.append(f"{name}: {p.stat().st_size} bytes, {want.get('size')} when written (truncated?)")
        elif sha256_file(p) != want.get("sha256"):
            problems.append(f"{name}: sha256 mismatch (the content changed after it was written)")
    if _rank() == 0:
        problems += [f"{n}: not in {CHECKSUMS}" for n in _files(folder) if n not in table]
    return sorted({p for part in _gather(problems) for p in part})


def latest_good_checkpoint(root: str | Path, *, trust_unverified: bool = False) -> Path | None:
    """The newest checkpoint that passes :func:`verify_checkpoint`; corrupt ones are skipped with a warning.

    None when there is no checkpoint at all; :class:`CheckpointError` when every one is corrupt, when the
    newest readable one predates checksums and ``trust_unverified`` is not given, or when ``latest`` or a
    checkpoint holds a link or special file (:func:`refuse_special`).
    """
    if Path(root).is_symlink():
        raise CheckpointError(f"{root} is {describe(root)}; allowed: a real folder inside the run folder")
    _refuse_special_marker(Path(root))
    tried = []
    for p in complete_checkpoints(root):
        problems = verify_checkpoint(p)
        if not problems:
            break
        if problems[0].startswith("unverified"):
            if not trust_unverified:
                raise CheckpointError(
                    f"checkpoint {p} has no {CHECKSUMS}: its state.json says it was written before checksums "
                    "were recorded, so its files cannot be verified. If you trust where this run folder came "
                    "from, pass --trust-unverified to load it unverified."
                )
            _warn(f"checkpoint {p} has no checksums (written by an older version): loading it unverified")
            break
        tried.append(f"{p}: {'; '.join(problems[:4])}")
        _warn(f"checkpoint {p} is corrupt, skipping it: {'; '.join(problems[:4])}")
    else:
        if tried:
            raise CheckpointError(
                "every checkpoint failed verification:\n  " + "\n  ".join(tried) + "\n"
                "Restore them from a copy, or move the checkpoints folder away to start the run over."
            )
        return None
    if tried:
        _warn(f"resuming from the newest intact checkpoint, {p}")
    return p


def _warn(msg: str) -> None:
    if _rank() == 0:
        warnings.warn(msg, IntegrityWarning, stacklevel=3)


def _rng_file(folder: Path, rank: int) -> Path:
    return folder / "rng" / f"rank{rank:05d}.safetensors"


def _rank_state_file(folder: Path, rank: int) -> Path:
    return folder / "rank_state" / f"rank{rank:05d}.safetensors"


def _save_rank_state(path: Path, tensors: dict[str, torch.Tensor], plain: dict) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(exist_ok=True)
    save_file(tensors, str(path), metadata={"plain": json.dumps(plain)})


def rank_state_file(folder: str | Path, rank: int) -> Path:
    """Where a checkpoint keeps ``rank``'s loop state (the pending off-policy batches)."""
    return _rank_state_file(Path(folder), rank)


def load_rank_state(folder: str | Path, rank: int) -> tuple[dict[str, torch.Tensor], dict] | None:
    """This rank's loop state saved with ``rank_state`` (tensors, plain data), or None when the checkpoint has none.
    :class:`CheckpointError` naming the file when it cannot be read as one (damaged: not safetensors, no record, a
    record that is not JSON)."""
    from safetensors import SafetensorError, safe_open

    path = _rank_state_file(Path(folder), rank)
    if not os.path.lexists(path):
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if "plain" not in meta:
                raise CheckpointError(
                    f"{path}: holds no loop-state record ('plain' metadata); the file is damaged"
                )
            plain = json.loads(meta["plain"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    except (SafetensorError, OSError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(
            f"{path}: cannot be read as this rank's loop state ({type(e).__name__}: {str(e)[:200]}); the file is "
            "damaged: resume from an earlier checkpoint"
        ) from None
    return tensors, plain


def save_rng_state(path: Path) -> None:
    """This process's RNG states as tensors (torch, CUDA, megatron's tracker, numpy's key) plus JSON."""
    from megatron.core import tensor_parallel
    from safetensors.torch import save_file

    version, key, gauss = random.getstate()
    kind, np_key, pos, has_gauss, cached = np.random.get_state()
    tensors = {"torch": torch.get_rng_state(), "numpy.key": torch.from_numpy(np_key.astype(np.int64))}
    tensors |= {f"tracker.{n}": s for n, s in tensor_parallel.get_cuda_rng_tracker().get_states().items()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state()
    plain = {
        "python": [version, list(key), gauss],
        "numpy": {"kind": kind, "pos": pos, "has_gauss": has_gauss, "cached_gaussian": cached},
    }
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"plain": json.dumps(plain)}
    )


def load_rng_state(folder: Path, rank: int) -> None:
    """Restore what :func:`save_rng_state` wrote (or an older checkpoint's ``rank<N>.pt``, read as plain data)."""
    from megatron.core import tensor_parallel
    from safetensors import safe_open

    from tim_megatron.trainer.checkpoint_scan import load_plain

    path = _rng_file(folder, rank)
    if path.exists():
        with safe_open(str(path), framework="pt") as f:
            plain = json.loads(f.metadata()["plain"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
        version, key, gauss = plain["python"]
        n = plain["numpy"]
        state = {
            "python": (version, tuple(key), gauss),
            "numpy": (
                n["kind"],
                tensors["numpy.key"].numpy().astype(np.uint32),
                n["pos"],
                n["has_gauss"],
                n["cached_gaussian"],
            ),
            "torch": tensors["torch"],
            "tracker": {
                k.removeprefix("tracker."): v for k, v in tensors.items() if k.startswith("tracker.")
            },
        }
        if "cuda" in tensors:
            state["cuda"] = tensors["cuda"]
    elif (old := folder / "rng" / f"rank{rank:05d}.pt").exists():
        state = load_plain(old, numpy=True)
    else:
        return
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class TrainerState(Protocol):
    """What a checkpoint needs of a trainer: the trainer saves and loads its own state
    (:class:`~tim_megatron.trainer.megatron_trainer.MegatronTrainer`)."""

    def checkpoint_state(self, *, loading: bool) -> dict: ...

    def restore_state(self, loaded: dict) -> None: ...

    def state_meta(self) -> dict: ...

    def restore_meta(self, meta: dict) -> None: ...


def save_checkpoint(
    trainer: TrainerState,
    root: str | Path,
    *,
    step: int,
    state: dict,
    keep: int = 2,
    rank_state: tuple[dict[str, torch.Tensor], dict] | None = None,
) -> Path:
    """Write a checkpoint of ``trainer`` plus the loop's JSON-able ``state``; return its folder. ``rank_state``:
    this rank's own loop state beyond the trainer's (tensors and plain data; the off-policy batches waiting to be
    trained), written per rank (:func:`load_rank_state`)."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    final = step_dir(root, step)
    tmp = root / f".tmp_{final.name}"
    if _rank() == 0:  # a linked root was refused when the attempt started (run_dir.unsafe_entries)
        root.mkdir(parents=True, exist_ok=True)
        _remove(tmp)
        tmp.mkdir()
    _barrier()
    with cuda_placement_to_cpu():
        dist_checkpointing.save(trainer.checkpoint_state(loading=False), str(tmp))
    (tmp / "rng").mkdir(exist_ok=True)
    save_rng_state(_rng_file(tmp, _rank()))
    if rank_state is not None:
        _save_rank_state(_rank_state_file(tmp, _rank()), *rank_state)
    _barrier()
    if _rank() == 0:
        meta = {
            "step": step,
            "state": state,
            **trainer.state_meta(),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            CHECKSUMS_KEY: CHECKSUMS,
        }
        write_atomic(tmp / "state.json", json.dumps(meta, indent=1))
    _barrier()
    write_checksums(tmp)
    if _rank() == 0:
        _fsync_tree(tmp)
        _remove(final, ignore_errors=False)
        os.replace(tmp, final)
        write_atomic(root / LATEST, final.name, root=root)
        older = sorted(p for p in root.glob("step_*") if p != final)
        for old in older[: max(len(older) - (keep - 1), 0)]:
            _remove(old)
    _barrier()
    return final


def _remove(p: Path, *, ignore_errors: bool = True) -> None:
    """Remove ``p`` in the checkpoints folder: a link is unlinked, never followed; a real folder is deleted (the
    links inside it too, not what they point to)."""
    if p.is_symlink() or (os.path.lexists(p) and not p.is_dir()):
        p.unlink()
    elif p.exists():
        shutil.rmtree(p, ignore_errors=ignore_errors)


def _fsync_tree(folder: Path) -> None:
    """Data on disk before the rename publishes the checkpoint (a power loss leaves no torn files)."""
    for p in folder.rglob("*"):
        if regular_file(p):
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def refuse_unsafe(path: str | Path) -> None:
    """:class:`CheckpointError` if any file of checkpoint ``path`` could run code when loaded, or is not a regular
    file (:func:`refuse_special`)."""
    refuse_special(path)
    unsafe = scan_checkpoint(path)
    if unsafe:
        raise CheckpointError(
            f"checkpoint {path} refused: loading it could run code or read past its files "
            f"({'; '.join(unsafe[:4])}). A checkpoint this project wrote holds only tensors and plain data, at "
            "the places its index declares; do not load this folder."
        )


def load_checkpoint(trainer: TrainerState, path: str | Path) -> dict:
    """Restore ``trainer`` (model, optimizer, RNG) from ``path``; return the loop state saved with it."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    refuse_special(path)
    try:
        meta = _read_json(path / "state.json")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: state.json is unreadable ({e})") from None
    world = dist.get_world_size() if dist.is_initialized() else 1
    if meta.get("world_size", 1) != world:
        raise CheckpointError(
            f"checkpoint {path} was written by {meta['world_size']} ranks; this run has {world}. "
            f"Resume with the recorded parallel layout (parallel.tp x pp x dp = {meta['world_size']})."
        )
    dims, recorded = trainer.state_meta()["model_dims"], meta.get("model_dims") or {}
    diff = ", ".join(  # keys both know: a field added since the checkpoint was written is not a change
        f"model.dims.{k}: {recorded[k]} -> {dims[k]}"
        for k in sorted(dims.keys() & recorded.keys())
        if recorded[k] != dims[k]
    )
    if diff:
        raise CheckpointError(
            f"checkpoint {path} holds a model of other dimensions ({diff}, recorded -> this run). "
            f"A run cannot change its model's shape: restore the recorded model.dims, or start a new run folder."
        )
    # checkpoints written before the expert layout was recorded all held per-expert expert weights
    buckets = bucket_resume_problem(
        saved=meta.get("optimizer_buckets", "per-expert"),
        current=trainer.state_meta().get("optimizer_buckets"),
    )
    if buckets:
        raise CheckpointError(f"checkpoint {path}: {buckets}.")
    refuse_unsafe(path)
    wanted = trainer.checkpoint_state(loading=True)
    with cuda_placement_to_cpu():
        loaded = dist_checkpointing.load(wanted, str(path))
    try:
        trainer.restore_state(loaded)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None
    load_rng_state(path, _rank())
    trainer.restore_meta(meta)
    return meta
