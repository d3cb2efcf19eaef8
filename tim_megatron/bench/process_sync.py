"""Weight sync into an engine in its own process (``rollout.engine_process``): the flat buffer against the
per-tensor path it replaced, and against vLLM's own in-process load.

For the tiny MoE (69 tensors) and the tiny MoE with 4 layers of 128 experts (1,575 tensors), the same weights (the
checkpoint's, scaled: what an update pushes) are loaded, round after round, interleaved, into:

* one :class:`~tim_megatron.rollout.process_engine.ProcessEngine` by its flat buffer (``update_weights``: packed
  into one shared-memory file, loaded from views of it, then the witness probe scored) and by the per-tensor path
  (``_update_weights_per_tensor``: each tensor in shared memory of its own, as torch's multiprocessing reductions
  send it; no witness);
* a :class:`~tim_megatron.rollout.vllm_engine.VLLMEngine` in this process: vLLM's ``reload_weights`` by reference,
  the raw library's floor.

The times are the rank's, from the call to its return (median of the rounds); the trainer's export, the same on
every path, is left out. The per-tensor path needs two open files per tensor: this process raises its soft
open-file limit to the hard one first.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

from tim_megatron import outcome

MODELS = {
    "tiny MoE": [],
    "4 layers x 128 experts": [
        "model.dims.num_layers=4",
        "model.dims.num_experts=128",
        "model.tiny_warmup_steps=0",
    ],
}


def _weights(path, scale: float) -> list:
    from safetensors.torch import load_file

    return [(k, v * scale if v.is_floating_point() else v) for k, v in load_file(str(path)).items()]


def _seconds(call) -> float:
    t = time.perf_counter()
    call()
    return time.perf_counter() - t


def measure(overrides: list[str], *, rounds: int) -> dict:
    from tim_megatron.recipe import load_recipe
    from tim_megatron.rollout.base import FleetLayout
    from tim_megatron.rollout.process_engine import ProcessEngine
    from tim_megatron.rollout.vllm_engine import VLLMEngine
    from tim_megatron.run_setup import model_path_for

    recipe = load_recipe("recipes/tiny-moe/grpo.yaml", ["rollout.engine_process=true", *overrides]).recipe
    path = model_path_for(recipe)
    layout, moe = FleetLayout(world=1, ranks_per_engine=1), recipe.model.dims.num_layers
    w = _weights(path / "model.safetensors", 1.01)
    own = ProcessEngine(recipe, model_path=path, layout=layout, num_moe_layers=moe)
    here = VLLMEngine(recipe, model_path=path, layout=layout, num_moe_layers=moe)
    own.update_weights(iter(w))  # the buffer's first layout, and every path once before the rounds
    own._update_weights_per_tensor(iter(w))
    here.update_weights(iter(w))
    flat, load, witness, per_tensor, in_process = [], [], [], [], []
    for _ in range(rounds):
        flat.append(_seconds(lambda: own.update_weights(iter(w))))
        load.append(own.last_load["load_seconds"])
        witness.append(own.last_load["witness_seconds"])
        per_tensor.append(_seconds(lambda: own._update_weights_per_tensor(iter(w))))
        in_process.append(_seconds(lambda: here.update_weights(iter(w))))
    own.close()
    here.close()
    return {
        "tensors": len(w),
        "mbytes": sum(t.numel() * t.element_size() for _, t in w) / 2**20,
        "flat_s": statistics.median(flat),
        "flat_load_s": statistics.median(load),
        "witness_s": statistics.median(witness),
        "per_tensor_s": statistics.median(per_tensor),
        "in_process_s": statistics.median(in_process),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tim_megatron.bench process_sync")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    print(
        "[process_sync] weight sync into an engine in its own process (CPU, vLLM's CPU engine), the same weights, "
        f"interleaved, median of {a.rounds} rounds; open-file limit raised from {soft} to {hard} for the per-tensor "
        "path"
    )
    for name, overrides in MODELS.items():
        r = measure(overrides, rounds=a.rounds)
        ratio = r["per_tensor_s"] / r["flat_s"]
        print(f"  {name} ({r['tensors']} tensors, {r['mbytes']:.1f} MiB):")
        print(
            f"    per-tensor path (before)   {r['per_tensor_s'] * 1e3:8.1f} ms   (no witness)\n"
            f"    flat buffer (after)        {r['flat_s'] * 1e3:8.1f} ms   (the engine's load {r['flat_load_s'] * 1e3:.1f} ms, "
            f"its witness probe {r['witness_s'] * 1e3:.1f} ms)\n"
            f"    vLLM in-process load       {r['in_process_s'] * 1e3:8.1f} ms   (by reference, the floor)"
        )
        o = outcome.judged(
            "ratio per-tensor / flat",
            value=ratio,
            met=ratio >= 1.0,
            rule=">= 1.0x",
            unit="x",
            group="process_sync",
        )
        print("    " + outcome.target_line(o))
        print(f"    flat / in-process {r['flat_s'] / r['in_process_s']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
