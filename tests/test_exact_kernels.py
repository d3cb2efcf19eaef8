"""Exact mode's row-invariant kernels (tim_megatron/exact/kernels.py) and the patch that routes a model through them.

The property the KV-cached exact sampler stands on: a row's result depends only on that row (and the other operand),
never on how many rows share the GEMM, what they hold, where the row sits among them, or how many batch elements a
``bmm`` has. These tests fail on this machine's stock GEMM for float32 (``make bench``'s ``exact`` section shows it)
and must pass for the tiled kernels at every shape the tiny models use, in float32 and bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from tim_megatron.exact.kernels import TiledCPUKernels, kernels_for
from tim_megatron.exact.kv_cache import KVCache

DTYPES = [torch.float32, torch.bfloat16]
# (K, N) of the tiny models' GEMMs: qkv, attention out, expert fc1 / fc2, router, LM head, dense MLP.
LINEAR_SHAPES = [(128, 256), (128, 128), (128, 128), (64, 128), (128, 8), (128, 64), (128, 512)]
ROW_COUNTS = [*range(1, 40), 63, 64, 65, 257, 1000]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_linear_row_has_the_same_bits_at_any_row_count_place_and_neighbours(dtype):
    kernels = TiledCPUKernels()
    g = torch.Generator().manual_seed(0)
    for k, n in LINEAR_SHAPES:
        w = torch.randn(n, k, generator=g).to(dtype)
        probe = torch.randn(8, k, generator=g).to(dtype)
        alone = torch.stack([kernels.linear(r[None], w)[0] for r in probe])
        for m in ROW_COUNTS:
            x = torch.randn(m, k, generator=g).to(dtype)
            places = torch.randperm(m, generator=g)[: min(m, 8)]
            x[places] = probe[: len(places)]
            y = kernels.linear(x, w)
            assert torch.equal(y[places], alone[: len(places)]), (k, n, m)
    # Leading dimensions are flattened: [s, b, K] rows are the same rows.
    x = torch.randn(5, 3, 128, generator=g).to(dtype)
    w = torch.randn(64, 128, generator=g).to(dtype)
    assert torch.equal(kernels.linear(x, w), kernels.linear(x.reshape(15, 128), w).reshape(5, 3, 64))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_bmm_row_has_the_same_bits_at_any_row_count_and_batch_count(dtype):
    """Attention's shapes: queries [B, M, head_dim] against keys [B, head_dim, W], probabilities [B, M, W] against
    values [B, W, head_dim]; M is 1-2 in a decode step and the width times the group size in training."""
    kernels = TiledCPUKernels()
    g = torch.Generator().manual_seed(1)
    for k, n in ((32, 48), (32, 128), (48, 32), (128, 32), (32, 512)):
        a0 = torch.randn(k, generator=g).to(dtype)
        b0 = torch.randn(k, n, generator=g).to(dtype)
        alone = kernels.bmm(a0.view(1, 1, k), b0[None])[0, 0]
        for batch in (1, 2, 7, 64):
            for m in (1, 2, 3, 4, 5, 17, 96):
                a = torch.randn(batch, m, k, generator=g).to(dtype)
                b = torch.randn(batch, k, n, generator=g).to(dtype)
                i, j = batch // 2, m - 1
                a[i, j], b[i] = a0, b0
                assert torch.equal(kernels.bmm(a, b)[i, j], alone), (k, n, batch, m)


def test_the_tiled_kernels_compute_the_same_products_as_torch():
    kernels = TiledCPUKernels()
    g = torch.Generator().manual_seed(2)
    x, w = (
        torch.randn(37, 128, generator=g, dtype=torch.float64),
        torch.randn(64, 128, generator=g, dtype=torch.float64),
    )
    torch.testing.assert_close(kernels.linear(x, w), x @ w.t())
    a, b = (
        torch.randn(3, 9, 16, generator=g, dtype=torch.float64),
        torch.randn(3, 16, 5, generator=g, dtype=torch.float64),
    )
    torch.testing.assert_close(kernels.bmm(a, b), a @ b)
    x.requires_grad_(True)
    kernels.linear(x, w).sum().backward()  # differentiable: the attention's training forward backpropagates
    torch.testing.assert_close(x.grad, w.sum(0).expand_as(x))


def test_tiles_below_four_rows_devices_without_verified_kernels_and_failed_checks_are_refused(monkeypatch):
    from tim_megatron.exact import kernels as kmod

    with pytest.raises(ValueError, match=r"TiledCPUKernels.attention_rows = 1: allowed >= 4"):
        TiledCPUKernels(attention_rows=1)
    with pytest.raises(ValueError, match=r"exact mode on cuda: no row-invariant kernels are verified"):
        kernels_for("cuda")
    # What a process without exact mode's MKL setting meets on a multi-threaded MKL (this pytest process may be one).
    monkeypatch.setattr(kmod, "invariance_problems", lambda kernels: ["float32 linear, K = 2048, N = 64"])
    with pytest.raises(RuntimeError, match=r"not row-invariant .*K = 2048.* Set MKL_CBWR=AUTO,STRICT"):
        kernels_for("cpu")


def test_the_kv_cache_writes_where_told_and_refuses_positions_past_its_width():
    cache = KVCache(rows=2, width=6)
    k = torch.arange(3 * 2 * 4, dtype=torch.float32).view(3, 2, 4)
    cache.write(0, torch.tensor([0, 1, cache.scratch]), torch.tensor([0, 5, 0]), k, -k)
    keys, values = cache.read(0, torch.tensor([1]))
    assert keys.shape == (1, 6, 2, 4) and torch.equal(keys[0, 5], k[1]) and torch.equal(values[0, 5], -k[1])
    assert keys[0, :5].abs().sum() == 0  # unwritten positions are zeros (masked, and finite: 0 * value = 0)
    assert cache.nbytes() == 2 * 3 * 6 * 2 * 4 * 4
    with pytest.raises(ValueError, match="position 6 outside the buffer width 6"):
        cache.write(0, torch.tensor([0]), torch.tensor([6]), k[:1], k[:1])


def test_the_invariant_kernels_patch_refuses_an_unknown_megatron_version(monkeypatch):
    import importlib.metadata as md

    from patches import guard
    from patches.megatron import invariant_kernels

    real = md.version
    monkeypatch.setattr(guard.md, "version", lambda d: "0.99.0" if d == "megatron-core" else real(d))
    with pytest.raises(guard.UnverifiedVersionError, match=r"megatron-invariant-kernels.*0\.99\.0"):
        invariant_kernels.apply(model=None, kernels=TiledCPUKernels())


def test_with_exact_modes_mkl_setting_the_tiles_are_invariant_at_wide_shapes_too():
    """At K >= 896 MKL may split one GEMM over its threads (a decode step's single tile); exact mode's MKL setting
    (tim train sets it, before the first GEMM) fixes the order of the sums. A fresh process with that setting and
    two threads: the wide-shape check kernels_for runs before a run finds nothing, and kernels_for returns."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tim_megatron.exact.kernels import CPU_ENV

    code = (
        "from tim_megatron.exact.kernels import TiledCPUKernels, invariance_problems, kernels_for\n"
        "print(invariance_problems(TiledCPUKernels(), seed=3)); kernels_for('cpu')\n"
    )
    env = {**os.environ, **CPU_ENV, "OMP_NUM_THREADS": "2"}
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "[]", res.stdout
