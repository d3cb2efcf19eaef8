"""``tim lab``: plan, run, aggregate, decide, report (the whole pipeline, top to bottom)."""

from __future__ import annotations

import time
from pathlib import Path

from tim_megatron.lab.archive import unpacked, write_archive
from tim_megatron.lab.claims import LabData, verdicts
from tim_megatron.lab.detectors import detector_table, load_traces
from tim_megatron.lab.grid import Grid, GridError, load_grid, plan
from tim_megatron.lab.report import write_report
from tim_megatron.lab.runner import completed_runs, run_grid
from tim_megatron.lab.runstats import run_stats

REPO = Path(__file__).resolve().parents[2]


def resolve_grid(name: str) -> Path:
    """A grid file, or a preset name (``quick``, ``full``) under ``lab/`` here or in the repository."""
    p = Path(name)
    if p.is_file():
        return p
    for root in (Path("lab"), REPO / "lab"):
        cand = root / f"{name}.yaml"
        if cand.is_file():
            return cand
    presets = sorted(x.stem for x in (REPO / "lab").glob("*.yaml"))
    raise GridError(f"{name}: neither a grid file nor a preset (presets: {', '.join(presets) or 'none'})")


def collect(grid: Grid, plans, root: Path) -> LabData:
    """Every completed run of the grid (made with the grid's current overrides) and its statistics."""
    runs: dict[str, dict] = {}
    for arm, seed, d in completed_runs(grid, plans, root):
        stats = run_stats(
            d, arm=arm, seed=seed, window=grid.collapse_window, min_steps=grid.collapse_min_steps
        )
        runs.setdefault(arm, {})[seed] = stats
    return LabData(grid=grid, plans={p.arm.name: p for p in plans}, runs=runs)


def run_lab(
    grid_path: str,
    *,
    out: Path | None = None,
    root: Path | None = None,
    only: set[str] | None = None,
    aggregate_only: bool = False,
    from_archive: Path | None = None,
    write_archive_to: Path | None = None,
    timeout_s: float | None = None,
    jobs: int = 1,
    command: str = "",
    log=print,
) -> dict:
    grid = load_grid(resolve_grid(grid_path))
    plans = plan(grid)  # every arm validated before anything runs
    if only is not None:
        names = [p.arm.name for p in plans]
        unknown = only - set(names)
        if unknown or not only:
            what = f"{sorted(unknown)}: no such arm" if unknown else "names no arm"
            raise GridError(f"--only {what} in {grid.path}; its arms: {', '.join(names)}")
    root = root or Path("runs") / "lab" / grid.name
    out = out or Path("report") / grid.name
    if from_archive is not None:
        if not aggregate_only or write_archive_to is not None:
            raise GridError(
                "--from-archive reads runs and runs nothing: it needs --aggregate-only, and not --write-archive"
            )
        with unpacked(grid, plans, from_archive) as archived:
            return _report(grid, plans, archived, out, records=[], wall=None, command=command)
    t0 = time.perf_counter()
    records = (
        []
        if aggregate_only
        else run_grid(grid, plans, root, only=only, timeout_s=timeout_s, jobs=jobs, log=log)
    )
    wall = time.perf_counter() - t0 if records else None
    res = _report(grid, plans, root, out, records=records, wall=wall, command=command)
    if write_archive_to is not None:
        n = write_archive(grid, plans, root, write_archive_to)
        log(f"archive: {write_archive_to} ({n} runs)")
    return res


def _report(grid: Grid, plans, root: Path, out: Path, *, records, wall, command: str) -> dict:
    lab = collect(grid, plans, root)
    vs = verdicts(lab)
    traces = load_traces([r for arm in lab.runs.values() for r in arm.values()])
    detectors, tuned = detector_table(traces, grid.tune_seeds)
    page = write_report(
        lab,
        out,
        verdicts=vs,
        detectors=detectors,
        tuned=tuned,
        command=command or f"tim lab {grid.path}",
        wall_seconds=wall,
        run_records=records,
    )
    return {"grid": grid, "verdicts": vs, "page": page, "records": records, "wall_seconds": wall, "lab": lab}
