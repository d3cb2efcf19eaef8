"""Rollout engine: our wrapper's generation throughput vs a bare ``LLM.generate``, and the cost of a weight sync.

Both generate the same requests (the tiny demo's prompts, ``rollout.n`` samples each, per-sample seeds) on
the same engine, interleaved, in one process. The sync is timed as the demo runs it (export from the
trainer, structural check, in-place reload) and with the optional probe verification, and printed as a
fraction of a demo step's time.
"""

from __future__ import annotations

import argparse
import statistics
import time

from tim_megatron import outcome


def run(*, rounds: int = 5, demo_step_s: float | None = None, overrides: list[str] | None = None) -> dict:
    from vllm import SamplingParams

    from tim_megatron.data.sources import PromptSource, encode_prompt
    from tim_megatron.recipe import load_recipe
    from tim_megatron.rollout.backends import BACKENDS
    from tim_megatron.rollout.sync import WeightSync, manifest
    from tim_megatron.rollout.vllm_engine import sample_seed
    from tim_megatron.run_setup import model_path_for
    from tim_megatron.trainer.megatron_trainer import MegatronTrainer

    recipe = load_recipe("recipes/tiny-moe/grpo.yaml", overrides or []).recipe
    path = model_path_for(recipe)
    tr = MegatronTrainer.of_run(recipe, model_path=path)
    eng = BACKENDS["vllm"].build(recipe, tr, model_path=path, tokenizer=None)  # as a run builds it
    src = PromptSource(recipe.data, seed=0)
    prompts = [
        encode_prompt(eng.tokenizer, it.prompt) for it in src.step_items(1, recipe.data.prompts_per_step)
    ]
    r, n = recipe.rollout, recipe.rollout.n
    reqs = [{"prompt_token_ids": p} for p in prompts for _ in range(n)]

    def bare_params(step):
        return [
            SamplingParams(
                n=1,
                temperature=r.temperature,
                top_p=r.top_p,
                top_k=r.top_k,
                max_tokens=r.max_tokens,
                logprobs=0,
                seed=sample_seed(recipe.run.seed, step, i // n, i % n),
            )
            for i in range(len(reqs))
        ]

    eng.generate(prompts, step=0)
    eng.llm.generate(reqs, bare_params(0), use_tqdm=False)
    ours, bare = [], []
    for step in range(1, rounds + 1):
        t = time.perf_counter()
        _, st = eng.generate(prompts, step=step)
        ours.append((st.response_tokens, time.perf_counter() - t))
        t = time.perf_counter()
        res = eng.llm.generate(reqs, bare_params(step), use_tqdm=False)
        bare.append((sum(len(o.outputs[0].token_ids) for o in res), time.perf_counter() - t))
    ws = WeightSync(recipe, expected=manifest(path), rank=0)
    probe = [prompts[0] + [3, 0], prompts[1] + [3, 0]]
    sync, verified = [], []
    for _ in range(rounds):
        ws.check = "off"
        rep = ws.push(eng, tr, probe=None)
        sync.append(rep["sync/seconds"])
        ws.check = "probe"
        rep = ws.push(eng, tr, probe=lambda: probe)
        verified.append(rep["sync/seconds"] + rep["sync/verify_seconds"])
    out = {
        "ours_tok_s": sum(x for x, _ in ours) / sum(t for _, t in ours),
        "bare_tok_s": sum(x for x, _ in bare) / sum(t for _, t in bare),
        "sync_s": statistics.median(sync),
        "sync_probe_s": statistics.median(verified),
        "demo_step_s": demo_step_s,
        "bytes": rep["sync/mbytes"] * 2**20,
    }
    return out  # no tr.close(): vLLM's exit hook still needs torch.distributed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tim_megatron.bench rollout")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--demo-step-s",
        type=float,
        default=None,
        help="a demo step's time (default: measured by the step bench)",
    )
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    r = run(rounds=a.rounds, demo_step_s=a.demo_step_s, overrides=a.overrides)
    ratio = r["ours_tok_s"] / r["bare_tok_s"]
    print("[rollout] tiny MoE, demo prompts x rollout.n, same engine, interleaved")
    print(f"  our generate        {r['ours_tok_s']:9.1f} response tokens/s")
    print(f"  bare LLM.generate   {r['bare_tok_s']:9.1f} response tokens/s")
    o = outcome.judged(
        "ratio ours / bare", value=ratio, met=ratio >= 0.95, rule=">= 0.95x", unit="x", group="rollout"
    )
    print("  " + outcome.target_line(o))
    print(
        f"  weight sync (export + structural check + in-place reload, {r['bytes'] / 2**20:.1f} MiB): {r['sync_s'] * 1e3:.1f} ms;"
        f" with an eager probe verification: {r['sync_probe_s'] * 1e3:.1f} ms"
    )
    if r["demo_step_s"]:
        share = r["sync_s"] / r["demo_step_s"]
        o = outcome.judged(
            f"sync as a share of a {r['demo_step_s'] * 1e3:.0f} ms demo step",
            value=share * 100,
            met=share <= 0.05,
            rule="<= 5%",
            unit="%",
            group="rollout",
        )
        print(
            "  "
            + outcome.target_line(o)
            + "; the default check is on the next step's samples and costs nothing extra"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
