"""The lab's outputs: ``index.html`` (static, no scripts), per-arm curves with seed bands, and CSVs.

* ``verdicts.csv``: one row per claim C1..C9 (:mod:`.claims`);
* ``arms.csv``: per arm, the statistics behind the claims, mean and 95% CI across seeds;
* ``runs.csv``: per run, everything :mod:`.runstats` computed;
* ``detectors.csv``: the early-warning evaluation (:mod:`.detectors`);
* ``tables.md``: the verdict, arm and detector tables in Markdown, for ``docs/lab-results.md`` (so that no
  number there is typed by hand), with the method (whether the rules were in place before the runs:
  :mod:`.provenance`), the commits the runs came from (``run.json``'s ``code``; "not recorded" for older runs)
  and the report's notices (runs of the grid it lacks, values left out of a run's metrics).

Figures follow ``tim_megatron/report/plots.py``: one PNG per metric, labelled axes, text never read as mathtext.
Every file is written only inside the output folder and replaces what is there by an atomic rename: a link planted
in an output folder from elsewhere is replaced, never written through.
"""

from __future__ import annotations

import csv
import html
import io
import math
import os
import time
import warnings
from pathlib import Path

import numpy as np

from tim_megatron import clock
from tim_megatron import metric_names as names
from tim_megatron.lab.checkout import code_rows, code_text, run_code
from tim_megatron.lab.claims import GROWTH_MIN, ClaimVerdict, LabData
from tim_megatron.lab.deficits import D_MIN_EFFECT, policy_deficits
from tim_megatron.lab.detectors import TUNE_GRID, Evaluation
from tim_megatron.lab.provenance import RunRules, rules_fixed_text
from tim_megatron.lab.rows import checked_rows
from tim_megatron.lab.runner import lab_spec
from tim_megatron.lab.runstats import (
    HIGH_BUCKET,
    LOW_BUCKETS,
    P,
    RunStats,
    pooled_bucket,
    run_meta,
    series,
)
from tim_megatron.lab.sensitivity import sensitivity_rows
from tim_megatron.lab.stats import mean_ci
from tim_megatron.report.build import CSS, fmt_cell
from tim_megatron.report.plots import _label, _plt, slug
from tim_megatron.safe_files import check_inside, save_figure, write_atomic

CURVES = (
    (names.REWARD, "Training reward", "mean reward", "linear"),
    (names.VAL_ACCURACY, "Validation accuracy (greedy)", "accuracy", "linear"),
    (names.VAL_POLICY_REWARD, "Policy reward (sampled, no injection)", "mean reward", "linear"),
    (P + "rho_std", "Mismatch: rho_std (old vs rollout)", "std of pi_train / pi_infer", "log"),
    (
        P + "log_ppl_abs_diff_seq_sum",
        "log-ppl |diff| per sequence (TIM-LR Eq. 8)",
        "nats per sequence",
        "log",
    ),
    (P + "log_ppl_abs_diff_token_mean", "log-ppl |diff| per token", "nats per token", "log"),
    (names.RESPONSE_LENGTH, "Response length", "tokens", "linear"),
    ("objective/J", "Surrogate J = sum A (phi - 1)", "J", "linear"),
    ("bucket/low-minus-high", "rho_mean(pi < 0.1) - rho_mean(pi >= 0.9)", "difference of mean rho", "linear"),
    (P + "inv_rho_mean", "E_infer[1/rho] (Eq. 46)", "mean pi_infer / pi_train", "linear"),
    ("response/entropy_mean", "Token entropy", "nats per token", "linear"),
    ("actor/grad_norm", "Gradient norm", "L2 norm", "log"),
    (names.LR, "Learning rate", "learning rate", "log"),
)


def _arm_series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    if key == "bucket/low-minus-high":
        lx, lo = pooled_bucket(rows, LOW_BUCKETS)
        hx, hi = pooled_bucket(rows, (HIGH_BUCKET,))
        hi_by = dict(zip(hx.tolist(), hi.tolist(), strict=True))
        keep = [i for i, s in enumerate(lx.tolist()) if s in hi_by]
        return lx[keep], np.array([lo[i] - hi_by[lx[i]] for i in keep])
    return series(rows, key)


def curve_panels(lab: LabData, out: Path) -> list[tuple[str, str]]:
    """Per metric: each arm's mean over seeds, with the band from the lowest to the highest seed."""
    plt = _plt()
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    arms = [a for a in lab.plans if lab.runs.get(a)]
    rows = {
        a: {s: checked_rows(Path(r.path), run=f"{a}/seed{s}")[0] for s, r in lab.runs[a].items()}
        for a in arms
    }
    made = []
    for key, title, ylabel, scale in CURVES:
        fig, ax = plt.subplots(figsize=(6.4, 3.8), constrained_layout=True)
        drawn, positive = 0, True
        for i, a in enumerate(arms):
            per_seed = [_arm_series(r, key) for r in rows[a].values()]
            per_seed = [(x, y) for x, y in per_seed if len(x)]
            if not per_seed:
                continue
            steps = sorted(set().union(*(x.tolist() for x, _ in per_seed)))
            grid = np.full((len(per_seed), len(steps)), np.nan)
            for j, (x, y) in enumerate(per_seed):
                idx = np.searchsorted(steps, x)
                grid[j, idx] = y
            with warnings.catch_warnings():  # a step no seed logged is an all-NaN column: NaN is right there
                warnings.simplefilter("ignore", RuntimeWarning)
                mean, lo, hi = np.nanmean(grid, 0), np.nanmin(grid, 0), np.nanmax(grid, 0)
            color = cycle[i % len(cycle)]
            ax.plot(steps, mean, color=color, linewidth=1.4, label=f"{a} ({len(per_seed)} seeds)")
            if len(per_seed) > 1:
                ax.fill_between(steps, lo, hi, color=color, alpha=0.15, linewidth=0)
            positive &= bool(np.nanmin(lo) > 0) if np.isfinite(lo).any() else True
            drawn += 1
        if not drawn:
            plt.close(fig)
            continue
        if scale == "log" and positive:
            _log_axis(ax)
        _label(ax, title, ylabel)
        ax.legend(loc="best", fontsize=7, framealpha=0.85)
        name = f"curve_{slug(key)}.png"
        save_figure(fig, inside(out, name), root=out)
        plt.close(fig)
        made.append((name, f"{title}: mean over seeds, band = lowest to highest seed"))
    return made


def _log_axis(ax) -> None:
    """Log y axis with plain-number ticks (mathtext is off for text from run folders, so no 10^k labels)."""
    from matplotlib import ticker

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_locator(ticker.NullLocator())


def arm_rows(lab: LabData) -> list[dict]:
    out = []
    for a, p in lab.plans.items():
        runs = list(lab.runs.get(a, {}).values())
        k = sum(r.collapse_step is not None for r in runs)

        def ci(key: str, fmt: str = "{:+.3g}", runs=runs) -> str:
            return mean_ci([getattr(r, key) for r in runs]).as_text(fmt)

        def avg(key: str, runs=runs) -> float:
            v = [getattr(r, key) for r in runs if r is not None and _finite(getattr(r, key))]
            return float(np.mean(v)) if v else float("nan")

        out.append(
            {
                "arm": a,
                "status": "ran"
                if runs
                else (f"not run: {p.reason} ({p.schema_error})" if p.reason else "no completed run"),
                "seeds": len(runs),
                "overrides": " ".join(p.arm.overrides),
                "slope_log_rho_std_per_step": ci("slope"),
                "growth": ci("growth"),
                "rho_std_start": avg("rho_std_start"),
                "rho_std_end": avg("rho_std_end"),
                "j_step_pcc": ci("j_step_pcc", "{:+.2f}"),
                "bucket_drift": ci("bucket_drift"),
                "collapsed": f"{k}/{len(runs)}" if runs else "",
                "collapse_steps": " ".join(str(r.collapse_step) for r in runs if r.collapse_step is not None),
                "reward_start": avg("reward_start"),
                "reward_end": avg("reward_end"),
                "final_reward": ci("final_reward", "{:.3f}"),
                "policy_reward": ci("policy_reward", "{:.3f}"),
                "dose_kl_per_token": avg("dose"),
                "ppl_growth": ci("ppl_growth"),
                "ppl_growth_token": ci("ppl_growth_token"),
                "length_start": avg("length_start"),
                "length_end": avg("length_end"),
                "surge_steps": " ".join(str(r.surge_step) for r in runs if r.surge_step is not None),
                "wall_seconds": avg("wall_seconds"),
            }
        )
    return out


def _finite(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _fmt(v) -> str:
    """A cell as :func:`tim_megatron.report.build.fmt_cell` writes it, None as an empty cell."""
    return fmt_cell(v, none="")


def inside(out: Path, name: str) -> Path:
    """``out / name``, refused (:class:`tim_megatron.safe_files.UnsafePathError`) unless it lies directly inside
    ``out``; whatever is there is replaced, never followed."""
    target = check_inside(out, Path(out) / name, what="report file")
    if target.parent != Path(os.path.normpath(os.path.abspath(out))):
        raise ValueError(f"report file {name!r} would be written outside {out}")
    return target


def write_csv(path: Path, rows: list[dict]) -> None:
    f = io.StringIO(newline="")
    if rows:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows([{k: _fmt(v) if isinstance(v, float) else v for k, v in r.items()} for r in rows])
    write_atomic(path, f.getvalue(), root=path.parent, what="report file")


def _table(rows: list[dict], cols: list[str] | None = None) -> str:
    if not rows:
        return "<p class='muted'>none</p>"
    cols = cols or list(rows[0])
    e = html.escape
    head = "".join(f"<th>{e(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{e(_fmt(r.get(c)))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


MD_VERDICT = (
    "claim",
    "verdict",
    "effect",
    "ci_low",
    "ci_high",
    "n_seeds",
    "p_value",
    "p_holm",
    "unit",
    "detail",
)
MD_ARM = (
    "arm", "seeds", "growth", "ppl_growth", "ppl_growth_token", "rho_std_start", "rho_std_end", "dose_kl_per_token",
    "j_step_pcc", "bucket_drift", "collapsed", "collapse_steps", "reward_start", "final_reward", "policy_reward",
    "length_start", "length_end",
    "surge_steps", "wall_seconds",
)  # fmt: skip


def markdown_table(rows: list[dict], cols: tuple[str, ...]) -> str:
    """A Markdown table of ``cols`` (numbers as in the CSVs; ``|`` escaped)."""

    def cell(v) -> str:
        return _fmt(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def write_tables_md(
    path: Path,
    *,
    title: str,
    verdicts: list[ClaimVerdict],
    arms: list[dict],
    detectors: list[Evaluation],
    method: str = "",
    deficits: list[dict] = (),
    sensitivity: list[dict] = (),
    code: str = "",
    notices: list[str] = (),
) -> None:
    det = [d.row() for d in detectors]
    parts = [
        f"# {title}: tables",
        method,
        *([code] if code else []),
        *[f"Notice: {n}" for n in notices],
        "## Verdicts",
        markdown_table([v.row() for v in verdicts], MD_VERDICT),
    ]
    if deficits:
        heading = (
            "per contrast (reference minus arm, paired by seed; Holm across contrasts; "
            if "contrast" in deficits[0]
            else "per injected arm (exact minus arm, paired by seed; Holm across arms; "
        )
        parts += [
            f"## Policy reward deficit {heading}smallest effect {D_MIN_EFFECT})",
            markdown_table(list(deficits), tuple(deficits[0])),
        ]
    if sensitivity:
        parts += [
            "## What the deficit tests could detect (at the observed paired SD; one-sided paired t at Holm's "
            "strictest level; 80% power; tim_megatron/lab/sensitivity.py)",
            markdown_table(list(sensitivity), tuple(sensitivity[0])),
        ]
    parts += [
        "## Arms (mean over seeds, 95% CI in brackets)",
        markdown_table(arms, MD_ARM),
        "## Early-warning detectors",
        markdown_table(det, tuple(det[0]) if det else ("rule",)),
    ]
    write_atomic(path, "\n\n".join(parts) + "\n", root=path.parent, what="report file")


def write_report(
    lab: LabData,
    out: Path,
    *,
    verdicts: list[ClaimVerdict],
    detectors: list[Evaluation],
    tuned,
    command: str,
    wall_seconds: float | None,
    run_records: list | None = None,
    notices: list[str] = (),
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    write_csv(inside(out, "verdicts.csv"), [v.row() for v in verdicts])
    arms = arm_rows(lab)
    write_csv(inside(out, "arms.csv"), arms)
    runs: list[RunStats] = sorted(
        (r for a in lab.runs.values() for r in a.values()), key=lambda r: (r.arm, r.seed)
    )
    codes = {(r.arm, r.seed): run_code(run_meta(Path(r.path))) for r in runs}
    write_csv(inside(out, "runs.csv"), [{**r.row(), **_code_cells(codes[r.arm, r.seed])} for r in runs])
    commits = code_rows([(f"{r.arm}/seed{r.seed}", codes[r.arm, r.seed]) for r in runs])
    rules = rules_text(lab)
    write_csv(inside(out, "detectors.csv"), [d.row() for d in detectors])
    deficits = [d.row() for d in policy_deficits(lab)]
    if deficits:
        write_csv(inside(out, "deficits.csv"), deficits)
    sensitivity = sensitivity_rows(lab) if deficits else []
    write_tables_md(
        inside(out, "tables.md"),
        title=lab.grid.name,
        verdicts=verdicts,
        arms=arms,
        detectors=detectors,
        method=method_text(lab.grid, rules=rules),
        deficits=deficits,
        sensitivity=sensitivity,
        code=code_text(commits),
        notices=list(notices),
    )
    figs = curve_panels(lab, out)
    e = html.escape
    g = lab.grid
    not_run = [a for a, p in lab.plans.items() if not p.runnable]
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{e(g.name)}</title><style>{CSS}</style></head><body>",
        f"<h1>TIM lab: {e(g.name)}</h1>",
        f"<p>{e(g.description)}</p>",
        f"<p class='muted'>Generated {clock.shown(time.time())}. Base recipe {e(str(g.base))}; seeds "
        f"{g.seeds}, data seed {g.data_seed} (the same prompts in the same order in every run); "
        f"{len(runs)} completed run(s)"
        + (f"; runs took {wall_seconds:.0f} s of wall time in this invocation" if wall_seconds else "")
        + f". Reproduce: <code>{e(command)}</code></p>",
    ]
    if not_run:
        parts.append(
            "<div class='notice'>Not run here: "
            + e("; ".join(f"{a}: {lab.plans[a].reason}" for a in not_run))
            + f". Once the features exist: <code>{e(rerun_command(g, not_run))}</code> runs just these arms and "
            "rebuilds this report (completed runs are reused).</div>"
        )
    for n in notices:
        parts.append(f"<div class='notice'>{e(n)}</div>")
    parts.append("<h2>Verdicts</h2>")
    parts.append(f"<p class='muted'>{e(method_text(g, rules=rules))}</p>")
    parts.append(
        _table(
            [
                {
                    "claim": v.claim,
                    "verdict": v.verdict,
                    "effect": v.effect,
                    "95% CI": f"[{_fmt(v.ci_low)}, {_fmt(v.ci_high)}]",
                    "seeds": v.n_seeds,
                    "p (one-sided)": v.p_value,
                    "p (Holm)": v.p_holm,
                    "statement": v.statement,
                    "unit": v.unit,
                    "rule": v.rule,
                    "detail": v.detail,
                    "source": v.source,
                }
                for v in verdicts
            ]
        )
    )
    parts.append("<h2>Arms</h2>")
    parts.append(_table(arms))
    parts.append("<h2>Early warning: lead time and false alarms</h2>")
    parts.append(
        "<p class='muted'>Rules replayed on each run's rho_std. A collapsing run is warned when the rule fires at "
        "or before the collapse (lead = steps between), late when after, missed when never; a run that never "
        "collapses counts a false alarm when the rule fires. median_ratio is the rule runs used before: median "
        "of 5 recent values >= 2 x the median of the first 5. trend is the noise-aware CUSUM (recipe defaults); "
        f"trend-tuned was chosen on the tuning seeds {g.tune_seeds} from {_grid_text()} by (warned fraction - "
        "false-alarm fraction), then longer lead, then larger h and k; the held-out rows played no part in the "
        "choice."
        + (f" Tuned: {e(tuned.describe())}." if tuned else "")
        + " False-alarm rate with its 95% Wilson interval.</p>"
    )
    parts.append(_table([d.row() for d in detectors]))
    parts.append("<h2>Code the runs came from</h2>")
    parts.append(
        "<p class='muted'>From each run's run.json (its code record: the commit of the checkout it ran from and "
        'whether that tree was clean); runs from before the record say "not recorded".</p>'
    )
    parts.append(_table(commits))
    parts.append("<h2>Curves by arm</h2><div class='grid'>")
    for f, cap in figs:
        parts.append(f"<figure><img src='{e(f)}' alt='{e(cap)}'><figcaption>{e(cap)}</figcaption></figure>")
    parts.append("</div>")
    if run_records:
        parts.append("<h2>Runs of this invocation</h2>")
        parts.append(
            _table(
                [
                    {
                        "arm": r.arm,
                        "seed": r.seed,
                        "status": r.status,
                        "seconds": r.seconds,
                        "folder": str(r.path),
                    }
                    for r in run_records
                ]
            )
        )
    parts.append("</body></html>")
    page = inside(out, "index.html")
    write_atomic(page, "\n".join(parts), root=out, what="report file")
    return page


def _code_cells(codes) -> dict:
    """runs.csv's columns on the code a run came from (its last attempt's record; empty when none)."""
    last = codes[-1] if codes else None
    return {
        "code_commit": (last.commit or "") if last else "not recorded",
        "code_clean": "" if last is None or last.clean is None else str(last.clean).lower(),
    }


def rules_text(lab) -> str:
    """Whether the rule files' content was in place before the runs (:mod:`tim_megatron.lab.provenance`), from what
    each run recorded: ``lab.json``'s rule hashes, ``run.json``'s code and start."""
    runs = []
    for arm in lab.runs.values():
        for r in arm.values():
            d = Path(r.path)
            meta = run_meta(d)
            runs.append(
                RunRules.of(f"{r.arm}/seed{r.seed}", lab=lab_spec(d), meta=meta, codes=run_code(meta))
            )
    return rules_fixed_text(runs=runs)


def method_text(grid, *, rules: str) -> str:
    """How the verdicts were reached, for the report and tables.md: the rules (``rules``: when they were fixed,
    from :func:`rules_text`), the correction, the seeds."""
    weights = (
        "Seeds vary the initial weights (the tiny model's seed follows the run seed), the sampling and the "
        "run; the data seed is fixed."
        if grid.weights == "seed"
        else "Seeds vary only the sampling and the run: every run starts from the same initial weights "
        "(weights: fixed), so the intervals leave out initialization variance."
    )
    return (
        f"Each claim is decided by the rule in its row. {rules} Effects "
        "are oriented so that a positive value supports the claim; the interval is a 95% Student t interval "
        "across seeds (paired by seed between arms). Tests are one-sided, and their p-values are adjusted with "
        "Holm's method across the claims tested in this report (family-wise 0.025). Growth = change of "
        f"log(mismatch) over the run (Theil-Sen slope x steps); log 1.25 = {GROWTH_MIN:.3f} is the smallest growth "
        "difference that counts. Collapse: the training reward's trailing "
        f"{grid.collapse_window}-step mean at 70% of its best so far or lower, and still there at the end of the "
        f"run, at least {grid.collapse_min_steps} step(s) later (a dip that recovers is not a collapse, and a drop "
        f"in the last {grid.collapse_min_steps - 1} step(s) is censored). Final-window reward: the mean over the last 10% of the "
        "steps. Dose: the run's mean KL(pi || mu) per token. " + weights
    )


def _grid_text() -> str:
    return ", ".join(f"{k} in {list(v)}" for k, v in TUNE_GRID.items())


def rerun_command(grid, arms: list[str]) -> str:
    return f"tim lab {grid.path} --only {','.join(arms)}"
