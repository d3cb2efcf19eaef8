"""Exact mode: which kernels are invariant to what surrounds a row, and what exact sampling and training cost.

1. Kernel probe (torch, this CPU): a row's result against the row count M, the batch count of ``bmm``, other
   rows' contents, its row index, masked attention keys and ``log_softmax`` of one row vs many; for the stock
   kernels and for the project's row-invariant ones (:class:`tim_megatron.exact.kernels.TiledCPUKernels`).
2. Trainer probe (the tiny MoE): logprobs of a full forward vs the same rows with every position after t
   padded, at the same width, with exact mode's invariant kernels and with the stock ones.
3. Sampler throughput: exact generated tokens/s with the KV cache vs one full forward per token, at fixed
   widths, same process, same rows and seeds. End-of-text is off, so every row runs to its budget: the KV
   cache fills the whole buffer (width - longest prompt tokens), full-forward generates a few tokens (each
   costs one forward of the whole width, the same for every token).
4. Step time: ``tim train`` on the countdown recipe in exact mode vs the same recipe on vLLM.
5. MoE: exact mode's old-logprob forward with sparse experts (each token through its top-k only) vs the dense
   shape-invariant path (``patches/megatron/shape_invariant_moe.py``: every expert on every token), by default
   over one countdown micro-batch (32 rows x width 128).

Every ratio is measured in the same run; the issue's targets are printed next to them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from tim_megatron import outcome
from tim_megatron.bench.train_run import train_rows

VEXACT = "recipes/tiny-moe/vexact.yaml"
COUNTDOWN = "recipes/tiny-moe/countdown.yaml"
QUIET = ["run.val_every=0", "logging.wandb.mode=disabled", "checkpoint.every=0", "diagnostics.dumps.every=0"]


def _rows_differing(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a != b).reshape(a.shape[0], -1).any(-1).sum())


# ------------------------------------------------------------------------------------------ 1. kernels


def kernel_probe(*, seed: int = 0) -> list[tuple[str, str, str, int, int]]:
    """(dtype, kernels, what, rows differing, rows compared) for each probe."""
    from tim_megatron.exact.kernels import TiledCPUKernels

    tiled = TiledCPUKernels()
    kernels = (("stock", F.linear, torch.bmm), (tiled.name, tiled.linear, tiled.bmm))
    g = torch.Generator().manual_seed(seed)
    out = []
    counts = (*range(1, 17), 31, 64, 100, 255, 1000)
    batches = (1, 2, 3, 8, 17, 63)
    for dt in (torch.float32, torch.bfloat16):
        name = str(dt).replace("torch.", "")
        w = torch.randn(64, 128, generator=g).to(dt)
        x = torch.randn(4096, 128, generator=g).to(dt)
        # Attention's shapes: [groups, rows, head dim] x [groups, head dim, keys].
        qa = torch.randn(16, 64, 32, generator=g).to(dt)
        kb = torch.randn(16, 32, 128, generator=g).to(dt)
        a = torch.randn(64, 24, 32, generator=g).to(dt)
        b = torch.randn(64, 32, 24, generator=g).to(dt)
        for kname, linear, bmm in kernels:
            ref = linear(x, w)
            bad = sum(_rows_differing(linear(x[:m], w), ref[:m]) for m in counts)
            out.append((name, kname, "linear: row vs row count M (1..16, 31 .. 1000)", bad, sum(counts)))
            ref = bmm(qa, kb)
            bad = tot = 0
            for m in range(1, 65):
                part = bmm(qa[:, :m], kb)
                bad += _rows_differing(
                    part.reshape(-1, part.shape[-1]), ref[:, :m].reshape(-1, ref.shape[-1])
                )
                tot += 16 * m
            out.append((name, kname, "bmm: row vs row count M (1..64)", bad, tot))
            ref = bmm(a, b)
            bad = sum(_rows_differing(bmm(a[:n], b[:n]), ref[:n]) for n in batches)
            out.append((name, kname, "bmm: batch vs batch count", bad, sum(batches)))
        base = F.linear(x[:512], w)
        y = x[:512].clone()
        y[1::2] = torch.randn(256, 128, generator=g).to(dt)
        out.append(
            (
                name,
                "stock",
                "linear, fixed M: every other row changed",
                _rows_differing(F.linear(y, w)[0::2], base[0::2]),
                256,
            )
        )
        perm = torch.randperm(512, generator=g)
        out.append(
            (
                name,
                "stock",
                "linear, fixed M: rows permuted",
                _rows_differing(F.linear(x[:512][perm], w), base[perm]),
                512,
            )
        )
        p = torch.softmax(torch.randn(8, 1, 40, generator=g), -1).to(dt)
        v = torch.randn(8, 40, 32, generator=g).to(dt)
        bad = 0
        for t in range(1, 40):
            pz = p.clone()
            pz[..., t:] = 0
            v2 = v.clone()
            v2[:, t:] = torch.randn(8, 40 - t, 32, generator=g).to(dt)
            bad += int(not torch.equal(torch.bmm(pz, v), torch.bmm(pz, v2)))
        out.append((name, "stock", "attention P @ V: masked keys hold other values", bad, 39))
        logits = torch.randn(512, 2048, generator=g).to(dt).float() * 3
        ref = torch.log_softmax(logits, -1)
        bad = sum(
            int(not torch.equal(torch.log_softmax(logits[i : i + 1], -1), ref[i : i + 1]))
            for i in range(0, 512, 16)
        )
        out.append((name, "stock", "log_softmax: one row vs 512 rows", bad, 32))
    return out


# ------------------------------------------------------------------------------------------ 2. trainer


def trainer_probe(tr, *, rows: int = 16, width: int = 24, seed: int = 0) -> dict[str, tuple[int, int]]:
    """Logprobs differing between a full forward and the prefix-padded ones, with exact mode's invariant
    kernels (the exact trainer's own forward) and with them reverted to the stock kernels (model and head)."""
    from patches.megatron import invariant_kernels
    from tim_megatron.trainer.logprobs import head_weight, token_logprobs
    from tim_megatron.trainer.model import final_hidden_states

    kernels = invariant_kernels.kernels_of(tr.model)
    if kernels is None:
        raise RuntimeError("trainer probe: the trainer has no invariant kernels (diagnostics.vexact = exact)")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, tr.dims.vocab_size, (rows, width), generator=g)
    plen = torch.randint(3, 8, (rows,), generator=g)
    pos = torch.arange(width)[None]

    @torch.no_grad()
    def lp(x, spec):
        h = final_hidden_states(tr.model, x)
        return token_logprobs(
            hidden=h, input_ids=x, weight=head_weight(tr.model), spec=spec, sequence_parallel=False
        ).logprobs

    def count(spec):
        tr.model.eval()
        full = lp(ids, spec)
        bad = tot = 0
        for k in range(width - 7):
            cur = (plen + k).clamp(max=width - 1)[:, None]
            keep = pos <= cur
            out = lp(ids.masked_fill(pos > cur, 0), spec)
            bad += int(((out != full) & keep).sum())
            tot += int(keep.sum())
        return bad, tot

    res = {f"invariant kernels ({kernels.name})": count(tr.head)}
    invariant_kernels.revert(tr.model)
    try:
        res["stock kernels"] = count(replace(tr.head, kernels=None))
    finally:
        invariant_kernels.apply(tr.model, kernels)
    return res


# ------------------------------------------------------------------------------------------ 3. sampler


def sampler_throughput(
    tr,
    *,
    tokenizer,
    recipe_path: str,
    overrides: list[str],
    widths: list[int],
    prompts: int,
    ff_tokens: int = 8,
    repeat: int = 2,
) -> list[dict]:
    """Per width W: tokens/s of the KV-cached sampler filling the whole buffer (W - longest prompt tokens
    per row) and of the full-forward sampler generating ``ff_tokens`` per row, both at width W with step 1's
    seeds; the fastest of ``repeat`` interleaved runs of each.

    ``tr`` must be built from ``recipe_path`` + ``overrides`` with room for the largest width (positions,
    model length); each sampler gets a recipe loaded the same way with its own budget and
    ``diagnostics.exact_sampler``. The trainer's width is pinned to W on the instance (it would add the
    trainer recipe's budget)."""
    from tim_megatron.data.sources import PromptSource, encode_prompt
    from tim_megatron.recipe import load_recipe
    from tim_megatron.rollout.exact_sampler import ExactSampler

    items = PromptSource(tr.recipe.data, seed=0).step_items(1, prompts)
    enc = [encode_prompt(tokenizer, it.prompt) for it in items]
    longest = max(len(p) for p in enc)

    def run(kind: str, *, width: int, budget: int, step: int):
        recipe = load_recipe(
            recipe_path,
            [
                *overrides,
                f"rollout.max_model_len={width}",
                f"data.max_prompt_tokens={longest}",
                f"rollout.max_tokens={budget}",
                f"diagnostics.exact_sampler={kind}",
            ],
        ).recipe
        sampler = ExactSampler(tr, recipe=recipe, eos_id=-1)  # no end-of-text: every row runs to its budget
        t = time.perf_counter()
        groups, stats = sampler.generate(enc, step=step)
        seconds = time.perf_counter() - t
        if stats.extra["width"] != width:
            raise RuntimeError(f"sampler ran at width {stats.extra['width']}, expected {width}")
        return [s.response_ids for g in groups for s in g], stats, seconds

    out = []
    try:
        for w in widths:
            tr.exact_width = lambda longest_prompt, w=w: w
            run("kv-cache", width=w, budget=2, step=0)  # warm-up at this width
            run("full-forward", width=w, budget=1, step=0)
            kv_s = ff_s = float("inf")
            for _ in range(repeat):  # interleaved, min of each: other processes share the cores
                kv_ids, kv, s = run("kv-cache", width=w, budget=w - longest, step=1)
                kv_s = min(kv_s, s)
                ff_ids, ff, s = run("full-forward", width=w, budget=ff_tokens, step=1)
                ff_s = min(ff_s, s)
            out.append(
                {
                    "width": w,
                    "rows": len(kv_ids),
                    "kv_tokens": kv.response_tokens,
                    "kv_forwards": kv.extra["forwards"],
                    "kv_tokens_per_s": kv.response_tokens / kv_s,
                    "ff_tokens": ff.response_tokens,
                    "ff_forwards": ff.extra["forwards"],
                    "ff_tokens_per_s": ff.response_tokens / ff_s,
                    "same_tokens": all(a[:ff_tokens] == b for a, b in zip(kv_ids, ff_ids, strict=True)),
                }
            )
    finally:
        tr.__dict__.pop("exact_width", None)
    return out


# ------------------------------------------------------------------------------------------ 4. step


def train_steps(*, recipe: str, steps: int, extra: list[str]) -> dict:
    """Run ``tim train`` for ``steps`` steps; mean step time and response length over steps 2.."""
    rows, wall = train_rows(recipe=recipe, steps=steps, overrides=[*QUIET, *extra])
    later = rows[1:] or rows
    return {
        "step_s": statistics.mean(r["time/step"] for r in later),
        "cpu_s": statistics.mean(r["time/step_cpu"] for r in later),
        "median_s": statistics.median(r["time/step"] for r in later),
        "kv_read_kib": statistics.mean(r.get("exact/kv_read_kib_per_token", 0.0) for r in later),
        "kv_copied_kib": statistics.mean(r.get("exact/kv_copied_kib_per_token", 0.0) for r in later),
        "first_step_s": rows[0]["time/step"],
        "response_len": statistics.mean(r["response/length_mean"] for r in later),
        "checked": int(sum(r.get("exact/checked_tokens", 0) for r in rows)),
        "steps": len(later),
        "wall_s": wall,
    }


def step_vs_vllm(*, steps: int = 6, prompts_per_step: int = 8) -> dict:
    """The countdown recipe in exact mode (fp32 head, as the lab's exact arms) and on vLLM, same everything
    else; also the exact arm's recipe (its sampler, samples per prompt, budget and widest micro-batch)."""
    from tim_megatron.recipe import load_recipe

    common = [f"data.prompts_per_step={prompts_per_step}"]
    exact = [*common, "diagnostics.vexact=exact", "remedies.fp32_lm_head=true"]
    r = load_recipe(COUNTDOWN, exact).recipe
    return {
        "sampler": r.diagnostics.exact_sampler,
        "n": r.rollout.n,
        "max_tokens": r.rollout.max_tokens,
        "width": r.data.max_prompt_tokens + r.rollout.max_tokens,
        "exact": train_steps(recipe=COUNTDOWN, steps=steps, extra=exact),
        "vllm": train_steps(recipe=COUNTDOWN, steps=steps, extra=common),
    }


# ------------------------------------------------------------------------------------------ 5. MoE


def moe_forward(tr, *, rows: int, width: int, repeat: int, seed: int = 0) -> dict:
    """Seconds (min over ``repeat`` interleaved runs) of the old-logprob forward over one batch, sparse
    experts vs dense, and the largest difference between their logprobs."""
    from patches.megatron import shape_invariant_moe
    from tim_megatron.trainer.megatron_trainer import SeqBatch

    g = torch.Generator().manual_seed(seed)
    batch = SeqBatch(
        torch.randint(2, tr.dims.vocab_size, (rows, width), generator=g), torch.full((rows,), width)
    )

    from megatron.core.transformer.moe.moe_layer import MoELayer

    from tim_megatron.trainer.model import unwrap

    inside = [0.0]  # seconds spent inside the MoE layers (router, dispatch, experts, combine)
    started: dict[int, float] = {}
    hooks = []
    for m in unwrap(tr.model).modules():
        if isinstance(m, MoELayer):
            hooks.append(
                m.register_forward_pre_hook(lambda mod, a: started.__setitem__(id(mod), time.perf_counter()))
            )
            hooks.append(
                m.register_forward_hook(
                    lambda mod, a, o: inside.__setitem__(
                        0, inside[0] + time.perf_counter() - started[id(mod)]
                    )
                )
            )

    def timed(dense: bool) -> tuple[float, float, torch.Tensor]:
        if dense:
            shape_invariant_moe.apply(tr.model)
        try:
            inside[0] = 0.0
            t = time.perf_counter()
            lp, _ = tr.logprobs(batch, width=width)
            return time.perf_counter() - t, inside[0], lp.logprobs
        finally:
            if dense:
                shape_invariant_moe.revert(tr.model)

    try:
        timed(False), timed(True)  # warm-up
        sparse_s = dense_s = sparse_moe = dense_moe = float("inf")
        for _ in range(repeat):  # interleaved, min of each: other processes share the cores
            s, moe, sparse = timed(False)
            sparse_s, sparse_moe = min(sparse_s, s), min(sparse_moe, moe)
            s, moe, dense = timed(True)
            dense_s, dense_moe = min(dense_s, s), min(dense_moe, moe)
    finally:
        for h in hooks:
            h.remove()
    return {
        "experts": tr.dims.num_experts,
        "top_k": tr.dims.num_experts_per_tok,
        "sparse_s": sparse_s,
        "dense_s": dense_s,
        "sparse_moe_s": sparse_moe,
        "dense_moe_s": dense_moe,
        "max_diff": float((dense - sparse).abs().max()),
    }


# ------------------------------------------------------------------------------------------ main


def _trainer(overrides: list[str]):
    from transformers import AutoTokenizer

    from tim_megatron.recipe import load_recipe
    from tim_megatron.run_setup import model_path_for
    from tim_megatron.trainer.megatron_trainer import MegatronTrainer

    recipe = load_recipe(VEXACT, overrides).recipe
    path = model_path_for(recipe)
    return MegatronTrainer.of_run(recipe, model_path=path), AutoTokenizer.from_pretrained(path)


def _print_kernels() -> None:
    """The probe under MKL's default and under exact mode's strict mode, each in a fresh process (MKL reads the
    setting at a process's first GEMM), plus the wide-shape check exact mode runs before a run starts."""
    import os
    import subprocess
    import sys

    from tim_megatron.exact.kernels import CPU_ENV

    code = (
        "import torch\n"
        "from tim_megatron.bench.exact import kernel_probe\n"
        "from tim_megatron.exact.kernels import TiledCPUKernels, invariance_problems\n"
        "for dtype, kname, what, bad, tot in kernel_probe():\n"
        "    print(f'  {dtype:<9} {kname:<9} {what:<49} {bad:5d} of {tot}')\n"
        "print('  wide-shape check of the tiled kernels:', invariance_problems(TiledCPUKernels()) or 'invariant')\n"
    )
    for setting in ("default", CPU_ENV["MKL_CBWR"]):
        env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
        if setting != "default":
            env["MKL_CBWR"] = setting
        print(
            f"[exact] kernel probe (torch {torch.__version__}, {torch.get_num_threads()} threads, MKL_CBWR "
            f"{setting}): rows differing (0 = invariant)",
            flush=True,
        )
        subprocess.run([sys.executable, "-c", code], env=env, check=True)


def _print_trainer(*, overrides: list[str]) -> None:
    tr, _ = _trainer(overrides)
    try:
        res = trainer_probe(tr)
    finally:
        tr.close()
    print(
        f"[exact] trainer probe ({VEXACT}, {tr.dtype}, MKL_CBWR {os.environ.get('MKL_CBWR', 'default')}): "
        "full forward vs the same rows padded after t, same width"
    )
    for what, (bad, tot) in res.items():
        print(f"  {what:<29} {bad:5d} of {tot} logprobs differ")


def _print_sampler(
    *, overrides: list[str], widths: list[int], prompts: int, ff_tokens: int, repeat: int
) -> None:
    room = [f"model.dims.max_position_embeddings={max(widths)}", f"rollout.max_model_len={max(widths)}"]
    tr, tok = _trainer([*overrides, *room])
    try:
        res = sampler_throughput(
            tr,
            tokenizer=tok,
            recipe_path=VEXACT,
            overrides=[*overrides, *room],
            widths=widths,
            prompts=prompts,
            ff_tokens=ff_tokens,
            repeat=repeat,
        )
    finally:
        tr.close()
    print(
        f"[exact] sampler tokens/s ({VEXACT}, {prompts} prompt(s) x {tr.recipe.rollout.n} rows, "
        "end-of-text off, "
        f"fastest of {repeat}): kv-cache fills the buffer, full-forward generates {ff_tokens} tokens per row"
    )
    for r in res:
        ratio = r["kv_tokens_per_s"] / r["ff_tokens_per_s"]
        kv = f"{r['kv_tokens_per_s']:9,.1f} tok/s ({r['kv_tokens']} tokens, {r['kv_forwards']} forwards)"
        ff = f"{r['ff_tokens_per_s']:8,.1f} tok/s ({r['ff_tokens']} tokens, {r['ff_forwards']} forwards)"
        if r["width"] == 512:
            o = outcome.judged(
                "ratio", value=ratio, met=ratio >= 5, rule=">= 5x at width 512", unit="x", group="exact"
            )
        else:
            o = outcome.Outcome("ratio", "info", value=ratio, unit="x", group="exact")
        print(f"  width {r['width']:5d}: kv-cache {kv}  full-forward {ff}  " + outcome.target_line(o))
    same = [r["width"] for r in res if not r["same_tokens"]]
    print(
        f"  first {ff_tokens} tokens of every row equal between the samplers: "
        f"{'yes' if not same else f'NO at widths {same}'}"
    )


def _print_step(*, steps: int, prompts: int) -> None:
    res = step_vs_vllm(steps=steps, prompts_per_step=prompts)
    ex, vl = res["exact"], res["vllm"]
    ratio, cpu_ratio = ex["step_s"] / vl["step_s"], ex["cpu_s"] / vl["cpu_s"]
    print(
        f"[exact] step time, {COUNTDOWN} ({prompts} prompts x {res['n']} samples, max_tokens "
        f"{res['max_tokens']}, exact width <= {res['width']}), mean over steps 2..{steps}; CPU seconds of the "
        "process and its descendants (vLLM's engine core)"
    )
    for arm, r in ((f"exact ({res['sampler']}, fp32 head)", ex), ("vLLM", vl)):
        line = (
            f"  {arm:<27} {r['step_s']:7.2f} s/step, {r['cpu_s']:7.2f} CPU s/step (median {r['median_s']:.2f}; "
            f"step 1 {r['first_step_s']:.2f} "
            f"s; run {r['wall_s']:.0f} s)  mean response {r['response_len']:.1f} tokens"
        )
        if r is ex:
            line += f", {r['checked']} checked exact"
        print(line)
    note = "; the two arms sample differently, so their response lengths (and step costs) differ"
    o = outcome.judged(
        "ratio exact / vLLM, CPU seconds",
        value=cpu_ratio,
        met=cpu_ratio <= 1.5,
        rule="<= 1.5x",
        unit="x",
        group="exact",
    )
    print("  " + outcome.target_line(o) + note)
    per_token = (ex["cpu_s"] / ex["response_len"]) / (vl["cpu_s"] / vl["response_len"])
    print(
        f"  ratio exact / vLLM, CPU seconds per response token = {per_token:.2f}x (not judged: lengths differ)"
    )
    o = outcome.judged(
        "ratio exact / vLLM, wall", value=ratio, met=ratio <= 2, rule="<= 2x", unit="x", group="exact"
    )
    print("  " + outcome.target_line(o))
    print(
        f"  exact KV cache traffic per decoded token: {ex['kv_read_kib']:.1f} KiB read in place + "
        f"{ex['kv_copied_kib']:.1f} KiB copied (finished sequences' slots refilled); gathering the active rows "
        f"every step (the former read: the live rows' buffers, gathered then reshaped) copied twice what is read, "
        f"{2 * ex['kv_read_kib']:.1f} KiB, and read {ex['kv_read_kib']:.1f}"
    )


def _print_moe(*, overrides: list[str], experts: list[int], rows: int, width: int, repeat: int) -> None:
    print(
        f"[exact] MoE old-logprob forward ({VEXACT}, {rows} rows x width {width}, fastest of {repeat}): "
        "sparse experts vs dense shape-invariant path"
    )
    for n in experts:
        tr, _ = _trainer([*overrides, f"model.dims.num_experts={n}"])
        try:
            r = moe_forward(tr, rows=rows, width=width, repeat=repeat)
        finally:
            tr.close()
        ratio = r["dense_s"] / r["sparse_s"]
        moe_ratio = r["dense_moe_s"] / r["sparse_moe_s"]
        if n == 64:
            o = outcome.judged(
                "ratio dense / sparse",
                value=moe_ratio,
                met=moe_ratio >= 4,
                rule=">= 4x at 64 experts",
                unit="x",
                group="exact",
            )
        else:
            o = outcome.Outcome("ratio dense / sparse", "info", value=moe_ratio, unit="x", group="exact")
        print(
            f"  {r['experts']:3d} experts (top-{r['top_k']}): MoE layers: sparse {r['sparse_moe_s']:7.3f} s  "
            f"dense {r['dense_moe_s']:7.3f} s  " + outcome.target_line(o)
        )
        print(
            f"  {'':17} whole forward: sparse {r['sparse_s']:7.3f} s  dense {r['dense_s']:7.3f} s  ratio "
            f"{ratio:5.2f}x  max |logprob diff| {r['max_diff']:.2e}"
        )


PARTS = ("kernels", "trainer", "sampler", "step", "moe")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tim_megatron.bench exact")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which parts to run")
    ap.add_argument("--widths", type=int, nargs="+", default=[128, 512, 2048], help="sampler widths")
    ap.add_argument("--prompts", type=int, default=1, help="sampler prompts (x rollout.n rows)")
    ap.add_argument("--ff-tokens", type=int, default=8, help="tokens per row full-forward generates")
    ap.add_argument("--sampler-repeat", type=int, default=2, help="sampler runs per width (fastest taken)")
    ap.add_argument("--steps", type=int, default=6, help="tim train steps per arm (mean over steps 2..)")
    ap.add_argument("--step-prompts", type=int, default=8, help="countdown prompts per step")
    ap.add_argument("--experts", type=int, nargs="+", default=[8, 64], help="MoE expert counts")
    ap.add_argument("--moe-rows", type=int, default=32, help="MoE forward batch rows")
    ap.add_argument("--moe-width", type=int, default=128, help="MoE forward batch width")
    ap.add_argument("--moe-repeat", type=int, default=5, help="MoE forward runs (fastest taken)")
    ap.add_argument("overrides", nargs="*", help="recipe overrides on recipes/tiny-moe/vexact.yaml")
    a = ap.parse_args(argv)
    from tim_megatron.exact.kernels import pin_cpu_reductions

    pin_cpu_reductions()  # exact mode's setting for this process's trainers (tim train sets it the same way)
    t0 = time.perf_counter()
    if "kernels" in a.parts:
        _print_kernels()
    if "trainer" in a.parts:
        _print_trainer(overrides=a.overrides)
    if "sampler" in a.parts:
        _print_sampler(
            overrides=a.overrides,
            widths=a.widths,
            prompts=a.prompts,
            ff_tokens=a.ff_tokens,
            repeat=a.sampler_repeat,
        )
    if "step" in a.parts:
        _print_step(steps=a.steps, prompts=a.step_prompts)
    if "moe" in a.parts:
        _print_moe(
            overrides=a.overrides, experts=a.experts, rows=a.moe_rows, width=a.moe_width, repeat=a.moe_repeat
        )
    print(f"[exact] done in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
