"""The optimizer's patches for a megatron-core without apex or transformer-engine (issue 57, item 1):
``patches/megatron/sync_free_grad_norm.py`` (the grad norm, clip and parameter copy without a host sync per
parameter) and ``patches/megatron/torch_adam_kernel.py`` (torch's fused or foreach AdamW)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import importable, require


def _grads(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * 10 ** (i % 3) for i, n in enumerate([7, 1000, 33, 4096, 1])]


def test_the_norm_is_megatrons_within_float32_rounding_and_the_scale_its_bits():
    require(importable("megatron.core"), "megatron-core")
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    from patches.megatron import cpu_shims
    from patches.megatron.sync_free_grad_norm import l2_norm, scale

    grads, flag = _grads(), torch.zeros(1, dtype=torch.int)
    with cpu_shims.cuda_placement_to_cpu():
        want, _ = local_multi_tensor_l2_norm(2048 * 32, flag, [grads], False)
    got, _ = l2_norm(2048 * 32, flag, [grads], False)
    assert got.shape == (1,) and got.dtype == torch.float32
    assert abs(float(got) - float(want)) <= 1e-6 * float(want)
    assert float(l2_norm(0, flag, [[]], False)[0]) == 0.0
    with pytest.raises(NotImplementedError):
        l2_norm(0, flag, [grads], True)
    for factor in (0.37, 1.0):
        a, b = _grads(1), _grads(1)  # the clip: source and destination are the same tensors
        local_multi_tensor_scale(0, flag, [a, a], factor)
        scale(0, flag, [b, b], factor)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        src = _grads(2)  # the parameter copy: fp32 masters into bf16 parameters
        x = [torch.empty_like(t, dtype=torch.bfloat16) for t in src]
        y = [torch.empty_like(t, dtype=torch.bfloat16) for t in src]
        local_multi_tensor_scale(0, flag, [src, x], factor)
        scale(0, flag, [src, y], factor)
        assert all(torch.equal(p, q) for p, q in zip(x, y, strict=True))


def test_the_adam_kernel_is_set_on_every_torch_adam_and_its_steps_kept():
    from patches.megatron.torch_adam_kernel import kernel_of, set_kernel

    class Wrapper:  # megatron's wrappers hold the torch optimizer as .optimizer (chained ones a list of them)
        def __init__(self, o):
            self.optimizer = o

    ps = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(2)]
    inner = [torch.optim.AdamW(ps[:1], lr=1e-3), torch.optim.Adam(ps[1:], lr=1e-3)]

    class Chained:
        def __init__(self):
            self.chained_optimizers = [Wrapper(o) for o in inner]

    for p in ps:
        p.grad = torch.ones_like(p)
    for o in inner:
        o.step()
    before = [o.state[p]["step"].clone() for o, p in zip(inner, ps, strict=True)]
    assert set_kernel(Chained(), "fused") == 2 and kernel_of(Chained()) == "fused"
    assert all(g["fused"] and not g["foreach"] for o in inner for g in o.param_groups)
    for o, p, s in zip(inner, ps, before, strict=True):
        assert torch.equal(o.state[p]["step"], s) and o.state[p]["step"].dtype == torch.float32
        o.step()  # torch's fused kernel steps with it
    assert set_kernel(Chained(), "foreach") == 2 and kernel_of(Chained()) == "foreach"
    with pytest.raises(ValueError, match="allowed: fused, foreach"):
        set_kernel(Chained(), "apex")
    assert set_kernel(Wrapper(torch.optim.SGD(ps, lr=1.0)), "fused") == 0  # not a torch Adam: untouched


def test_both_patches_refuse_a_megatron_core_they_were_not_verified_on(monkeypatch):
    import importlib.metadata as md

    from patches import guard
    from patches.megatron import sync_free_grad_norm, torch_adam_kernel

    real = md.version
    monkeypatch.setattr(guard.md, "version", lambda d: "0.99.0" if d == "megatron-core" else real(d))
    for mod in (sync_free_grad_norm, torch_adam_kernel):
        with pytest.raises(guard.UnverifiedVersionError, match="megatron-core 0.99.0 is installed"):
            guard.check_version(mod.SPEC)
