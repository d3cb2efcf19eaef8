"""Load a recipe: resolve ``base:`` inheritance, apply dotted overrides, validate.

Every error names the file that set the offending key, the dotted key, the bad value and what is allowed.
"""

from __future__ import annotations

import copy
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from tim_megatron.recipe.schema import Recipe, RecipeValueError

OVERRIDE_SOURCE = "command line"


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-6`` (no dot) as a float, as YAML 1.2 does."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+(?:\.\d*)?|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


class RecipeError(ValueError):
    """A recipe that cannot be loaded; the message says where, what and what is allowed."""


@dataclass
class LoadedRecipe:
    recipe: Recipe
    path: Path | None
    name: str
    """The run name: ``run.name`` or one derived from the file path."""
    provenance: dict[str, str] = field(default_factory=dict)
    """Dotted key -> the file (or 'command line') that set it last."""
    chain: list[Path] = field(default_factory=list)
    """Files read, parents first."""
    overrides: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------- files


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise RecipeError(f"{path}: recipe file not found") from None
    try:
        data = yaml_load(text)
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe must be a mapping at the top level, got {type(data).__name__}")
    return data


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out[key] = v
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
    return out


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _resolve(path: Path, stack: list[Path], chain: list[Path], prov: dict[str, str]) -> dict[str, Any]:
    path = path.resolve()
    if path in stack:
        cycle = " -> ".join(str(p) for p in [*stack[stack.index(path) :], path])
        raise RecipeError(f"{stack[-1]}: cyclic base chain: {cycle}")
    data = _read_yaml(path)
    bases = data.pop("base", None)
    if bases is None:
        bases = []
    elif isinstance(bases, str):
        bases = [bases]
    elif not (isinstance(bases, list) and all(isinstance(b, str) for b in bases)):
        raise RecipeError(f"{path}: base = {bases!r}: expected a file path or a list of file paths")
    merged: dict[str, Any] = {}
    for b in bases:
        parent = (path.parent / b) if not Path(b).is_absolute() else Path(b)
        if not parent.exists():
            raise RecipeError(f"{path}: base = {b!r}: file not found ({parent})")
        merged = _deep_merge(merged, _resolve(parent, [*stack, path], chain, prov))
    for key in _flatten(data):
        prov[key] = str(path)
    chain.append(path)
    return _deep_merge(merged, data)


# ----------------------------------------------------------------------------------------- overrides


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b.c=value`` -> ("a.b.c", value), with the value read as YAML (so 0.28 is a float)."""
    if "=" not in text:
        raise RecipeError(f"override {text!r}: expected key=value, e.g. rl.clip.high=0.28")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise RecipeError(f"override {text!r}: bad dotted key {key!r}")
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    node = data
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise RecipeError(f"override {key}: {'.'.join(parts[: i + 1])} is a value, not a section")
        node = nxt
    node[parts[-1]] = value


# ------------------------------------------------------------------------------------------ messages


def _section_model(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class that the location ``loc`` lives in."""
    model: type[BaseModel] | None = Recipe
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        model = _model_of(model.model_fields[part].annotation)
    return model


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            m = _model_of(arg)
            if m is not None:
                return m
    return None


def all_keys(model: type[BaseModel] = Recipe, prefix: str = "") -> list[str]:
    """Every dotted key the schema knows."""
    out = []
    for name, f in model.model_fields.items():
        key = prefix + name
        out.append(key)
        sub = _model_of(f.annotation)
        if sub is not None:
            out.extend(all_keys(sub, key + "."))
    return out


def _did_you_mean(loc: tuple[Any, ...]) -> str:
    parent = _section_model(loc[:-1])
    name = str(loc[-1])
    prefix = ".".join(str(p) for p in loc[:-1])
    if parent is not None:
        close = difflib.get_close_matches(name, list(parent.model_fields), n=1, cutoff=0.6)
        if close:
            return f" (did you mean '{prefix + '.' if prefix else ''}{close[0]}'?)"
    dotted = ".".join(str(p) for p in loc)
    keys = all_keys()
    tail_matches = [k for k in keys if k.endswith("." + name)]
    close = tail_matches or difflib.get_close_matches(dotted, keys, n=1, cutoff=0.75)
    if close:
        return f" (did you mean '{close[0]}'?)"
    if parent is not None:
        return f"; allowed here: {', '.join(parent.model_fields)}"
    return ""


def _source_of(key: str, prov: dict[str, str]) -> str:
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        src = prov.get(".".join(parts[:i]))
        if src is not None:
            return src
    return "defaults"


def _format_validation(err: ValidationError, prov: dict[str, str]) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"])
        key = ".".join(str(p) for p in loc)
        ctx_err = (e.get("ctx") or {}).get("error")
        if isinstance(ctx_err, RecipeValueError):
            src = ", ".join(sorted({_source_of(k, prov) for k in ctx_err.keys}))
            lines.append(f"{src}: {ctx_err}")
            continue
        src = _source_of(key, prov)
        if e["type"] == "extra_forbidden":
            lines.append(f"{src}: unknown key '{key}'{_did_you_mean(loc)}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{src}: {key} = {e['input']!r}: {msg}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- API


def derive_name(path: Path | None) -> str:
    if path is None:
        return "recipe"
    path = Path(path)
    parent = path.resolve().parent.name
    stem = path.stem
    return stem if parent in ("recipes", "") else f"{parent}-{stem}"


def resolve_dict(
    path: str | Path | None, overrides: list[str] | None = None
) -> tuple[dict[str, Any], dict[str, str], list[Path]]:
    """Merged, overridden, unvalidated recipe data with the provenance of every key."""
    prov: dict[str, str] = {}
    chain: list[Path] = []
    data = _resolve(Path(path), [], chain, prov) if path is not None else {}
    for text in overrides or []:
        key, value = parse_override(text)
        _set_dotted(data, key, value)
        prov[key] = OVERRIDE_SOURCE
        if isinstance(value, dict):
            for sub in _flatten(value, key + "."):
                prov[sub] = OVERRIDE_SOURCE
    return data, prov, chain


def validate_recipe(data: dict[str, Any], prov: dict[str, str] | None = None) -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(_format_validation(e, prov or {})) from None


def load_recipe(path: str | Path | None, overrides: list[str] | None = None) -> LoadedRecipe:
    """Load, merge, override and validate a recipe file."""
    data, prov, chain = resolve_dict(path, overrides)
    recipe = validate_recipe(data, prov)
    name = recipe.run.name or derive_name(Path(path) if path is not None else None)
    return LoadedRecipe(
        recipe=recipe,
        path=Path(path) if path is not None else None,
        name=name,
        provenance=prov,
        chain=chain,
        overrides=list(overrides or []),
    )


def recipe_to_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)


def check_dir(root: str | Path) -> list[tuple[Path, str | None]]:
    """Validate every recipe under ``root`` (sweep files are checked by the sweep loader)."""
    from tim_megatron.recipe.sweep import is_sweep_file, load_sweep

    results = []
    for p in sorted(Path(root).rglob("*.yaml")):
        try:
            if is_sweep_file(p):
                load_sweep(p)
            else:
                load_recipe(p)
            results.append((p, None))
        except RecipeError as e:
            results.append((p, str(e)))
    return results
