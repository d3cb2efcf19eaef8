"""Per-family scenarios for tests/test_families.py, every family one after another in the same processes (each
family's trainer and engine are closed before the next family's start).

    python tests/workers/family_worker.py single OUT_ROOT NAME=RECIPE [NAME=RECIPE ...]
    torchrun --nproc_per_node 2 tests/workers/family_worker.py parallel OUT_ROOT NAME=RECIPE [...]

``single`` does every one-process check on one trainer and one vLLM engine (fp32, R3 hooks), in an order that
keeps each check's inputs clean: logprobs and gradients of the fixed batch, the HF round trip, Megatron and vLLM
against HF transformers, vLLM's captured experts against HF's top-k, a verified weight sync after an update,
then R3 replay against perturbed routers (last: it perturbs them). ``parallel`` computes the same logprobs and
gradients under TP=2, then EP=2 (x DP=2), in the same two processes, on the batch ``single`` chose. Rank 0
writes ``OUT_ROOT/<NAME>/<scenario>.pt``.

The fixed batch is random tokens. A random tiny router can put two experts within float32 rounding of each
other, and two implementations may then pick differently: the batch seed is chosen as the first whose top-k
margin (k-th minus (k+1)-th selection score, every MoE layer, every real token, in HF) is at least
``MIN_MARGIN``, and the margin found is reported so the test can assert it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "workers"))

from megatron_worker import N, fixed_batch, gather_rows  # noqa: E402

from patches.megatron import mla_tp_rope_grad  # noqa: E402
from tim_megatron.algo.aggregation import local_denominator  # noqa: E402
from tim_megatron.models.tiny import ensure_tiny_checkpoint  # noqa: E402
from tim_megatron.recipe import load_recipe  # noqa: E402
from tim_megatron.rl.objective import plain_loss_fn  # noqa: E402
from tim_megatron.trainer.megatron_trainer import MegatronTrainer, SeqBatch  # noqa: E402

BASE = [
    "trainer.micro_batch_size=2",
    "trainer.logprob_chunk=5",
    "trainer.dtype=float32",
    "rollout.dtype=float32",
]
MIN_MARGIN = 1e-4
"""Smallest top-k selection margin accepted in the fixed batch (fp32 implementations differ by about 1e-6)."""


# ------------------------------------------------------------------------------------------------ HF side


def hf_routers(hf) -> list[torch.nn.Module]:
    """The HF model's MoE routers in layer order (transformers 5 names them ...TopKRouter / ...TopkRouter)."""
    return [m for m in hf.modules() if type(m).__name__.lower().endswith("topkrouter")]


def hf_forward(hf, ids: torch.Tensor, dims) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """HF log-softmax ``[N, L, V]``, and per MoE layer its selection scores and top-k ids ``[N, L, ...]``."""
    scores, chosen, hooks = [], [], []

    def hook(mod, _inp, out):
        logits, _weights, idx = out
        logits = logits.float().view(ids.shape[0], ids.shape[1], -1)
        if dims.router_score == "sigmoid":
            sel = torch.sigmoid(logits)
            bias = getattr(mod, "e_score_correction_bias", None)
            sel = sel + bias.float() if bias is not None else sel
        else:
            sel = torch.softmax(logits, -1)
        scores.append(sel)
        chosen.append(idx.view(ids.shape[0], ids.shape[1], -1))

    for m in hf_routers(hf):
        hooks.append(m.register_forward_hook(hook))
    with torch.no_grad():
        logp = torch.log_softmax(hf(input_ids=ids).logits.float(), -1)
    for h in hooks:
        h.remove()
    return logp, scores, chosen


def topk_margin(scores: list[torch.Tensor], k: int, lengths: torch.Tensor) -> float:
    valid = torch.arange(scores[0].shape[1])[None] < lengths[:, None]
    worst = float("inf")
    for s in scores:
        top = s.topk(k + 1, -1).values
        worst = min(worst, float((top[..., k - 1] - top[..., k])[valid].min()))
    return worst


def choose_batch(hf, dims) -> tuple[int, float]:
    for seed in range(64):
        batch, _, _ = fixed_batch(seed)
        _, scores, _ = hf_forward(hf, batch.input_ids, dims)
        margin = topk_margin(scores, dims.num_experts_per_tok, batch.lengths)
        if margin >= MIN_MARGIN:
            return seed, margin
    raise RuntimeError(f"no batch seed in 0..63 has a top-k margin of {MIN_MARGIN}")


def token_logprobs(logp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Position t: log p(token t | < t); position 0: 0."""
    lp = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(ids.shape[0], 1), lp], 1)


# ---------------------------------------------------------------------------------------------- scenarios


def equivalence(tr: MegatronTrainer, seed: int) -> dict:
    """Logprobs and gradients of the fixed batch (compared across layouts by the test)."""
    batch, mask, adv = fixed_batch(seed)
    rows = tr.rank_rows(N)
    local = batch.select(rows)
    lp, _ = tr.logprobs(local, with_entropy=True)
    den = float(local_denominator(mask=mask, mode="token-mean"))
    tr.backward(local, plain_loss_fn(lp.logprobs.detach(), adv[rows], mask[rows], den))
    return {
        "logprobs": gather_rows(lp.logprobs, tr),
        "entropy": gather_rows(lp.entropy, tr),
        "grads": {k: v.clone() for k, v in tr.export_hf(grads=True)},
    }


def hf_gradient_error(hf, grads: dict[str, torch.Tensor], seed: int) -> tuple[float, int]:
    """The same loss through HF transformers' autograd: the largest gradient difference relative to the tensor's
    largest entry, over every parameter. transformers keeps some tensors under other names in memory (fused
    experts, Mixtral's ``block_sparse_moe``); its own ``save_pretrained`` of the gradients gives checkpoint names."""
    import copy
    import tempfile

    from safetensors.torch import load_file

    hf = copy.deepcopy(hf)  # its parameters are overwritten with their gradients below
    batch, mask, adv = fixed_batch(seed)
    ids = batch.input_ids
    den = float(local_denominator(mask=mask, mode="token-mean"))
    hf.zero_grad(set_to_none=True)
    lp = token_logprobs(torch.log_softmax(hf(input_ids=ids).logits.float(), -1), ids)
    (-(adv[:, None] * mask * lp).sum() / den).backward()  # the token-clip loss at ratio 1: its gradient
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        want = load_file(f"{tmp}/model.safetensors")
    missing = sorted(set(grads) - set(want))
    if missing:
        raise KeyError(f"no HF gradient for {missing[:3]}")
    worst = max(float((grads[k] - want[k]).abs().max() / want[k].abs().max().clamp(min=1e-12)) for k in grads)
    return worst, len(grads)


def scenario_single(recipe_path: str, out: dict) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tim_megatron.rollout.base import FleetLayout
    from tim_megatron.rollout.vllm_engine import VLLMEngine

    r = load_recipe(recipe_path, [*BASE, "remedies.router_replay=r3"]).recipe
    dims = r.model.dims
    ck = ensure_tiny_checkpoint(
        dims, seed=r.model.tiny_seed, warmup_steps=r.model.tiny_warmup_steps, task=r.data.task
    )
    hf = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32)
    seed, margin = choose_batch(hf, dims)
    out.update(batch_seed=seed, topk_margin=margin)
    batch, mask, adv = fixed_batch(seed)
    ids, lengths = batch.input_ids, batch.lengths
    valid = (torch.arange(ids.shape[1])[None] < lengths[:, None]) & (torch.arange(ids.shape[1])[None] > 0)

    tr = MegatronTrainer.of_run(r, model_path=ck)
    out.update(equivalence(tr, seed))
    out["num_moe_layers"] = tr.num_moe_layers()
    out["grads_vs_hf"], out["grads_compared"] = hf_gradient_error(hf, out["grads"], seed)

    # HF -> Megatron -> HF, bit for bit.
    orig = load_file(str(ck / "model.safetensors"))
    exported = {k: v.clone() for k, v in tr.export_hf()}
    out["roundtrip_names_equal"] = set(exported) == set(orig)
    out["roundtrip_not_equal"] = sorted(
        k
        for k in orig
        if k not in exported or exported[k].dtype != orig[k].dtype or not torch.equal(exported[k], orig[k])
    )
    out["roundtrip_tensors"] = len(orig)

    # Megatron vs HF transformers (fp32).
    logp, _scores, hf_top = hf_forward(hf, ids, dims)
    hf_lp = token_logprobs(logp, ids)
    out["megatron_vs_hf"] = float((out["logprobs"] - hf_lp)[valid].abs().max())
    ent = -(logp.exp() * logp).sum(-1)  # position t's distribution predicts token t + 1
    ent_valid = torch.arange(ids.shape[1])[None] < (lengths[:, None] - 1)
    out["entropy_vs_hf"] = float((out["entropy"][:, 1:] - ent[:, :-1])[ent_valid[:, :-1]].abs().max())

    # vLLM: routed experts captured on the prompts (prefill), then scores, both against HF.
    eng = VLLMEngine(
        r, model_path=ck, layout=FleetLayout(world=1, ranks_per_engine=1), num_moe_layers=tr.num_moe_layers()
    )
    out["engine_kernels"] = eng.kernels
    seqs = [ids[i, : int(lengths[i])].tolist() for i in range(N)]
    groups, _ = eng.generate(seqs, step=0, n=1, max_tokens=1)
    k = dims.num_experts_per_tok
    routed = torch.zeros(tr.num_moe_layers(), N, ids.shape[1], k, dtype=torch.long)
    agree = total = 0
    for i, g in enumerate(groups):
        e = torch.from_numpy(g[0].routed_experts.astype("int64"))[: int(lengths[i])]  # [len, layers, k]
        routed[:, i, : e.shape[0]] = e.permute(1, 0, 2)
        got = e.permute(1, 0, 2).sort(-1).values
        want = torch.stack([t[i, : e.shape[0]] for t in hf_top]).sort(-1).values
        agree += int((got == want).all(-1).sum())
        total += got.shape[0] * got.shape[1]
    out["capture_agreement_with_hf"] = agree / total
    out["capture_shape"] = tuple(groups[0][0].routed_experts.shape)
    eng.llm.reset_prefix_cache()
    scored = eng.score(seqs)
    out["vllm_vs_hf"] = max(
        float((torch.tensor(row[1:]) - hf_lp[i, 1 : len(row)]).abs().max()) for i, row in enumerate(scored)
    )

    # tim align against the float32 reference (HF transformers), before any update: the engine, then the trainer.
    from tim_megatron.align.run import AlignOptions, compare_sides

    for side in ("engine", "trainer"):
        hf_side = compare_sides(eng, tr, seqs, AlignOptions(sides=(side, "hf")), replay=False, hf=hf)
        out[f"align_{side}_vs_hf"] = hf_side.as_dict()

    # An update, a stale engine that the check catches, a verified sync (re-prepacked experts included).
    from tim_megatron.algo.stats import Stats
    from tim_megatron.rollout.sync import WeightSync, manifest

    tr.train_step(batch, lambda lp_, rows, s: (-lp_[:, 1:].mean(), Stats()), lr=1e-3)
    if dims.router_expert_bias:  # never trained, so move it by hand: the sync must carry it too
        from tim_megatron.trainer.model import unwrap

        g = torch.Generator().manual_seed(5)
        for name, buf in unwrap(tr.model).named_buffers():
            if name.endswith("router.expert_bias"):
                buf.add_(torch.randn(buf.shape, generator=g) * 0.1)
    out["before_sync_vllm_vs_megatron"] = _vllm_vs_trainer(eng, tr, batch, seqs)
    ws = WeightSync(r, expected=manifest(ck), rank=0)
    ws.check = "probe"
    rep = ws.push(eng, tr, probe=lambda: seqs)
    out["sync_tensors"] = int(rep["sync/tensors"])
    out["after_sync_vllm_vs_megatron"] = _vllm_vs_trainer(eng, tr, batch, seqs)
    if dims.resolved_family == "gpt_oss":  # the family whose reload needs patches/vllm/gpt_oss_reload.py
        out.update(reload_without_patch(eng, tr, ws, batch, seqs))
    out.update(align_checks(eng, tr, seqs, dims))  # before R3's check perturbs the trainer's routers
    out.update(r3_replay(tr, batch, mask, adv, routed, dims))
    eng.close()  # the engine first: it joined the trainer's process group
    tr.close()
    if dims.resolved_family == "deepseek_v3":  # the family whose checkpoints are published in block FP8
        out.update(fp8_load(r, ck, seed, out["logprobs"]))
    out["kernels"] = other_kernels(recipe_path, ck, seed, mla=dims.is_mla, hf_lp=hf_lp, valid=valid)


def reload_without_patch(eng, tr: MegatronTrainer, ws, batch: SeqBatch, seqs: list[list[int]]) -> dict:
    """gpt-oss: another update, loaded into the engine without patches/vllm/gpt_oss_reload.py (vLLM 0.32 copies the
    fused experts and the sinks around their weight loaders, which its in-place reload ignores), then with it."""
    from patches.vllm import gpt_oss_reload
    from tim_megatron.algo.stats import Stats

    tr.train_step(batch, lambda lp_, rows, s: (-lp_[:, 1:].mean(), Stats()), lr=1e-3)
    gpt_oss_reload.revert()
    try:
        ws.load(eng, tr.export_hf())
        bare = _vllm_vs_trainer(eng, tr, batch, seqs)
    finally:
        gpt_oss_reload.apply()
    ws.load(eng, tr.export_hf())
    return {
        "reload_unpatched_vllm_vs_megatron": bare,
        "reload_patched_vllm_vs_megatron": _vllm_vs_trainer(eng, tr, batch, seqs),
    }


KERNELS = {
    "grouped": [
        "trainer.experts=grouped",
        "trainer.attention=auto",
    ],  # auto on CPU: materialized (latent: sdpa)
    "sdpa": ["trainer.experts=loop", "trainer.attention=sdpa"],
}
"""The layer kernels compared with the loop over experts and the materialized attention (the CPU default)."""


def other_kernels(
    recipe_path: str, ck: Path, seed: int, *, mla: bool, hf_lp: torch.Tensor, valid: torch.Tensor
) -> dict:
    """The fixed batch's logprobs (also against HF transformers') and gradients with the grouped experts, and with
    torch's fused attention (latent attention runs on it always: no second run)."""
    from tim_megatron.recipe import RecipeError

    res = {}
    for name, overrides in KERNELS.items():
        if name == "sdpa" and mla:
            continue
        try:
            recipe = load_recipe(recipe_path, [*BASE, *overrides]).recipe
            refused = kernel_refusal(recipe)
        except RecipeError as e:  # grouped experts with biases (gpt-oss)
            refused = str(e)
        if refused:
            res[name] = {"refused": refused}
            continue
        tr = MegatronTrainer.of_run(recipe, model_path=ck)
        res[name] = {**equivalence(tr, seed), "built": tr.kernels}
        res[name]["vs_hf"] = float((res[name]["logprobs"] - hf_lp)[valid].abs().max())
        tr.close()
    return res


def kernel_refusal(recipe) -> str:
    """Why the trainer would refuse the recipe's layer kernels on this machine ('' when it builds them): FlexAttention
    for attention sinks has no backward on the CPU (gpt-oss with ``trainer.attention: sdpa``)."""
    from tim_megatron.trainer.attention import LayerKernels, resolve_attention
    from tim_megatron.trainer.families import get_family

    dims = recipe.model.dims
    if not (dims.attention_sinks or dims.sliding_window):
        return ""
    kernels = LayerKernels(
        attention=resolve_attention(recipe.trainer.attention, exact=False, on_gpu=torch.cuda.is_available())
    )
    try:
        get_family(dims.resolved_family).layer_specs(dims, False, kernels=kernels)
    except ValueError as e:
        return str(e)
    return ""


def fp8_load(r, ck: Path, seed: int, source_logprobs: torch.Tensor) -> dict:
    """A block-FP8 copy of the checkpoint (DeepSeek-V3's published format, 128 x 128 blocks) in the trainer: it holds
    exactly the dequantized weights, exports them in its own dtype under the source's names (no scales), and its
    logprobs differ from the source's by FP8's error."""
    import tempfile

    from tim_megatron.trainer.weights import HFCheckpoint
    from tim_megatron.trainer.weights.fp8_checkpoint import convert_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        q = Path(tmp) / "fp8"
        convert_checkpoint(ck, q, to="fp8", block=(128, 128))
        tr = MegatronTrainer.of_run(r, model_path=q)
        want = HFCheckpoint(q)
        exported = {k: v.clone() for k, v in tr.export_hf()}
        res = {
            "fp8_export_names_equal": set(exported) == HFCheckpoint(ck).keys(),
            "fp8_export_dtypes": sorted({str(v.dtype) for v in exported.values()}),
            "fp8_weights_not_dequantized": sorted(
                k for k in exported if not torch.equal(exported[k], want.get(k))
            ),
            "fp8_vs_source_logprobs": float(
                (equivalence(tr, seed)["logprobs"] - source_logprobs).abs().max()
            ),
        }
        tr.close()
    return res


def align_checks(eng, tr: MegatronTrainer, seqs: list[list[int]], dims) -> dict:
    """tim align's comparison on this engine and trainer (fp32, just synced): clean, then with the last MoE layer's
    experts scaled by 1.01 in the engine; then R3 over a large fault in the first MoE layer's experts."""
    from tim_megatron.align.run import AlignOptions, compare_sides

    moe = list(range(dims.first_k_dense_layers, dims.num_layers))
    planted = compare_sides(eng, tr, seqs, AlignOptions(fault_layer=moe[-1]), replay=False)
    r3 = compare_sides(eng, tr, seqs, AlignOptions(fault_layer=moe[0], fault_scale=1.0), replay=True)
    return {
        "align_moe_layers": moe,
        "align_planted": planted.as_dict(),
        "align_r3": r3.as_dict(),
        "align_report": (planted, len(seqs)),  # written by main() as tim align writes it
    }


def align_recipe(recipe_path: str, out_dir: Path) -> None:
    """What ``tim align RECIPE --prompts 2 --out OUT_DIR`` runs, in this process (after the scenario's own engine and
    trainer are closed): the family's tiny recipe as it is, its engine sampling the sequences."""
    from tim_megatron.align.run import AlignOptions, align

    align(load_recipe(recipe_path), AlignOptions(prompts=2), out=out_dir)


def _vllm_vs_trainer(eng, tr: MegatronTrainer, batch: SeqBatch, seqs: list[list[int]]) -> float:
    """Largest |logprob| difference between vLLM's scores and the trainer's on the fixed batch."""
    lp, _ = tr.logprobs(batch)
    eng.llm.reset_prefix_cache()
    return max(
        float((torch.tensor(row[1:]) - lp.logprobs[i, 1 : len(row)]).abs().max())
        for i, row in enumerate(eng.score(seqs))
    )


def r3_replay(tr: MegatronTrainer, batch: SeqBatch, mask, adv, routed: torch.Tensor, dims) -> dict:
    """R3: replay vLLM's experts after perturbing every router; check the experts used, the gating weights (the
    family's own formula on the perturbed router's scores at those experts) and that gradients reach the router."""
    from megatron.core.transformer.moe.router import TopKRouter

    from patches.megatron import router_replay
    from tim_megatron.trainer.model import unwrap

    res: dict = {}
    gpt = unwrap(tr.model)
    routers = [m for m in gpt.modules() if isinstance(m, TopKRouter)]
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for m in routers:
            m.weight.add_(torch.randn(m.weight.shape, generator=g) * 5.0)
    _, free = tr.logprobs(batch, routing="record")
    with_r = SeqBatch(batch.input_ids, batch.lengths, routed)
    mb, s = tr._trimmed(with_r, torch.arange(N))
    seen = []  # (router input, probs, routing_map) per router
    hooks = [
        m.register_forward_hook(lambda mod, inp, o: seen.append((inp[0].detach(), *[t.detach() for t in o])))
        for m in routers
    ]
    with (
        router_replay.replay(
            tr.model, action="replay", indices=tr._replay_indices(mb.routed_experts, mb.lengths)
        ),
        torch.no_grad(),
    ):
        tr._forward(mb.input_ids)
    for h in hooks:
        h.remove()
    valid = torch.arange(s)[None, :] < (batch.lengths[:, None] - 1)  # positions whose outputs matter
    exact, differs, gate_err, bias_gap = [], [], 0.0, float("inf")
    for layer, (x, probs, routing_map) in enumerate(seen):
        got = routing_map.view(s, N, -1).permute(1, 0, 2)
        want = torch.zeros_like(got).scatter_(-1, routed[layer, :, :s], True)
        exact.append(bool((got == want).all(-1)[valid].all()))
        fr = torch.zeros_like(got).scatter_(-1, free[layer, :, :s].long(), True)
        differs.append(bool((fr != want).any(-1)[valid].any()))
        logits = x.float().reshape(-1, x.shape[-1]) @ routers[layer].weight.float().t()  # [s*N, E]
        if routers[layer].bias is not None:  # gpt-oss's router has a bias
            logits = logits + routers[layer].bias.float()
        idx = routed[layer, :, :s].permute(1, 0, 2).reshape(-1, dims.num_experts_per_tok)
        ref = gating_weights(logits, idx, dims)
        got_w = probs.gather(1, idx)
        keep = valid.t().reshape(-1)
        gate_err = max(gate_err, float((got_w - ref)[keep].abs().max()))
        bias = routers[layer].expert_bias
        if bias is not None:  # the check can tell: weights taken from score + bias would differ this much
            wrong = gating_weights(logits, idx, dims, bias=bias)
            bias_gap = min(bias_gap, float((got_w - wrong)[keep].abs().max()))
    res["replayed_equal_given"] = exact
    res["perturbation_changed_free_routing"] = differs
    res["gating_weight_err"] = gate_err
    res["gating_gap_if_bias_weighted"] = bias_gap
    res["clean_after_replay"] = router_replay.is_clean(tr.model)
    den = float(mask.sum())
    lp, _ = tr.logprobs(with_r, routing="replay")
    tr.backward(with_r, plain_loss_fn(lp.logprobs, adv, mask, den), routing="replay")
    res["router_grad_abs_sum"] = [float(m.weight.main_grad.abs().sum()) for m in routers]
    res["clean_after_backward"] = router_replay.is_clean(tr.model)
    return res


def gating_weights(
    logits: torch.Tensor, idx: torch.Tensor, dims, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The family's gating weights at the given experts, as its HF implementation computes them from the scores
    (an expert bias only chooses experts; it never enters the weights: ``bias`` computes the wrong variant)."""
    if dims.router_score == "sigmoid":
        w = (torch.sigmoid(logits) + (0 if bias is None else bias.float())).gather(1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) if dims.norm_topk_prob else w
    else:
        w = torch.softmax(logits, -1).gather(1, idx)
        w = w / w.sum(-1, keepdim=True) if dims.norm_topk_prob else w
    return w * dims.routed_scaling_factor


def scenario_parallel(recipe_path: str, out: dict, *, seed: int) -> None:
    from tim_megatron.recipe import RecipeError

    biases = load_recipe(recipe_path, BASE).recipe.model.dims.linear_biases
    # expert biases allow no expert-TP (gpt-oss): TP=2 with the experts on EP=2 instead
    tp2 = ["parallel.tp=2", "parallel.ep=2", "parallel.expert_tp=1"] if biases else ["parallel.tp=2"]
    for name, layout in (("tp2", tp2), ("ep2", ["parallel.ep=2", "parallel.dp=2"])):
        try:
            r = load_recipe(recipe_path, [*BASE, *layout]).recipe
        except RecipeError as e:  # a layout the recipe refuses (MLA under TP): the refusal is the result
            out[name] = {"refused": str(e)}
            continue
        ck = ensure_tiny_checkpoint(
            r.model.dims, seed=r.model.tiny_seed, warmup_steps=r.model.tiny_warmup_steps, task=r.data.task
        )
        tr = MegatronTrainer.of_run(
            r, model_path=ck
        )  # re-initializes megatron's groups inside the same two processes
        out[name] = equivalence(tr, seed)
        out[name]["world_size"] = dist.get_world_size()
        patched = [h for h in tr._handles if h.name == mla_tp_rope_grad.SPEC.name]
        if patched:  # the same step without the patch: what megatron-core 0.16.1 computes on its own
            patched[0].revert()
            out[name]["unpatched"] = equivalence(tr, seed)
        if biases and name == "tp2":  # the same without patches/megatron/expert_bias_grad.py's gradient fix
            from patches.megatron import expert_bias_grad
            from tim_megatron.trainer.model import unwrap

            for p in expert_bias_grad.expert_fc2_biases(unwrap(tr.model)):
                p.sequence_parallel = True  # as megatron-core 0.16.1 marks them
            out[name]["unpatched"] = equivalence(tr, seed)
        try:
            grouped = load_recipe(recipe_path, [*BASE, *layout, *KERNELS["grouped"]]).recipe
        except RecipeError as e:  # grouped experts with biases (gpt-oss)
            out[name]["grouped"] = {"refused": str(e)}
            tr.close(keep_default_group=True)
            continue
        del tr
        tr = MegatronTrainer.of_run(grouped, model_path=ck)
        out[name]["grouped"] = {**equivalence(tr, seed), "built": tr.kernels}
        tr.close(keep_default_group=True)  # its patches go with it: the next family's trainer applies its own


def main() -> None:
    scenario, out_root, *families = sys.argv[1:]
    for item in families:  # NAME=RECIPE, one family after another in these processes
        name, recipe_path = item.split("=", 1)
        out_dir = Path(out_root) / name
        out: dict = {}
        if scenario == "single":
            scenario_single(recipe_path, out)
            align_recipe(recipe_path, out_dir / "align-recipe")
        else:  # the fixed batch that the family's single scenario chose
            seed = torch.load(out_dir / "single.pt", weights_only=False)["batch_seed"]
            scenario_parallel(recipe_path, out, seed=seed)
        if not dist.is_initialized() or dist.get_rank() == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            if "align_report" in out:
                from tim_megatron.align.report import write

                planted, sequences = out.pop("align_report")
                write(planted, out_dir / "align", sequences=sequences, meta={"recipe": recipe_path})
            torch.save(out, out_dir / f"{scenario}.pt")
    if scenario == "parallel":
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
