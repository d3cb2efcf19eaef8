"""Report figures (matplotlib, Agg). Every panel is its own PNG with labelled axes and units."""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import numpy as np

from tim_megatron import metric_names as names
from tim_megatron.report.analysis import RunSummary, pearson
from tim_megatron.report.runs import DumpError, RunData, read_dump


class Curve(NamedTuple):
    key: str
    title: str
    ylabel: str
    scale: str = "linear"
    """linear; log (when every value is > 0); ratio (log axis, plain ticks: 2x and 0.5x equally far from 1);
    one_minus (1 - value on a log axis: correlations, where 0.9999 -> 0.99 is the signal)."""
    off_policy: bool = False
    """Drawn only when some run trained off-policy (a non-zero ``offpolicy/age``)."""


CURVES = (
    Curve(names.REWARD, "Training reward", "mean reward"),
    Curve(names.VAL_ACCURACY, "Validation accuracy", "accuracy"),
    Curve(
        names.RHO_STD,
        "Mismatch: std of rho (old vs rollout)",
        "std of pi_train / pi_infer",
        "log",
    ),
    Curve(
        names.LOG_PPL_TOKEN,
        "log-ppl |diff| per token (old vs rollout)",
        "nats per token",
        "log",
    ),
    Curve(
        names.PROB_PEARSON,
        "1 - Pearson(pi_train, pi_infer)",
        "1 - correlation (0: identical)",
        "one_minus",
    ),
    Curve("mismatch/old_vs_rollout/rho_max", "Max rho (old vs rollout)", "max pi_train / pi_infer", "ratio"),
    Curve("mismatch/old_vs_rollout/kl_rollout_old_k3", "KL(rollout || old), k3", "nats per token", "log"),
    Curve("response/entropy_mean", "Token entropy", "nats per token"),
    Curve("actor/grad_norm", "Gradient norm", "L2 norm", "log"),
    Curve(names.RESPONSE_LENGTH, "Response length", "tokens"),
    Curve("actor/clipfrac_token_low", "Clip fraction, token low side", "fraction of tokens"),
    Curve(names.CLIP_HIGH, "Clip fraction, token high side", "fraction of tokens"),
    Curve("actor/clipfrac_seq", "Clip fraction, sequences (GSPO)", "fraction of sequences"),
    Curve(names.LR, "Learning rate", "learning rate", "log"),
    Curve(names.OFFPOLICY_AGE, "Age of the trained batch", "updates since it was sampled", off_policy=True),
    Curve(
        names.STALENESS_STD, "Staleness: std of log pi_t - log pi_s", "nats per token", "log", off_policy=True
    ),
    Curve(names.TIM_STD, "TIM: std of log pi_s - log mu_s", "nats per token", "log", off_policy=True),
    Curve(
        "routing/rollout_vs_trainer/exact_match",
        "Routing agreement (rollout vs trainer)",
        "exact top-k match",
    ),
)


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")[:80] or "x"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Run names, folder names and metric keys come from run folders: "$...$" in them is text, never mathtext.
    plt.rcParams.update(
        {
            "font.size": 10,
            "axes.titlesize": 11,
            "legend.fontsize": 8,
            "figure.dpi": 110,
            "text.parse_math": False,
            "text.usetex": False,
        }
    )
    return plt


def colors(runs: list[RunData]) -> dict[str, str]:
    plt = _plt()
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {r.name: cycle[i % len(cycle)] for i, r in enumerate(runs)}


SMOOTH_MIN_POINTS = 30
"""Series with at least this many points are drawn raw (faint) plus a rolling median (solid)."""


def rolling_median(y: np.ndarray, window: int) -> np.ndarray:
    """Centered rolling median; the window shrinks at the ends (no padding values are invented)."""
    h = window // 2
    return np.array([np.median(y[max(0, i - h) : i + h + 1]) for i in range(len(y))])


def smoothing_window(n: int) -> int:
    return max(5, (n // 25) | 1)


def _draw(ax, x, y, *, color, label):
    """Short series as points and lines; long ones as faint raw values under a rolling median."""
    if len(x) < SMOOTH_MIN_POINTS:
        ax.plot(x, y, label=label, color=color, linewidth=1.2, marker=".")
        return
    ax.plot(x, y, color=color, linewidth=0.7, alpha=0.3)
    ax.plot(x, rolling_median(y, smoothing_window(len(y))), label=label, color=color, linewidth=1.6)


def ratio_axis(ax) -> None:
    """Log y axis for ratios (2x and 0.5x equally far from 1) with plain-number ticks, also on narrow ranges."""
    from matplotlib import ticker

    ax.set_yscale("log")
    lo, hi = ax.get_ylim()
    if hi / lo < 4:
        ax.yaxis.set_major_locator(ticker.MaxNLocator(7))
        fmt = ticker.ScalarFormatter(useOffset=False)
        fmt.set_scientific(False)
    else:
        ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        fmt = ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_minor_locator(ticker.NullLocator())
    ax.yaxis.set_major_formatter(fmt)


def _label(ax, title: str, ylabel: str, xlabel: str = "RL step") -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def inside(root: Path, name: str) -> Path:
    """``root / name``, refused unless it resolves to a file directly inside ``root``."""
    target = (root / name).resolve()
    if target.parent != root.resolve():
        raise ValueError(f"report file {name!r} would be written outside {root}")
    return target


def _save(plt, fig, out: Path, name: str) -> str:
    fig.savefig(inside(out, name))
    plt.close(fig)
    return name


def _marks(ax, runs, summaries: dict[str, RunSummary], col):
    """Vertical marks per run, and gray legend entries saying what the line styles mean."""
    kinds = set()
    for r in runs:
        s = summaries[r.name]
        if s.first_warning is not None:
            ax.axvline(s.first_warning, color=col[r.name], linestyle="--", linewidth=1, alpha=0.8)
            kinds.add("--")
        if s.length_surge is not None:
            ax.axvline(s.length_surge, color=col[r.name], linestyle=":", linewidth=1.2, alpha=0.8)
            kinds.add(":")
    for style, text in (("--", "first early warning"), (":", "response-length surge")):
        if style in kinds:
            ax.plot([], [], color="gray", linestyle=style, linewidth=1, label=text)


def curve_panels(runs: list[RunData], summaries: dict[str, RunSummary], out: Path) -> list[tuple[str, str]]:
    """One PNG per metric that some run logged; returns (file, title)."""
    plt = _plt()
    col = colors(runs)
    made = []
    off_policy = any((r.series(names.OFFPOLICY_AGE)[1] > 0).any() for r in runs)
    for c in CURVES:
        if c.off_policy and not off_policy:
            continue
        series = [(r, *r.series(c.key)) for r in runs]
        series = [(r, x, 1 - y if c.scale == "one_minus" else y) for r, x, y in series if len(x)]
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6.2, 3.6), constrained_layout=True)
        for r, x, y in series:
            _draw(ax, x, y, color=col[r.name], label=r.name)
        _marks(ax, runs, summaries, col)
        if c.scale == "ratio":
            ratio_axis(ax)
        elif c.scale in ("log", "one_minus") and all((y > 0).all() for _, _, y in series):
            ax.set_yscale("log")
        _label(ax, c.title, c.ylabel)
        ax.legend(loc="best", framealpha=0.85)
        made.append((_save(plt, fig, out, f"curve_{slug(c.key)}.png"), c.title))
    return made


def scatter_panels(runs: list[RunData], out: Path, notices: list[str] | None = None) -> list[tuple[str, str]]:
    """pi_train vs pi_infer from each run's earliest and latest token dumps (an unreadable one is a notice)."""
    plt = _plt()
    made = []
    for r in runs:
        if not r.dumps:
            continue
        picks = [r.dumps[0]] if len(r.dumps) == 1 else [r.dumps[0], r.dumps[-1]]
        fig, axes = plt.subplots(
            1, len(picks), figsize=(5.6 * len(picks), 5.0), constrained_layout=True, squeeze=False
        )
        for ax, path in zip(axes[0], picks, strict=True):
            try:
                d = read_dump(path)
            except DumpError as e:
                if notices is not None:
                    notices.append(f"{e}; its panel is empty")
                ax.text(0.5, 0.5, "unreadable dump", ha="center", va="center", transform=ax.transAxes)
                continue
            x, y = d.get("pi_train"), d.get("pi_infer")
            step = int(d["step"][0]) if len(d.get("step", [])) else -1
            ok = np.isfinite(x) & np.isfinite(y) if x is not None else None
            if x is None or not ok.any():
                ax.text(
                    0.5,
                    0.5,
                    "no trainer probabilities in this dump",
                    ha="center",
                    va="center",
                    transform=ax.transAxes,
                )
                continue
            x, y = x[ok], y[ok]
            ax.plot([0, 1], [0, 1], color="red", linestyle="--", linewidth=0.8, zorder=1)
            if len(x) > 5000:
                hb = ax.hexbin(
                    x, y, gridsize=60, bins="log", cmap="viridis", mincnt=1, extent=(0, 1, 0, 1), zorder=2
                )
                fig.colorbar(hb, ax=ax, label="tokens (log count)")
            else:
                ax.scatter(x, y, s=14, alpha=0.45, edgecolors="none", zorder=2)
            ax.set_xlim(-0.02, 1.02)  # tokens at p = 1 stay visible
            ax.set_ylim(-0.02, 1.02)
            ax.set_xlabel("pi_train (trainer probability)")
            ax.set_ylabel("pi_infer (rollout probability)")
            ax.set_title(
                f"step {step}: PCC = {pearson(x, y):.4f}, {len(x):,} tokens\n"
                f"max |pi_train - pi_infer| = {np.abs(x - y).max():.2g}",
                fontsize=10,
            )
            ax.set_aspect("equal")
        fig.suptitle(
            f"{r.name}: " + ("earliest and latest dump" if len(picks) == 2 else "the only dump so far")
        )
        made.append((_save(plt, fig, out, f"scatter_{slug(r.name)}.png"), f"{r.name}: pi_train vs pi_infer"))
    return made


def bucket_panels(runs: list[RunData], out: Path) -> list[tuple[str, str]]:
    """Mean rho per pi_train bucket against step (objective-level-hacking paper, Fig. 7b)."""
    plt = _plt()
    made = []
    for r in runs:
        keys = sorted(
            k
            for k in r.metric_keys()
            if k.startswith("mismatch/old_vs_rollout/bucket/") and k.endswith("/rho_mean")
        )
        if not keys:
            continue
        fig, ax = plt.subplots(figsize=(6.2, 3.8), constrained_layout=True)
        cmap = plt.get_cmap("viridis")
        for i, k in enumerate(keys):
            x, y = r.series(k)
            if len(x):
                _draw(
                    ax, x, y, color=cmap(i / max(len(keys) - 1, 1)), label=f"pi_train in {k.split('/')[-2]}"
                )
        ax.axhline(1.0, color="red", linestyle="--", linewidth=1)
        ratio_axis(ax)
        _label(ax, f"{r.name}: mean rho by probability bucket", "mean pi_train / pi_infer")
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
        made.append((_save(plt, fig, out, f"buckets_{slug(r.name)}.png"), f"{r.name}: rho drift by bucket"))
    return made


def surrogate_panel(runs: list[RunData], out: Path) -> list[tuple[str, str]]:
    """J = sum A (phi - 1) against step, with its Pearson correlation to step (paper, Fig. 6)."""
    plt = _plt()
    col = colors(runs)
    series = [(r, *r.series("objective/J")) for r in runs]
    series = [(r, x, y) for r, x, y in series if len(x)]
    if not series:
        return []
    fig, ax = plt.subplots(figsize=(6.2, 3.8), constrained_layout=True)
    for r, x, y in series:
        ax.scatter(x, y, s=8, color=col[r.name], label=f"{r.name} (PCC with step {pearson(x, y):+.2f})")
    _label(ax, "Objective-level surrogate J = sum A (phi - 1)", "J (advantage units)")
    ax.legend(loc="best", frameon=False)
    return [(_save(plt, fig, out, "surrogate_J.png"), "Surrogate J against step")]


def by_age(run: RunData) -> dict[int, dict[str, float]]:
    """An off-policy run's split by the trained batch's age: for each age, its steps and the mean over them of
    the staleness and TIM parts' log-ratio std (each step trains one batch, of one age)."""
    ages, stale, tim = (
        dict(zip(*run.series(k), strict=True))
        for k in (names.OFFPOLICY_AGE, names.STALENESS_STD, names.TIM_STD)
    )
    out: dict[int, dict[str, float]] = {}
    for age in sorted({int(a) for a in ages.values()}):
        steps = [s for s, a in ages.items() if int(a) == age and s in stale and s in tim]
        if steps:
            out[age] = {
                "steps": float(len(steps)),
                "staleness": float(np.mean([stale[s] for s in steps])),
                "tim": float(np.mean([tim[s] for s in steps])),
            }
    return out


def age_panel(runs: list[RunData], out: Path) -> list[tuple[str, str]]:
    """The staleness and TIM parts against the trained batch's age, one line per off-policy run: the staleness
    part grows with the age, the TIM part should not."""
    split = {r.name: by_age(r) for r in runs}
    split = {n: a for n, a in split.items() if len(a) > 1}
    if not split:
        return []
    plt = _plt()
    col = colors(runs)
    fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.6), constrained_layout=True)
    for ax, part, title in ((axes[0], "staleness", "Staleness"), (axes[1], "tim", "TIM")):
        for name, a in split.items():
            ax.plot(list(a), [v[part] for v in a.values()], marker="o", color=col[name], label=name)
        ax.set_xticks(sorted({age for a in split.values() for age in a}))
        _label(
            ax, f"{title} by age: std of its log-ratio", "nats per token (mean over steps)", "age (updates)"
        )
    axes[0].legend(loc="best", framealpha=0.85)
    return [(_save(plt, fig, out, "offpolicy_by_age.png"), "Staleness and TIM by the trained batch's age")]
