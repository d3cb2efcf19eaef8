"""End-of-run artifacts: a PNG of reward and the main mismatch curves, and a short text summary.

Both replace what the run folder holds under their names by an atomic rename, so a link planted there (a run
folder from elsewhere) is replaced, never written through."""

from __future__ import annotations

import math
from pathlib import Path

from tim_megatron import metric_names as names
from tim_megatron.safe_files import save_figure, write_atomic

CURVES = (
    (names.REWARD, "reward (mean)"),
    (names.VAL_ACCURACY, "validation accuracy"),
    (names.RHO_STD, "mismatch: rho_std (old vs rollout)"),
    (names.LOG_PPL_TOKEN, "log-ppl |diff| per token (old vs rollout)"),
    (names.PROB_PEARSON, "Pearson(pi_train, pi_infer)"),
    (names.RESPONSE_LENGTH, "response length (tokens)"),
)


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric over ``metrics.jsonl`` rows: finite numbers only (no bools, NaN, Inf)."""
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def write_summary(
    run_dir: Path, rows: list[dict], *, name: str, wall_seconds: float, events: list[dict]
) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 7), constrained_layout=True)
    for ax, (key, title) in zip(axes.flat, CURVES, strict=True):
        xs, ys = series(rows, key)
        ax.plot(xs, ys, marker="." if len(xs) < 40 else None)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        for e in events:
            ax.axvline(e["step"], color="tab:red", alpha=0.4, linestyle="--")
        if not xs:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    fig.suptitle(f"{name}: reward and training-inference mismatch", fontsize=12)
    save_figure(fig, run_dir / "curves.png", root=run_dir, dpi=110)
    plt.close(fig)

    def first_last(key):
        _, ys = series(rows, key)
        k = max(1, len(ys) // 5)
        return (sum(ys[:k]) / k, sum(ys[-k:]) / k) if ys else (float("nan"), float("nan"))

    r0, r1 = first_last(names.REWARD)
    m0, m1 = first_last(names.RHO_STD)
    n0, n1 = first_last(names.RESPONSE_LENGTH)
    p0, p1 = first_last(names.LOG_PPL_TOKEN)
    _, val = series(rows, names.VAL_ACCURACY)
    lines = [
        f"run: {name}",
        f"steps: {rows[-1]['step'] if rows else 0}   wall time: {wall_seconds:.1f} s",
        f"reward, mean of first 20% of steps: {r0:.4f}   last 20%: {r1:.4f}   change: {r1 - r0:+.4f}",
        f"rho_std (old vs rollout), first 20%: {m0:.3e}   last 20%: {m1:.3e}",
        f"response length (tokens), first 20%: {n0:.1f}   last 20%: {n1:.1f}   "
        f"log-ppl |diff| per token (old vs rollout), first 20%: {p0:.3e}   last 20%: {p1:.3e}",
        f"validation accuracy: {', '.join(f'{v:.3f}' for v in val) if val else 'not run'}",
        "early warnings: "
        + (", ".join(f"{e['kind']} at step {e['step']} ({e['metric']})" for e in events) or "none"),
    ]
    text = "\n".join(lines) + "\n"
    write_atomic(run_dir / "summary.txt", text, root=run_dir, what="run summary")
    return text
