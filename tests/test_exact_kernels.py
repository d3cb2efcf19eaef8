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
    with pytest.raises(ValueError, match=r"exact mode on mps: no row-invariant kernels .*allowed: cpu, cuda"):
        kernels_for("mps")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"exact mode on cuda: torch sees no CUDA device"):
            kernels_for("cuda")
    # What a process without exact mode's MKL setting meets on a multi-threaded MKL (this pytest process may be one).
    monkeypatch.setattr(
        kmod, "invariance_problems", lambda kernels, **kw: ["float32 linear, K = 2048, N = 64"]
    )
    with pytest.raises(RuntimeError, match=r"not row-invariant .*K = 2048.* Set MKL_CBWR=AUTO,STRICT"):
        kernels_for("cpu")


ADMISSION_SCENARIO = """
import json
from dataclasses import dataclass

from tim_megatron.exact.kernels import PlainKernels, TiledCPUKernels, admit_kernels


@dataclass(frozen=True)
class Planted(TiledCPUKernels):
    name: str = "planted-fast"

    def elementwise(self, fn, x):  # an activation that rounds an odd-sized input through float64
        return fn(x.double()).to(x.dtype) if x.numel() % 2 else fn(x)


planted, tiles = Planted(), TiledCPUKernels()
out = {}
kernels, adm = admit_kernels("cpu", (planted, PlainKernels(), tiles))
out["fallback"] = [kernels is tiles, adm.chosen, [[n, len(c)] for n, c in adm.refused], adm.text()]
kernels, adm = admit_kernels("cpu", (tiles, planted))
out["first_passes"] = [kernels is tiles, adm.chosen, len(adm.refused)]
out["default"] = admit_kernels("cpu")[1].chosen
try:
    admit_kernels("cpu", (planted, PlainKernels()))
    out["none"] = "admitted"
except RuntimeError as e:
    out["none"] = str(e)
print(json.dumps(out))
"""


def test_a_planted_non_invariant_candidate_is_refused_and_the_run_falls_back_naming_it():
    """Issue 62, item 2: candidates are tried fastest first and admitted only when the device's own check passes (in
    a fresh process with exact mode's MKL setting, as tim train runs it); a refused one is named with its failing
    cases and the next is used. Measured, not assumed: torch's own CPU products (PlainKernels) fail the check here
    and the tiles pass it."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tim_megatron.exact.kernels import CPU_ENV

    env = {**os.environ, **CPU_ENV, "OMP_NUM_THREADS": "2"}
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run(
        [sys.executable, "-c", ADMISSION_SCENARIO], env=env, cwd=root, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    used_tiles, chosen, refused, text = out["fallback"]
    assert used_tiles and chosen == "cpu-tiled"
    assert [n for n, _ in refused] == ["planted-fast", "plain"] and all(k > 0 for _, k in refused)
    assert text.startswith("cpu-tiled on cpu (refused: planted-fast: ") and "; plain: " in text
    assert out["first_passes"] == [True, "cpu-tiled", 0] and out["default"] == "cpu-tiled"
    assert "not row-invariant" in out["none"]


def test_the_kv_cache_writes_where_told_reads_in_place_and_refuses_positions_past_its_width():
    cache = KVCache(rows=3, width=6, dtype=torch.float32)
    k = torch.arange(3 * 2 * 4, dtype=torch.bfloat16).view(3, 2, 4)
    # The third entry is padding (the scratch row): never stored.
    cache.write(0, torch.tensor([0, 1, cache.scratch]), torch.tensor([0, 5, 0]), k, -k)
    keys, values = cache.span(0, 1, 2)  # rows 1..2: [2 rows x 2 groups, width, head_dim]
    assert keys.shape == (4, 6, 4) and keys.dtype == torch.float32
    assert torch.equal(keys.view(2, 2, 6, 4)[0, :, 5], k[1].float()) and torch.equal(
        values.view(2, 2, 6, 4)[0, :, 5], -k[1].float()
    )
    assert (
        keys.view(2, 2, 6, 4)[0, :, :5].abs().sum() == 0
    )  # unwritten positions are zeros (masked, and finite)
    assert keys.data_ptr() == cache.keys[0][1].data_ptr()  # a view of the buffer, not a copy
    assert cache.read_bytes == 2 * 4 * 6 * 4 * 4 and cache.copied_bytes == 0
    assert cache.nbytes() == 2 * 3 * 2 * 6 * 4 * 4  # no scratch row allocated
    with pytest.raises(ValueError, match="position 6 outside the buffer width 6"):
        cache.write(0, torch.tensor([0]), torch.tensor([6]), k[:1], k[:1])


def test_a_finished_sequence_hands_its_slot_to_the_last_live_one_so_the_live_ones_stay_one_block():
    cache = KVCache(rows=3, width=4, dtype=torch.float32)
    k = torch.randn(3, 1, 2)
    cache.write(0, torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2]), k, 2 * k)
    before = cache.keys[0].clone()
    cache.release(0)  # sequence 2 (the last live slot) moves into slot 0
    assert cache.live == 2 and cache.slots(torch.tensor([0, 1, 2, 3])).tolist() == [-1, 1, 0, -1]
    assert torch.equal(cache.keys[0][0], before[2]) and torch.equal(cache.values[0][0], 2 * before[2])
    assert cache.copied_bytes == 2 * 1 * 4 * 2 * 4  # one row's keys and values, once
    cache.write(0, torch.tensor([2, 0]), torch.tensor([3, 3]), k[:2], k[:2])  # a released sequence: skipped
    assert torch.equal(cache.keys[0][0, :, 3], k[0]) and torch.equal(cache.keys[0][1], before[1])
    cache.release(1)  # the last live slot itself: nothing moves
    assert cache.live == 1 and cache.copied_bytes == 64
    with pytest.raises(ValueError, match="sequence 1 released twice"):
        cache.release(1)


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


class _PlantedDecode(TiledCPUKernels):
    """Tiled kernels whose attention products take another algorithm (float64, rounded) for a short query stack,
    as flash does for a one-token decode query on an H200."""

    def bmm(self, a, b):
        if a.shape[1] <= 16:
            return torch.bmm(a.double(), b.double()).to(a.dtype)
        return super().bmm(a, b)


def test_the_decode_check_catches_a_short_query_path_and_passes_the_tiled_kernels():
    from tim_megatron.exact.kernels import DECODE_POSITIONS, decode_attention_problems

    assert decode_attention_problems(TiledCPUKernels()) == []
    found = decode_attention_problems(_PlantedDecode())
    # float32: every position but 0 (one key: a single product, the same in float64), and the two-query stack; in
    # bfloat16 the rounding of the scores and outputs may absorb the float64 path.
    assert found and found[0].startswith("float32 decode attention"), found
    assert str([*DECODE_POSITIONS[1:], (5, 6)]) in found[0], found


class _PlantedActivation(TiledCPUKernels):
    """Tiled kernels with one non-invariant op planted: an elementwise op computed in float64 (and rounded) on
    tensors of more than 1,024 elements, as a kernel that picks another algorithm for large inputs would."""

    def elementwise(self, fn, x):
        if x.numel() > 1024:
            return fn(x.double()).to(x.dtype)
        return super().elementwise(fn, x)


def test_the_self_check_fails_on_a_planted_non_invariant_activation_and_reduction_and_passes_the_tiled_kernels():
    from tim_megatron.exact.kernels import CHECK_THREADS, elementwise_problems, reduction_problems

    assert elementwise_problems(TiledCPUKernels(), threads=CHECK_THREADS) == []
    planted = elementwise_problems(_PlantedActivation(), threads=(1, 4))
    assert any("float32 silu" in p for p in planted), planted
    assert reduction_problems(TiledCPUKernels(), threads=CHECK_THREADS) == []
    # A lone row of 49,999 entries summed over 2+ threads: ATen's two-pass reduction (measured on every CPU here).
    lone = reduction_problems(TiledCPUKernels(min_rows=1), threads=(2, 4, 8))  # no padding
    assert lone and all("one row" in p for p in lone), lone


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("threads", [1, 2, 4, 8])
def test_an_activation_row_has_the_same_bits_alone_and_among_many_at_any_thread_count(dtype, threads):
    """What broke exact mode at 4 threads: an expert's SiLU over a tensor split between threads at an offset that
    is no multiple of the vector width. Odd widths, the gated MLP's strided half, and row counts past the split."""
    from tim_megatron.exact.kernels import ACTIVATIONS, torch_threads

    kernels = TiledCPUKernels()
    g = torch.Generator().manual_seed(5)
    for width in (1, 7, 33, 48, 64, 100):
        for rows in (1, 3, 700, 5000):
            x = (torch.randn(rows, 2 * width, generator=g) * 4).to(dtype)[:, :width]
            probe = torch.unique(torch.tensor([0, rows // 3, rows // 2, rows - 1]))
            for name, fn in ACTIVATIONS.items():
                with torch_threads(threads):
                    full = kernels.elementwise(fn, x)
                    alone = torch.stack([kernels.elementwise(fn, x[r : r + 1])[0] for r in probe])
                assert full.shape == x.shape and full.dtype == dtype
                assert torch.equal(full[probe], alone), (name, width, rows)
                torch.testing.assert_close(
                    full, fn(x), rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5
                )


def test_the_head_pads_a_one_row_chunk_so_its_cross_entropy_is_the_same_row_among_others(one_rank):
    """``trainer.logprob_chunk = 1`` at a vocabulary of 65,536: the chunk's lone row is padded to the kernels'
    ``min_rows`` before megatron-core's cross-entropy (its one-row sum would be split over the threads)."""
    from tim_megatron.exact.kernels import torch_threads
    from tim_megatron.trainer.logprobs import HeadSpec, cross_entropy

    spec = HeadSpec(kernels=TiledCPUKernels())
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(6, 1, 65_536, generator=g) * 3
    targets = torch.randint(0, 65_536, (6, 1), generator=g)
    for threads in (1, 2, 4, 8):
        with torch_threads(threads):
            together = cross_entropy(logits.clone(), targets, spec)
            alone = torch.cat(
                [cross_entropy(logits[i : i + 1].clone(), targets[i : i + 1], spec) for i in range(6)]
            )
        assert together.shape == (6, 1) and torch.equal(alone, together), threads
    stock = cross_entropy(logits.clone(), targets, HeadSpec())
    torch.testing.assert_close(stock, together)
    x = logits[:1].clone().requires_grad_(True)  # differentiable through the padding (the training forward's)
    cross_entropy(x * 1.0, targets[:1], spec).sum().backward()
    assert x.grad.shape == x.shape and torch.isfinite(x.grad).all()


def test_the_cuda_tiles_run_every_gemm_as_calls_of_the_same_shape_and_compute_torchs_products(monkeypatch):
    """TiledCUDAKernels' code path, on this CPU: every bmm call holds exactly ``tiles_per_call`` tiles (zero tiles
    added below, the last call overlapping above), so a row's tile always goes through the same call shape."""
    from tim_megatron.exact.kernels import TiledCUDAKernels

    kernels = TiledCUDAKernels()
    shapes = []
    real = torch.bmm

    def bmm(a, b):
        shapes.append(tuple(a.shape))
        return real(a, b)

    g = torch.Generator().manual_seed(7)
    w = torch.randn(48, 64, generator=g, dtype=torch.float64)
    for m in (1, 31, 33, 255, 257, 600):
        x = torch.randn(m, 64, generator=g, dtype=torch.float64)
        shapes.clear()
        monkeypatch.setattr(torch, "bmm", bmm)
        y = kernels.linear(x, w)
        monkeypatch.setattr(torch, "bmm", real)
        assert set(shapes) == {(8, 32, 64)}, (m, shapes)
        torch.testing.assert_close(y, x @ w.t())
        assert torch.equal(kernels.linear(x[-1:], w)[0], y[-1])


def test_padding_entries_neither_enter_the_cache_nor_deepen_any_sequences_attention():
    """Under EP every rank decodes as many entries as the busiest one: the rest are padding (row ``scratch``).
    They are not stored, their outputs are zero, and the real entries' query stacks stay one row per head deep
    (the former scratch row took them all, and its count set every sequence's depth)."""
    import types

    from patches.megatron import invariant_kernels as ik

    class Recording(TiledCPUKernels):
        def bmm(self, a, b):
            shapes.append(tuple(a.shape))
            return super().bmm(a, b)

    heads, groups, hn, width = 4, 2, 8, 16
    cache = KVCache(rows=3, width=width, dtype=torch.float32)
    g = torch.Generator().manual_seed(8)

    def step(rows, positions):
        n = len(rows)
        module = types.SimpleNamespace(_tim_kernels=Recording(), softmax_scale=hn**-0.5)
        module._tim_decode = ik._Decode(
            cache=cache, layer=0, rows=torch.tensor(rows), positions=torch.tensor(positions)
        )
        q = torch.randn(n, 1, heads, hn, generator=g)
        kv = torch.randn(2, n, 1, groups, hn, generator=g)
        return q, kv, ik._attention_forward(module, q, kv[0], kv[1], attention_mask=None)

    shapes: list = []
    step([0, 1, 2], [0, 0, 0])  # prefill one position per sequence
    shapes.clear()
    pad = cache.scratch
    _q, _kv, out = step([0, 2] + [pad] * 30, [1, 1] + [0] * 30)
    assert out.shape == (32, 1, heads * hn) and out[2:].abs().sum() == 0  # padding outputs: zero
    assert (
        int(cache.keys[0][:, :, 0].abs().sum(-1).gt(0).sum()) == 3 * groups
    )  # only the 3 real entries stored
    per = heads // groups
    # Sequences 0..2 in the block (1 has no entry this step), one query row per head each: depth 1.
    assert shapes[0][1] == per * 1 and shapes[0][0] == 3 * groups, shapes


def _sigmoid_router(
    *, experts: int = 8, topk: int = 2, groups: int | None = None, group_topk: int | None = None
):
    """megatron-core's TopKRouter as GLM-4.5 (groups None) and DeepSeek-V3 (grouped) configure it: sigmoid scores,
    a score-correction bias, float32 routing, renormalized top-k, routed scaling."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.router import TopKRouter

    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_router_topk_scaling_factor=2.5,
        moe_router_num_groups=groups,
        moe_router_group_topk=group_topk,
        use_cpu_initialization=True,
    )
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp", "tp_cp", "tp_dp_cp"])
    router = TopKRouter(cfg, pg_collection=pgs)
    with torch.no_grad():
        router.expert_bias.copy_(torch.linspace(-0.05, 0.05, experts))
    return router


@pytest.mark.parametrize(("groups", "group_topk"), [(None, None), (4, 2)], ids=["glm", "grouped"])
def test_a_sigmoid_routers_probabilities_for_a_token_are_the_same_bits_alone_and_among_many(
    one_rank, groups, group_topk
):
    """torch's float32 sigmoid gives an element other bits on its scalar tail path than on its vector path, so with
    the stock router a token's routing probabilities can differ alone (8 scores: all on the tail) and among 255
    others (2 of 86 rows on AMD EPYC; how many depends on the CPU, so this test does not count them). Exact mode's
    routing takes the sigmoid from ``ExactKernels.elementwise``: a planted elementwise op that depends on the
    tensor's size shows through in the probabilities, and with the tiled kernels a row's probabilities are the same
    alone and among others at any thread count; the gradient is the stock sigmoid's."""
    from patches.megatron import invariant_kernels
    from tim_megatron.exact.kernels import torch_threads

    router = _sigmoid_router(topk=4 if groups else 2, groups=groups, group_topk=group_topk)
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(256, 1, 8, generator=g) * 3

    def rows_differing() -> int:
        with torch.no_grad():
            together, map_all = router.routing(logits)
            bad = 0
            for i in range(0, 256, 3):
                alone, map_one = router.routing(logits[i : i + 1])
                bad += int(not (torch.equal(alone[0], together[i]) and torch.equal(map_one[0], map_all[i])))
        return bad

    class Planted(TiledCPUKernels):
        def elementwise(self, fn, x):
            return fn(x) + 1e-7 * x.numel()  # not elementwise: a row alone gets other bits

    invariant_kernels.route_router(router, Planted())
    assert rows_differing() == 86  # every row: the router's sigmoid is the kernels' op
    invariant_kernels.route_router(router, TiledCPUKernels())
    for threads in (1, 2, 4, 8):
        with torch_threads(threads):
            assert rows_differing() == 0, threads
    x = logits.clone().requires_grad_(True)
    probs, _ = router.routing(x)
    (probs * torch.arange(8.0)).sum().backward()
    ref = logits.clone().requires_grad_(True)
    ref_probs, _ = type(router).routing(router, ref)
    (ref_probs * torch.arange(8.0)).sum().backward()
    torch.testing.assert_close(probs, ref_probs)
    torch.testing.assert_close(x.grad, ref.grad)


def test_widened_weights_are_kept_only_inside_a_held_span_and_per_dtype():
    """A held pass widens each 16-bit weight parameter once per dtype; outside it (and for a tensor that is not a
    parameter, or with gradients on) every call converts afresh, so no copy outlives an optimizer step."""
    from tim_megatron.exact.kernels import WideWeights

    wide = WideWeights()
    w = torch.nn.Parameter(torch.randn(4, 3).bfloat16())
    assert not wide.holding and wide.of(w, torch.float32) is not wide.of(w, torch.float32)
    with torch.no_grad(), wide.held():
        assert wide.holding
        first = wide.of(w, torch.float32)
        assert wide.of(w, torch.float32) is first and torch.equal(first, w.float())
        assert wide.of(w, torch.float64).dtype == torch.float64  # another dtype, another copy
        with wide.held():  # nested: the outer span's copies stay
            assert wide.of(w, torch.float32) is first
        assert wide.holding
        plain = w.detach().clone()
        assert wide.of(plain, torch.float32) is not wide.of(plain, torch.float32)
        assert wide.of(first, torch.float32) is first  # already that dtype: as it is
    assert not wide.holding and wide.of(w, torch.float32) is not first
    with wide.held():  # gradients on: a differentiable conversion, never a kept copy
        out = wide.of(w, torch.float32)
        assert out.requires_grad and out is not wide.of(w, torch.float32)


def test_the_combine_is_fixed_order_on_a_gpu_and_as_it_is_on_a_cpu():
    """megatron-core's ``unpermute`` adds a token's top-k expert outputs by ``scatter_add_``: in index order on a
    CPU, by atomics on a GPU (on an H200 five runs over the same inputs gave other bits). Exact mode's combine turns
    torch's deterministic algorithms on for the call when the tokens are on a GPU (``index_add_`` in the sorted
    indices' order), restores the setting after it, also when the call raises, and leaves a CPU call as it is."""
    from patches.megatron.invariant_kernels import _fixed_order

    seen = []

    def unpermute(tokens, *args, fail=False, **kwargs):
        seen.append(torch.are_deterministic_algorithms_enabled())
        if fail:
            raise RuntimeError("planted")
        return tokens

    class OnGPU:
        is_cuda = True

    call = _fixed_order(unpermute)
    assert not torch.are_deterministic_algorithms_enabled()
    call(OnGPU())
    call(torch.zeros(2))
    with pytest.raises(RuntimeError, match="planted"):
        call(OnGPU(), fail=True)
    assert seen == [True, False, True]
    assert not torch.are_deterministic_algorithms_enabled()


def test_each_dispatchers_combine_goes_through_the_fixed_order_call_and_a_token_combines_alone_as_among_many(
    one_rank,
):
    """The all-gather dispatcher's combine is a copy of megatron-core's own method with ``unpermute`` resolved to
    the fixed-order call (the class is untouched); through it a token's top-8 combine gives the same bits alone and
    among 64 tokens; a fused unpermute is refused."""
    import copy

    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    from patches.megatron import invariant_kernels

    kw = dict(num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_router_topk=8)
    cfg = TransformerConfig(**kw, use_cpu_initialization=True)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    d = MoEAllGatherTokenDispatcher(8, list(range(8)), cfg, pg_collection=pgs)
    invariant_kernels.route_combine(d)
    routed = d.__dict__["combine_preprocess"]
    assert routed.__func__.__code__ is MoEAllGatherTokenDispatcher.combine_preprocess.__code__
    assert routed.__func__.__globals__["unpermute"]._tim_fixed_order
    stock = MoEAllGatherTokenDispatcher.combine_preprocess.__globals__["unpermute"]
    assert not hasattr(stock, "_tim_fixed_order")  # megatron-core's module is as it was
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(64, 1, 64, generator=g).bfloat16()
    probs = torch.rand(64, 8, generator=g)
    routing_map = torch.ones(64, 8, dtype=torch.bool)

    def combine(rows: slice) -> torch.Tensor:
        h, p = d.dispatch_preprocess(hidden[rows], routing_map[rows], probs[rows])
        h, p = d.token_dispatch(h, p)
        permuted, _counts, _probs = d.dispatch_postprocess(h, p)
        expert_out = permuted * 1.5 + 0.25  # any per-row expert
        return d.combine_postprocess(d.token_combine(d.combine_preprocess(expert_out)))

    together = combine(slice(0, 64))
    for i in (0, 17, 63):
        assert torch.equal(combine(slice(i, i + 1))[0], together[i])
    fused = MoEAllGatherTokenDispatcher(8, list(range(8)), cfg, pg_collection=pgs)
    fused.config = copy.copy(cfg)  # megatron-core validates the flag only with transformer-engine installed
    fused.config.moe_permute_fusion = True
    with pytest.raises(ValueError, match="moe_permute_fusion"):
        invariant_kernels.route_combine(fused)
