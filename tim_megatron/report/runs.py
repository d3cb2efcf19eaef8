"""Read run folders for the report: metrics, run metadata, recipe, token dumps. Never crash on bad input.

Problems become notices on the report page (and warnings on stderr): a folder without metrics, a corrupt
line in ``metrics.jsonl`` (skipped, named by file and line number), runs from different sweeps mixed on
purpose, runs still in progress (reported as far as they got).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tim_megatron.logging.summary import series
from tim_megatron.logging.tracker import read_metrics

MISMATCH = "mismatch/old_vs_rollout/rho_std"


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
    meta = {}
    if (path / "run.json").exists():
        try:
            meta = json.loads((path / "run.json").read_text())
        except json.JSONDecodeError:
            notices.append(f"{path}/run.json: unreadable; run shown without metadata")
    recipe = None
    if (path / "recipe.yaml").exists():
        from tim_megatron.recipe import RecipeError, load_recipe

        try:
            recipe = load_recipe(path / "recipe.yaml").recipe
        except RecipeError as e:
            notices.append(f"{path}/recipe.yaml: {str(e).splitlines()[0]}")
    name = meta.get("name") or path.parent.name
    if meta.get("status") in ("running", "submitted", "created"):
        notices.append(f"{name}: still running; shown up to step {rows[-1]['step'] if rows else 0}")
    if not rows:
        notices.append(f"{path}: metrics.jsonl has no readable step yet")
    dumps = sorted((path / "dumps").glob("step_*.parquet")) if (path / "dumps").exists() else []
    return RunData(path=path, name=name, rows=rows, meta=meta, recipe=recipe, dumps=dumps)


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


def _sweep_ids(root: Path) -> dict[str, list[Path]]:
    out: dict[str, list[Path]] = {}
    for meta in Path(root).glob("*/*/run.json"):
        try:
            sid = json.loads(meta.read_text()).get("sweep_id")
        except (json.JSONDecodeError, OSError):
            continue
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
    ids = _sweep_ids(Path(root))
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
        raise ValueError(f"no run folder under {root} belongs to {what}; sweep ids there: {known}")
    best = max(candidates, key=_stamp)
    return best, sorted(ids[best])


def read_dump(path: Path, max_points: int = 200_000):
    import pyarrow.parquet as pq

    cols = ["step", "pi_train", "pi_infer"]
    t = pq.read_table(path, columns=[c for c in cols if c in pq.read_schema(path).names])
    d = {c: t.column(c).to_numpy() for c in t.column_names}
    n = len(d.get("pi_infer", []))
    if n > max_points:
        idx = np.random.default_rng(0).choice(n, max_points, replace=False)
        d = {k: v[idx] for k, v in d.items()}
    return d
