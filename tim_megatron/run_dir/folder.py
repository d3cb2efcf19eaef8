"""A run folder's place and recipe: a fresh folder, the refusal of one that is not a run folder, the recipe it was
started with, and the changes a recipe given for it may make."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from tim_megatron.recipe import LoadedRecipe, recipe_to_yaml
from tim_megatron.recipe.loader import load_recipe
from tim_megatron.run_dir.errors import RecipeChangeError, RunDirError
from tim_megatron.run_dir.record import META_FILE, RESERVE_FILE, create_record, now, read_meta, update_meta
from tim_megatron.run_lock import LOCK_FILE
from tim_megatron.safe_files import describe, regular_file, write_atomic

RECIPE_FILE = "recipe.yaml"
BEFORE_RUN_FILES = frozenset(
    {LOCK_FILE, f".{META_FILE}.lock", RESERVE_FILE, "lab.json", "slot.json", "train.log"}
)
"""What a folder may hold before ``tim train`` first writes its run there: a lock from an earlier try, and
what ``tim lab`` puts there for the run it starts (its spec, core slot and log)."""
IGNORED_CHANGES = ("run.output_dir",)
"""Recipe keys that say where run folders live, not what a run computes: never a recipe change."""
FIXED_KEYS = ("model.dims.", "parallel.")
"""Prefixes of keys a checkpoint cannot continue across (tensor shapes, the rank layout of its files)."""


def new_run_dir(loaded: LoadedRecipe, *, root: str | Path | None = None) -> Path:
    """Create a fresh run folder; the name is validated by the recipe schema, so it cannot leave ``root``."""
    base = Path(root or loaded.recipe.run.output_dir).resolve()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    parent = base / loaded.name
    d = parent / stamp
    i = 1
    while d.exists():
        d = parent / f"{stamp}-{i}"
        i += 1
    if base not in d.resolve().parents:
        raise ValueError(f"run folder {d} would be outside {base}")
    d.mkdir(parents=True)
    write_resolved(loaded, d)
    return d


def check_target(d: Path) -> None:
    """Refuse ``tim train --run-dir d`` into a folder that is not a run folder, before anything is written.

    Allowed: a path that does not exist yet, an empty folder, a run folder (``run.json`` and ``recipe.yaml``)
    and a folder prepared for a run (:data:`BEFORE_RUN_FILES` only). Anything else holds someone's files, which
    a run would mix its own among (and ``run.json`` would be replaced)."""
    d = Path(d)
    if not d.exists() and not d.is_symlink():
        return
    if not d.is_dir():
        raise RunDirError(f"--run-dir {d}: exists and is not a folder; give a new path or a run folder")
    if (d / RECIPE_FILE).is_file() and read_meta(d).get("status"):
        return
    foreign = sorted(p.name for p in d.iterdir() if p.name not in BEFORE_RUN_FILES)
    if foreign:
        shown = ", ".join(repr(n) for n in foreign[:5]) + (
            f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        )
        raise RunDirError(
            f"--run-dir {d}: the folder exists and is not a run folder (it has no {META_FILE} with a status and "
            f"{RECIPE_FILE}; it holds {shown}). tim train writes only into a new or empty folder or a run "
            f"folder; nothing was written. Give a new path, or leave out --run-dir for a fresh folder under "
            f"run.output_dir."
        )


def write_resolved(loaded: LoadedRecipe, d: Path) -> None:
    _write_recipe(loaded, d)
    create_record(
        d,
        name=loaded.name,
        recipe_path=str(loaded.path),
        overrides=loaded.overrides,
        sweep_id=loaded.recipe.run.sweep_id,
    )


def _write_recipe(loaded: LoadedRecipe, d: Path) -> None:
    text = f"# resolved from {loaded.path} with overrides {loaded.overrides}\n" + recipe_to_yaml(
        loaded.recipe
    )
    write_atomic(d / RECIPE_FILE, text, root=d, what="run recipe")


def _recipe_file(d: Path) -> Path:
    """``d``'s recipe.yaml; :class:`RunDirError` unless it is a regular file (a link would read another file)."""
    p = d / RECIPE_FILE
    if not regular_file(p):
        raise RunDirError(f"{d}: its {RECIPE_FILE} is {describe(p)}; a run folder's recipe is a regular file")
    return p


def load_run(d: str | Path) -> LoadedRecipe:
    """The recipe a run folder was started with (for ``tim train --resume``)."""
    d = Path(d)
    if not os.path.lexists(d / RECIPE_FILE):
        raise FileNotFoundError(f"{d} is not a run folder (no {RECIPE_FILE})")
    loaded = load_recipe(_recipe_file(d))
    meta = read_meta(d)
    loaded.name = meta.get("name", loaded.name)
    return loaded


def _flat(data, prefix: str = "") -> dict:
    if isinstance(data, dict) and data:
        out = {}
        for k, v in data.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: data}


def recipe_changes(old, new) -> dict[str, tuple]:
    """``{dotted key: (recorded value, new value)}`` for every key where two recipes differ."""
    a, b = _flat(old.model_dump(mode="json")), _flat(new.model_dump(mode="json"))
    return {
        k: (a.get(k), b.get(k))
        for k in sorted(a.keys() | b.keys())
        if a.get(k) != b.get(k) and k not in IGNORED_CHANGES
    }


def _show(v) -> str:
    s = json.dumps(v)
    return s if len(s) <= 60 else s[:57] + "..."


def has_checkpoint(d: Path) -> bool:
    return any((Path(d) / "checkpoints").glob("step_*/state.json"))


def adopt_recipe(
    d: Path, loaded: LoadedRecipe, *, allow_change: bool = False, retry: bool = False
) -> dict[str, tuple]:
    """Make ``loaded`` the recipe of run folder ``d``; return the changes accepted (empty: none).

    A folder without a recipe gets this one. An identical recipe continues. A different one is refused
    with the differing keys listed, unless ``allow_change``, or ``retry`` (``tim train`` again on a folder where
    no step ever ran: a corrected start after one that failed): then it replaces ``recipe.yaml`` and the
    change (keys, old and new values, the step it applies from) is appended to ``run.json``'s
    ``recipe_changes``. Shapes and the rank layout cannot change under a checkpoint, flag or not.
    """
    d = Path(d)
    if not os.path.lexists(d / RECIPE_FILE):
        write_resolved(loaded, d)
        return {}
    recorded = load_recipe(_recipe_file(d)).recipe
    changes = recipe_changes(recorded, loaded.recipe)
    if not changes:
        return {}
    lines = "\n".join(f"  {k}: {_show(old)} -> {_show(new)}" for k, (old, new) in changes.items())
    fixed = [k for k in changes if k.startswith(FIXED_KEYS)]
    if fixed and has_checkpoint(d):
        raise RecipeChangeError(
            f"{d} holds checkpoints of another model shape or rank layout; these keys cannot change under a "
            f"checkpoint: {', '.join(fixed)}\n{lines}\n"
            f"Start a new run folder for the new values (give no --run-dir), or resume as recorded "
            f"(tim train --resume {d})."
        )
    fresh = retry and _never_stepped(
        d
    )  # a start that failed or stopped before its first step: nothing to mix
    if not allow_change and not fresh:
        raise RecipeChangeError(
            f"{d} was started with another recipe; {len(changes)} key(s) differ (recorded -> given):\n{lines}\n"
            f"Resume as recorded (tim train --resume {d}), or pass --allow-recipe-change to continue with "
            f"the new values (the change is recorded in {d / META_FILE})."
        )
    from_step = _checkpoint_step(d)
    _write_recipe(loaded, d)
    entry = {
        "at": now(),
        "from_step": from_step + 1 if from_step is not None else 1,
        "changes": {k: [old, new] for k, (old, new) in changes.items()},
        "overrides": loaded.overrides,
    }
    if fresh and not allow_change:
        entry["note"] = "no step had run in this folder"

    def record(meta):
        meta.setdefault("recipe_changes", []).append(entry)
        if fresh:  # the folder's record describes the recipe its first step will run
            meta.update(name=loaded.name, recipe_path=str(loaded.path), overrides=loaded.overrides)

    update_meta(d, record)
    return changes


def _never_stepped(d: Path) -> bool:
    """No step ever ran in ``d`` (no checkpoint, no metrics row) and no Slurm job waits to run in it."""
    metrics = d / "metrics.jsonl"
    return (
        _checkpoint_step(d) is None
        and not (metrics.is_file() and metrics.stat().st_size)
        and read_meta(d).get("status") != "submitted"
    )


def _checkpoint_step(d: Path) -> int | None:
    steps = []
    for p in (Path(d) / "checkpoints").glob("step_*"):
        with contextlib.suppress(ValueError):
            steps.append(int(p.name.split("_", 1)[1]))
    return max(steps) if steps else None
