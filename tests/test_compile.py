"""``trainer.compile`` (:mod:`tim_megatron.trainer.compile`): where it applies, and its compiled functions against the
eager ones, values and gradients, at two shapes each (``dynamic=True``: one graph for both).

The functions are compiled here with the ``aot_eager`` backend: dynamo's tracing and AOT autograd's forward and
backward graphs, run with eager kernels. Inductor's own kernels (what a CUDA run uses) cost about 14 s of C++
compile per function on a 2-core CPU, too slow for CI; ``make gpu-check`` compares a model's logprobs compiled and
eager on the GPU. Its wiring on a built model is tested in tests/test_gpu_check.py (one trainer shared with the
profile's test)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import importable, require
from tim_megatron.trainer.compile import COMPILE_SETTINGS, glu_probs, resolve_compile


def test_compile_applies_on_cuda_only_never_in_exact_mode_and_off_turns_it_off():
    from tim_megatron.recipe.schema import TrainerConfig

    assert TrainerConfig().compile == "auto" and COMPILE_SETTINGS == ("auto", "off")
    assert resolve_compile("auto", exact=False, on_gpu=True) == ""
    assert "on CPU" in resolve_compile("auto", exact=False, on_gpu=False)
    assert "exact mode" in resolve_compile("auto", exact=True, on_gpu=True)
    assert resolve_compile("off", exact=False, on_gpu=True) == "trainer.compile = off"
    with pytest.raises(ValueError, match=r"trainer.compile = 'on'; allowed: auto, off"):
        resolve_compile("on", exact=False, on_gpu=True)


def _same(fn, compiled, *args):
    """``fn`` and ``compiled`` on copies of ``args`` (leaves that need gradients): outputs and every gradient equal."""
    got = []
    for f in (fn, compiled):
        xs = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
        y = f(*xs)
        y.backward(torch.linspace(-1, 1, y.numel()).view_as(y).to(y.dtype))
        got.append([y, *(x.grad for x in xs if x.requires_grad)])
    for a, b in zip(*got, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), (a - b).abs().max()


def test_compiled_norm_rope_and_swiglu_give_the_eager_values_and_gradients():
    require(importable("megatron.core"), "megatron-core")
    from patches.megatron import compiled_rope
    from tim_megatron.trainer.norm import rms_norm

    rope = compiled_rope.original()
    norm, rope_c, glu = (
        torch.compile(f, dynamic=True, backend="aot_eager") for f in (rms_norm, rope, glu_probs)
    )
    g = torch.Generator().manual_seed(0)
    for s, b in ((5, 3), (7, 2)):  # q and k as megatron holds them, [s, b, heads, d], two sequence lengths
        x = torch.randn(s, b, 4, 32, generator=g).to(torch.bfloat16).requires_grad_()
        w = torch.randn(32, generator=g).to(torch.bfloat16).requires_grad_()
        _same(lambda x, w: rms_norm(x, w, 1e-6), lambda x, w: norm(x, w, 1e-6), x, w)
        freqs = torch.randn(s, 1, 1, 32, generator=g)
        _same(lambda t, f=freqs: rope(t, f), lambda t, f=freqs: rope_c(t, f), x)
    for rows in (6, 11):
        h = torch.randn(rows, 2 * 16, generator=g).to(torch.bfloat16).requires_grad_()
        p = torch.rand(rows, generator=g).requires_grad_()  # the router's float32 probabilities
        _same(glu_probs, glu, h, p)


def test_the_rope_patch_binds_megatrons_module_global_and_restores_it():
    require(importable("megatron.core"), "megatron-core")
    from megatron.core.models.common.embeddings import rope_utils

    from patches.megatron import compiled_rope

    own = rope_utils._apply_rotary_pos_emb_bshd
    compiled = torch.compile(own, dynamic=True, backend="eager")  # never called: nothing is compiled
    h = compiled_rope.apply(compiled)
    try:
        assert rope_utils._apply_rotary_pos_emb_bshd is compiled
        assert (
            compiled_rope.apply(compiled).undo == []
        )  # a second trainer on the same compiled form changes nothing
    finally:
        h.revert()
    assert rope_utils._apply_rotary_pos_emb_bshd is own
    rope_utils._apply_rotary_pos_emb_bshd = lambda *a: None  # someone else's replacement is refused
    try:
        with pytest.raises(RuntimeError, match="is not megatron-core's own"):
            compiled_rope.apply(compiled)
    finally:
        rope_utils._apply_rotary_pos_emb_bshd = own
