"""Validate a folder of YAML files: recipes by the recipe loader, sweep files by the sweep loader."""

from __future__ import annotations

from pathlib import Path

from tim_megatron.recipe.loader import RecipeError, load_recipe
from tim_megatron.recipe.sweep import is_sweep_file, load_sweep


def check_dir(root: str | Path) -> list[tuple[Path, str | None]]:
    """Validate every recipe under ``root`` (sweep files are checked by the sweep loader)."""
    results = []
    for p in sorted(Path(root).rglob("*.yaml")):
        try:  # a folder, a binary or an unreadable file named *.yaml fails here too, and the check goes on
            if is_sweep_file(p):
                load_sweep(p)
            else:
                load_recipe(p)
            results.append((p, None))
        except RecipeError as e:
            results.append((p, str(e)))
    return results
