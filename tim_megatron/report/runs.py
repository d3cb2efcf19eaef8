"""Read run folders for the report: metrics, run metadata, recipe, token dumps. Never crash on bad input.

Problems become notices on the report page (and warnings on stderr): a folder without metrics, a corrupt
line in ``metrics.jsonl`` (skipped, named by file and line number), a dump that is not parquet, runs from
different sweeps mixed on purpose, runs still in progress (reported as far as they got).

A run folder is data, not code, and may have been written by anyone: every identifier read back from it
(``name``, ``sweep_id``, ``status`` in ``run.json``) must match a strict pattern before the report uses it in a
path, a file name, a page or generated code. One that does not is dropped with a notice. Only regular files
are read, each within a size limit (:mod:`tim_megatron.untrusted`); ``recipe.yaml`` is read as it
stands (a run folder holds its recipe resolved), so a ``base:`` in it is never followed. Notices are the one
channel for problems (the command line prints them once); each is made :func:`printable` before it is shown.

``--sweep latest`` is the sweep with the newest submission stamp (``<name>-YYYYmmdd-HHMMSS``, local time), among
stamps that are not in the future and not later than the sweep's run folders were last written: a copied-in
``run.json`` with ``sweep_id: latest`` (a reserved word) or a far-future stamp cannot take it over.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tim_megatron import metric_names as names
from tim_megatron.logging.summary import series
from tim_megatron.logging.tracker import MetricsError, read_metrics
from tim_megatron.recipe.schema import NAME_PATTERN
from tim_megatron.untrusted import UnreadableFile, open_regular, shown
from tim_megatron.untrusted import printable as printable  # the command line's notices use it

MISMATCH = names.RHO_STD
STATUS_PATTERN = r"^[a-z][a-z_-]{0,31}$"
MAX_META_BYTES = 1 << 20
"""A run.json larger than this is not read (the project writes a few hundred bytes)."""
RESERVED_IDS = frozenset({"latest"})
"""Words ``tim report --sweep`` gives a meaning; a run.json claiming one as its sweep id is not believed."""
STAMP = re.compile(r"-(\d{8}-\d{6})$")
"""The submission time at the end of a sweep id (``tim sweep`` writes ``<name>-YYYYmmdd-HHMMSS``)."""
CLOCK_SKEW_SECONDS = 300.0
"""How far a stamp may run ahead of this machine's clock, or of its run folders' times (clocks of nodes)."""


def valid_id(value: object) -> bool:
    """A run name or sweep id: letters, digits, '.', '_', '-', starting with a letter or digit, <= 100 chars."""
    return isinstance(value, str) and re.fullmatch(NAME_PATTERN, value) is not None


class DumpError(ValueError):
    """A token dump that cannot be read as parquet."""


def checked_meta(path: Path, notices: list[str]) -> dict:
    """``run.json`` read by the run folder's one reader (:func:`tim_megatron.run_dir.meta.read_record`) as a dict
    whose identifiers are all valid; an unreadable record or a bad identifier is left out with a notice."""
    from tim_megatron.run_dir.meta import RecordError, read_record

    f = path / "run.json"
    if not os.path.lexists(f):
        return {}
    try:
        meta = read_record(path)
    except RecordError as e:
        notices.append(f"{e}; run shown without metadata")
        return {}
    for key, ok in (
        ("name", valid_id),
        ("sweep_id", valid_id),
        ("status", lambda v: isinstance(v, str) and re.fullmatch(STATUS_PATTERN, v) is not None),
    ):
        if key in meta and meta[key] is not None and not ok(meta[key]):
            notices.append(f"{f}: {key} = {shown(meta.pop(key))} is not a valid {key}; ignored")
    sid = meta.get("sweep_id")
    if isinstance(sid, str) and sid.lower() in RESERVED_IDS:
        notices.append(
            f"{f}: sweep_id = {shown(meta.pop('sweep_id'))} is a reserved word of `tim report --sweep`, not a "
            "sweep id; ignored"
        )
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


read_meta = checked_meta
"""The name ``tim_megatron/lab/runstats.py`` imports it by: a rule file of the lab, whose content the lab's
provenance judges, so it is not edited for a rename."""


def read_jsonl(path: Path, notices: list[str]) -> list[dict] | None:
    """:func:`~tim_megatron.logging.tracker.read_metrics`, each skipped line or value a notice; None (and a
    notice) when the file is not read at all."""
    try:
        return read_metrics(path, notices)
    except MetricsError as e:
        notices.append(f"{e}; run left out")
        return None


def read_recipe(path: Path, notices: list[str]):
    """The run folder's ``recipe.yaml`` as it stands, validated; None (with a notice) if it cannot be used.

    A run folder holds its recipe resolved, so ``base:`` is not followed: one pointing anywhere would let a
    copied-in folder probe which files exist, or bring another file's values into the report.
    """
    from tim_megatron.recipe.loader import RecipeError, read_yaml_file, validate_recipe

    f = path / "recipe.yaml"
    try:
        data = read_yaml_file(f)
        if not isinstance(data, dict):
            raise RecipeError(f"{f}: a recipe must be a mapping at the top level, got {type(data).__name__}")
        if "base" in data:
            notices.append(
                f"{f}: base = {shown(data['base'])}: a run folder holds its recipe resolved, so base: is not "
                "followed; the recipe is left out"
            )
            return None
        return validate_recipe(data)
    except RecipeError as e:
        notices.append(f"{f}: {str(e).splitlines()[0]}")
        return None


def load_run(path: str | Path, notices: list[str]) -> RunData | None:
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not os.path.lexists(metrics):
        notices.append(
            f"{path}: no metrics.jsonl (not a run folder, or the run has not logged a step yet); left out"
        )
        return None
    rows = read_jsonl(metrics, notices)
    if rows is None:
        return None
    meta = checked_meta(path, notices)
    recipe = read_recipe(path, notices) if os.path.lexists(path / "recipe.yaml") else None
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
    """Valid sweep id -> its run folders. A run.json with an invalid or reserved ``sweep_id`` is skipped and
    listed in ``ignored``: the id becomes the report's folder name, and a crafted one could point outside
    ``report/`` or stand for another sweep."""
    out: dict[str, list[Path]] = {}
    for meta in Path(root).glob("*/*/run.json"):
        notes: list[str] = []
        sid = checked_meta(meta.parent, notes).get("sweep_id")
        if ignored is not None:
            ignored.extend(n for n in notes if "sweep_id" in n)
        if sid:
            out.setdefault(sid, []).append(meta.parent)
    return out


def submitted_at(sweep_id: str) -> float | None:
    """The submission time at the end of a sweep id, in seconds since the epoch; None if it has none."""
    m = STAMP.search(sweep_id)
    if m is None:
        return None
    try:
        return time.mktime(time.strptime(m.group(1), "%Y%m%d-%H%M%S"))
    except (ValueError, OverflowError):  # month 13, second 61, a year time_t cannot hold
        return None


def _last_written(folders: list[Path]) -> float:
    times = []
    for d in folders:
        try:
            times.append(os.stat(d / "run.json").st_mtime)
        except OSError:
            continue
    return max(times, default=0.0)


def newest_sweep(candidates: list[str], ids: dict[str, list[Path]], notices: list[str]) -> str | None:
    """The candidate with the newest believable submission stamp; each one passed over is a notice.

    A stamp is believed when it parses, is not ahead of this machine's clock, and is not later than its run
    folders were last written (``tim sweep`` creates them after it stamps the id; a folder planted earlier
    with a stamp that only later stops being in the future fails this).
    """
    now = time.time()
    dated: list[tuple[float, float, str]] = []
    for sid in candidates:
        stamp = submitted_at(sid)
        written = _last_written(ids[sid])
        if stamp is None:
            why = "its id does not end in a submission time (-YYYYmmdd-HHMMSS)"
        elif stamp > now + CLOCK_SKEW_SECONDS:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))
            why = f"its submission time {when} is in the future"
        elif stamp > written + CLOCK_SKEW_SECONDS:
            why = "its submission time is later than its run folders were last written"
        else:
            dated.append((stamp, written, sid))
            continue
        notices.append(f"sweep {sid}: not taken as the newest sweep: {why}")
    return max(dated)[2] if dated else None


def resolve_sweep(
    spec: str, root: str | Path = "runs", notices: list[str] | None = None
) -> tuple[str, list[Path]]:
    """A sweep id; a sweep YAML file (its newest submission); or ``latest`` (the newest sweep under root).

    Run folders skipped on the way (an invalid or reserved sweep id) and sweeps passed over as the newest
    are appended to ``notices``. Raises ValueError naming what was looked for and what exists.
    """
    notices = [] if notices is None else notices
    ignored: list[str] = []
    ids = _sweep_ids(Path(root), ignored)
    notices.extend(ignored)
    if spec == "latest":
        candidates, what = list(ids), "any sweep"
    elif spec in ids:
        return spec, sorted(ids[spec])
    elif spec.endswith((".yaml", ".yml")) and Path(spec).exists():
        from tim_megatron.recipe.sweep import load_sweep

        name = load_sweep(spec).name
        candidates = [i for i in ids if i.startswith(name + "-")]
        what = f"sweep {name!r} (from {spec})"
    else:
        candidates, what = [], f"sweep id {spec!r}"
    passed_over: list[str] = []
    best = newest_sweep(candidates, ids, passed_over) if candidates else None
    notices.extend(passed_over)
    if best is None:
        known = ", ".join(sorted(ids)) or "none"
        skipped = f" ({len(ignored)} run folder(s) with an invalid sweep_id were ignored)" if ignored else ""
        dated = f"; {len(passed_over)} passed over as the newest (see the notices)" if passed_over else ""
        raise ValueError(
            f"no run folder under {root} belongs to {what}; sweep ids there: {known}{skipped}{dated}"
        )
    return best, sorted(ids[best])


def dump_schema(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with open_regular(path) as f:
            return pq.read_schema(f)
    except UnreadableFile as e:
        raise DumpError(str(e)) from None
    except (OSError, pa.ArrowException) as e:
        raise DumpError(f"{path}: not a readable parquet token dump ({type(e).__name__}: {e})") from None


def read_dump(path: Path, max_points: int = 200_000):
    """The dump's step and probability columns (subsampled); :class:`DumpError` if it cannot be read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = ["step", "pi_train", "pi_infer"]
    names = dump_schema(path).names
    try:
        with open_regular(path) as f:
            t = pq.read_table(f, columns=[c for c in cols if c in names])
        d = {c: np.asarray(t.column(c).to_numpy(), dtype=float) for c in t.column_names}
    except UnreadableFile as e:
        raise DumpError(str(e)) from None
    except (OSError, ValueError, pa.ArrowException) as e:
        raise DumpError(f"{path}: not a readable parquet token dump ({type(e).__name__}: {e})") from None
    n = len(d.get("pi_infer", []))
    if n > max_points:
        idx = np.random.default_rng(0).choice(n, max_points, replace=False)
        d = {k: v[idx] for k, v in d.items()}
    return d
