"""Validate a folder of YAML files: recipes by the recipe loader, sweep files by the sweep loader.

A recipe whose ``model.path`` is a checkpoint on this machine is also checked against that checkpoint's
config.json, read as the trainer reads it at start (:func:`tim_megatron.trainer.hf_config.dims_from_hf`): a
config.json key the project refuses (e.g. ``rope_interleave: false``) or dims that describe another model fail
here, offline, instead of at the start of a job. Hub names and paths that do not exist here are left to the job.
"""

from __future__ import annotations

from pathlib import Path

from tim_megatron.recipe.loader import RecipeError, load_recipe
from tim_megatron.recipe.sweep import is_sweep_file, load_sweep


def check_dir(root: str | Path) -> list[tuple[Path, str | None]]:
    """Validate every recipe under ``root`` (sweep files are checked by the sweep loader)."""
    return [(p, check_file(p)) for p in sorted(Path(root).rglob("*.yaml"))]


def check_file(p: Path) -> str | None:
    """Why the recipe or sweep file ``p`` is invalid, or None. A folder, a binary or an unreadable file named
    *.yaml is a reason like any other."""
    try:
        if is_sweep_file(p):
            load_sweep(p)
            return None
        recipe = load_recipe(p).recipe
    except RecipeError as e:
        return str(e)
    return checkpoint_problem(recipe)


def checkpoint_problem(recipe) -> str | None:
    """Why the checkpoint at the recipe's local ``model.path`` cannot run it (its config.json refused, or its dims
    not the recipe's), or None; None too for the built-in tiny model and paths that are not on this machine."""
    from tim_megatron.trainer.hf_config import (
        CheckpointMismatchError,
        UnsupportedModelError,
        check_dims_match,
        dims_from_hf,
        read_hf_config,
    )

    path = recipe.model.path
    try:
        if path == "tiny" or not Path(path).exists():
            return None
    except (OSError, ValueError):  # a name no file can have (a NUL byte, too long): not on this machine
        return None
    where = f"model.path = {path}"
    try:
        dims = dims_from_hf(read_hf_config(path))
        check_dims_match(recipe.model.dims, dims, where=where)
    except CheckpointMismatchError as e:  # names model.path itself
        return str(e)
    except (UnsupportedModelError, OSError) as e:
        return f"{where}: {e}"
    return None
