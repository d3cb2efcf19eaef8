"""Several one-process training runs in one Python process, one after another, through the library's ``train``.

    python tests/workers/train_worker.py RUNS.json RESULTS.json

``RUNS.json`` is a list of ``{"name", "recipe", "overrides", "output_dir"}``. Each run is set up as ``tim train``
sets up a one-process run (the recipe loaded with its overrides, a new run folder that adopts the recipe, one
attempt recorded in run.json) and trained with ``tim_megatron.loop.train``, which releases the engine and the
trainer after the run. ``RESULTS.json`` maps each name to ``{"exit", "run_dir", "error", "seconds"}``; it is rewritten after
every run, so a crash leaves the runs before it readable.

A run ``{"name", "resume_of", "from_step", "output_dir"}`` resumes a copy of an earlier run of the list, as
``tim train --resume`` does: its folder copied to ``output_dir`` without the checkpoints after ``from_step``, the
recipe read from the copy, and trained from that checkpoint.

The start-up that every ``tim train`` process pays (the imports of torch, vLLM, megatron-core and transformers,
about 10 s on two cores) is paid once for all the runs. An exact-mode run sets MKL's reproducibility settings
before the first GEMM (as ``tim train`` does), which then hold for the whole process: give exact-mode runs a
worker of their own.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def load(spec: dict):
    from tim_megatron.recipe import load_recipe

    return load_recipe(ROOT / spec["recipe"], [*spec["overrides"], f"run.output_dir={spec['output_dir']}"])


def run_one(loaded) -> dict:
    from tim_megatron import run_dir as run_folder
    from tim_megatron.loop import train
    from tim_megatron.stop import StopRequest

    rd = run_folder.new_run_dir(loaded)
    rd.mkdir(parents=True, exist_ok=True)
    run_folder.adopt_recipe(rd, loaded, allow_change=False, retry=True)
    try:
        with run_folder.attempt(rd, writer=True):
            code = train(loaded, rd, stop=StopRequest(at_once=False), close=True)
    except Exception:
        return {"exit": None, "run_dir": str(rd), "error": traceback.format_exc()}
    return {"exit": code, "run_dir": str(rd), "error": None}


def resume_one(spec: dict, results: dict) -> dict:
    """Resume a copy of an earlier run from its checkpoint of step ``spec["from_step"]``."""
    import shutil

    from tim_megatron import run_dir as run_folder
    from tim_megatron.loop import train
    from tim_megatron.stop import StopRequest
    from tim_megatron.trainer.checkpoint import step_dir

    earlier = results.get(spec["resume_of"]) or {}
    if earlier.get("error") is not None or not earlier.get("run_dir"):
        return {"exit": None, "run_dir": None, "error": f"{spec['resume_of']} did not run: nothing to resume"}
    rd, step = Path(spec["output_dir"]), spec["from_step"]

    def later(_folder, names):  # the checkpoints after ``step`` (step_NNNNNNNN folders) and the run's lock
        return [
            n
            for n in names
            if n == "run.lock" or (n.startswith("step_") and n[5:].isdigit() and int(n[5:]) > step)
        ]

    shutil.copytree(earlier["run_dir"], rd, ignore=later)
    (rd / "checkpoints" / "latest").write_text(step_dir(Path("."), step).name)
    try:
        loaded = run_folder.load_run(rd)
        with run_folder.attempt(rd, writer=True):
            code = train(loaded, rd, resume=True, stop=StopRequest(at_once=False), close=True)
    except Exception:
        return {"exit": None, "run_dir": str(rd), "error": traceback.format_exc()}
    return {"exit": code, "run_dir": str(rd), "error": None}


def main(runs_file: str, results_file: str) -> None:
    runs = json.loads(Path(runs_file).read_text())
    # every recipe checked before the first run starts
    recipes = [None if "resume_of" in spec else load(spec) for spec in runs]
    if any(r is not None and r.recipe.diagnostics.vexact == "exact" for r in recipes):
        from tim_megatron.exact.kernels import pin_cpu_reductions

        pin_cpu_reductions()  # before this process's first GEMM, as tim train does for an exact-mode run
    results: dict[str, dict] = {}
    for spec, loaded in zip(runs, recipes, strict=True):
        t = time.perf_counter()
        results[spec["name"]] = run_one(loaded) if loaded is not None else resume_one(spec, results)
        results[spec["name"]]["seconds"] = round(time.perf_counter() - t, 1)  # what each run costs a suite
        Path(results_file).write_text(json.dumps(results, indent=1))
        print(f"{spec['name']}: exit {results[spec['name']]['exit']}", flush=True)


if __name__ == "__main__":  # multiprocessing (the checkpoint writer) spawns children that import this file
    main(*sys.argv[1:])
