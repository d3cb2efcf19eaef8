"""Megatron scenarios run in fresh processes by tests/test_trainer.py (megatron-core keeps global state).

    python tests/workers/megatron_worker.py SCENARIO OUT_DIR [overrides...]
    torchrun --nproc_per_node 2 tests/workers/megatron_worker.py SCENARIO OUT_DIR [overrides...]

Rank 0 writes ``OUT_DIR/<scenario>.pt``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tim_megatron.algo.aggregation import local_denominator  # noqa: E402
from tim_megatron.recipe import load_recipe  # noqa: E402
from tim_megatron.rl.objective import plain_loss_fn  # noqa: E402
from tim_megatron.run_setup import model_path_for  # noqa: E402
from tim_megatron.trainer.megatron_trainer import MegatronTrainer, SeqBatch  # noqa: E402

RECIPE = ROOT / "recipes" / "tiny-moe" / "grpo.yaml"
N, L, PROMPT = 4, 14, 5


def fixed_batch(seed: int = 0) -> tuple[SeqBatch, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 60, (N, L), generator=g)
    lengths = torch.tensor([14, 11, 8, 13])
    for i, n in enumerate(lengths):
        ids[i, n:] = 0
    mask = (torch.arange(L)[None] >= PROMPT) & (torch.arange(L)[None] < lengths[:, None])
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0])
    return SeqBatch(ids, lengths), mask, adv


def gather_rows(t: torch.Tensor, tr: MegatronTrainer) -> torch.Tensor:
    """Concatenate each DP rank's rows (TP peers hold the same rows)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    dp_peers = {}
    for r, p in enumerate(parts):
        dp_peers.setdefault(_dp_rank_of(r, tr), p)
    return torch.cat([dp_peers[k] for k in sorted(dp_peers)], 0)


def _dp_rank_of(global_rank: int, tr: MegatronTrainer) -> int:
    obj = [None] * dist.get_world_size()
    dist.all_gather_object(obj, tr.dp_rank)
    return obj[global_rank]


def scenario_equivalence(tr: MegatronTrainer, out: dict) -> None:
    """Logprobs and gradients of a fixed batch (compared across TP/EP/DP layouts by the test)."""
    batch, mask, adv = fixed_batch()
    rows = tr.rank_rows(N)
    local = batch.select(rows)
    lp, _ = tr.logprobs(local, with_entropy=True)
    out["logprobs"] = gather_rows(lp.logprobs, tr)
    out["entropy"] = gather_rows(lp.entropy, tr)
    den = float(local_denominator(mask=mask, mode="token-mean"))
    old = lp.logprobs.detach()
    tr.backward(local, plain_loss_fn(old, adv[rows], mask[rows], den))
    out["grads"] = {k: v.clone() for k, v in tr.export_hf(grads=True)}
    # The head as one autograd function (the default) against the checkpointed chunk, with and without the fp32
    # head: the same training logprobs, and the gradients (issue 57, item 3).
    from tim_megatron.trainer import logprobs as head_module

    calls, apply = [], head_module._HeadLogprobs.apply
    head_module._HeadLogprobs.apply = lambda *a: (calls.append(1), apply(*a))[1]  # which path ran, counted
    heads = {}
    for fused in (True, False):
        for fp32 in (False, True):
            with tr.head_changed(fused=fused, fp32=fp32):
                seen = []

                def loss_fn(lp_, r, s, seen=seen):
                    seen.append(lp_.detach().clone())
                    return plain_loss_fn(old, adv[rows], mask[rows], den)(lp_, r, s)

                before = len(calls)
                tr.backward(local, loss_fn)
                heads[f"fused={fused} fp32={fp32}"] = {
                    "function_calls": len(calls) - before,
                    "logprobs": seen,
                    "grads": {k: v.clone() for k, v in tr.export_hf(grads=True)},
                }
    out["heads"] = heads
    head_module._HeadLogprobs.apply = apply


WIDTHS = range(2, 10)


def width_batch(width: int) -> tuple[SeqBatch, torch.Tensor, torch.Tensor]:
    """Four sequences whose longest is exactly ``width`` tokens (odd and even), a 1-token prompt or more."""
    g = torch.Generator().manual_seed(100 + width)
    ids = torch.randint(2, 60, (N, width), generator=g)
    lengths = torch.tensor([width, max(2, width - 1), max(2, width - 3), max(2, width - 2)])
    prompt = max(1, width // 3)
    for i, n in enumerate(lengths):
        ids[i, n:] = 0
    pos = torch.arange(width)[None]
    mask = (pos >= prompt) & (pos < lengths[:, None])
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0])
    return SeqBatch(ids, lengths), mask, adv


def scenario_widths(tr: MegatronTrainer, out: dict) -> None:
    """One train step per batch width, through the RL objective the loop uses (rl.objective.make_loss_fn).

    The widths are forced here, whatever an engine would sample: a width that is not a multiple of TP is
    padded by the trainer for sequence parallelism, and that padding must never reach the loss.
    """
    from tim_megatron.rl.objective import LossRows, make_loss_fn

    r = tr.recipe
    rows = tr.rank_rows(N)
    dp_group = tr.ps.get_data_parallel_group() if dist.is_initialized() else None
    for width in WIDTHS:
        batch, mask, adv = width_batch(width)
        local = batch.select(rows)
        lp, _ = tr.logprobs(local)
        assert lp.logprobs.shape == (len(local), width), (lp.logprobs.shape, width)
        old = lp.logprobs * mask[rows]
        loss_rows = LossRows(
            old=old,
            rollout=old.clone(),
            mask=mask[rows],
            advantages=adv[rows],
            weights=mask[rows].float(),
        )
        den = float(local_denominator(mask=mask, mode=r.rl.aggregation))
        loss, _stats, _ = tr.backward(local, make_loss_fn(r, loss_rows, denominator=den))
        grads = {k: v.clone() for k, v in tr.export_hf(grads=True)}
        res = tr.step(lr=0.0, loss=loss)  # lr 0: every width starts from the same weights
        t = torch.tensor([loss], dtype=torch.float64)
        if dp_group is not None:
            dist.all_reduce(t, group=dp_group)  # each DP rank holds its rows' share of the loss
        out.setdefault("loss", {})[width] = float(t)
        out.setdefault("grads", {})[width] = grads
        out.setdefault("applied", {})[width] = res.applied
        out.setdefault("logprobs", {})[width] = gather_rows(lp.logprobs, tr)


def scenario_single(tr: MegatronTrainer, out: dict) -> None:
    """Everything a single process shows: equivalence data, round trip, a loss-lowering step, NaN guard."""
    scenario_equivalence(tr, out)
    out["export"] = {k: v.clone() for k, v in tr.export_hf()}
    batch, mask, adv = fixed_batch()
    lp, _ = tr.logprobs(batch)
    old = lp.logprobs
    den = float(mask.sum())
    fn = plain_loss_fn(old, adv, mask, den)
    loss0, _, _ = tr.backward(batch, fn)
    res = tr.step(lr=1e-4, loss=loss0)
    loss1, _, _ = tr.backward(batch, fn)
    out["loss_before"], out["loss_after"], out["applied"] = loss0, loss1, res.applied
    out["grad_norm"] = res.grad_norm
    # NaN guard: a non-finite loss skips the update, and nan_guard_max + 1 in a row aborts.
    from tim_megatron.trainer.megatron_trainer import NonFiniteAbort

    before = {k: v.clone() for k, v in tr.export_hf()}

    def nan_fn(lp_, rows, s):
        loss, st = fn(lp_, rows, s)
        return loss * float("nan"), st

    skipped = []
    try:
        for _ in range(tr.recipe.trainer.nan_guard_max + 1):
            tr.backward(batch, nan_fn)
            skipped.append(not tr.step(lr=1e-4, loss=float("nan")).applied)
        out["nan_abort"] = False
    except NonFiniteAbort as e:
        out["nan_abort"] = str(e)
    after = dict(tr.export_hf())
    out["nan_skipped"] = skipped
    out["nan_params_unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    # The finite check on real gradient buffers: one NaN, one inf, planted in one element of one bucket.
    tr.backward(batch, fn)
    buffers = [b for b in [*tr.model.buffers, *tr.model.expert_parallel_buffers] if b.grad_data is not None]
    found = {"clean": tr._grads_finite(), "buckets": len(buffers)}
    for bad in ("nan", "inf", "-inf"):
        for where, buf in (("first", buffers[0]), ("last", buffers[-1])):
            i = buf.grad_data.numel() // 2 if where == "first" else buf.grad_data.numel() - 1
            keep = buf.grad_data.view(-1)[i].clone()
            buf.grad_data.view(-1)[i] = float(bad)
            found[f"{bad}@{where}"] = tr._grads_finite()
            buf.grad_data.view(-1)[i] = keep
    found["restored"] = tr._grads_finite()
    out["finite_check"] = found


def scenario_resume(tr: MegatronTrainer, out: dict) -> None:
    """Train ``steps`` updates, optionally saving at ``save_at`` and stopping (the test then kills us)."""
    from tim_megatron.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

    ckdir = Path(os.environ["TIM_CKPT_DIR"])
    steps = int(os.environ.get("TIM_STEPS", 4))
    save_at = int(os.environ.get("TIM_SAVE_AT", 0))
    start = 1
    if os.environ.get("TIM_RESUME"):
        meta = load_checkpoint(tr, latest_checkpoint(ckdir))
        start = meta["step"] + 1
        out["weights_at_start"] = {k: v.float().clone() for k, v in tr.export_hf()}
    losses = {}
    for step in range(start, steps + 1):
        batch, mask, adv = fixed_batch(seed=step)
        rows = tr.rank_rows(N)
        local = batch.select(rows)
        lp, _ = tr.logprobs(local)
        den = float(mask.sum())
        loss, _, _ = tr.backward(local, plain_loss_fn(lp.logprobs, adv[rows], mask[rows], den))
        tr.step(lr=1e-3, loss=loss)
        t = torch.tensor([loss], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(t)
        losses[step] = float(t)
        if step == save_at:
            save_checkpoint(tr, ckdir, step=step, state={"losses": losses}, keep=2)
            if tr.is_rank0:
                (ckdir / "SAVED").write_text(str(step))
            for _ in range(300):  # wait to be killed, like a preempted job (gone by itself after 5 min)
                time.sleep(1)
            raise SystemExit("resume worker was never killed")
    out["losses"] = losses
    # The weights too: this loss is the same at every step (old logprobs are the current ones, ratio 1), so
    # only the weights show whether the optimizer state came back whole.
    out["weights"] = {k: v.float().clone() for k, v in tr.export_hf()}


def _adam_state(tr: MegatronTrainer) -> dict[str, torch.Tensor]:
    """Every tensor of the torch Adams' state (moments, steps) and their fp32 master parameters, by position."""
    from patches.megatron.torch_adam_kernel import torch_adams

    found = {}
    for i, o in enumerate(torch_adams(tr.optimizer)):
        for j, g in enumerate(o.param_groups):
            for k, p in enumerate(g["params"]):
                found[f"{i}.{j}.{k}.param"] = p.detach().cpu().clone()
                for name, v in o.state.get(p, {}).items():
                    found[f"{i}.{j}.{k}.{name}"] = torch.as_tensor(v).detach().cpu().clone()
    return found


def _one_update(tr: MegatronTrainer, step: int) -> None:
    batch, mask, adv = fixed_batch(seed=step)
    lp, _ = tr.logprobs(batch)
    loss, _, _ = tr.backward(batch, plain_loss_fn(lp.logprobs, adv, mask, float(mask.sum())))
    tr.step(lr=1e-3, loss=loss)


def scenario_adam_kernels(tr: MegatronTrainer, out: dict) -> None:
    """A checkpoint saved under one torch Adam kernel resumes under the other (issue 57, item 1): after the load the
    state is the saved one bit for bit, and the next update equals the one the saving trainer makes after
    switching to that kernel in memory."""
    from patches.megatron.torch_adam_kernel import kernel_of, set_kernel
    from tim_megatron.trainer.checkpoint import load_checkpoint, save_checkpoint

    ckdir = Path(os.environ["TIM_CKPT_DIR"])
    results = {}
    _one_update(tr, 1)
    for step, (saved, resumed) in enumerate([("foreach", "fused"), ("fused", "foreach")], start=2):
        set_kernel(tr.optimizer, saved)
        tr.optimizer_kernel = saved
        _one_update(tr, step)  # an update under the saving kernel, then its checkpoint
        path = save_checkpoint(tr, ckdir / saved, step=step, state={}, keep=1)
        state = _adam_state(tr)
        set_kernel(tr.optimizer, resumed)  # in memory: the same state, the other kernel
        _one_update(tr, step + 10)
        direct = {k: v.float().clone() for k, v in tr.export_hf()}
        tr.optimizer_kernel = resumed
        load_checkpoint(tr, path)
        loaded = _adam_state(tr)
        same_state = state.keys() == loaded.keys() and all(
            state[k].dtype == loaded[k].dtype and torch.equal(state[k], loaded[k]) for k in state
        )
        kernel = kernel_of(tr.optimizer)
        _one_update(tr, step + 10)
        after = {k: v.float().clone() for k, v in tr.export_hf()}
        results[f"{saved}->{resumed}"] = {
            "state_bit_for_bit": same_state,
            "tensors": len(state),
            "kernel_after_load": kernel,
            "next_update_bit_for_bit": all(torch.equal(direct[k], after[k]) for k in direct),
        }
    out["adam_kernels"] = results


def scenario_fp16(tr: MegatronTrainer, out: dict) -> None:
    batch, mask, _adv = fixed_batch()
    from tim_megatron.algo.stats import Stats

    def fn(lp, rows, s):
        m = mask[rows, :s]
        return -(lp * m).sum() / mask.sum(), Stats()

    scales, applied, losses = [], [], []
    for _ in range(int(os.environ.get("TIM_STEPS", 30))):
        r = tr.train_step(batch, fn, lr=1e-4)
        scales.append(r.loss_scale)
        applied.append(r.applied)
        losses.append(r.loss)
    out.update(scales=scales, applied=applied, losses=losses, dtype=str(next(tr.model.parameters()).dtype))


def scenario_fp32_head(tr: MegatronTrainer, out: dict) -> None:
    """Logits of the head (fp32 or not), the fp64 reference from the same hidden states."""
    from tim_megatron.trainer.logprobs import head_gemm, head_weight
    from tim_megatron.trainer.model import final_hidden_states, unwrap

    batch, _, _ = fixed_batch()
    with torch.no_grad():
        hidden = final_hidden_states(tr.model, batch.input_ids)
        w = head_weight(tr.model)
        logits = head_gemm(hidden, w, tr.head)
        ref = torch.nn.functional.linear(hidden.double(), w.double())
    out.update(
        head_weight_dtype=str(unwrap(tr.model).output_layer.weight.dtype),
        head_fp32=tr.head.fp32,
        logits_dtype=str(logits.dtype),
        err=float((logits.double() - ref).abs().max()),
        body_dtype=str(unwrap(tr.model).decoder.layers[0].self_attention.linear_qkv.weight.dtype),
    )


def scenario_replay(tr: MegatronTrainer, out: dict) -> None:
    """R2: record routing, perturb the router, replay; the replayed experts are the recorded ones."""
    from patches.megatron import router_replay
    from tim_megatron.trainer.model import unwrap

    batch, mask, adv = fixed_batch()
    lp, routed = tr.logprobs(batch, routing="record")
    out["routed_shape"] = tuple(routed.shape)
    out["clean_after_record"] = router_replay.is_clean(tr.model)
    gpt = unwrap(tr.model)
    with torch.no_grad():
        for layer in gpt.decoder.layers:
            layer.mlp.router.weight.add_(torch.randn_like(layer.mlp.router.weight) * 5.0)
    _, free = tr.logprobs(batch, routing="record")
    batch.routed_experts = routed
    lp_replay, replayed = None, None
    with_r = SeqBatch(batch.input_ids, batch.lengths, routed)
    lp_replay, _ = tr.logprobs(with_r, routing="replay")
    # Record while replaying: what the routers actually used.
    import contextlib

    used = []
    mb, s = tr._trimmed(with_r, torch.arange(N))
    with (
        router_replay.replay(
            tr.model, action="replay", indices=tr._replay_indices(mb.routed_experts, mb.lengths)
        ),
        contextlib.ExitStack(),
    ):
        from megatron.core.transformer.moe.router import TopKRouter

        hooks = []
        for m in gpt.modules():
            if isinstance(m, TopKRouter):
                hooks.append(m.register_forward_hook(lambda mod, inp, o: used.append(o[1].clone())))
        with torch.no_grad():
            tr._forward(mb.input_ids)
        for h in hooks:
            h.remove()
    valid = torch.arange(s)[None, :] < (batch.lengths[:, None] - 1)  # positions whose outputs matter
    exact, perturbed_differs = [], []
    for layer, routing_map in enumerate(used):  # [s*b, E] bool, token order (s, b)
        got = routing_map.view(s, N, -1).permute(1, 0, 2)
        want = torch.zeros_like(got)
        want.scatter_(-1, routed[layer, :, :s].long(), True)
        exact.append(bool((got == want).all(-1)[valid].all()))
        fr = torch.zeros_like(got)
        fr.scatter_(-1, free[layer, :, :s].long(), True)
        perturbed_differs.append(bool(((fr != want).any(-1))[valid].any()))
    out["replayed_equal_recorded"] = exact
    out["perturbation_changed_free_routing"] = perturbed_differs
    out["clean_after_replay"] = router_replay.is_clean(tr.model)
    # Gradients reach the router under replay.
    den = float(mask.sum())
    tr.backward(with_r, plain_loss_fn(lp.logprobs, adv, mask, den), routing="replay")
    g = [
        float(unwrap(tr.model).decoder.layers[i].mlp.router.weight.main_grad.abs().sum())
        for i in range(len(gpt.decoder.layers))
    ]
    out["router_grad_abs_sum"] = g
    out["clean_after_backward"] = router_replay.is_clean(tr.model)
    del lp_replay, replayed


def _megatron_allgather_dispatchers(tr: MegatronTrainer) -> None:
    """Put megatron-core's own all-gather dispatcher back in every MoE layer (same process groups)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    from patches.megatron.indexed_dispatcher import moe_layers

    for layer in moe_layers(tr.model):
        old = layer.token_dispatcher
        pgs = ProcessGroupCollection(ep=old.ep_group, expt_tp=old.tp_group, tp_ep=old.tp_ep_group)
        layer.token_dispatcher = MoEAllGatherTokenDispatcher(
            layer.num_local_experts, layer.local_expert_indices, config=layer.config, pg_collection=pgs
        )


def scenario_dispatchers(tr: MegatronTrainer, out: dict) -> None:
    """Issue 57, item 5: the trainer built with ``trainer.moe_dispatcher = indexed``, then the same model with
    megatron-core's all-gather dispatcher put back: each one's logprobs and gradients of a fixed batch, and what
    the first MoE layer's experts were handed (rows, tokens per expert, probabilities) on every rank."""
    from patches.megatron.indexed_dispatcher import moe_layers

    batch, mask, adv = fixed_batch()
    rows = tr.rank_rows(N)
    local = batch.select(rows)
    den = float(local_denominator(mask=mask, mode="token-mean"))
    first = moe_layers(tr.model)[0]
    out["dispatcher"] = {}
    for name in ("indexed", "allgather"):
        if name == "allgather":
            _megatron_allgather_dispatchers(tr)
        seen: list = []
        hook = first.experts.register_forward_pre_hook(
            lambda mod, args, seen=seen: seen.append(tuple(a.detach().clone() for a in args))
        )
        lp, _ = tr.logprobs(local)
        tr.backward(local, plain_loss_fn(lp.logprobs.detach(), adv[rows], mask[rows], den))
        hook.remove()
        every = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
        if dist.is_initialized():
            dist.all_gather_object(every, seen[0])
        else:
            every = [seen[0]]
        out["dispatcher"][name] = {
            "class": type(first.token_dispatcher).__name__,
            "logprobs": gather_rows(lp.logprobs, tr),
            "grads": {k: v.clone() for k, v in tr.export_hf(grads=True)},
            "experts_input": every,  # per rank: (rows, tokens per expert, probabilities) of the first forward
        }


def scenario_expert_shards(tr: MegatronTrainer, out: dict) -> None:
    """The grouped path's stacked experts against megatron-core's SequentialMLP on the same weights, in every MoE
    layer on this layout's ranks (issue 57, item 4): the sharded checkpoint entries each saves (keys, offsets,
    shapes, replica ids, numbers), and a distributed checkpoint of either module loaded into a fresh other, which
    must give it the saver's weights. Mismatches per rank, gathered."""
    import tempfile

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.experts import SequentialMLP

    from patches.megatron.cpu_shims import cuda_placement_to_cpu
    from tim_megatron.trainer.experts import per_expert_parameters, stacked_experts_class
    from tim_megatron.trainer.model import unwrap

    gpt = unwrap(tr.model)
    layers = gpt.decoder.layers
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    cls = stacked_experts_class()
    found, compared, mismatch = 0, 0, []

    def flat(sd):
        apply_factories(sd)
        return {(v.key, tuple(v.global_offset)): v for v in nested_values(sd)}

    def fresh(kind, like):
        if kind == "stacked":
            return cls(like.num_local_experts, like.config, pg_collection=pgs)
        spec = get_gpt_layer_local_spec(num_experts=like.config.num_moe_experts, moe_grouped_gemm=False)
        sub = spec.submodules.mlp.submodules.experts.submodules
        return SequentialMLP(like.num_local_experts, like.config, sub, pg_collection=pgs)

    box = [tempfile.mkdtemp(prefix="expert-shards-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    for i, layer in enumerate(layers):
        stacked = getattr(layer.mlp, "experts", None)
        if not isinstance(stacked, cls):
            continue
        found += 1
        loop = fresh("loop", stacked)
        mine = dict(per_expert_parameters(stacked))
        with torch.no_grad():
            for n, p in loop.named_parameters():
                p.copy_(mine[n])
        prefix, offsets = f"decoder.layers.{i}.mlp.experts.", ((0, i, len(layers)),)
        want, got = (
            flat(loop.sharded_state_dict(prefix, offsets)),
            flat(stacked.sharded_state_dict(prefix, offsets)),
        )
        if set(want) != set(got):
            mismatch.append(f"layer {i}: keys {sorted(set(want) ^ set(got))[:4]}")
        for at in set(want) & set(got):
            compared += 1
            a, b = want[at], got[at]
            for f in ("global_shape", "local_shape", "axis_fragmentations", "replica_id", "prepend_axis_num"):
                if getattr(a, f, None) != getattr(b, f, None):
                    mismatch.append(f"layer {i} {at}: {f} {getattr(a, f, None)} != {getattr(b, f, None)}")
            if isinstance(a.data, torch.Tensor) and not torch.equal(a.data, b.data):
                mismatch.append(f"layer {i} {at}: numbers differ")
        for saver, kind in ((loop, "stacked"), (stacked, "loop")):  # each saved, loaded into a fresh other
            folder = Path(box[0]) / f"layer{i}-{kind}"
            if dist.get_rank() == 0:
                folder.mkdir()
            dist.barrier()
            one = ((0, 0, 1),)  # the saved checkpoint holds this one layer
            with cuda_placement_to_cpu():
                dist_checkpointing.save(saver.sharded_state_dict(prefix, one), str(folder))
                loader = fresh(kind, stacked)
                loaded = dist_checkpointing.load(loader.sharded_state_dict(prefix, one), str(folder))
            loader.load_state_dict({k.removeprefix(prefix): v for k, v in loaded.items()})
            back = dict(per_expert_parameters(loader))
            if back.keys() != mine.keys() or not all(torch.equal(back[n], mine[n]) for n in mine):
                mismatch.append(
                    f"layer {i}: a {kind} module loaded from the other's checkpoint has other weights"
                )
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"layers": found, "compared": compared, "mismatch": mismatch})
    out["expert_shards"] = everyone
    dist.barrier()
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(box[0], ignore_errors=True)


SCENARIOS = {
    f.__name__.removeprefix("scenario_"): f
    for f in [
        scenario_equivalence,
        scenario_single,
        scenario_resume,
        scenario_fp16,
        scenario_adam_kernels,
        scenario_fp32_head,
        scenario_replay,
        scenario_widths,
        scenario_dispatchers,
        scenario_expert_shards,
    ]
}


BASE = [
    "trainer.micro_batch_size=2",
    "trainer.logprob_chunk=5",
    "trainer.dtype=float32",
    "rollout.dtype=float32",
]


def run_scenario(name: str, out_path: Path, overrides: list[str], *, last: bool = True) -> None:
    """One scenario on a trainer built for ``overrides``; rank 0 saves ``out_path``. ``last=False`` keeps the
    launcher's default process group for the next scenario in the same processes."""
    recipe = load_recipe(RECIPE, [*BASE, *overrides]).recipe
    ckpt = model_path_for(recipe)
    tr = MegatronTrainer.of_run(recipe, model_path=ckpt)
    out: dict = {"world_size": dist.get_world_size() if dist.is_initialized() else 1}
    SCENARIOS[name](tr, out)
    if tr.is_rank0:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(out, out_path)
    tr.close(keep_default_group=not last)


def main() -> None:
    """``SCENARIO OUT_DIR [overrides]`` writes ``OUT_DIR/SCENARIO.pt``; ``many OUT_DIR JOBS.json`` runs each job
    (``{"key", "scenario", "overrides"}``) in turn in the same processes and writes ``OUT_DIR/<key>.pt``."""
    name, out_dir, *rest = sys.argv[1:]
    if os.environ.get("TIM_DISTRIBUTED_OPTIMIZER"):
        # megatron's distributed optimizer, which the trainer uses on CUDA only: on one CPU rank it runs the same
        # save and load code (what a GPU job's resume runs), so its checkpoint round trip can be tested here.
        MegatronTrainer._use_distributed_optimizer = lambda self: True
    if name != "many":
        run_scenario(name, Path(out_dir) / f"{name}.pt", rest)
        return
    jobs = json.loads(Path(rest[0]).read_text())
    for i, job in enumerate(jobs):
        path = Path(out_dir) / f"{job['key']}.pt"
        run_scenario(job["scenario"], path, job["overrides"], last=i == len(jobs) - 1)


if __name__ == "__main__":
    main()
