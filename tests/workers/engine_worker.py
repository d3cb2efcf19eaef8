"""A rank with one engine process (``rollout.engine_process``) through a series of faults, for
tests/test_engine_faults.py.

    python tests/workers/engine_worker.py RESULTS.json

Real components throughout: the tiny MoE's checkpoint, a real vLLM CPU engine in its own process, the rank's side of
:class:`~tim_megatron.rollout.process_engine.ProcessEngine`; no trainer (the weights an update would push are the
checkpoint's, scaled). In order, each scenario's outcome written to ``RESULTS.json`` (rewritten atomically after
each one):

1. ``thread``: the engine is started from a thread that then ends (the overlapped schedule restarts engines from
   its sampling thread), and must outlive that thread;
2. ``own_error``: a weight stream that raises ``OSError(EMFILE)`` on this rank, and ``no_room``: a sync at an
   open-file limit with no room left: each the rank's error, no restart;
3. ``hang_before_read``: the fire drill in a generation after a weight load (found within
   ``rollout.faults.timeout_s``, restarted, the witness compared, the samples the same); ``hang_in_reply`` runs on
   two ranks in the test's runs;
4. ``stale``: a restart that skips its load: :class:`~tim_megatron.rollout.faults.WitnessMismatch`;
5. ``stopped``: the engine stops itself (the ``hang`` drill, a 600 s timeout) while this rank waits for it; the
   results name this process's descendants and the worker waits to be killed (the test sends SIGKILL).
"""

from __future__ import annotations

import errno
import json
import os
import resource
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

TINY = "recipes/tiny-moe/grpo.yaml"
PROMPTS = [[2 + (3 * i + j) % 40 for j in range(5 + i)] for i in range(4)]


def _write(path: Path, results: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, path)


def _samples(out) -> list:
    groups, _ = out
    return [[(s.prompt_ids, s.response_ids, s.logprobs) for s in g] for g in groups]


def _update(path: Path, scale: float) -> list:
    """The checkpoint's tensors, the floating ones scaled: what an update would push."""
    from safetensors.torch import load_file

    return [(k, v * scale if v.is_floating_point() else v) for k, v in load_file(str(path)).items()]


def _drill(eng, kind: str, step: int, reference: list) -> dict:
    """``kind`` planted in a generation at ``step``: what it cost, and whether the samples are the reference's."""
    eng.begin_step(step)
    eng.arm_drill(kind, "generate")
    t = time.monotonic()
    out = eng.generate(PROMPTS, step=1, first_index=0)
    return {
        "seconds": time.monotonic() - t,
        "faults": eng.faults(),
        "same_samples": _samples(out) == reference,
        "pid": eng.describe()["process"],
    }


def main(results_file: str) -> None:
    import psutil

    from tim_megatron.recipe import load_recipe
    from tim_megatron.rollout.base import FleetLayout
    from tim_megatron.rollout.faults import WitnessMismatch
    from tim_megatron.rollout.process_engine import ProcessEngine
    from tim_megatron.run_setup import model_path_for

    out = Path(results_file)
    res: dict = {"rank": os.getpid()}
    over = [
        "rollout.engine_process=true",
        "rollout.faults.timeout_s=2",
        "rollout.faults.max_restarts_per_step=1",
    ]
    recipe = load_recipe(ROOT / TINY, over).recipe
    path = model_path_for(recipe)
    layout = FleetLayout(world=1, ranks_per_engine=1)
    box: dict = {}

    def start() -> None:
        box["eng"] = ProcessEngine(
            recipe, model_path=path, layout=layout, num_moe_layers=recipe.model.dims.num_layers
        )

    starter = threading.Thread(target=start, name="sampling-thread-like")
    starter.start()
    starter.join()
    eng = box["eng"]
    pid = eng.describe()["process"]
    time.sleep(1.0)  # time for a death signal tied to the ended thread to arrive
    eng.begin_step(1)
    first = _samples(eng.generate(PROMPTS, step=1, first_index=0))
    res["thread"] = {
        "starter_alive": starter.is_alive(),
        "answered": bool(first),
        "same_pid": eng.describe()["process"] == pid,
    }
    _write(out, res)

    update = _update(path / "model.safetensors", 1.01)

    def failing():
        yield update[0]
        raise OSError(errno.EMFILE, "Too many open files")

    try:
        eng.update_weights(failing())
        res["own_error"] = {"raised": None}
    except Exception as e:
        res["own_error"] = {
            "raised": type(e).__name__,
            "errno": getattr(e, "errno", None),
            "restarts": eng.faults()["faults/restarts"],
            "same_pid": eng.describe()["process"] == pid,
        }
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(
        resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) - 1, hard)
    )  # no room for one more
    try:
        eng.update_weights(iter(update))
        res["no_room"] = {"raised": None}
    except Exception as e:
        res["no_room"] = {
            "raised": type(e).__name__,
            "message": str(e),
            "restarts": eng.faults()["faults/restarts"],
            "same_pid": eng.describe()["process"] == pid,
        }
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    _write(out, res)

    eng.update_weights(iter(update))  # the update, whole: the engine holds it, the buffer too
    reference = _samples(eng.generate(PROMPTS, step=1, first_index=0))
    res["reference"] = {"differs_from_checkpoint": reference != first}
    res["hang_before_read"] = _drill(eng, "hang_before_read", 2, reference)
    _write(out, res)

    eng.begin_step(3)
    eng.arm_drill("stale", "generate")
    try:
        eng.generate(PROMPTS, step=1, first_index=0)
        res["stale"] = {"raised": None}
    except WitnessMismatch as e:
        res["stale"] = {"raised": type(e).__name__, "message": str(e), "faults": eng.faults()}
    _write(out, res)

    eng.limits = eng.limits.model_copy(update={"timeout_s": 600.0})
    eng.begin_step(4)
    eng.arm_drill("hang", "generate")
    me = psutil.Process()
    res["stopped"] = {
        "engine": eng.describe()["process"],
        "descendants": [p.pid for p in me.children(recursive=True)],
        "threads": [t.name for t in threading.enumerate()],
    }
    _write(out, res)
    eng.generate(PROMPTS, step=1, first_index=0)  # the engine stops itself; the test kills this process
    res["stopped"]["returned"] = True  # not reached
    _write(out, res)


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except BaseException:
        traceback.print_exc()
        raise
