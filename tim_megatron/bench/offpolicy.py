"""The overlapped off-policy schedule against the sequential one, on the same recipe, lag and machine.

Three real ``tim train`` runs: on-policy, k-step-off in sequence, and k-step-off overlapped (the later batch sampled
on a thread beside the update). Prints each one's mean step time after warm-up and the overlapped/sequential
ratio, with how much generation ran beside the update and how long the step then waited for it. On a CPU the
engine and the trainer share the same cores, so the overlap hides less than on a GPU node, where they would run
on separate devices or streams; ``tim plan`` estimates that case.
"""

from __future__ import annotations

import argparse
import platform
import statistics

from tim_megatron.bench.train_run import train_rows

QUIET = ["logging.wandb.mode=disabled", "checkpoint.every=0", "run.val_every=0", "diagnostics.dumps.every=0"]


def _mean(rows: list[dict], key: str) -> float:
    return statistics.mean(r.get(key, 0.0) for r in rows)


def run(*, recipe: str, steps: int, k: int, extra: list[str]) -> dict[str, dict[str, float]]:
    """Each schedule's mean step time and phases over the steps after the first ``k + 2`` (warm-up)."""
    out = {}
    for name, over in (
        ("on-policy", ["rollout.max_staleness=0"]),
        ("sequential", [f"rollout.max_staleness={k}", "rollout.schedule=sequential"]),
        ("overlapped", [f"rollout.max_staleness={k}", "rollout.schedule=overlapped"]),
    ):
        rows, _ = train_rows(recipe=recipe, steps=steps, overrides=[*QUIET, *extra, *over])
        rows = rows[min(k + 2, len(rows) - 1) :]
        out[name] = {
            "step": _mean(rows, "time/step"),
            "rollout": _mean(rows, "time/rollout"),
            "update": _mean(rows, "time/update"),
            "generated_beside": _mean(rows, "offpolicy/overlap_generate_seconds"),
            "waited": _mean(rows, "offpolicy/overlap_wait_seconds"),
            "steps": len(rows),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tim_megatron.bench offpolicy")
    ap.add_argument("--recipe", default="recipes/tiny-moe/countdown.yaml")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    r = run(recipe=a.recipe, steps=a.steps, k=a.k, extra=a.overrides)
    where = f"CPU ({platform.processor() or platform.machine()}), engine and trainer on the same cores"
    print(
        f"[offpolicy] {a.recipe}, k = {a.k}, {where}: mean over {r['overlapped']['steps']} steps after warm-up"
    )
    for name, m in r.items():
        print(
            f"  {name:<11} step {m['step'] * 1e3:8.1f} ms  rollout {m['rollout'] * 1e3:7.1f} ms  "
            f"update {m['update'] * 1e3:7.1f} ms"
        )
    o, s = r["overlapped"], r["sequential"]
    print(
        f"  overlapped / sequential step time: {o['step'] / s['step']:.2f}x; generation beside the update "
        f"{o['generated_beside'] * 1e3:.1f} ms per step, of which the step waited {o['waited'] * 1e3:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
