"""Load a recipe: resolve ``base:`` inheritance, apply dotted overrides, validate.

Every error names the file that set the offending key, the dotted key, the bad value and what is allowed.

YAML is read with limits, because a recipe may come from anyone: at most :data:`MAX_YAML_BYTES` per file,
:data:`MAX_YAML_NODES` values once aliases are expanded (a 600-byte "billion laughs" file expands to 10^9),
:data:`MAX_YAML_DEPTH` levels of nesting, and error messages clipped to :data:`MAX_ERROR_CHARS`. Plain
scalars follow the YAML 1.2 core schema: ``0x10``, ``0o17``, ``1_000``, ``yes``/``on`` and ``1:30`` are
strings, not numbers or booleans, so a typed field refuses them instead of silently reading 16 or True. A
mapping that sets a key twice is refused (:class:`DuplicateKeyError`, both lines named), where YAML would keep
the last one silently; this holds for everything read through :func:`yaml_load` (recipes, sweep files, lab
grids, override values).
"""

from __future__ import annotations

import copy
import difflib
import re
import stat
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from tim_megatron.recipe.schema import NAME_PATTERN, Recipe, RecipeValueError
from tim_megatron.untrusted import clip

OVERRIDE_SOURCE = "command line"
MAX_YAML_BYTES = 1 << 20
"""A recipe file larger than this (1 MiB) is refused before it is parsed; shipped recipes are < 4 KiB."""
MAX_YAML_NODES = 100_000
"""Most values one YAML document may hold once every alias is expanded."""
MAX_YAML_DEPTH = 64
"""Deepest nesting of mappings and lists in one YAML document (recipes use about 5)."""
MAX_ERROR_CHARS = 4000
"""Longest error message a recipe can produce; longer ones are clipped, saying how much was left out."""
MAX_VALUE_CHARS = 200
"""Longest rendering of one bad value inside an error message."""
MAX_ERROR_LINES = 20
"""Most validation problems listed in one error; the rest are counted."""


class RecipeError(ValueError):
    """A recipe that cannot be loaded; the message says where, what and what is allowed."""

    def __init__(self, message: str):
        super().__init__(clip(str(message), MAX_ERROR_CHARS))


class YAMLLimitError(RecipeError, yaml.YAMLError):
    """YAML over a size, alias-expansion or depth limit (also a ``yaml.YAMLError`` for callers that catch that)."""


class DuplicateKeyError(RecipeError, yaml.YAMLError):
    """A mapping that sets one key twice: YAML would keep the last silently, so the file is refused instead."""


class _Loader(yaml.SafeLoader):
    """SafeLoader with the YAML 1.2 core schema's plain scalars: decimal ints, floats (``1e-6`` included,
    ``.inf``, ``.nan``), ``true``/``false``, ``null``. Everything else plain is a string."""

    yaml_implicit_resolvers: typing.ClassVar[dict] = {}

    def construct_yaml_int(self, node):
        return int(self.construct_scalar(node), 10)  # "010" is ten, not YAML 1.1's octal eight


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
for _tag, _regex, _first in (
    ("bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    ("null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
    ("int", r"^[-+]?[0-9]+$", "-+0123456789"),
    (
        "float",
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
        "-+0123456789.",
    ),
):
    _Loader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(_regex), list(_first))


def _expanded_size(node: yaml.Node, memo: dict[int, int], path: set[int], depth: int = 0) -> int:
    """Values under ``node`` with every alias expanded: linear in the distinct nodes (memoized by identity)."""
    key = id(node)
    if key in memo:
        return memo[key]
    if key in path:
        raise YAMLLimitError("an alias refers to a node that contains it (recursive YAML is not allowed)")
    if depth > MAX_YAML_DEPTH:
        raise YAMLLimitError(f"nested more than {MAX_YAML_DEPTH} levels deep")
    path.add(key)
    n = 1
    if isinstance(node, yaml.SequenceNode):
        n += sum(_expanded_size(c, memo, path, depth + 1) for c in node.value)
    elif isinstance(node, yaml.MappingNode):
        n += sum(
            _expanded_size(k, memo, path, depth + 1) + _expanded_size(v, memo, path, depth + 1)
            for k, v in node.value
        )
    path.discard(key)
    memo[key] = n
    return n


def _key_identity(loader: _Loader, node: yaml.Node) -> Any:
    """What a key becomes once built (``1`` and ``01`` are one int key), or its text if it cannot be built here."""
    if not isinstance(node, yaml.ScalarNode):
        return None  # a list or mapping as a key is refused by construction itself (unhashable)
    try:
        key = loader.construct_object(node)
        hash(key)
    except Exception:  # a bad key value gets its own named error when the document is built
        return (node.tag, node.value)
    return (type(key).__name__, key)


def _refuse_duplicate_keys(loader: _Loader, node: yaml.Node, where: str, seen: set[int]) -> None:
    """Raise :class:`DuplicateKeyError` for the first mapping that repeats a key; each node is visited once, so
    aliases cost nothing (the size limit has already bounded the document)."""
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(loader, item, f"{where}[{i}]", seen)
    elif isinstance(node, yaml.MappingNode):
        first: dict[Any, yaml.Node] = {}
        for k, v in node.value:
            name = k.value if isinstance(k, yaml.ScalarNode) else "?"
            key = f"{where}.{name}" if where else str(name)
            ident = _key_identity(loader, k)
            if ident is not None and k.tag != "tag:yaml.org,2002:merge":
                if ident in first:
                    raise DuplicateKeyError(
                        f"line {k.start_mark.line + 1}: duplicate key {key!r} (first set at line "
                        f"{first[ident].start_mark.line + 1}); a key may appear once in a mapping, and YAML would "
                        "silently keep only the last: merge the two into one"
                    )
                first[ident] = k
            _refuse_duplicate_keys(loader, v, key, seen)


def yaml_load(text: str) -> Any:
    """One YAML document, refused (:class:`YAMLLimitError`) before it is built if it is too big or too deep, and
    (:class:`DuplicateKeyError`) if a mapping repeats a key."""
    if len(text) > MAX_YAML_BYTES:
        raise YAMLLimitError(f"{len(text)} characters of YAML; at most {MAX_YAML_BYTES} are read")
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded_size(node, {}, set())
        if size > MAX_YAML_NODES:
            raise YAMLLimitError(
                f"{size} values once aliases (*name) are expanded; at most {MAX_YAML_NODES} are allowed "
                "(write the values out, or use base: to share settings between recipes)"
            )
        _refuse_duplicate_keys(loader, node, "", set())
        try:
            return loader.construct_document(node)
        except (ValueError, TypeError, OverflowError) as e:  # e.g. `!!int 0x10`, `!!float abc`
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read this value: {e}", node.start_mark
            ) from None
    except RecursionError:
        raise YAMLLimitError(f"nested more than {MAX_YAML_DEPTH} levels deep") from None
    finally:
        loader.dispose()


def read_yaml_file(path: str | Path) -> Any:
    """The YAML document in ``path``; :class:`RecipeError` names the file and what is wrong with it."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise RecipeError(f"{path}: recipe file not found") from None
    except OSError as e:
        raise RecipeError(f"{path}: cannot be read ({e.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        raise RecipeError(
            f"{path}: is a folder, not a recipe file; give a .yaml file (`tim recipe check {path}` checks every "
            "recipe in a folder)"
        )
    if not stat.S_ISREG(st.st_mode):
        raise RecipeError(f"{path}: not a regular file; a recipe is a YAML text file")
    if st.st_size > MAX_YAML_BYTES:
        raise RecipeError(
            f"{path}: {st.st_size} bytes; a recipe file may have at most {MAX_YAML_BYTES} bytes "
            "(recipes are short YAML diffs over a base: recipe)"
        )
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_YAML_BYTES + 1)
    except OSError as e:
        raise RecipeError(f"{path}: cannot be read ({e.strerror})") from None
    if len(raw) > MAX_YAML_BYTES:
        raise RecipeError(f"{path}: more than {MAX_YAML_BYTES} bytes; a recipe file may have at most that")
    try:
        if b"\0" in raw:
            raise UnicodeDecodeError("utf-8", raw, raw.index(b"\0"), raw.index(b"\0") + 1, "NUL byte")
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecipeError(
            f"{path}: not a text file (byte {e.start} is not UTF-8 text); a recipe is a YAML text file"
        ) from None
    try:
        return yaml_load(text)
    except YAMLLimitError as e:
        raise RecipeError(f"{path}: refused: {e}") from None
    except DuplicateKeyError as e:
        raise RecipeError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from None


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
    data = read_yaml_file(path)
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


MAX_RECIPE_FILES = 64
"""Most files one recipe may read through its base: chain (each at most MAX_YAML_BYTES)."""


def _real_path(path: Path, named_by: str) -> Path:
    """``path`` with every link followed; a missing file or a link loop is a named error (Python 3.11 raises
    RuntimeError for a loop)."""
    try:
        return path.resolve(strict=True)
    except FileNotFoundError:
        raise RecipeError(
            f"{named_by}: file not found ({path})" if named_by else f"{path}: recipe file not found"
        ) from None
    except (RuntimeError, OSError) as e:
        why = "a symbolic link loop" if isinstance(e, RuntimeError) else (e.strerror or str(e))
        raise RecipeError(
            f"{named_by or path}: cannot be read ({why}); a recipe is a YAML text file, or a link that ends at one"
        ) from None


def _resolve(
    path: Path, stack: list[Path], chain: list[Path], prov: dict[str, str], *, named_by: str = ""
) -> dict[str, Any]:
    path = _real_path(path, named_by)
    if len(chain) >= MAX_RECIPE_FILES:
        raise RecipeError(
            f"{stack[-1] if stack else path}: the base: chain reads more than {MAX_RECIPE_FILES} files; "
            "flatten the inheritance"
        )
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
        merged = _deep_merge(
            merged, _resolve(parent, [*stack, path], chain, prov, named_by=f"{path}: base = {b!r}")
        )
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
    except YAMLLimitError as e:
        raise RecipeError(f"override {key}=...: refused: {e}") from None
    except DuplicateKeyError as e:
        raise RecipeError(f"override {key}=...: {e}") from None
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
    elsewhere = [k for k in keys if k.endswith("." + name)]  # the right name in the wrong section
    if elsewhere:
        return f" (did you mean '{elsewhere[0]}'?)"
    if parent is not None:
        return f"; allowed here: {', '.join(parent.model_fields)}"
    close = difflib.get_close_matches(dotted, keys, n=1, cutoff=0.75)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _source_of(key: str, prov: dict[str, str]) -> str:
    """Who set ``key``: itself, else whoever set something below it (``cluster.env.X.Y=1`` makes ``cluster.env.X``
    a mapping, so the command line is to blame), else whoever set the section it is in."""
    if key in prov:
        return prov[key]
    below = sorted({src for k, src in prov.items() if k.startswith(key + ".")})
    if below:
        return OVERRIDE_SOURCE if OVERRIDE_SOURCE in below else ", ".join(below)
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        src = prov.get(".".join(parts[:i]))
        if src is not None:
            return src
    return "defaults"


def _value(v: Any) -> str:
    return clip(repr(v), MAX_VALUE_CHARS)


def _format_validation(err: ValidationError, prov: dict[str, str]) -> str:
    lines = []
    errors = err.errors()
    for e in errors[:MAX_ERROR_LINES]:
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
            lines.append(f"{src}: {key} = {_value(e['input'])}: {msg}{_hint(e)}")
    # the count of what is left out must survive the clip to MAX_ERROR_CHARS: list fewer problems instead
    while len(lines) > 1 and sum(len(x) + 1 for x in lines) > MAX_ERROR_CHARS - 200:
        lines.pop()
    if len(errors) > len(lines):
        lines.append(f"... and {len(errors) - len(lines)} more problems")
    return "\n".join(lines)


def _hint(e: dict) -> str:
    """How to write the value the field wants, for the strict-type errors people actually hit."""
    v, t = e.get("input"), e["type"]
    if t == "int_type" and isinstance(v, bool):
        return f" (a boolean is not a number: write the number, e.g. {int(v)})"
    if t == "int_type" and isinstance(v, float):
        return " (write a whole number without a decimal point or exponent, e.g. 1000 not 1e3)"
    if t == "int_type" and isinstance(v, str):
        return " (write a plain decimal number: hex, octal and digit separators are not read as numbers)"
    if t in ("bool_type", "bool_parsing"):
        return " (write true or false)"
    if t == "string_pattern_mismatch" and e.get("ctx", {}).get("pattern") == NAME_PATTERN:
        return " (use letters, digits, '.', '_' and '-', starting with a letter or digit, at most 100 characters)"
    if t == "finite_number":
        return " (NaN and infinity are not allowed here)"
    if t == "string_type" and isinstance(v, int | float):
        return f" (quote it to make it text: '{v}')"
    return ""


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


def layout_of(path: str | Path | None, overrides: list[str] | None = None):
    """The ``parallel`` and ``cluster`` sections of a recipe before the whole recipe is validated, and the keys'
    provenance: what ``parallel.dp`` following the process or node count needs to know *before* the rules that
    depend on the world size run (a fault drill's rank, say). Sections that do not validate come back as None (the
    whole recipe's validation then names the problem)."""
    from tim_megatron.recipe.schema import ClusterConfig, ParallelismConfig

    data, prov, _ = resolve_dict(path, overrides)

    def section(model, key):
        try:
            return model.model_validate(data.get(key) or {})
        except (ValidationError, TypeError):
            return None

    return section(ParallelismConfig, "parallel"), section(ClusterConfig, "cluster"), prov


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
    if not re.fullmatch(NAME_PATTERN, name):  # run.name is checked by the schema; a derived one here
        raise RecipeError(
            f"{path}: the run name derived from this file's folder and name is {name!r}, which is not allowed "
            f"(letters, digits, '.', '_' and '-', starting with a letter or digit, at most 100 characters: "
            f"{NAME_PATTERN}); rename the file (or its folder), or set run.name"
        )
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
