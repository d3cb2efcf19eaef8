"""Read run folders for the report: metrics, run metadata, recipe, token dumps. Never crash on bad input.

Problems become notices on the report page (and warnings on stderr): a folder without metrics, a corrupt
line in ``metrics.jsonl`` (skipped, named by file and line number), a dump that is not parquet, runs from
different sweeps mixed on purpose, runs still in progress (reported as far as they got).

A run folder is data, not code, and may have been written by anyone: every identifier read back from it
(``name``, ``sweep_id``, ``status`` in ``run.json``) must match a strict pattern before the report uses it in a
path, a file name, a page or generated code. One that does not is dropped with a notice.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tim_megatron.logging.summary import series
from tim_megatron.logging.tracker import read_metrics
from tim_megatron.recipe.schema import NAME_PATTERN

MISMATCH = "mismatch/old_vs_rollout/rho_std"
STATUS_PATTERN = r"^[a-z][a-z_-]{0,31}$"
MAX_META_BYTES = 1 << 20
"""A run.json larger than this is not read (the project writes a few hundred bytes)."""


def valid_id(value: object) -> bool:
    """A run name or sweep id: letters, digits, '.', '_', '-', starting with a letter or digit, <= 100 chars."""
    return isinstance(value, str) and re.fullmatch(NAME_PATTERN, value) is not None


def shown(value: object) -> str:
    """A bad value, short and printable, for a notice."""
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


class DumpError(ValueError):
    """A token dump that cannot be read as parquet."""


def read_meta(path: Path, notices: list[str]) -> dict:
    """``run.json`` as a dict whose identifiers are all valid; bad ones are dropped with a notice."""
    f = path / "run.json"
    if not f.exists():
        return {}
    try:
        if f.stat().st_size > MAX_META_BYTES:
            raise ValueError(f"{f.stat().st_size} bytes, more than {MAX_META_BYTES}")
        meta = json.loads(f.read_text())
        if not isinstance(meta, dict):
            raise ValueError(f"a JSON {type(meta).__name__}, not an object")
    except (ValueError, OSError) as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        notices.append(f"{f}: unreadable ({e}); run shown without metadata")
        return {}
    for key, ok in (
        ("name", valid_id),
        ("sweep_id", valid_id),
        ("status", lambda v: isinstance(v, str) and re.fullmatch(STATUS_PATTERN, v) is not None),
    ):
        if key in meta and meta[key] is not None and not ok(meta[key]):
            notices.append(f"{f}: {key} = {shown(meta.pop(key))} is not a valid {key}; ignored")
    return meta


@dataclass
class RunData:
    path: Path
    name: str
    rows: list[dict]
    meta: dict = field(default_factory=dict)
    recipe: object | None = None
    dumps: list[Path] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.name

    @property
    def sweep_id(self) -> str | None:
        return self.meta.get("sweep_id")

    @property
    def status(self) -> str:
        return self.meta.get("status", "unknown")

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        xs, ys = series(self.rows, key)
        return np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)

    def metric_keys(self) -> set[str]:
        out: set[str] = set()
        for r in self.rows:
            out.update(r)
        return out


def read_jsonl(path: Path, notices: list[str]) -> list[dict]:
    """:func:`~tim_megatron.logging.tracker.read_metrics`, with each skipped line also a warning."""
    problems: list[str] = []
    rows = read_metrics(path, problems)
    for msg in problems:
        warnings.warn(msg, stacklevel=2)
    notices.extend(problems)
    return rows


def load_run(path: str | Path, notices: list[str]) -> RunData | None:
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.exists():
        msg = f"{path}: no metrics.jsonl (not a run folder, or the run has not logged a step yet); left out"
        warnings.warn(msg, stacklevel=2)
        notices.append(msg)
        return None
    rows = read_jsonl(metrics, notices)
    meta = read_meta(path, notices)
    recipe = None
    if (path / "recipe.yaml").exists():
        from tim_megatron.recipe import RecipeError, load_recipe

        try:
            recipe = load_recipe(path / "recipe.yaml").recipe
        except RecipeError as e:
            notices.append(f"{path}/recipe.yaml: {str(e).splitlines()[0]}")
    name = meta.get("name") or path.resolve().parent.name
    if not valid_id(name):
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")[:100] or "run"
        notices.append(f"{path}: the folder name is not a valid run name; the run is shown as {name!r}")
    if meta.get("status") in ("running", "submitted", "created"):
        notices.append(f"{name}: still running; shown up to step {rows[-1]['step'] if rows else 0}")
    if not rows:
        notices.append(f"{path}: metrics.jsonl has no readable step yet")
    dumps = sorted((path / "dumps").glob("step_*.parquet")) if (path / "dumps").exists() else []
    dumps = [d for d in dumps if _readable_dump(d, notices)]
    return RunData(path=path, name=name, rows=rows, meta=meta, recipe=recipe, dumps=dumps)


def _readable_dump(path: Path, notices: list[str]) -> bool:
    try:
        dump_schema(path)
    except DumpError as e:
        notices.append(f"{e}; left out of the scatter plots")
        return False
    return True


def load_runs(paths: list[str | Path], notices: list[str]) -> list[RunData]:
    runs = [r for r in (load_run(p, notices) for p in paths) if r is not None]
    seen: dict[str, int] = {}
    for r in runs:  # several runs of one recipe: tell them apart
        seen[r.name] = seen.get(r.name, 0) + 1
    for r in runs:
        if seen[r.name] > 1:
            r.name = f"{r.name}/{r.path.name}"
    sweeps = {r.sweep_id for r in runs if r.sweep_id}
    if len(sweeps) > 1 or (sweeps and any(r.sweep_id is None for r in runs)):
        notices.append(
            f"runs from different sweeps are compared on purpose: {sorted(s or 'none' for s in sweeps | {r.sweep_id for r in runs})}"
        )
    return runs


def _sweep_ids(root: Path, ignored: list[str] | None = None) -> dict[str, list[Path]]:
    """Valid sweep id -> its run folders. A run.json with an invalid ``sweep_id`` is skipped and listed in
    ``ignored``: the id becomes the report's folder name, and a crafted one could point outside ``report/``."""
    out: dict[str, list[Path]] = {}
    for meta in Path(root).glob("*/*/run.json"):
        notes: list[str] = []
        sid = read_meta(meta.parent, notes).get("sweep_id")
        if ignored is not None:
            ignored.extend(n for n in notes if "sweep_id" in n)
        if sid:
            out.setdefault(sid, []).append(meta.parent)
    return out


def _stamp(sweep_id: str) -> str:
    """Sweep ids end in the submission time (``<name>-YYYYmmdd-HHMMSS``); newest sorts last."""
    return sweep_id[-15:]


def resolve_sweep(spec: str, root: str | Path = "runs") -> tuple[str, list[Path]]:
    """A sweep id; a sweep YAML file (its newest submission); or ``latest`` (the newest sweep under root).

    Raises ValueError naming what was looked for and what exists.
    """
    ignored: list[str] = []
    ids = _sweep_ids(Path(root), ignored)
    for msg in ignored:
        warnings.warn(msg, stacklevel=2)
    if spec in ids:
        return spec, sorted(ids[spec])
    if spec == "latest":
        candidates = list(ids)
        what = "any sweep"
    elif spec.endswith((".yaml", ".yml")) and Path(spec).exists():
        from tim_megatron.recipe.sweep import load_sweep

        name = load_sweep(spec).name
        candidates = [i for i in ids if i.startswith(name + "-")]
        what = f"sweep {name!r} (from {spec})"
    else:
        candidates, what = [], f"sweep id {spec!r}"
    if not candidates:
        known = ", ".join(sorted(ids)) or "none"
        skipped = f" ({len(ignored)} run folder(s) with an invalid sweep_id were ignored)" if ignored else ""
        raise ValueError(f"no run folder under {root} belongs to {what}; sweep ids there: {known}{skipped}")
    best = max(candidates, key=_stamp)
    return best, sorted(ids[best])


def dump_schema(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_schema(path)
    except (OSError, pa.ArrowException) as e:
        raise DumpError(f"{path}: not a readable parquet token dump ({type(e).__name__}: {e})") from None


def read_dump(path: Path, max_points: int = 200_000):
    """The dump's step and probability columns (subsampled); :class:`DumpError` if it cannot be read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = ["step", "pi_train", "pi_infer"]
    names = dump_schema(path).names
    try:
        t = pq.read_table(path, columns=[c for c in cols if c in names])
        d = {c: np.asarray(t.column(c).to_numpy(), dtype=float) for c in t.column_names}
    except (OSError, ValueError, pa.ArrowException) as e:
        raise DumpError(f"{path}: not a readable parquet token dump ({type(e).__name__}: {e})") from None
    n = len(d.get("pi_infer", []))
    if n > max_points:
        idx = np.random.default_rng(0).choice(n, max_points, replace=False)
        d = {k: v[idx] for k, v in d.items()}
    return d
