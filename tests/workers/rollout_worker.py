"""vLLM rollout scenarios run in fresh processes by tests/test_rollout.py.

python tests/workers/rollout_worker.py SCENARIO OUT_DIR [overrides...]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tim_megatron.algo import compute_mismatch  # noqa: E402
from tim_megatron.recipe import load_recipe  # noqa: E402
from tim_megatron.rollout.backends import BACKENDS  # noqa: E402
from tim_megatron.rollout.sync import WeightSync, WeightSyncError, manifest, verdict  # noqa: E402
from tim_megatron.run_setup import model_path_for  # noqa: E402
from tim_megatron.trainer.megatron_trainer import MegatronTrainer, SeqBatch  # noqa: E402

RECIPE = ROOT / "recipes" / "tiny-moe" / "grpo.yaml"
PROMPTS = ["3+4=", "1+1=", "2+0=", "4+4="]


def build(overrides):
    recipe = load_recipe(RECIPE, ["trainer.micro_batch_size=8", *overrides]).recipe
    ck = model_path_for(recipe)
    tr = MegatronTrainer.of_run(recipe, model_path=ck)
    eng = BACKENDS["vllm"].build(recipe, tr, model_path=ck, tokenizer=None)  # as a run builds it
    return recipe, ck, tr, eng


def padded(seqs):
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    return ids, torch.tensor([len(s) for s in seqs])


def sampled(eng, step=1):
    prompts = [eng.tokenizer.encode(p) for p in PROMPTS]
    groups, stats = eng.generate(prompts, step=step)
    return [s for g in groups for s in g], stats


def response_logprobs(lp: torch.Tensor, samples) -> torch.Tensor:
    return torch.cat(
        [lp[i, len(s.prompt_ids) : len(s.prompt_ids) + len(s.response_ids)] for i, s in enumerate(samples)]
    )


def scenario_fp32(out: dict, overrides) -> None:
    recipe, ck, tr, eng = build(
        ["trainer.dtype=float32", "rollout.dtype=float32", "rollout.capture_routed_experts=true", *overrides]
    )
    samples, stats = sampled(eng)
    out["distinct_samples_in_group"] = len({tuple(s.response_ids) for s in samples[: recipe.rollout.n]})
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    ids, lengths = padded(seqs)
    vllm_lp = torch.tensor([x for s in samples for x in s.logprobs])
    # HF transformers, fp32, with router logits.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32)
    with torch.no_grad():
        hout = hf(
            input_ids=ids,
            attention_mask=(torch.arange(ids.shape[1])[None] < lengths[:, None]).long(),
            output_router_logits=True,
        )
    logp = torch.log_softmax(hout.logits.float() / recipe.rollout.temperature, -1)
    hf_tok = torch.cat([torch.zeros(len(seqs), 1), logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)], 1)
    out["vllm_vs_hf"] = float((vllm_lp - response_logprobs(hf_tok, samples)).abs().max())
    lp, _ = tr.logprobs(SeqBatch(ids, lengths))
    out["vllm_vs_megatron"] = float((vllm_lp - response_logprobs(lp.logprobs, samples)).abs().max())
    # Routed experts vs HF's router top-k for the same tokens.
    k = recipe.model.dims.num_experts_per_tok
    router = torch.stack(
        [r.view(len(seqs), ids.shape[1], -1) for r in hout.router_logits]
    )  # [layers, N, L, E]
    hf_top = router.topk(k, -1).indices.sort(-1).values
    agree, total, shapes_ok = 0, 0, True
    for i, s in enumerate(samples):
        need = len(s.prompt_ids) + len(s.response_ids) - 1
        e = torch.from_numpy(s.routed_experts.astype("int64"))  # [need, layers, k]
        shapes_ok &= tuple(e.shape) == (need, recipe.model.dims.num_layers, k)
        got = e.permute(1, 0, 2).sort(-1).values
        agree += int((got == hf_top[:, i, :need]).all(-1).sum())
        total += got.shape[0] * got.shape[1]
    out["routing_agreement_with_hf"] = agree / total
    out["routing_shapes_ok"] = bool(shapes_ok)
    # Update the trainer, sync, and compare with the trainer's new logprobs.
    from tim_megatron.algo.stats import Stats

    tr.train_step(SeqBatch(ids, lengths), lambda lp_, rows, s: (-lp_[:, 1:].mean(), Stats()), lr=1e-3)
    man = manifest(ck)
    ws = WeightSync(recipe, expected=man, rank=0)

    def verify(probe):
        verdict(ws.probe_agreements(eng, tr, probe), recipe.sync_tolerance, where="probe")

    try:
        verify(seqs[:4])
        out["stale_detected"] = False
    except WeightSyncError:
        out["stale_detected"] = True
    ws.check = "probe"  # every push verified on the probe
    rep = ws.push(eng, tr, probe=lambda: seqs[:4])
    out["sync_report"] = {
        "tensors": rep["sync/tensors"],
        "max_abs_prob_diff": rep["sync/probe_max_abs_prob_diff"],
        "mean_abs_prob_diff": rep["sync/probe_mean_abs_prob_diff"],
    }
    new_lp, _ = tr.logprobs(SeqBatch(ids, lengths))
    scored = eng.score(seqs)
    worst = 0.0
    for i, row in enumerate(scored):
        worst = max(worst, float((torch.tensor(row[1:]) - new_lp.logprobs[i, 1 : len(row)]).abs().max()))
    out["after_sync_vllm_vs_megatron"] = worst

    # Corrupted syncs: a dropped expert tensor, then a transposed square matrix.
    def dropped():
        for name, t in tr.export_hf():
            if name != "model.layers.1.mlp.experts.3.down_proj.weight":
                yield name, t

    try:
        ws.load(eng, dropped())
        out["dropped_caught"] = None
    except WeightSyncError as e:
        out["dropped_caught"] = str(e)

    def transposed():
        for name, t in tr.export_hf():
            yield name, (t.t().contiguous() if name == "model.layers.0.self_attn.q_proj.weight" else t)

    ws.load(eng, transposed())  # well-shaped: the structural check cannot see it
    try:
        verify(seqs[:4])
        out["transposed_caught"] = None
    except WeightSyncError as e:
        out["transposed_caught"] = str(e)
    # Repaired by a full push: the probe agrees again, and so does every scored sequence.
    fixed = ws.push(eng, tr, probe=lambda: seqs[:4])
    out["repaired_probe_max_abs_prob_diff"] = fixed["sync/probe_max_abs_prob_diff"]
    worst = 0.0
    for i, row in enumerate(eng.score(seqs)):
        worst = max(worst, float((torch.tensor(row[1:]) - new_lp.logprobs[i, 1 : len(row)]).abs().max()))
    out["repaired_vllm_vs_megatron"] = worst
    # The trainer's logprob pass is bitwise repeatable (what exact mode builds on): rho == 1 between two passes.
    ids2, len2 = padded(seqs)
    mask = torch.zeros_like(ids2, dtype=torch.bool)
    for i, s in enumerate(samples):
        mask[i, len(s.prompt_ids) : len(s.prompt_ids) + len(s.response_ids)] = True
    one, _ = tr.logprobs(SeqBatch(ids2, len2), with_entropy=True)
    again, _ = tr.logprobs(SeqBatch(ids2, len2))
    out["recompute_bitwise_repeatable"] = bool(torch.equal(one.logprobs, again.logprobs))
    # Two separate forwards (one also computing the entropy on the side), compared as the mismatch metric sees
    # them: rho == 1 exactly. The same metric on vLLM's logprobs from before the update is the control that
    # shows the comparison can see a difference.
    m0 = compute_mismatch(train_logprobs=again.logprobs, infer_logprobs=one.logprobs, mask=mask)
    out["vexact_std"], out["vexact_max"] = (
        m0["mismatch/old_vs_rollout/rho_std"],
        m0["mismatch/old_vs_rollout/rho_max"],
    )
    stale = torch.zeros(ids2.shape)
    for i, s in enumerate(samples):
        stale[i, len(s.prompt_ids) : len(s.prompt_ids) + len(s.response_ids)] = torch.tensor(s.logprobs)
    out["stale_rollout_std"] = compute_mismatch(
        train_logprobs=again.logprobs, infer_logprobs=stale, mask=mask
    )["mismatch/old_vs_rollout/rho_std"]
    out["gen_tokens_per_s"] = stats.tokens_per_s
    # Bad input is refused before anything is generated.
    from tim_megatron.rollout.vllm_engine import RolloutInputError

    # vLLM numbers every request it is given (LLM.request_counter): a refused prompt must not move it, and one
    # good prompt moves it by exactly one, so the count can tell the two apart.
    before = eng.llm.request_counter.counter
    try:
        eng.generate([list(range(2, 30)) * 2], step=9)
        out["long_prompt_error"] = None
    except RolloutInputError as e:
        out["long_prompt_error"] = str(e)
    out["requests_after_bad_prompt"] = eng.llm.request_counter.counter - before
    eng.generate([eng.tokenizer.encode(PROMPTS[0])], step=9, n=1)
    out["requests_after_good_prompt"] = eng.llm.request_counter.counter - before
    partial_routes(out, recipe, eng, hf)


def partial_routes(out: dict, recipe, eng, hf) -> None:
    """Partial rollouts: a sequence begun under the checkpoint's weights and continued under weights whose first
    router sends every token to the next expert along; the routes kept for each position must be those of the call
    that sampled the next token: HF's top-k with the checkpoint's weights up to the prompt's last position, the
    same shifted by one expert in layer 0 after it (its router's input does not depend on any routing)."""
    from tim_megatron.rl.partial import RUNNING, extended
    from tim_megatron.rollout.base import Sample, Segment

    eng.update_weights(None)  # the checkpoint's weights again (hf's)
    eng.reset_prefix_cache()
    prompts = [eng.tokenizer.encode(p) for p in PROMPTS]
    rows = [Sample(p, [], [], RUNNING, prompt_index=i, versions=[]) for i, p in enumerate(prompts)]

    def part(budget: int, version: int) -> None:
        picks = [i for i, r in enumerate(rows) if r.finish_reason == RUNNING]
        seg = Segment(
            seeds=[11 + i for i in picks],
            max_tokens=[budget] * len(picks),
            prompt_lens=[len(rows[i].prompt_ids) for i in picks],
            indices=[(i, 0) for i in picks],
            longest_prompt=max(map(len, prompts)),
        )
        groups, _ = eng.generate(
            [rows[i].prompt_ids + rows[i].response_ids for i in picks], step=1, segment=seg
        )
        for i, (new,) in zip(picks, groups, strict=True):
            rows[i] = extended(rows[i], new, version=version, max_tokens=recipe.rollout.max_tokens)

    part(1, 0)
    gate = "model.layers.0.mlp.gate.weight"
    weight = dict(hf.named_parameters())[gate].detach()
    eng.update_weights([(gate, torch.roll(weight, 1, 0).clone())])  # expert e's scores now go to e + 1
    eng.reset_prefix_cache()
    part(recipe.rollout.max_tokens - 1, 1)
    eng.update_weights(None)
    continued = [r for r in rows if r.versions == [0] + [1] * (len(r.versions) - 1) and len(r.versions) > 1]
    seqs = [r.prompt_ids + r.response_ids for r in continued]
    ids, _ = padded(seqs)  # right padding: a causal forward's positions before it are unchanged
    with torch.no_grad():
        router = hf(input_ids=ids, output_router_logits=True).router_logits
    k, experts = recipe.model.dims.num_experts_per_tok, recipe.model.dims.num_experts
    logits = torch.stack([x.view(len(seqs), ids.shape[1], -1) for x in router])  # [layers, N, L, E]
    top = logits.topk(k, -1).indices
    agree = total = 0
    for i, r in enumerate(continued):
        p = len(r.prompt_ids)
        want = top[:, i, : len(seqs[i]) - 1]  # [layers, positions, k]
        got = torch.from_numpy(r.routed_experts.astype("int64")).permute(1, 0, 2).sort(-1).values
        # up to the prompt's last position every layer as the checkpoint routes it; after it the shifted layer 0
        # (a later layer's input depends on the shifted routing: HF's forward says nothing of it)
        before = got[:, :p] == want[:, :p].sort(-1).values
        after = got[0, p:] == ((want[0, p:] + 1) % experts).sort(-1).values
        agree += int(before.all(-1).sum()) + int(after.all(-1).sum())
        total += before.shape[0] * before.shape[1] + after.shape[0]
    out["partial_continued_rows"] = len(continued)
    out["partial_routes_agreement"] = agree / max(total, 1)


def scenario_precision(out: dict, overrides) -> None:
    """Mismatch between vLLM and Megatron on the same sampled tokens, under a given precision setup."""
    _recipe, _ck, tr, eng = build(list(overrides))
    samples, _ = sampled(eng)
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    ids, lengths = padded(seqs)
    lp, _ = tr.logprobs(SeqBatch(ids, lengths))
    mask = torch.zeros_like(ids, dtype=torch.bool)
    roll = torch.zeros(ids.shape)
    for i, s in enumerate(samples):
        p = len(s.prompt_ids)
        mask[i, p : p + len(s.response_ids)] = True
        roll[i, p : p + len(s.response_ids)] = torch.tensor(s.logprobs)
    m = compute_mismatch(train_logprobs=lp.logprobs, infer_logprobs=roll, mask=mask)
    # The same comparison on fixed sequences, which no sampler chose: every task prompt followed by every
    # single-digit answer and end-of-text, scored by both engines at T = 1 (vLLM's prompt logprobs).
    from tim_megatron.data.arithmetic import all_problems

    eos = eng.tokenizer.eos_token_id
    fixed = [
        eng.tokenizer.encode(p.prompt) + eng.tokenizer.encode(str(d)) + [eos]
        for p in all_problems(_recipe.data.task)
        for d in range(9)
    ]
    fids, flen = padded(fixed)
    with tr.head_changed(temperature=1.0):
        tlp, _ = tr.logprobs(SeqBatch(fids, flen))
    vlp = torch.zeros(fids.shape)
    for i, row in enumerate(eng.score(fixed)):
        vlp[i, : len(row)] = torch.tensor(row)
    pos = torch.arange(fids.shape[1])[None]
    fmask = (pos >= flen[:, None] - 2) & (pos < flen[:, None])  # the answer digit and end-of-text
    out.update(
        rho_std=m["mismatch/old_vs_rollout/rho_std"],
        kl=m["mismatch/old_vs_rollout/kl_rollout_old_k3"],
        vllm_head_dtype=eng.head_dtype(),
        tokens=int(mask.sum()),
        fixed_abs_log_ratio=float((tlp.logprobs - vlp)[fmask].abs().mean()),
        fixed_tokens=int(fmask.sum()),
    )


def scenario_bench(out: dict, overrides) -> None:
    """Generation throughput of our wrapper vs a bare LLM.generate on the same engine and prompts, plus sync cost."""
    from vllm import SamplingParams

    from tim_megatron.rollout.vllm_engine import sample_seed

    recipe, ck, tr, eng = build(list(overrides))
    prompts = [eng.tokenizer.encode(p) for p in PROMPTS * 4]
    n = recipe.rollout.n
    reqs = [{"prompt_token_ids": p} for p in prompts for _ in range(n)]
    r = recipe.rollout
    sps = [
        SamplingParams(
            n=1,
            temperature=r.temperature,
            max_tokens=r.max_tokens,
            logprobs=0,
            seed=sample_seed(0, 1, i // n, i % n),
        )
        for i in range(len(reqs))
    ]
    eng.generate(prompts, step=0)  # warm-up
    eng.llm.generate(reqs, sps, use_tqdm=False)
    ours, bare = [], []
    for rep in range(5):
        t = time.perf_counter()
        _, st = eng.generate(prompts, step=1 + rep)
        ours.append((st.response_tokens, time.perf_counter() - t))
        t = time.perf_counter()
        res = eng.llm.generate(reqs, sps, use_tqdm=False)
        bare.append((sum(len(o.outputs[0].token_ids) for o in res), time.perf_counter() - t))
    out["ours_tok_s"] = sum(x for x, _ in ours) / sum(t for _, t in ours)
    out["bare_tok_s"] = sum(x for x, _ in bare) / sum(t for _, t in bare)
    ws = WeightSync(recipe, expected=manifest(ck), rank=0)
    ws.check, ws.tolerance = "probe", 1.0
    seqs = [prompts[0] + [5, 0]] * 2
    times = []
    for _ in range(5):
        rep = ws.push(eng, tr, probe=lambda: seqs)
        times.append(rep["sync/seconds"] + rep["sync/verify_seconds"])
    out["sync_s"] = min(times)


SCENARIOS = {"fp32": scenario_fp32, "precision": scenario_precision, "bench": scenario_bench}


def main() -> None:
    name, out_dir, *overrides = sys.argv[1:]
    out: dict = {}
    SCENARIOS[name](out, overrides)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    torch.save(out, Path(out_dir) / f"{name}.pt")


if __name__ == "__main__":
    main()
