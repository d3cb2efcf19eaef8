"""The grouped path's stacked expert weights (issue 57, item 4) against megatron-core's SequentialMLP: the sharded
checkpoint state each saves (the same per-expert sharded tensors, for weights and optimizer states), a checkpoint
of one module loaded into the other, the per-expert views the weight mapping reads, and the refusal of the
distributed optimizer's bucket state across the two layouts.

The whole-model checks are elsewhere: logprobs and gradients against the loop at 1 rank, TP2 and EP2
(tests/test_families.py, every family), the same sharded state at TP2 and EP2 (tests/test_trainer.py, in its
two-rank run), a trainer checkpoint resumed across the two paths (tests/test_trainer.py), the module's outputs and
gradients (tests/test_layer_kernels.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.conftest import importable, require

PREFIX = "decoder.layers.1.mlp.experts."
LAYER = ((0, 1, 2),)
"""The sharded offsets a decoder layer gives its MoE layer (layer 1 of 2), as megatron-core's block does."""
ONLY = ((0, 0, 1),)
"""The same for a model of one layer (a checkpoint must cover its tensors)."""


def _modules(experts: int = 4):
    from tim_megatron.bench.experts import expert_modules

    g = torch.Generator().manual_seed(5)
    loop, stacked = expert_modules(experts=experts, hidden=32, width=16, dtype=torch.float32)
    with torch.no_grad():
        for p in loop.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        for attr, linear in (("weight1", "linear_fc1"), ("weight2", "linear_fc2")):
            getattr(stacked, attr).copy_(torch.stack([getattr(e, linear).weight for e in loop.local_experts]))
    return loop, stacked


def _flat(sharded: dict) -> dict:
    """Every sharded tensor and object of a sharded state dict (factories built), by (key, global offset)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories

    apply_factories(sharded)
    out = {}
    for v in nested_values(sharded):
        at = (v.key, tuple(v.global_offset))
        assert at not in out, at
        out[at] = v
    return out


FIELDS = (
    "global_shape",
    "local_shape",
    "axis_fragmentations",
    "replica_id",
    "prepend_axis_num",
    "flattened_range",
)


@pytest.mark.parametrize("singleton", [False, True], ids=["one-key-per-weight", "singleton-local-shards"])
def test_the_stacked_experts_save_the_loops_sharded_tensors(one_rank, singleton):
    """The stacked module's sharded state is SequentialMLP's, entry for entry: the same keys and global offsets (the
    expert axis, a gated fc1's gate and up halves), shapes, replica ids and numbers, with and without megatron's
    ``singleton_local_shards``; and an optimizer state going through the same factory (as megatron's optimizers
    build theirs: the key prefixed, the state in place of the weight) lands under the loop's optimizer keys."""
    loop, stacked = _modules()
    want = loop.sharded_state_dict(PREFIX, LAYER, {"singleton_local_shards": singleton})
    got = stacked.sharded_state_dict(PREFIX, LAYER, {"singleton_local_shards": singleton})
    assert set(got) == {f"{PREFIX}weight1", f"{PREFIX}weight2"} | {
        k for k in want if k.endswith("_extra_state")
    }  # the stacked weights (factories), and the loop's extra states, which the loop asks for
    # the optimizer's view of both (megatron's make_sharded_optimizer_tensor), before the factories are built
    states = {
        name: {
            k: replace(v, key=f"optimizer.state.exp_avg.{v.key}", data=v.data * 0.5)
            for k, v in sd.items()
            if not k.endswith("_extra_state")
        }
        for name, sd in (("loop", want), ("stacked", got))
    }
    for w, g in ((want, got), (states["loop"], states["stacked"])):
        w, g = _flat(dict(w)), _flat(dict(g))
        assert set(g) == set(w) and len(w) >= 4 * 3
        for at, v in w.items():
            for f in FIELDS:
                assert getattr(g[at], f, None) == getattr(v, f, None), (at, f)
            if isinstance(v.data, torch.Tensor):
                assert torch.equal(g[at].data, v.data), at


def test_a_checkpoint_of_either_expert_module_loads_into_the_other(one_rank, tmp_path):
    """megatron-core's distributed checkpoint of one module, loaded into the other (fresh weights), gives it the
    saver's weights exactly, both ways."""
    from megatron.core import dist_checkpointing

    from patches.megatron.cpu_shims import cuda_placement_to_cpu
    from tim_megatron.trainer.experts import per_expert_parameters

    loop, stacked = _modules()
    for saver, loader, name in ((loop, stacked, "loop"), (stacked, loop, "stacked")):
        weights = {n: p.detach().clone() for n, p in per_expert_parameters(saver)}
        folder = tmp_path / name
        folder.mkdir()
        with cuda_placement_to_cpu():
            dist_checkpointing.save(saver.sharded_state_dict(PREFIX, ONLY), str(folder))
        with torch.no_grad():
            for p in loader.parameters():
                p.zero_()
        with cuda_placement_to_cpu():
            loaded = dist_checkpointing.load(loader.sharded_state_dict(PREFIX, ONLY), str(folder))
        loader.load_state_dict({k.removeprefix(PREFIX): v for k, v in loaded.items()})
        got = dict(per_expert_parameters(loader))
        assert got.keys() == weights.keys()
        assert all(torch.equal(got[n], w) for n, w in weights.items()), name


def test_the_weight_mapping_reads_per_expert_views_of_the_stacked_weights(one_rank):
    """What the HF <-> Megatron mapping reads of the stacked module is per-expert views (the stack's own storage,
    the loop's names and shapes) carrying their slice of the stacked gradient; writing one writes the stack."""
    from tim_megatron.trainer.experts import per_expert_parameters

    loop, stacked = _modules(experts=3)
    stacked.weight1.grad = torch.randn(stacked.weight1.shape)
    views = dict(per_expert_parameters(stacked))
    shapes = {n: tuple(p.shape) for n, p in loop.named_parameters()}
    assert {n: tuple(v.shape) for n, v in views.items()} == shapes
    v = views["local_experts.2.linear_fc1.weight"]
    assert v.data_ptr() == stacked.weight1[2].data_ptr() and torch.equal(v.main_grad, stacked.weight1.grad[2])
    assert not hasattr(views["local_experts.2.linear_fc2.weight"], "main_grad")  # no gradient yet: none given
    with torch.no_grad():
        v.copy_(torch.full_like(v, 7.0))
    assert bool((stacked.weight1[2] == 7.0).all()) and not bool((stacked.weight1[1] == 7.0).any())


class _Trainer:
    """What ``load_checkpoint`` asks of a trainer before it reads any tensor."""

    def __init__(self, buckets: str | None):
        self.buckets = buckets

    def state_meta(self) -> dict:
        return {"updates": 0, "model_dims": {"num_experts": 8}, "optimizer_buckets": self.buckets}

    def checkpoint_state(self, *, loading: bool) -> dict:
        raise AssertionError("the refusal comes before any tensor is read")


def _checkpoint(root: Path, meta: dict) -> Path:
    folder = root / "step_00000002"
    folder.mkdir(parents=True)
    (folder / "state.json").write_text(
        json.dumps({"world_size": 1, "model_dims": {"num_experts": 8}, **meta})
    )
    return folder


@pytest.mark.parametrize(
    ("saved", "current"),
    [("stacked", "per-expert"), ("per-expert", "stacked"), (None, "stacked")],
    ids=["grouped-then-loop", "loop-then-grouped", "recorded-before-the-layout-was"],
)
def test_the_distributed_optimizers_bucket_state_is_refused_across_the_expert_layouts(
    tmp_path, saved, current
):
    """megatron's distributed optimizer saves Adam's state by gradient bucket (dp_reshardable), whose layout the
    stacked weights change: read into the other layout it filled the experts' states with other experts' numbers,
    silently (a trainer resumed so moved its weights 0.19 away from the unbroken run's in two steps). The load is
    refused by name before any tensor is read; a checkpoint that predates the record held per-expert weights."""
    require(importable("megatron.core"), "megatron-core")
    from tim_megatron.trainer.checkpoint import CheckpointError, load_checkpoint

    meta = {} if saved is None else {"optimizer_buckets": saved}
    folder = _checkpoint(tmp_path, meta)
    saved_path = {"stacked": "grouped", "per-expert": "loop", None: "loop"}[saved]
    with pytest.raises(
        CheckpointError, match=rf"Resume with trainer.experts = {saved_path} \(the recorded layout\)"
    ):
        load_checkpoint(_Trainer(current), folder)


@pytest.mark.parametrize(
    ("saved", "current"), [("stacked", "stacked"), ("per-expert", None), ("stacked", None), (None, None)]
)
def test_the_same_layout_or_state_by_parameter_is_not_refused(tmp_path, saved, current):
    """The same layout on both sides, or a trainer whose optimizer state is not by bucket, passes the check (and
    reaches the tensors)."""
    from tim_megatron.trainer.checkpoint import load_checkpoint

    folder = _checkpoint(tmp_path, {"optimizer_buckets": saved})
    with pytest.raises(AssertionError, match="before any tensor is read"):
        load_checkpoint(_Trainer(current), folder)


def test_the_compiled_swiglu_slot_runs_in_the_stacked_experts(one_rank):
    """Issue 57, item 6: ``trainer.compile`` sets the compiled ``glu_probs`` on each experts module whose activation is
    SiLU without clamp or offset; the stacked experts call it in place of their eager SwiGLU, with the same outputs
    and gradients (dynamo's ``aot_eager`` backend here: its tracing, eager kernels)."""
    from tim_megatron.trainer.compile import _glu_fits, compiled_functions

    _, stacked = _modules()
    assert _glu_fits(stacked) and type(stacked).glu_probs_fn is None
    g = torch.Generator().manual_seed(9)
    x = torch.randn(12, 32, generator=g, requires_grad=True)
    tokens = torch.tensor([3, 0, 5, 4])
    probs = torch.rand(12, generator=g)
    out = {}
    for name in ("eager", "compiled"):
        if name == "compiled":
            fn, calls = compiled_functions("aot_eager")["glu_probs"], []
            stacked.glu_probs_fn = lambda h, p, fn=fn, calls=calls: (calls.append(h.shape), fn(h, p))[1]
        x.grad = None
        stacked.zero_grad()
        y, _ = stacked(x, tokens, probs)
        y.square().sum().backward()
        out[name] = (y.detach(), x.grad.clone(), stacked.weight1.grad.clone())
    del stacked.glu_probs_fn
    assert calls == [torch.Size([12, 32])]  # the slot ran, on the fc1 output (gate and up of width 16)
    assert all(torch.equal(a, b) for a, b in zip(out["eager"], out["compiled"], strict=True))
