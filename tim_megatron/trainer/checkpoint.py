"""Checkpoints: megatron-core distributed checkpointing of model and optimizer, plus RNG and loop state.

Layout under a run's ``checkpoints/`` folder::

    step_00000012/          one complete checkpoint (megatron dist-checkpoint files, rng/, state.json)
    latest                  text file naming the newest complete step folder

A checkpoint is written into ``.tmp_step_<N>/`` and renamed to ``step_<N>/`` only after every rank has
finished, then ``latest`` is replaced atomically. A crash at any point leaves the previous checkpoint
and ``latest`` untouched. Old checkpoints beyond ``keep`` are deleted only after the new one is in place.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from patches.megatron.cpu_shims import cuda_placement_to_cpu
from tim_megatron.trainer.model import unwrap

LATEST = "latest"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint folder, or None."""
    root = Path(root)
    marker = root / LATEST
    if marker.exists():
        p = root / marker.read_text().strip()
        if p.is_dir() and (p / "state.json").exists():
            return p
    done = sorted(p for p in root.glob("step_*") if (p / "state.json").exists()) if root.exists() else []
    return done[-1] if done else None


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _sharded(trainer, loading: bool) -> dict:
    gpt = unwrap(trainer.model)
    msd = gpt.sharded_state_dict()
    out = {"model": msd}
    if trainer.recipe.checkpoint.save_optimizer:
        with cuda_placement_to_cpu():
            out["optimizer"] = trainer.optimizer.sharded_state_dict(msd, is_loading=loading)
    return out


def save_checkpoint(trainer, root: str | Path, *, step: int, state: dict, keep: int = 2) -> Path:
    """Write a checkpoint of ``trainer`` plus the loop's JSON-able ``state``; return its folder."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    final = step_dir(root, step)
    tmp = root / f".tmp_{final.name}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    with cuda_placement_to_cpu():
        dist_checkpointing.save(_sharded(trainer, loading=False), str(tmp))
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), tmp / "rng" / f"rank{_rank():05d}.pt")
    _barrier()
    if _rank() == 0:
        meta = {
            "step": step,
            "state": state,
            "updates": trainer.updates,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        }
        (tmp / "state.json").write_text(json.dumps(meta, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_text(root / LATEST, final.name)
        older = sorted(p for p in root.glob("step_*") if p != final)
        for old in older[: max(len(older) - (keep - 1), 0)]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(trainer, path: str | Path) -> dict:
    """Restore ``trainer`` (model, optimizer, RNG) from ``path``; return the loop state saved with it."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    meta = json.loads((path / "state.json").read_text())
    world = dist.get_world_size() if dist.is_initialized() else 1
    if meta.get("world_size", 1) != world:
        raise ValueError(f"checkpoint {path} was written by {meta['world_size']} ranks; this run has {world}")
    sharded = _sharded(trainer, loading=True)
    with cuda_placement_to_cpu():
        loaded = dist_checkpointing.load(sharded, str(path))
    unwrap(trainer.model).load_state_dict(loaded["model"])
    if "optimizer" in loaded:
        with cuda_placement_to_cpu():
            trainer.optimizer.load_state_dict(loaded["optimizer"])
    rng = path / "rng" / f"rank{_rank():05d}.pt"
    if rng.exists():
        _set_rng_state(torch.load(rng, weights_only=False))
    trainer.updates = meta.get("updates", 0)
    return meta
