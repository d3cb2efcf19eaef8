"""Several one-process training runs in one Python process, one after another, through the library's ``train``.

    python tests/workers/train_worker.py RUNS.json RESULTS.json

``RUNS.json`` is a list of ``{"name", "recipe", "overrides", "output_dir"}``. Each run is set up as ``tim train``
sets up a one-process run (the recipe loaded with its overrides, a new run folder that adopts the recipe, one
attempt recorded in run.json) and trained with ``tim_megatron.loop.train``, which releases the engine and the
trainer after the run. ``RESULTS.json`` maps each name to ``{"exit", "run_dir", "error"}``; it is rewritten after
every run, so a crash leaves the runs before it readable.

The start-up that every ``tim train`` process pays (the imports of torch, vLLM, megatron-core and transformers,
about 10 s on two cores) is paid once for all the runs. An exact-mode run sets MKL's reproducibility settings
before the first GEMM (as ``tim train`` does), which then hold for the whole process: give exact-mode runs a
worker of their own.
"""

from __future__ import annotations

import json
import sys
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


def main(runs_file: str, results_file: str) -> None:
    runs = json.loads(Path(runs_file).read_text())
    recipes = [load(spec) for spec in runs]  # every recipe checked before the first run starts
    if any(r.recipe.diagnostics.vexact == "exact" for r in recipes):
        from tim_megatron.exact.kernels import pin_cpu_reductions

        pin_cpu_reductions()  # before this process's first GEMM, as tim train does for an exact-mode run
    results: dict[str, dict] = {}
    for spec, loaded in zip(runs, recipes, strict=True):
        results[spec["name"]] = run_one(loaded)
        Path(results_file).write_text(json.dumps(results, indent=1))
        print(f"{spec['name']}: exit {results[spec['name']]['exit']}", flush=True)


if __name__ == "__main__":  # multiprocessing (the checkpoint writer) spawns children that import this file
    main(*sys.argv[1:])
