"""Loop scenarios that need to look inside a run (tests/test_fleet.py), in a fresh process.

    python tests/workers/fleet_worker.py sleep_wake OUT_DIR [overrides...]

Writes ``OUT_DIR/<scenario>.json``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

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


class TouchSpy(TorchDispatchMode):
    """Sees every tensor op of this thread (the trainer's and the in-process engine's); records and refuses one
    that reads or writes a storage the trainer has in host memory (outside the trainer's own moves)."""

    def __init__(self, host):
        super().__init__()
        self.host = host
        self.moving = False
        self.touches: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        away = () if self.moving else self.host.away()
        if away:
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    try:
                        key = t.untyped_storage()._cdata
                    except (RuntimeError, NotImplementedError):
                        continue
                    if key in away:
                        self.touches.append(str(func))
                        raise RuntimeError(f"{func} touched an offloaded trainer tensor")
        return func(*args, **kwargs)


def spy_trainer(trainer, calls: list, touch: TouchSpy) -> None:
    """Record the trainer's memory moves and its update, in the same list as the engine's calls."""

    def wrap(name: str, moves: bool = False):
        inner = getattr(trainer, name)

        def call(*args, **kwargs):
            calls.append([f"trainer.{name}", {"parts": list(args[0])} if name == "offload" else {}])
            touch.moving = moves
            try:
                return inner(*args, **kwargs)
            finally:
                touch.moving = False

        setattr(trainer, name, call)

    for name in ("release_memory", "backward", "step"):
        wrap(name)
    wrap("offload", moves=True)
    wrap("onload", moves=True)


def param_digest(trainer) -> str:
    h = hashlib.sha256()
    for name, p in trainer.model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().float().clone().numpy().tobytes())  # a copy: numpy() pins a storage's size
    return h.hexdigest()


def scenario_sleep_wake(out_dir: Path, overrides: list[str]) -> dict:
    loaded = load_recipe(RECIPE, overrides)
    run_dir = out_dir / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    write_resolved(loaded, run_dir)
    parts = setup(loaded, run_dir, resume=False)
    calls: list = []
    parts.rollout = Spy(parts.rollout, calls)
    parts.colocation.rollout = parts.rollout
    touch = TouchSpy(parts.trainer.host)
    spy_trainer(parts.trainer, calls, touch)
    with touch:
        rc = run_steps(parts, loaded=loaded, run_dir=run_dir)
    calls = list(calls)  # the run's; the check below adds its own
    # Does the spy see a touch? Move the parameters out, read one, and expect the refusal.
    caught = False
    parts.trainer.offload(("params",))
    with touch:
        try:
            next(parts.trainer.model.parameters()).sum()
        except RuntimeError:
            caught = touch.touches[-1:] == ["aten.sum.default"]
    touch.touches.pop()
    parts.trainer.onload()
    return {
        "rc": rc,
        "calls": calls,
        "steps": loaded.recipe.run.steps,
        "touches": touch.touches,
        "spy_catches_a_touch": caught,
        "params": param_digest(parts.trainer),
        "metrics": [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()],
    }


SCENARIOS = {"sleep_wake": scenario_sleep_wake}


def main() -> None:
    name, out_dir, *overrides = sys.argv[1:]
    out = Path(out_dir)
    res = SCENARIOS[name](out, overrides)
    (out / f"{name}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
