"""Exact mode: which operations are invariant to what surrounds a row, and what exact sampling costs.

1. Kernel probe (torch, this CPU): a row's result against the row count M, other rows' contents, its row
   index, the batch count of ``bmm``, masked attention keys, and ``log_softmax`` of one row vs many.
2. Trainer probe (the tiny MoE): logprobs of a full forward vs the same rows with every position after t padded,
   at the same width, for every t: with megatron's routed experts and with the shape-invariant path.
3. Throughput: the exact sampler's generated tokens/s against the trainer's plain forward (the old-logprob pass
   over the same rows, scoring the same tokens), same process, same batch. The ratio is the price of exactness:
   about one forward of the micro-batch per generated token.
"""

from __future__ import annotations

import argparse
import time

import torch


def _rows_differing(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a != b).reshape(a.shape[0], -1).any(-1).sum())


def kernel_probe(seed: int = 0) -> list[tuple[str, str, int, int]]:
    """(dtype, what, rows differing, rows compared) for each probe."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for dt in (torch.float32, torch.bfloat16):
        name = str(dt).replace("torch.", "")
        w = torch.randn(64, 128, generator=g).to(dt)
        x = torch.randn(4096, 128, generator=g).to(dt)
        ref = torch.nn.functional.linear(x, w)
        bad = tot = 0
        for m in (*range(1, 17), 31, 64, 100, 255, 1000):
            bad += _rows_differing(torch.nn.functional.linear(x[:m], w), ref[:m])
            tot += m
        out.append((name, "linear: row vs row count M (M = 1..16, 31 .. 1000)", bad, tot))
        base = torch.nn.functional.linear(x[:512], w)
        y = x[:512].clone()
        y[1::2] = torch.randn(256, 128, generator=g).to(dt)
        out.append(
            (
                name,
                "linear, fixed M: every other row changed",
                _rows_differing(torch.nn.functional.linear(y, w)[0::2], base[0::2]),
                256,
            )
        )
        perm = torch.randperm(512, generator=g)
        out.append(
            (
                name,
                "linear, fixed M: rows permuted",
                _rows_differing(torch.nn.functional.linear(x[:512][perm], w), base[perm]),
                512,
            )
        )
        a = torch.randn(64, 24, 32, generator=g).to(dt)
        b = torch.randn(64, 32, 24, generator=g).to(dt)
        ref = torch.bmm(a, b)
        bad = sum(_rows_differing(torch.bmm(a[:n], b[:n]), ref[:n]) for n in (1, 2, 3, 8, 17, 63))
        out.append((name, "bmm: batch vs batch count", bad, 1 + 2 + 3 + 8 + 17 + 63))
        p = torch.softmax(torch.randn(8, 1, 40, generator=g), -1).to(dt)
        v = torch.randn(8, 40, 32, generator=g).to(dt)
        bad = 0
        for t in range(1, 40):
            pz = p.clone()
            pz[..., t:] = 0
            v2 = v.clone()
            v2[:, t:] = torch.randn(8, 40 - t, 32, generator=g).to(dt)
            bad += int(not torch.equal(torch.bmm(pz, v), torch.bmm(pz, v2)))
        out.append((name, "attention P @ V: masked keys hold other values", bad, 39))
        logits = torch.randn(512, 2048, generator=g).to(dt).float() * 3
        ref = torch.log_softmax(logits, -1)
        bad = sum(
            int(not torch.equal(torch.log_softmax(logits[i : i + 1], -1), ref[i : i + 1]))
            for i in range(0, 512, 16)
        )
        out.append((name, "log_softmax: one row vs 512 rows", bad, 32))
    return out


def trainer_probe(tr, *, rows: int = 16, width: int = 24, seed: int = 0) -> dict[str, tuple[int, int]]:
    """Logprobs differing between a full forward and the prefix-padded ones, sparse vs shape-invariant experts."""
    from patches.megatron import shape_invariant_moe
    from tim_megatron.trainer.logprobs import head_weight, token_logprobs
    from tim_megatron.trainer.model import final_hidden_states

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, tr.dims.vocab_size, (rows, width), generator=g)
    plen = torch.randint(3, 8, (rows,), generator=g)
    pos = torch.arange(width)[None]

    @torch.no_grad()
    def lp(x):
        h = final_hidden_states(tr.model, x)
        return token_logprobs(
            hidden=h, input_ids=x, weight=head_weight(tr.model), spec=tr.head, sequence_parallel=False
        ).logprobs

    def count():
        tr.model.eval()
        full = lp(ids)
        bad = tot = 0
        for k in range(width - 7):
            cur = (plen + k).clamp(max=width - 1)[:, None]
            keep = pos <= cur
            out = lp(ids.masked_fill(pos > cur, 0))
            bad += int(((out != full) & keep).sum())
            tot += int(keep.sum())
        return bad, tot

    res = {"shape-invariant experts": count()}
    shape_invariant_moe.revert(tr.model)
    res["megatron's routed experts"] = count()
    shape_invariant_moe.apply(tr.model)
    return res


def throughput(tr, tokenizer, *, prompts: int, repeat: int) -> dict:
    from tim_megatron.data.sources import PromptSource, encode_prompt
    from tim_megatron.rl.batch import from_samples
    from tim_megatron.rollout.exact_sampler import ExactSampler
    from tim_megatron.trainer.engine import SeqBatch

    r = tr.recipe
    items = PromptSource(r.data, seed=0).step_items(1, prompts)
    enc = [encode_prompt(tokenizer, it.prompt) for it in items]
    sampler = ExactSampler(tr, eos_id=tokenizer.eos_token_id)
    sampler.generate(enc, step=0)  # warm-up
    gen_s, fwd_s, tokens, forwards = [], [], 0, 0
    for step in range(1, repeat + 1):
        t = time.perf_counter()
        groups, stats = sampler.generate(enc, step=step)
        gen_s.append(time.perf_counter() - t)
        tokens, forwards = stats.response_tokens, stats.extra["forwards"]
        b = from_samples(groups, [[0.0] * len(g) for g in groups], total_rows=len(enc) * r.rollout.n)
        width = tr.exact_width(int(b.prompt_lens.max()))
        t = time.perf_counter()
        tr.logprobs(SeqBatch(b.input_ids, b.lengths), width=width)
        fwd_s.append(time.perf_counter() - t)
    gen, fwd = min(gen_s), min(fwd_s)
    return {
        "sample_tokens_per_s": tokens / gen,
        "forward_tokens_per_s": tokens / fwd,
        "ratio": (tokens / gen) / (tokens / fwd),
        "tokens": tokens,
        "forwards": forwards,
        "micro_batches": -(-len(enc) * r.rollout.n // r.trainer.micro_batch_size),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tim_megatron.bench exact")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("overrides", nargs="*", help="recipe overrides on recipes/tiny-moe/vexact.yaml")
    a = ap.parse_args(argv)
    print(
        f"[exact] kernel probe (torch {torch.__version__}, {torch.get_num_threads()} threads): rows differing"
    )
    for dtype, what, bad, tot in kernel_probe():
        print(f"  {dtype:<9} {what:<54} {bad:5d} of {tot}")

    from transformers import AutoTokenizer

    from tim_megatron.recipe import load_recipe
    from tim_megatron.run_setup import model_path_for
    from tim_megatron.trainer.engine import MegatronTrainer

    recipe = load_recipe("recipes/tiny-moe/vexact.yaml", a.overrides).recipe
    path = model_path_for(recipe)
    tr = MegatronTrainer(recipe, model_path=path)
    print(f"[exact] trainer probe ({tr.dtype}): full forward vs the same rows padded after t, same width")
    for what, (bad, tot) in trainer_probe(tr).items():
        print(f"  {what:<27} {bad:5d} of {tot} logprobs differ")
    r = throughput(tr, AutoTokenizer.from_pretrained(path), prompts=a.prompts, repeat=a.repeat)
    tr.close()
    print(
        f"[exact] {a.prompts} prompts x {recipe.rollout.n} samples, max_tokens {recipe.rollout.max_tokens}: "
        f"{r['tokens']} tokens, {r['forwards']} forwards over {r['micro_batches']} micro-batches"
    )
    print(f"  exact sampler        {r['sample_tokens_per_s']:10,.0f} generated tokens/s")
    print(
        f"  trainer forward      {r['forward_tokens_per_s']:10,.0f} tokens/s (old-logprob pass, same rows and width)"
    )
    print(
        f"  ratio sampler / forward = {r['ratio']:.3f}  (1 / forwards per micro-batch = {r['micro_batches'] / r['forwards']:.3f})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
