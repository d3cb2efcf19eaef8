"""One train step through our trainer vs a bare megatron-core step, same model, same batch, same process.

Ours: ``MegatronTrainer.train_step`` with the GRPO token-clip loss (chunked vocab-parallel head, loss from
``tim_megatron.algo``, NaN guard, megatron optimizer). Bare: ``GPTModel(..., labels=...)`` (megatron's own
head and cross-entropy), backward, ``finalize_model_grads``, ``optimizer.step()``. Also prints the
logprob-recompute throughput (no-grad forward + head) in tokens/s.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tim_megatron import outcome


def _bench(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(*, seqs: int = 32, length: int = 32, repeat: int = 10, overrides: list[str] | None = None) -> dict:
    from tim_megatron.bench.bare import bare_megatron_step
    from tim_megatron.recipe import load_recipe
    from tim_megatron.rl.objective import plain_loss_fn
    from tim_megatron.run_setup import model_path_for
    from tim_megatron.trainer.megatron_trainer import MegatronTrainer, SeqBatch

    recipe = load_recipe(
        "recipes/tiny-moe/grpo.yaml", [f"trainer.micro_batch_size={seqs}", *(overrides or [])]
    ).recipe
    tr = MegatronTrainer.of_run(recipe, model_path=model_path_for(recipe))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, recipe.model.dims.vocab_size, (seqs, length), generator=g)
    lengths = torch.full((seqs,), length)
    batch = SeqBatch(ids, lengths)
    mask = torch.ones(seqs, length, dtype=torch.bool)
    mask[:, :4] = False
    adv = torch.randn(seqs, generator=g)
    old = tr.logprobs(batch)[0].logprobs
    den = float(mask.sum())

    loss_fn = plain_loss_fn(old, adv, mask, den)

    def ours():
        tr.train_step(batch, loss_fn, lr=1e-6)

    bare = bare_megatron_step(tr, ids=ids, mask=mask)

    t_ours, t_bare = [], []
    for _ in range(3):  # interleave, so drift hits both alike
        t_ours.append(_bench(ours, repeat))
        t_bare.append(_bench(bare, repeat))
    t_lp = _bench(lambda: tr.logprobs(batch), repeat)
    tr.close()
    to, tb = min(t_ours), min(t_bare)
    return {
        "ours_s": to,
        "bare_s": tb,
        "ratio": to / tb,
        "logprob_tokens_per_s": seqs * length / t_lp,
        "tokens": seqs * length,
        "dtype": tr.dtype,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tim_megatron.bench trainer")
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--length", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    r = run(seqs=a.seqs, length=a.length, repeat=a.repeat, overrides=a.overrides)
    print(
        f"[trainer] tiny MoE, {r['tokens']} tokens per step, {r['dtype']}, device={'cuda' if torch.cuda.is_available() else 'cpu'}"
    )
    print(f"  our train step (GRPO loss, chunked head)   {r['ours_s'] * 1e3:8.1f} ms")
    print(f"  bare megatron-core fwd+bwd+optimizer step  {r['bare_s'] * 1e3:8.1f} ms")
    o = outcome.judged(
        "ratio ours / bare",
        value=r["ratio"],
        met=r["ratio"] <= 1.10,
        rule="<= 1.10x",
        unit="x",
        group="trainer",
    )
    print("  " + outcome.target_line(o))
    print(f"  logprob recompute: {r['logprob_tokens_per_s']:,.0f} tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
