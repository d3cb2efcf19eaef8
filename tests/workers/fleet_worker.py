"""Loop scenarios that need to look inside a run (tests/test_fleet.py), in a fresh process.

    python tests/workers/fleet_worker.py sleep_wake OUT_DIR [overrides...]

Writes ``OUT_DIR/<scenario>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tim_megatron.loop import run_steps  # noqa: E402
from tim_megatron.recipe import load_recipe  # noqa: E402
from tim_megatron.run_dir import write_resolved  # noqa: E402
from tim_megatron.run_setup import setup  # noqa: E402

RECIPE = ROOT / "recipes" / "tiny-moe" / "grpo.yaml"
PROTOCOL = (
    "generate",
    "score",
    "update_weights",
    "sleep",
    "wake_up",
    "reset_prefix_cache",
    "head_dtype",
    "describe",
)


class Spy:
    """Records every call of the rollout interface, in order, and passes it on to the real engine."""

    def __init__(self, inner, calls: list):
        self._inner = inner
        self._calls = calls

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in PROTOCOL:
            return attr

        def call(*args, **kwargs):
            shown = {k: v for k, v in kwargs.items() if k in ("level", "tags", "greedy")}
            if name in ("sleep", "wake_up") and args:
                shown["arg"] = args[0]
            self._calls.append([name, shown])
            return attr(*args, **kwargs)

        return call


def scenario_sleep_wake(out_dir: Path, overrides: list[str]) -> dict:
    loaded = load_recipe(RECIPE, overrides)
    run_dir = out_dir / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    write_resolved(loaded, run_dir)
    run = setup(loaded, run_dir, resume=False)
    calls: list = []
    run.rollout = Spy(run.rollout, calls)
    release = run.trainer.release_memory

    def spied_release():
        calls.append(["trainer.release_memory", {}])
        release()

    run.trainer.release_memory = spied_release
    rc = run_steps(run)
    return {"rc": rc, "calls": calls, "steps": loaded.recipe.run.steps}


SCENARIOS = {"sleep_wake": scenario_sleep_wake}


def main() -> None:
    name, out_dir, *overrides = sys.argv[1:]
    out = Path(out_dir)
    res = SCENARIOS[name](out, overrides)
    (out / f"{name}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
