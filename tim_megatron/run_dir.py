"""Run folders: ``<output_dir>/<run name>/<timestamp>/`` holding everything a run writes."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tim_megatron.recipe import LoadedRecipe, recipe_to_yaml
from tim_megatron.recipe.loader import load_recipe

RECIPE_FILE = "recipe.yaml"
META_FILE = "run.json"


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


def write_resolved(loaded: LoadedRecipe, d: Path) -> None:
    (d / RECIPE_FILE).write_text(
        f"# resolved from {loaded.path} with overrides {loaded.overrides}\n" + recipe_to_yaml(loaded.recipe)
    )
    meta = {
        "name": loaded.name,
        "recipe_path": str(loaded.path),
        "overrides": loaded.overrides,
        "sweep_id": loaded.recipe.run.sweep_id,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "status": "created",
    }
    (d / META_FILE).write_text(json.dumps(meta, indent=1))


def load_run(d: str | Path) -> LoadedRecipe:
    """The recipe a run folder was started with (for ``tim train --resume``)."""
    d = Path(d)
    if not (d / RECIPE_FILE).exists():
        raise FileNotFoundError(f"{d} is not a run folder (no {RECIPE_FILE})")
    loaded = load_recipe(d / RECIPE_FILE)
    meta = json.loads((d / META_FILE).read_text()) if (d / META_FILE).exists() else {}
    loaded.name = meta.get("name", loaded.name)
    return loaded


def set_status(d: Path, status: str, **extra) -> None:
    p = d / META_FILE
    meta = json.loads(p.read_text()) if p.exists() else {}
    meta.update(status=status, updated=time.strftime("%Y-%m-%dT%H:%M:%S"), **extra)
    tmp = p.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    tmp.replace(p)
