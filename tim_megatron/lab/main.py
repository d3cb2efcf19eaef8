"""``tim lab``: plan, run, aggregate, decide, report (the whole pipeline, top to bottom).

Everything that can be checked before a run is checked before the first one: the grid and every arm, ``--only``,
the ``--write-archive`` target (:func:`tim_megatron.lab.archive.check_target`) and, for a pre-registered grid,
a clean checkout (:func:`tim_megatron.lab.checkout.require_clean`). A run's metrics are read through
:func:`tim_megatron.lab.rows.checked_run` (a value of the wrong type is left out and named, never a traceback),
and a report that lacks some of the grid's runs says which.
"""

from __future__ import annotations

import time
from pathlib import Path

from tim_megatron.lab.archive import check_target, unpacked, write_archive
from tim_megatron.lab.checkout import require_clean
from tim_megatron.lab.claims import LabData, verdicts
from tim_megatron.lab.detectors import detector_table, load_traces
from tim_megatron.lab.grid import Grid, GridError, load_grid, plan
from tim_megatron.lab.report import write_report
from tim_megatron.lab.rows import checked_run
from tim_megatron.lab.runner import completed_runs, run_grid

REPO = Path(__file__).resolve().parents[2]
MISSING_SHOWN = 12
"""Missing runs named in the notice (the rest are counted)."""


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


def collect(grid: Grid, plans, root: Path, notices: list[str] | None = None) -> LabData:
    """Every completed run of the grid (made with the grid's current overrides) and its statistics; a value of the
    wrong type in a run's metrics is left out, with a notice appended to ``notices``."""
    runs: dict[str, dict] = {}
    for arm, seed, d in completed_runs(grid, plans, root):
        stats, notes = checked_run(
            d, arm=arm, seed=seed, window=grid.collapse_window, min_steps=grid.collapse_min_steps
        )
        if notices is not None:
            notices.extend(notes)
        runs.setdefault(arm, {})[seed] = stats
    return LabData(grid=grid, plans={p.arm.name: p for p in plans}, runs=runs)


def missing_runs(grid: Grid, plans, lab: LabData) -> list[str]:
    """``arm/seedN`` of every run of the grid's runnable arms that the report has no completed run of."""
    return [
        f"{p.arm.name}/seed{s}"
        for p in plans
        if p.runnable
        for s in grid.seeds
        if s not in lab.runs.get(p.arm.name, {})
    ]


def run_lab(
    grid_path: str,
    *,
    out: Path | None = None,
    root: Path | None = None,
    only: set[str] | None = None,
    aggregate_only: bool = False,
    from_archive: Path | None = None,
    write_archive_to: Path | None = None,
    overwrite_archive: bool = False,
    allow_dirty: bool = False,
    timeout_s: float | None = None,
    jobs: int = 1,
    command: str = "",
    repo: Path = REPO,
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
            return _report(
                grid, plans, archived, out, records=[], wall=None, command=command, log=log,
                missing_from=f"the archive {from_archive}",
            )  # fmt: skip
    if write_archive_to is not None:  # before any run: hours of runs must not end in a refusal
        check_target(write_archive_to, root=root, out=out, overwrite=overwrite_archive)
    if not aggregate_only:
        require_clean(grid, repo, allow_dirty=allow_dirty)
    t0 = time.perf_counter()
    records = (
        []
        if aggregate_only
        else run_grid(grid, plans, root, only=only, timeout_s=timeout_s, jobs=jobs, log=log)
    )
    wall = time.perf_counter() - t0 if records else None
    res = _report(
        grid, plans, root, out, records=records, wall=wall, command=command, log=log,
        missing_from=f"the run folders {root}",
    )  # fmt: skip
    if write_archive_to is not None:
        n = write_archive(grid, plans, root, write_archive_to, out=out, overwrite=overwrite_archive)
        log(f"archive: {write_archive_to} ({n} runs)")
    return res


def _report(
    grid: Grid, plans, root: Path, out: Path, *, records, wall, command: str, log, missing_from: str
) -> dict:
    notices: list[str] = []
    lab = collect(grid, plans, root, notices)
    missing = missing_runs(grid, plans, lab)
    if missing:
        total = sum(len(grid.seeds) for p in plans if p.runnable)
        more = f" and {len(missing) - MISSING_SHOWN} more" if len(missing) > MISSING_SHOWN else ""
        notices.insert(
            0,
            f"{len(missing)} of the grid's {total} runs are not in this report (no completed run of today's grid "
            f"in {missing_from}): {', '.join(missing[:MISSING_SHOWN])}{more}",
        )
    for n in notices:
        log(f"notice: {n}")
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
        notices=notices,
    )
    return {
        "grid": grid,
        "verdicts": vs,
        "page": page,
        "records": records,
        "wall_seconds": wall,
        "lab": lab,
        "notices": notices,
    }
