"""The ``indexed`` MoE token dispatcher (:mod:`tim_megatron.trainer.dispatch`) against megatron-core's all-gather
dispatcher on the same router output: the permuted rows, tokens per expert and probabilities, the combined output
and every gradient, bit for bit in float32 (each token's rows are summed in the same, ascending expert order), with
the router's own routing and with R3's replayed routes; a whole MoE layer with either experts path; no host read in
its forward or backward at one rank; at EP2 and TP2 on two gloo ranks (tests/workers/megatron_worker.py); and which
dispatcher a run gets (``trainer.moe_dispatcher``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.conftest import importable, require

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.megatron

EXPERTS, TOP_K, HIDDEN = 8, 3, 32


@pytest.fixture
def moe_rank(one_rank):
    """``one_rank`` with the router's CPU patch and deterministic algorithms, as the trainer runs (megatron's
    unpermute then takes ``index_add_``)."""
    import megatron.core.transformer.moe.moe_utils  # noqa: F401  (binds te_general_gemm, or leaves it unbound)

    from patches.megatron import no_te_router_gemm

    patch = no_te_router_gemm.apply() if no_te_router_gemm.needed() else None
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was)
    if patch is not None:
        patch.revert()


def moe_layers(*, experts: str = "loop", dtype=torch.float32):
    """Two megatron-core MoE layers with the same weights, as the project builds them (local spec, all-gather
    dispatcher, routing replay hooks): the second with the indexed dispatcher installed."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    from patches.megatron import indexed_dispatcher, router_replay
    from tim_megatron.trainer.dispatch import indexed_dispatcher_class
    from tim_megatron.trainer.experts import use_grouped_experts

    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOP_K,
        moe_ffn_hidden_size=16,
        ffn_hidden_size=64,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32",
        moe_enable_routing_replay=True,
    )
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    if experts == "grouped":
        use_grouped_experts(spec)
    torch.manual_seed(0)
    theirs = build_module(spec.submodules.mlp, config=cfg)
    ours = build_module(spec.submodules.mlp, config=cfg)
    ours.load_state_dict(theirs.state_dict())
    with torch.no_grad():  # spread the router's scores, so top-k picks vary from token to token
        theirs.router.weight.mul_(40.0)
        ours.router.weight.copy_(theirs.router.weight)
    for layer in (theirs, ours):
        router_replay.attach(layer)
    assert indexed_dispatcher.install(ours, indexed_dispatcher_class()) == 1
    return theirs, ours


def replay_routes(tokens: int, *, seed: int) -> torch.Tensor:
    """R3's routes: ``top_k`` distinct experts per token in no particular order (the engine gives them by score),
    expert 5 never chosen (an empty group)."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(EXPERTS) if e != 5])
    return torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:TOP_K]] for _ in range(tokens)])


def routed(layer, hidden: torch.Tensor, routes: torch.Tensor | None):
    """The router's ``(probs, routing_map)``, its own or with ``routes`` replayed (R3)."""
    from patches.megatron import router_replay

    if routes is None:
        return layer.router(hidden)
    with router_replay.replay(layer, action="replay", indices=[routes]):
        return layer.router(hidden)


def run_dispatcher(d, hidden, probs, routing_map, grads):
    """Dispatch, a row-wise function of the rows and their probabilities in place of the experts, combine; then
    the backward of a fixed weighting of the output and the permuted probabilities."""
    x = hidden.detach().clone().requires_grad_()
    p = probs.detach().clone().requires_grad_()
    h, pp = d.dispatch_preprocess(x, routing_map, p)
    h, pp = d.token_dispatch(h, pp)
    rows, tokens_per_expert, pp = d.dispatch_postprocess(h, pp)
    y = torch.sin(rows) * pp.unsqueeze(-1) + rows * rows
    out = d.combine_postprocess(d.token_combine(d.combine_preprocess(y)))
    ((out * grads[0]).sum() + (pp * grads[1][: pp.shape[0]]).sum()).backward()
    return {
        "rows": rows.detach(),
        "tokens_per_expert": tokens_per_expert,
        "probs": pp.detach(),
        "out": out.detach(),
        "grad_hidden": x.grad,
        "grad_probs": p.grad,
    }


@pytest.mark.parametrize("routing", ["router", "r3"])
def test_permute_and_unpermute_equal_megatrons_bit_for_bit(moe_rank, routing):
    """The same router output through megatron-core's all-gather dispatcher and through the indexed one: the
    experts' rows, tokens per expert and probabilities, the combined output, and the gradients of the hidden
    states and of the router's probabilities are equal bit for bit (float32), with the router's own top-k and with
    replayed routes given in no order and leaving an expert without tokens."""
    theirs, ours = moe_layers()
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(11, 3, HIDDEN, generator=g)
    routes = replay_routes(33, seed=2) if routing == "r3" else None
    probs, routing_map = routed(theirs, hidden, routes)
    assert bool((routing_map.sum(1) == TOP_K).all())
    grads = (torch.randn(11, 3, HIDDEN, generator=g), torch.randn(33 * TOP_K, generator=g))
    want = run_dispatcher(theirs.token_dispatcher, hidden, probs, routing_map, grads)
    got = run_dispatcher(ours.token_dispatcher, hidden, probs, routing_map, grads)
    assert got["tokens_per_expert"].device == routing_map.device  # the counts stay where the routing is
    for key in want:
        assert got[key].shape == want[key].shape and torch.equal(got[key], want[key]), key
    if routing == "r3":
        assert int(want["tokens_per_expert"][5]) == 0
    assert float(want["grad_probs"].abs().sum()) > 0 and float(want["grad_hidden"].abs().sum()) > 0


def layer_step(layer, hidden, grad, routes):
    """One MoE layer's forward and backward: output, input gradient, every parameter's gradient."""
    from patches.megatron import router_replay

    layer.zero_grad(set_to_none=True)
    x = hidden.detach().clone().requires_grad_()
    if routes is None:
        out, bias = layer(x)
    else:
        with router_replay.replay(layer, action="replay", indices=[routes]):
            out, bias = layer(x)
    assert bias is None
    out.backward(grad)
    return (
        out.detach(),
        x.grad,
        {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None},
    )


@pytest.mark.parametrize("experts", ["loop", "grouped"])
@pytest.mark.parametrize("routing", ["router", "r3"])
def test_a_moe_layer_with_it_equals_the_layer_with_megatrons_dispatcher(moe_rank, experts, routing):
    """A whole MoE layer (router, dispatcher, megatron's loop over experts or the grouped experts) in float32: its
    output and the gradients of its input, the router weight and every expert weight are megatron's bit for bit
    (each token's expert rows are summed in the same ascending expert order)."""
    theirs, ours = moe_layers(experts=experts)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(9, 2, HIDDEN, generator=g)
    grad = torch.randn(9, 2, HIDDEN, generator=g)
    routes = replay_routes(18, seed=4) if routing == "r3" else None
    out_w, gx_w, gw_w = layer_step(theirs, hidden, grad, routes)
    out_g, gx_g, gw_g = layer_step(ours, hidden, grad, routes)
    assert torch.equal(out_g, out_w) and torch.equal(gx_g, gx_w)
    assert set(gw_g) == set(gw_w) and "router.weight" in gw_w
    for name in gw_w:
        assert torch.equal(gw_g[name], gw_w[name]), name
    assert float(gw_w["router.weight"].abs().sum()) > 0


class HostReads(TorchFunctionMode):
    """Fails on every call that reads a tensor's values on the host or makes an output's size depend on them (a
    device-to-host copy and a wait on CUDA)."""

    READS: ClassVar = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}
    SIZED_BY_VALUES: ClassVar = {
        "nonzero",
        "argwhere",
        "masked_select",
        "unique",
        "unique_consecutive",
        "bincount",
    }

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in self.READS or name in self.SIZED_BY_VALUES:
            raise AssertionError(f"host read: {name}")
        if name == "repeat_interleave" and "output_size" not in kwargs:
            raise AssertionError("host read: repeat_interleave without output_size")
        if name == "__getitem__" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if isinstance(args[1], tuple) else (args[1],))
        ):
            raise AssertionError("host read: boolean-mask indexing")
        return func(*args, **kwargs)


def test_the_dispatch_reads_nothing_on_the_host_at_one_rank(moe_rank):
    """A whole MoE layer with the grouped experts and the indexed dispatcher, forward and backward, reads no tensor
    value on the host (no ``.item()``, ``.tolist()``, ``.cpu()``, truth value, or value-sized output): on CUDA it
    would run without a host sync. The same layer with megatron's all-gather dispatcher trips the guard (it copies
    the tokens per expert to the host and permutes with ``masked_select``)."""
    theirs, ours = moe_layers(experts="grouped")
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(6, 2, HIDDEN, generator=g, requires_grad=True)
    with HostReads():
        out, _ = ours(hidden)
        out.backward(torch.ones_like(out))
    for routes in (replay_routes(12, seed=6),):  # and under R3 replay
        from patches.megatron import router_replay

        with router_replay.replay(ours, action="replay", indices=[routes]), HostReads():
            ours(hidden)[0].sum().backward()
    with pytest.raises(AssertionError, match="host read"), HostReads():
        theirs(hidden)


def test_a_routing_map_without_top_k_experts_per_token_is_refused(moe_rank):
    """The plan needs exactly top-k experts per token (a dropless router's output); a map with another count fails
    the device-side check instead of dispatching the wrong rows."""
    from tim_megatron.trainer.dispatch import route_plan

    routing_map = torch.zeros(4, EXPERTS, dtype=torch.bool)
    routing_map[:, :TOP_K] = True
    plan = route_plan(routing_map, top_k=TOP_K)
    assert plan.rows.tolist() == [0, 1, 2, 3] * TOP_K and plan.tokens_per_expert.tolist()[:4] == [4, 4, 4, 0]
    routing_map[2, 0] = False
    with pytest.raises(RuntimeError, match="exactly top_k"):
        route_plan(routing_map, top_k=TOP_K)


def test_the_chunk_order_equals_megatrons_sort_chunks(moe_rank):
    """The EP > 1 reorder of received rows (chunks by source rank, then local expert -> by local expert, then
    source) and its inverse equal megatron-core's ``sort_chunks_by_idxs`` with the all-to-all dispatcher's orders,
    empty chunks included."""
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

    from tim_megatron.trainer.dispatch import chunk_order, reorder

    g = torch.Generator().manual_seed(7)
    for sources, local in ((2, 4), (4, 2), (3, 1), (1, 5)):
        sizes = torch.randint(0, 4, (sources, local), generator=g)
        sizes[0, 0] = 0
        total = int(sizes.sum())
        x = torch.randn(total, 3, generator=g)
        chunks = torch.arange(sources * local)
        forward_order = chunks.reshape(-1, local).T.ravel()  # megatron's sort_input_by_local_experts
        back_order = chunks.reshape(local, -1).T.ravel()  # restore_output_by_local_experts
        want, _ = sort_chunks_by_idxs(x, sizes.ravel(), forward_order)
        index, inverse = chunk_order(sizes, total=total)
        got = reorder(x, index, inverse)
        assert torch.equal(got, want)
        back, _ = sort_chunks_by_idxs(want, sizes.T.ravel(), back_order)
        assert torch.equal(reorder(got, inverse, index), back) and torch.equal(back, x)


def test_the_dispatcher_a_run_gets(moe_rank):
    """``trainer.moe_dispatcher``: auto is megatron's all-gather on CPU (the CPU figures stay as measured) and
    indexed on CUDA; indexed is installed in every MoE layer of a built model; alltoall is refused on CPU, an
    unknown value names the allowed ones, and exact mode refuses indexed."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    from patches.megatron.indexed_dispatcher import moe_layers as layers_of
    from tim_megatron.recipe import RecipeError, load_recipe
    from tim_megatron.recipe.dims import ModelDims
    from tim_megatron.recipe.schema import ModelConfig, ParallelismConfig
    from tim_megatron.trainer.dispatch import indexed_dispatcher_class, resolve_dispatcher
    from tim_megatron.trainer.model import BuildOptions, build_model

    assert resolve_dispatcher("auto", on_gpu=False) == "allgather"
    assert resolve_dispatcher("auto", on_gpu=True) == "indexed"
    assert [resolve_dispatcher(s, on_gpu=False) for s in ("allgather", "indexed")] == ["allgather", "indexed"]
    with pytest.raises(ValueError, match="trainer.moe_dispatcher = alltoall needs CUDA"):
        resolve_dispatcher("alltoall", on_gpu=False)
    with pytest.raises(ValueError, match="allowed: auto, allgather, alltoall, indexed"):
        resolve_dispatcher("fast", on_gpu=True)

    dims = ModelDims()
    assert dims.is_moe
    built = {}
    for setting in ("auto", "indexed"):
        model = build_model(
            dims, ModelConfig(dims=dims), ParallelismConfig(), BuildOptions(dispatcher=setting, use_te=False)
        )
        built[setting] = {type(layer.token_dispatcher) for layer in layers_of(model)}
    assert built == {"auto": {MoEAllGatherTokenDispatcher}, "indexed": {indexed_dispatcher_class()}}
    assert not issubclass(
        indexed_dispatcher_class(), MoEAllGatherTokenDispatcher
    )  # exact mode's checks refuse it

    with pytest.raises(RecipeError, match="trainer.moe_dispatcher = indexed"):
        load_recipe(ROOT / "recipes/tiny-moe/vexact.yaml", ["trainer.moe_dispatcher=indexed"])


def test_two_rank_layouts_give_megatrons_results(tmp_path):
    """EP2 (4 experts per rank, all-to-all of rows) and TP2 (expert tensor parallel: all-gather and reduce-scatter of
    rows over the two ranks) on two gloo ranks, the tiny model (top-2) in float32: the first MoE layer's experts
    get megatron's rows, tokens per expert and probabilities bit for bit on every rank. At EP2 the logprobs and
    gradients are megatron's bit for bit too (with two experts per token, the all-gather's per-rank partial sums
    and its reduce-scatter add the same two rows, each to zero first). At TP2 they agree within 1e-6 of the largest
    entry: the expert-TP partial rows are summed over the ranks before the combine here (as megatron's all-to-all
    dispatcher does) and after it in megatron's all-gather."""
    require(importable("megatron.core"), "megatron-core")
    from tests.conftest import free_port

    layouts = {"ep2": ["parallel.ep=2", "parallel.dp=2"], "tp2": ["parallel.tp=2"]}
    jobs = [
        {"key": k, "scenario": "dispatchers", "overrides": [*v, "trainer.moe_dispatcher=indexed"]}
        for k, v in layouts.items()
    ]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    worker = ROOT / "tests" / "workers" / "megatron_worker.py"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
    ]
    res = subprocess.run(
        [*cmd, str(worker), "many", str(tmp_path), str(tmp_path / "jobs.json")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    for key in layouts:
        out = torch.load(tmp_path / f"{key}.pt", weights_only=False)
        got, want = out["dispatcher"]["indexed"], out["dispatcher"]["allgather"]
        assert out["world_size"] == 2
        assert (got["class"], want["class"]) == ("IndexedTokenDispatcher", "MoEAllGatherTokenDispatcher")
        assert len(got["experts_input"]) == 2
        for rank, (mine, theirs) in enumerate(zip(got["experts_input"], want["experts_input"], strict=True)):
            for name, a, b in zip(("rows", "tokens per expert", "probs"), mine, theirs, strict=True):
                assert a.shape == b.shape and torch.equal(a, b), (key, rank, name)
        lp_g, lp_w = got["logprobs"], want["logprobs"]
        assert set(got["grads"]) == set(want["grads"])
        if key == "ep2":
            assert torch.equal(lp_g, lp_w)
            assert all(torch.equal(got["grads"][k], want["grads"][k]) for k in want["grads"])
        else:
            assert float((lp_g - lp_w).abs().max()) <= 1e-6 * float(lp_w.abs().max())
            for k, w in want["grads"].items():
                assert float((got["grads"][k] - w).abs().max()) <= 1e-6 * max(1.0, float(w.abs().max())), k
        assert sum(float(v.abs().sum()) for v in want["grads"].values()) > 0
