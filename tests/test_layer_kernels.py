"""The trainer's layer kernels: torch's fused attention against megatron-core's materialized one, the grouped
expert GEMM against a loop over experts, and which of them a run gets (``trainer.attention``, ``trainer.experts``).

The whole-model checks (every family at 1 rank, TP2 and EP2, HF parity, three trained steps with verified syncs)
are in tests/test_families.py; resuming across the two expert paths in tests/test_trainer.py; the stacked experts'
checkpoint layout in tests/test_stacked_experts.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.conftest import importable, require


def _megatron_attention(heads: int, groups: int, channels: int):
    """megatron-core's local DotProductAttention on one rank (in the parallel state of :func:`one_rank`)."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=heads * channels,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=channels,
        attention_softmax_in_fp32=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        masked_softmax_fusion=False,
        use_cpu_initialization=True,
    )
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    return cfg, DotProductAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=pgs)


def _attention_shapes() -> list:
    """(family, heads, key/value heads, head_dim) of every non-latent family's tiny model; latent attention has no
    materialized counterpart (megatron-core's DotProductAttention takes one head size)."""
    from tim_megatron.trainer.families import families

    return [
        pytest.param(f.tiny.num_attention_heads, f.tiny.num_key_value_heads, f.tiny.head_dim, id=name)
        for name, f in sorted(families().items())
        if not f.tiny.is_mla
    ]


@pytest.mark.parametrize(
    ("heads", "groups", "channels"), [(4, 4, 32), (4, 2, 32), (4, 1, 32), *_attention_shapes()]
)
def test_sdpa_attention_equals_megatrons_materialized_attention(one_rank, heads, groups, channels):
    """The two core attentions on the same inputs in float32, as megatron hands them over (key and value with the
    query groups' heads), at MHA, GQA, MQA and every non-latent family's tiny attention shape: within 1e-6 of each
    other, with the causal mask given as a tensor (the materialized attention needs it) and without one (the fused
    attention's ``is_causal``, which lets flash attention run)."""
    from tim_megatron.trainer.attention import SdpaCoreAttention
    from tim_megatron.trainer.model import causal_mask

    cfg, materialized = _megatron_attention(heads, groups, channels=channels)
    sdpa = SdpaCoreAttention(cfg, 1, None, "self")
    g = torch.Generator().manual_seed(1)
    s, b = 19, 3
    q = torch.randn(s, b, heads, channels, generator=g) * 2
    k = torch.randn(s, b, groups, channels, generator=g) * 2
    v = torch.randn(s, b, groups, channels, generator=g)
    mask = causal_mask(s, q.device)
    want = materialized(q, k, v, mask)
    for given in (mask, None):
        got = sdpa(q, k, v, given)
        assert got.shape == want.shape == (s, b, heads * channels)
        err = float((got - want).abs().max())
        assert err <= 1e-6 * max(1.0, float(want.abs().max())), err
    # a change in the future does not reach the past: position 7's output ignores keys 8 and on
    k2 = k.clone()
    k2[8:] += 1.0
    assert torch.equal(sdpa(q, k2, v, None)[:8], sdpa(q, k, v, None)[:8])


@pytest.mark.parametrize("experts", [4, 1])
def test_the_stacked_experts_equal_sequential_mlp(one_rank, experts):
    """megatron-core's SequentialMLP and the grouped path's stacked experts on the same weights, as the trainer builds
    them: the same output and the same gradients (tokens, every expert's weights, read as the per-expert views the
    weight mapping reads) in float32, with an expert that gets no token, with one local expert, and with no token
    for any of them (the branch that skips the grouped GEMM); and the backward gives each stacked weight one
    gradient (one AccumulateGrad), where the loop gives one per expert and linear layer."""
    from tim_megatron.bench.experts import expert_modules
    from tim_megatron.trainer.experts import per_expert_parameters

    loop, stacked = expert_modules(experts=experts, hidden=32, width=16, dtype=torch.float32)
    assert [n for n, _ in stacked.named_parameters()] == ["weight1", "weight2"]
    assert stacked.weight1.shape == (experts, 2 * 16, 32) and stacked.weight2.shape == (experts, 32, 16)
    assert sorted(n for n, _ in per_expert_parameters(stacked)) == sorted(
        n for n, _ in loop.named_parameters()
    )
    accumulated = {"loop": [], "stacked": []}
    for name, module in (("loop", loop), ("stacked", stacked)):
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(lambda p, name=name: accumulated[name].append(p.shape))
    g = torch.Generator().manual_seed(3)
    for counts in ([3, 0, 5, 2][:experts] if experts > 1 else [6], [0] * experts):
        counts = torch.tensor(counts)
        rows = int(counts.sum())
        x = torch.randn(rows, 32, generator=g)
        probs = torch.rand(rows, generator=g)
        grad = torch.randn(rows, 32, generator=g)
        got = {}
        for name, module in (("loop", loop), ("stacked", stacked)):
            module.zero_grad(set_to_none=True)
            accumulated[name].clear()
            xi = x.clone().requires_grad_()
            out, bias = module(xi, counts, probs)
            assert bias is None and out.shape == (rows, 32)
            out.backward(grad)
            params = module.named_parameters() if name == "loop" else per_expert_parameters(module)
            weights = {n: p.grad if name == "loop" else p.main_grad for n, p in params}
            got[name] = (out.detach(), xi.grad, {n: w.clone() for n, w in weights.items() if w is not None})
        assert len(accumulated["stacked"]) == 2 and len(accumulated["loop"]) == 2 * experts
        (out_l, gx_l, gw_l), (out_s, gx_s, gw_s) = got["loop"], got["stacked"]
        assert (out_s - out_l).abs().max() <= 1e-6 if rows else out_s.shape == out_l.shape
        if rows:
            assert (gx_s - gx_l).abs().max() <= 1e-6
        assert set(gw_s) == set(gw_l) == {n for n, _ in loop.named_parameters()}  # every expert has one
        for n, w in gw_s.items():
            assert (w - gw_l[n]).abs().max() <= 1e-5, n
        assert sum(float(w.abs().sum()) for w in gw_s.values()) > 0 or not rows


def test_the_fused_attention_refuses_what_it_does_not_compute():
    require(importable("megatron.core"), "megatron-core")
    from tim_megatron.trainer.attention import SdpaCoreAttention

    ok = SimpleNamespace(context_parallel_size=1, attention_dropout=0.0, kv_channels=32, window_size=None)
    for change, match in (
        ({"context_parallel_size": 2}, "context_parallel_size = 2"),
        ({"attention_dropout": 0.1}, "attention_dropout = 0.1"),
        ({"window_size": (8, 0)}, "window_size"),
        ({"softmax_type": "off-by-one"}, "softmax_type = off-by-one"),
    ):
        with pytest.raises(ValueError, match=match):
            SdpaCoreAttention(SimpleNamespace(**{**vars(ok), **change}), 1, None, "self")
    from megatron.core.transformer.enums import AttnMaskType

    with pytest.raises(ValueError, match="attn_mask_type = padding"):
        SdpaCoreAttention(ok, 1, AttnMaskType.padding, "self")
    att = SdpaCoreAttention(ok, 1, AttnMaskType.causal, "self")
    with pytest.raises(ValueError, match="3 query heads cannot share 2"):
        att(torch.zeros(4, 1, 3, 32), torch.zeros(4, 1, 2, 32), torch.zeros(4, 1, 2, 32), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_gemm_equals_a_loop_over_experts_and_copies_no_weight(dtype):
    """The grouped experts' GEMM (tokens grouped by expert through their expert's ``[out, in]`` slice of the stacked
    weight) against one GEMM per expert: the same outputs and gradients (within 1e-5 of the output's scale), experts
    with no token included (their gradient is zero); what autograd keeps for the backward is the input and the
    stacked weight itself (its own storage, no stacked copy: at Qwen3-30B-A3B's shape a copy is 1.2 GB per layer in
    bf16), and the weight's gradient comes in the weight's own contiguous ``[experts, out, in]`` layout."""
    from tim_megatron.trainer.experts import grouped_linear

    g = torch.Generator().manual_seed(2)
    counts = torch.tensor([3, 0, 5, 1, 0, 7])
    rows = int(counts.sum())
    weight = torch.randn(len(counts), 40, 24, generator=g).to(dtype).requires_grad_()
    x = torch.randn(rows, 24, generator=g).to(dtype).requires_grad_()
    grad_out = torch.randn(rows, 40, generator=g).to(dtype)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = grouped_linear(x, weight, counts)
    big = [t for t in saved if t.dim() == 3]
    assert len(big) == 1 and big[0].data_ptr() == weight.data_ptr() and big[0].shape == weight.shape
    y.backward(grad_out)
    gx, gw = x.grad.clone(), weight.grad.clone()
    assert weight.grad.shape == weight.shape and weight.grad.is_contiguous()
    x.grad = None
    weight.grad = None
    loop = torch.cat([t @ weight[e].t() for e, t in enumerate(torch.split(x, counts.tolist()))])
    loop.backward(grad_out)

    def close(a, b):
        return float((a.float() - b.float()).abs().max()) <= 1e-5 * max(1.0, float(b.float().abs().max()))

    assert close(y, loop) and close(gx, x.grad) and close(gw, weight.grad)
    assert not gw[1].any() and not gw[4].any() and gw[0].any()


def test_which_kernels_a_run_gets():
    from tim_megatron.trainer.attention import resolve_attention
    from tim_megatron.trainer.experts import grouped_mm_problem, resolve_experts

    assert grouped_mm_problem(device="cpu", dtype=torch.float32) == ""
    on_gpu = torch.cuda.is_available()
    # auto: grouped and fused on CUDA, the loop and the materialized attention on CPU; exact mode keeps both
    want_auto = (
        "grouped" if on_gpu and not grouped_mm_problem(device="cuda", dtype=torch.bfloat16) else "loop"
    )
    assert resolve_experts("auto", exact=False, dtype=torch.bfloat16, on_gpu=on_gpu) == want_auto
    assert resolve_experts("grouped", exact=False, dtype=torch.float32, on_gpu=False) == "grouped"
    assert resolve_experts("grouped", exact=True, dtype=torch.float32, on_gpu=False) == "loop"
    assert resolve_attention("auto", exact=False, on_gpu=on_gpu) == ("sdpa" if on_gpu else "materialized")
    assert resolve_attention("auto", exact=False, on_gpu=True) == "sdpa"  # the device the run will train on
    assert resolve_attention("sdpa", exact=True, on_gpu=True) == "materialized"
    # the kernel's strides must be multiples of 16 bytes: an expert width of 36 in bfloat16 is refused by name
    with pytest.raises(
        ValueError, match=r"trainer.experts = grouped: rows of 36 torch.bfloat16 values .* 8 here"
    ):
        resolve_experts("grouped", exact=False, dtype=torch.bfloat16, on_gpu=False, widths=(128, 36))
    assert (
        resolve_experts("auto", exact=False, dtype=torch.bfloat16, on_gpu=on_gpu, widths=(128, 36)) == "loop"
    )
    with pytest.raises(ValueError, match=r"trainer.experts = 'fast'; allowed: auto, loop, grouped"):
        resolve_experts("fast", exact=False, dtype=torch.float32, on_gpu=False)
    with pytest.raises(ValueError, match=r"trainer.attention = 'flash'; allowed: auto, sdpa, materialized"):
        resolve_attention("flash", exact=False, on_gpu=False)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("experts", "grouped", "set trainer.experts = loop or auto"),
        ("attention", "sdpa", "set trainer.attention = materialized or auto"),
    ],
)
def test_exact_mode_refuses_the_fused_kernels_by_name(key, value, match):
    from tim_megatron.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=match) as e:
        load_recipe("recipes/tiny-moe/vexact.yaml", [f"trainer.{key}={value}"])
    assert f"trainer.{key} = {value} with vexact = exact" in str(e.value)
    with pytest.raises(RecipeError, match=r"trainer.experts"):
        load_recipe("recipes/tiny-moe/grpo.yaml", ["trainer.experts=fast"])
