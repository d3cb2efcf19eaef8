"""The off-policy schedules against each other, on the same recipe, lag and machine.

Real ``tim train`` runs: on-policy, k-step-off in sequence, k-step-off overlapped (the later batch sampled on a
thread beside the update), and partial rollouts (``rollout.partial.tokens_per_step``: each step generates at most
that many tokens of each sequence trained later, and finishes those of the batch it trains), in sequence and
overlapped. Prints each one's mean step time after warm-up and its ratio to the sequential k-step-off step, how
much generation ran beside the update and how long the step then waited for it, and for the partial runs the share
of trained tokens at each age (updates since the weights that sampled them), with the share of trained sequences
holding tokens of two or more versions. On a CPU the engine and the trainer share the same cores, so the overlap
hides less than on a GPU node; ``tim plan`` estimates that case.
"""

from __future__ import annotations

import argparse
import platform
import statistics

from tim_megatron.bench.train_run import train_rows

QUIET = ["logging.wandb.mode=disabled", "checkpoint.every=0", "run.val_every=0", "diagnostics.dumps.every=0"]
OFF = ["rl.correction.mode=tis"]
"""Off-policy runs weight the ratio by the behaviour policy (TIS on pi_t / mu_s)."""


def _mean(rows: list[dict], key: str) -> float:
    return statistics.mean(r.get(key, 0.0) for r in rows)


def schedules(*, k: int, tokens_per_step: int) -> list[tuple[str, list[str]]]:
    """Each schedule's name and overrides."""
    lag = [f"rollout.max_staleness={k}", *OFF]
    partial = [*lag, f"rollout.partial.tokens_per_step={tokens_per_step}"]
    return [
        ("on-policy", ["rollout.max_staleness=0"]),
        ("sequential", [*lag, "rollout.schedule=sequential"]),
        ("overlapped", [*lag, "rollout.schedule=overlapped"]),
        ("partial", [*partial, "rollout.schedule=sequential"]),
        ("partial, overlapped", [*partial, "rollout.schedule=overlapped"]),
    ]


def run(
    *, recipe: str, steps: int, k: int, tokens_per_step: int, extra: list[str]
) -> dict[str, dict[str, float]]:
    """Each schedule's mean step time, phases and token ages over the steps after the first ``k + 2`` (warm-up)."""
    out = {}
    for name, over in schedules(k=k, tokens_per_step=tokens_per_step):
        rows, _ = train_rows(recipe=recipe, steps=steps, overrides=[*QUIET, *extra, *over])
        rows = rows[min(k + 2, len(rows) - 1) :]
        out[name] = {
            "step": _mean(rows, "time/step"),
            "rollout": _mean(rows, "time/rollout"),
            "update": _mean(rows, "time/update"),
            "generated_beside": _mean(rows, "offpolicy/overlap_generate_seconds"),
            "waited": _mean(rows, "offpolicy/overlap_wait_seconds"),
            "ages": [_mean(rows, f"offpolicy/tokens_age_{a}_frac") for a in range(k + 1)],
            "multi_version": _mean(rows, "offpolicy/multi_version_frac"),
            "finished_at_training": _mean(rows, "partial/finished_at_training_tokens"),
            "steps": len(rows),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tim_megatron.bench offpolicy")
    ap.add_argument("--recipe", default="recipes/tiny-moe/countdown.yaml")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument(
        "--tokens-per-step", type=int, default=40, help="the partial runs' rollout.partial.tokens_per_step"
    )
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    r = run(recipe=a.recipe, steps=a.steps, k=a.k, tokens_per_step=a.tokens_per_step, extra=a.overrides)
    where = f"CPU ({platform.processor() or platform.machine()}), engine and trainer on the same cores"
    print(
        f"[offpolicy] {a.recipe}, k = {a.k}, partial: {a.tokens_per_step} tokens per step; {where}: mean over "
        f"{r['overlapped']['steps']} steps after warm-up"
    )
    s = r["sequential"]
    for name, m in r.items():
        print(
            f"  {name:<20} step {m['step'] * 1e3:8.1f} ms ({m['step'] / s['step']:.2f}x sequential)  rollout "
            f"{m['rollout'] * 1e3:7.1f} ms  update {m['update'] * 1e3:7.1f} ms"
        )
    o = r["overlapped"]
    print(
        f"  overlapped / sequential step time: {o['step'] / s['step']:.2f}x; generation beside the update "
        f"{o['generated_beside'] * 1e3:.1f} ms per step, of which the step waited {o['waited'] * 1e3:.1f} ms"
    )
    for name in ("partial", "partial, overlapped"):
        m = r[name]
        ages = ", ".join(f"age {a}: {f:.1%}" for a, f in enumerate(m["ages"]))
        print(
            f"  {name}: trained tokens by age {ages}; {m['multi_version']:.1%} of trained sequences hold tokens of "
            f"two or more versions; {m['finished_at_training']:.0f} tokens a step generated for the trained batch "
            "at its own step"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
