"""Sweep files: a base recipe plus named variants, each a list of dotted overrides."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tim_megatron.recipe.loader import LoadedRecipe, RecipeError, load_recipe, read_yaml_file

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
"""A sweep's or a variant's name; used with ``fullmatch`` (``match`` with ``$`` would pass a trailing newline)."""


@dataclass
class Variant:
    name: str
    overrides: list[str]


@dataclass
class Sweep:
    path: Path
    name: str
    base: Path
    variants: list[Variant]

    def load_variant(
        self, variant: Variant, extra: list[str] | None = None, sweep_id: str | None = None
    ) -> LoadedRecipe:
        ov = [*variant.overrides, f"run.name={self.name}-{variant.name}"]
        if sweep_id:
            ov.append(f"run.sweep_id={sweep_id}")
        return load_recipe(self.base, [*ov, *(extra or [])])


def is_sweep_file(path: Path) -> bool:
    try:
        data = read_yaml_file(path)  # the recipe loader's limits apply to sweep files too
    except RecipeError:
        return False
    return isinstance(data, dict) and "variants" in data and "base_recipe" in data


def load_sweep(path: str | Path) -> Sweep:
    path = Path(path)
    if not path.exists():
        raise RecipeError(f"{path}: sweep file not found")
    data = read_yaml_file(path)
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a sweep file must be a mapping")
    unknown = set(data) - {"name", "base_recipe", "variants", "description"}
    if unknown:
        raise RecipeError(
            f"{path}: unknown sweep key(s) {sorted(unknown)}; allowed: name, base_recipe, variants, description"
        )
    name = str(data.get("name") or path.stem)
    if not _NAME.fullmatch(name):
        raise RecipeError(f"{path}: name = {name!r}: use letters, digits, '.', '_' and '-'")
    base = data.get("base_recipe")
    if not isinstance(base, str):
        raise RecipeError(f"{path}: base_recipe = {base!r}: expected a recipe path")
    base_path = (path.parent / base) if not Path(base).is_absolute() else Path(base)
    raw = data.get("variants")
    if not isinstance(raw, list) or not raw:
        raise RecipeError(f"{path}: variants: expected a non-empty list of {{name, overrides}}")
    variants, seen = [], set()
    for i, v in enumerate(raw):
        if not isinstance(v, dict) or set(v) - {"name", "overrides"} or "name" not in v:
            raise RecipeError(
                f"{path}: variants[{i}] = {v!r}: expected {{name: ..., overrides: [key=value, ...]}}"
            )
        vname = str(v["name"])
        if not _NAME.fullmatch(vname):
            raise RecipeError(
                f"{path}: variants[{i}].name = {vname!r}: use letters, digits, '.', '_' and '-'"
            )
        if vname in seen:
            raise RecipeError(f"{path}: variants[{i}].name = {vname!r} is used twice")
        seen.add(vname)
        ov = v.get("overrides") or []
        if not isinstance(ov, list) or not all(isinstance(o, str) for o in ov):
            raise RecipeError(
                f"{path}: variants[{i}].overrides = {ov!r}: expected a list of key=value strings"
            )
        variants.append(Variant(vname, list(ov)))
    sweep = Sweep(path=path, name=name, base=base_path, variants=variants)
    for v in variants:  # every variant must validate offline
        try:
            sweep.load_variant(v)
        except RecipeError as e:
            raise RecipeError(f"{path}: variant {v.name!r}:\n{e}") from None
    return sweep
