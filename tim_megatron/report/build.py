"""``tim report``: runs (or a sweep) -> ``report/<name>/index.html`` + PNGs + ``summary.csv``.

The page is static and self-contained (relative image links, inline CSS, no scripts), readable without a
server. The summary table ranks variants by mismatch growth and also goes to stdout and CSV.

Every file is written through :func:`~tim_megatron.report.plots.inside`, so none lands outside ``out``; text
from run folders is HTML-escaped on the page, and reaches the generated ``wandb_report.py`` only as Python
literals written by ``repr`` (never spliced into code). Notices, which quote run-folder paths, have their
control characters escaped before they are returned (for the terminal) or written.
"""

from __future__ import annotations

import csv
import html
import json
import math
import time
from pathlib import Path

from tim_megatron.report import align_section, plots
from tim_megatron.report.analysis import WarningSettings, ranked, summarize
from tim_megatron.report.plots import inside
from tim_megatron.report.runs import load_runs, printable

CSS = """
body { font-family: -apple-system, Segoe UI, Helvetica, Arial, sans-serif; margin: 24px auto; max-width: 1320px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 32px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
table { border-collapse: collapse; font-size: 13px; } th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: right; }
th { background: #f4f4f4; } td:first-child, th:first-child { text-align: left; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(600px, 1fr)); gap: 16px; }
.wide { display: grid; grid-template-columns: minmax(0, 1100px); gap: 16px; }
figure { margin: 0; } figure img { width: 100%; border: 1px solid #eee; } figcaption { font-size: 12px; color: #555; }
.notice { background: #fff7e0; border-left: 4px solid #e0a000; padding: 6px 10px; margin: 4px 0; font-size: 13px; }
.muted { color: #777; font-size: 13px; }
"""

COLUMNS = (
    ("variant", "variant"),
    ("mismatch_growth_per_step", "mismatch growth / step"),
    ("first_warning_step", "first warning"),
    ("length_surge_step", "length surge"),
    ("first_collapse_step", "first collapse"),
    ("best_val", "best validation"),
    ("final_mismatch", "final mismatch"),
    ("tokens_per_s", "rollout tokens/s"),
    ("steps", "steps"),
    ("status", "status"),
)


def fmt_cell(v, *, none: str = "none") -> str:
    """A table cell: ``none`` for None, "n/a" for NaN and Inf, a float to 4 significant digits (3 decimals in
    e-notation for magnitudes below 0.01), anything else as ``str``; the run report's and the lab report's."""
    if v is None:
        return none
    if isinstance(v, float):
        if not math.isfinite(v):
            return "n/a"
        return f"{v:.3e}" if (abs(v) < 1e-2 and v != 0) else f"{v:.4g}"
    return str(v)


def table_text(rows: list[dict]) -> str:
    heads = [h for _, h in COLUMNS]
    cells = [[fmt_cell(r[k]) for k, _ in COLUMNS] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(heads)]
    line = "  ".join(h.ljust(w) for h, w in zip(heads, widths, strict=True))
    body = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join([line, "-" * len(line), *body])


def build_report(
    paths: list[str | Path],
    out: str | Path,
    *,
    title: str | None = None,
    settings: WarningSettings | None = None,
    notices: list[str] | None = None,
) -> dict:
    """The report of ``paths`` in ``out``; ``notices`` (e.g. from finding the sweep) go first on the page."""
    t0 = time.perf_counter()
    settings = settings or WarningSettings()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    notices = list(notices or [])
    runs = load_runs(paths, notices)
    summaries = {r.name: summarize(r, settings) for r in runs}
    order = ranked(list(summaries.values()))
    rows = [s.row() for s in order]
    with open(inside(out, "summary.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else [k for k, _ in COLUMNS])
        w.writeheader()
        w.writerows(rows)
    figs = {
        "curves": plots.curve_panels(runs, summaries, out) if runs else [],
        "scatter": plots.scatter_panels(runs, out, notices) if runs else [],
        "buckets": plots.bucket_panels(runs, out) if runs else [],
        "surrogate": plots.surrogate_panel(runs, out) if runs else [],
        "ages": plots.age_panel(runs, out) if runs else [],
    }
    no_dumps = [r.name for r in runs if not r.dumps]
    aligned = align_section.section(runs, out, notices)
    notices = [printable(n) for n in notices]
    (inside(out, "index.html")).write_text(
        _page(title or out.name, runs, rows, figs, notices, no_dumps, settings, aligned)
    )
    inside(out, "report.json").write_text(
        json.dumps(
            {"runs": [str(r.path) for r in runs], "summary": rows, "notices": notices}, indent=1, default=str
        )
    )
    _wandb_helper(out, runs, title or out.name)
    return {
        "rows": rows,
        "notices": notices,
        "figures": figs,
        "seconds": time.perf_counter() - t0,
        "out": out,
    }


def fault_rows(runs) -> list[dict]:
    """Per run whose engines ran in processes of their own (``faults/*`` logged): restarts, seconds lost, prompts
    regenerated, and the steps that had a restart."""
    out = []
    for r in runs:
        logged = [row for row in r.rows if "faults/restarts" in row]
        if logged:
            out.append(
                {
                    "run": r.name,
                    "restarts": sum(row["faults/restarts"] for row in logged),
                    "seconds_lost": sum(row.get("faults/seconds_lost", 0.0) for row in logged),
                    "prompts_regenerated": sum(row.get("faults/prompts_regenerated", 0.0) for row in logged),
                    "steps": [int(row["step"]) for row in logged if row["faults/restarts"] > 0],
                }
            )
    return out


def _faults_section(runs) -> list[str]:
    rows = fault_rows(runs)
    if not rows:
        return []
    e = html.escape
    head = ("run", "engine restarts", "seconds lost", "prompts regenerated", "steps with a restart")
    parts = [
        "<h2>Rollout engine faults</h2>",
        "<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>",
    ]
    for f in rows:
        cells = (
            f["run"],
            fmt_cell(f["restarts"]),
            fmt_cell(f["seconds_lost"]),
            fmt_cell(f["prompts_regenerated"]),
        )
        steps = ", ".join(map(str, f["steps"])) or "none"
        parts.append("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in (*cells, steps)) + "</tr>")
    parts.append(
        "</table><p class='muted'>Engines in processes of their own (rollout.engine_process): each restart "
        "reloaded the weights its engine held and regenerated what was lost (docs/faults.md).</p>"
    )
    return parts


def _img(f: str, cap: str) -> str:
    return f'<figure><img src="{html.escape(f)}" alt="{html.escape(cap)}"></figure>'


def _page(title, runs, rows, figs, notices, no_dumps, s: WarningSettings, aligned: list[str]) -> str:
    e = html.escape
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title><style>{CSS}</style></head><body>"
    ]
    parts.append(f"<h1>Training-inference mismatch report: {e(title)}</h1>")
    parts.append(
        f"<p class='muted'>{len(runs)} run(s), generated {time.strftime('%Y-%m-%d %H:%M')}. Dashed vertical lines: first early "
        f"warning (median of the last {s.window} mismatch values reaches {s.threshold}x the median of the first "
        f"{s.baseline_steps}); dotted: response-length surge. Collapse: validation (or reward) {int(s.collapse_drop * 100)}% below its best. "
        f"Series of {plots.SMOOTH_MIN_POINTS} or more steps: faint per-step values under a rolling median.</p>"
    )
    for n in notices:
        parts.append(f"<div class='notice'>{e(n)}</div>")
    parts.append("<h2>Variants ranked by mismatch growth</h2>")
    if rows:
        parts.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for _, h in COLUMNS) + "</tr>")
        for r in rows:
            parts.append("<tr>" + "".join(f"<td>{e(fmt_cell(r[k]))}</td>" for k, _ in COLUMNS) + "</tr>")
        parts.append(
            "</table><p class='muted'>Mismatch growth: Theil-Sen slope of log(std of rho) per step; "
            "positive means the mismatch grows. Also in summary.csv.</p>"
        )
    else:
        parts.append("<p>No run with metrics was found.</p>")
    sections = (
        ("curves", "Curves by variant", None),
        ("scatter", "pi_train vs pi_infer, earliest and latest dumps", "no token dumps"),
        ("buckets", "rho drift by probability bucket", None),
        ("surrogate", "Surrogate J against step", "J is logged by every run; none had a finite value"),
        ("ages", "Off-policy: staleness and TIM by the trained batch's age", None),
    )
    for key, heading, empty in sections:
        if key == "ages" and not figs[key]:
            continue  # on-policy runs only
        parts.append(f"<h2>{e(heading)}</h2>")
        if key == "scatter" and no_dumps:
            parts.append(
                f"<p class='muted'>No token dumps for: {e(', '.join(no_dumps))} (diagnostics.dumps.every = 0).</p>"
            )
        if figs[key]:
            cls = "wide" if key == "scatter" else "grid"
            parts.append(f"<div class='{cls}'>" + "".join(_img(f, c) for f, c in figs[key]) + "</div>")
        elif empty and key != "scatter":
            parts.append(f"<p class='muted'>{e(empty)}</p>")
    parts.extend(_faults_section(runs))
    parts.extend(aligned)  # already escaped
    parts.append("</body></html>")
    return "\n".join(parts)


def _wandb_helper(out: Path, runs, title: str) -> None:
    """A script that rebuilds the curve panels as a wandb report for runs that were logged online (optional).

    Its only inputs are three constants written with ``repr`` (a list of hex ids, a list of metric names, the
    title string): whatever the title holds, it stays a string literal.
    """
    import hashlib

    ids = [hashlib.blake2b(str(r.path.resolve()).encode(), digest_size=6).hexdigest() for r in runs]
    keys = [k for k, *_ in plots.CURVES]
    inside(
        out, "wandb_report.py"
    ).write_text(f'''"""Optional: the same comparison as a wandb report, for runs logged online.

Needs `pip install wandb-workspaces` and network access; nothing in tim-megatron depends on it.
    python wandb_report.py ENTITY PROJECT
"""
import sys

import wandb_workspaces.reports.v2 as wr

RUN_IDS = {ids!r}
METRICS = {keys!r}
TITLE = {"tim-megatron: " + title!r}

entity, project = sys.argv[1], sys.argv[2]
runset = wr.Runset(entity=entity, project=project, filters="Run.ID in " + repr(RUN_IDS))
panels = [wr.LinePlot(title=m, x="Step", y=[m]) for m in METRICS]
report = wr.Report(entity=entity, project=project, title=TITLE,
                   blocks=[wr.PanelGrid(runsets=[runset], panels=panels)])
report.save()
print(report.url)
''')
