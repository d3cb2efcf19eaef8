"""The demo recipe's step-time breakdown, from a real ``tim train`` run's ``time/*`` metrics.

Prints every phase's mean time and share of a step (steps after the first few, which include warm-up), and
checks that metrics and logging together stay under 2% of a step.
"""

from __future__ import annotations

import argparse
import statistics

from tim_megatron import outcome
from tim_megatron.bench.train_run import train_rows

PHASES = ("rollout", "old_logprobs", "advantages", "metrics", "update", "sync", "validation", "logging")


def run(
    *, steps: int = 30, recipe: str = "recipes/tiny-moe/grpo.yaml", extra: list[str] | None = None
) -> dict:
    rows, _ = train_rows(
        recipe=recipe,
        steps=steps,
        overrides=["logging.wandb.mode=disabled", "checkpoint.every=0", *(extra or [])],
    )
    rows = rows[min(3, len(rows) - 1) :]
    step = statistics.mean(r["time/step"] for r in rows)
    out = {"step_s": step, "steps": len(rows)}
    for p in PHASES:
        out[p] = statistics.mean(r.get(f"time/{p}", 0.0) for r in rows)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tim_megatron.bench step")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--recipe", default="recipes/tiny-moe/grpo.yaml")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    r = run(steps=a.steps, recipe=a.recipe, extra=a.overrides)
    print(
        f"[step] {a.recipe}: mean over {r['steps']} steps after warm-up: {r['step_s'] * 1e3:.1f} ms per step"
    )
    for p in PHASES:
        print(f"  {p:<13} {r[p] * 1e3:8.1f} ms  {100 * r[p] / r['step_s']:5.1f}%")
    share = (r["metrics"] + r["logging"]) / r["step_s"]
    sync = r["sync"] / r["step_s"]
    for o in (
        outcome.judged(
            "metrics + logging",
            value=share * 100,
            met=share <= 0.02,
            rule="<= 2%",
            unit="% of a step",
            group="step",
        ),
        outcome.judged(
            "weight sync", value=sync * 100, met=sync <= 0.05, rule="<= 5%", unit="% of a step", group="step"
        ),
    ):
        print("  " + outcome.target_line(o))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
