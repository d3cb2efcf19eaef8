"""Row-invariant kernels: the one interface exact mode's forward needs from a device.

Exact mode (``diagnostics.vexact: exact``) needs a token's logprob to come out bit for bit the same whether the
token is computed inside the training forward (every position of a micro-batch at once, ``M = width x rows``
GEMM rows) or inside a cached decode step (one new position per sequence, ``M = rows``). Stock GEMMs do not give
that: on a 2-core AMD EPYC VM (torch 2.13 CPU), ``make bench``'s ``exact`` probe found 15 of 1,586 float32
``linear`` rows and 16 of 33,280 float32 ``bmm`` rows with other bits at another row count (bfloat16: none).

What does hold, measured the same way, is the fixed-shape invariance: at a FIXED GEMM shape a row's bits depend
only on that row (not on the other rows' values or its place among them), and ``bmm`` treats each batch element
on its own. :class:`TiledCPUKernels` builds every product out of fixed-shape tiles: the rows are zero-padded to a
multiple of ``R`` and each tile of ``R`` rows is one ``[R, K] x [K, N]`` GEMM of a ``bmm``. A row's result is then
the same for any row count, any neighbours and any batch: 0 rows differ in the bench's probe, and 0 of 4,140
linear rows and 0 of 1,196 ``bmm`` rows differed in a wider one at ``R = 4 .. 32``, float32 and bfloat16 (at
``R = 1``, float32 ``bmm`` took a GEMV path and 185 of 1,174 differed, so ``R >= 4``).
``tests/test_exact_kernels.py`` checks the property on every run (and fails on the stock float32 kernels here).

One more condition: MKL may split a single GEMM's reduction over its threads when one tile is all there is (a
decode step's few rows against ``K >= 896``), which changes the order of the sums; several tiles run one per
thread. MKL's conditional-numerical-reproducibility mode fixes the order whatever the split
(``MKL_CBWR=AUTO,STRICT``, read at the process's first GEMM: :func:`pin_cpu_reductions`, which ``tim train`` calls
in exact mode before anything runs). bfloat16 and float16 GEMMs go through oneDNN, which that mode does not reach,
so the tiles compute them in float32 and round the result. :func:`kernels_for` checks the invariance at a wide
shape before a run starts and stops with the fix when it does not hold.

Elementwise ops are not row-invariant as torch runs them: ATen computes a contiguous run of elements on the SIMD
path and the run's last ``len % (2 x vector width)`` elements on a scalar path, and a tensor of 32,768 elements or
more (its ``GRAIN_SIZE``) is cut into one run per thread at offsets that are not multiples of the vector width.
SiLU's, sigmoid's and GELU's two paths disagree in the last bit on a few percent of inputs (exp's, log's and
rsqrt's agree on the CPUs measured), so a row's activations depended on its place in the tensor and on the thread
count. :meth:`TiledCPUKernels.elementwise` runs such an op on a flat copy padded to a multiple of
:data:`VECTOR_SPAN` elements, in calls of :data:`ELEMENTWISE_BLOCK` elements: each call runs on one thread and
every element on the SIMD path, so an element's bits depend only on its value.

Row reductions (norms, softmax, the head's cross-entropy) keep each row on one thread when the reduction has two
rows or more; a lone row of 32,768 entries or more is split over the threads (ATen's two-pass reduction), so the
head pads a chunk to :attr:`TiledCPUKernels.min_rows` rows (``trainer/logprobs.py``).

:func:`invariance_problems` checks all of it at 1, 2, 4 and 8 threads, at odd widths and large row counts, and a
one-token decode query against its row of a full causal pass, before a run starts. On CUDA,
:class:`TiledCUDAKernels` runs the same tiles in full float32, every GEMM as ``bmm`` calls of one fixed shape;
:func:`kernels_for` returns them only when the same checks pass on the device (never yet run on a GPU:
``docs/exact-mode.md``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

CPU_ENV = {"MKL_CBWR": "AUTO,STRICT"}
"""MKL's strict reproducibility mode: a GEMM's sums in one order whatever its threads do."""


def pin_cpu_reductions() -> None:
    """Set :data:`CPU_ENV` (unless set): call before the process's first GEMM, where MKL reads it."""
    for key, value in CPU_ENV.items():
        os.environ.setdefault(key, value)


VECTOR_SPAN = 64
"""Elements ATen's vectorised elementwise loop takes per iteration at most (two 512-bit vectors of 16-bit values):
a run whose length is a multiple of it has no scalar tail."""

ELEMENTWISE_BLOCK = 256 * VECTOR_SPAN
"""Elements per call of an invariant elementwise op: below ATen's ``GRAIN_SIZE`` (32,768), so one thread runs it."""

CHECK_THREADS = (1, 2, 4, 8)
"""Thread counts :func:`invariance_problems` runs its elementwise and reduction probes at (and the process's own)."""

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "gelu": F.gelu,
    "exp": torch.exp,
}
"""The elementwise ops the self-check probes (the activations exact mode routes, and the head's exp)."""


class WideWeights:
    """The compute-dtype copies of 16-bit weight parameters, kept only inside :meth:`held`.

    A tile computes a bfloat16 product in float32 (:func:`_wide`), so without this each call widens its weight
    again: a decode step widens every weight of the model once more per generated token. Inside :meth:`held` the
    caller promises the weights do not change (a rollout, an old-logprob pass, one minibatch's forward and
    backward before its optimizer step), and each parameter is widened once; outside it nothing is kept, so no
    copy can outlive an update. Only ``nn.Parameter`` weights are kept (a tensor made for one call is not)."""

    def __init__(self) -> None:
        self._copies: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def holding(self) -> bool:
        """Inside :meth:`held`: a weight must not change (the trainer's optimizer step refuses to run)."""
        return self._copies is not None

    @contextmanager
    def held(self) -> Iterator[None]:
        """Keep copies until the outermost ``held`` exits (nesting is allowed)."""
        if self._copies is not None:
            yield
            return
        self._copies = {}
        try:
            yield
        finally:
            self._copies = None

    def of(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``weight`` in ``dtype``: the kept copy inside :meth:`held`, a fresh one outside."""
        if weight.dtype == dtype:
            return weight
        if self._copies is None or not isinstance(weight, torch.nn.Parameter) or torch.is_grad_enabled():
            return weight.to(dtype)  # differentiable, as :meth:`ExactKernels.linear` promises
        key = (id(weight), dtype)
        kept = self._copies.get(key)
        if kept is None or kept[0] is not weight:
            kept = self._copies[key] = (weight, weight.detach().to(dtype))
        return kept[1]


class ExactKernels(Protocol):
    """Products whose every output row depends only on its own input row (and the other operand)."""

    name: str
    min_rows: int
    """Row reductions (the head's cross-entropy) are given at least this many rows."""
    wide: WideWeights
    """Widened weights, kept while the caller holds them fixed (:meth:`WideWeights.held`)."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x [..., K] @ weight[N, K]^T -> [..., N]``; differentiable."""
        ...

    def bmm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a [B, M, K] @ b [B, K, N] -> [B, M, N]``; row ``(i, m)`` depends only on ``a[i, m]`` and ``b[i]``."""
        ...

    def softmax(self, x: torch.Tensor) -> torch.Tensor:
        """Softmax over the last dimension, each row on its own."""
        ...

    def elementwise(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``fn`` (an elementwise op) of ``x``, each element's bits depending only on its value; not differentiable."""
        ...

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the products compute operands of ``dtype`` in (the KV cache stores keys and values in it)."""
        ...


@dataclass(frozen=True)
class TiledCPUKernels:
    """Fixed-shape tiles of ``linear_rows`` (GEMMs) and ``attention_rows`` (attention's ``bmm``) rows."""

    linear_rows: int = 32
    """Rows per GEMM tile of :meth:`linear` (a decode step pads its rows up to a multiple of this)."""
    attention_rows: int = 4
    """Rows per tile of :meth:`bmm` (a decode step's single query per head is padded to this)."""
    min_rows: int = 2
    """Rows a row reduction is given at least: a lone row of 32,768 entries or more is split over threads."""
    name: str = "cpu-tiled"
    wide: WideWeights = field(default_factory=WideWeights, compare=False, repr=False)
    """The float32 copies of 16-bit weights a held pass reuses (:class:`WideWeights`)."""

    def __post_init__(self):
        for key in ("linear_rows", "attention_rows"):
            if getattr(self, key) < 4:
                raise ValueError(
                    f"TiledCPUKernels.{key} = {getattr(self, key)}: allowed >= 4 (below, GEMV paths)"
                )

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        n = weight.shape[0]
        rows = x.reshape(-1, k)
        m, r = rows.shape[0], self.linear_rows
        if m == 0:
            return x.new_zeros(*lead, n)
        tiles = self._tile_count(-(-m // r))
        padded = _padded(rows, tiles * r, _wide(x.dtype)).view(tiles, r, k)
        out = self._tile_products(padded, self.wide.of(weight, padded.dtype).t())
        return out.reshape(tiles * r, n)[:m].reshape(*lead, n).to(x.dtype)

    def _tile_count(self, tiles: int) -> int:
        """How many tiles ``tiles`` tiles of rows are computed as (more, zero, on a device that needs it)."""
        return tiles

    def _tile_products(self, tiles: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``tiles [T, R, K] @ w [K, N]``, each tile one GEMM (``w`` expanded over the tiles, never copied)."""
        return self._batch_products(tiles, w.unsqueeze(0).expand(tiles.shape[0], *w.shape))

    def bmm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        batch, m, _k = a.shape
        r = self.attention_rows
        tiles = -(-m // r)
        wide = _wide(a.dtype)
        padded = _padded(a, tiles * r, wide, dim=1)
        b = b.to(wide)
        # One bmm per tile, over the whole batch: b is never copied per tile.
        parts = [self._batch_products(padded[:, t * r : (t + 1) * r], b) for t in range(tiles)]
        return torch.cat(parts, 1)[:, :m].to(a.dtype) if parts else a.new_zeros(batch, 0, b.shape[-1])

    def _batch_products(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a [B, R, K] @ b [B, K, N]``: one ``bmm`` (each batch element computed on its own, measured on CPUs)."""
        return torch.bmm(a, b)

    def softmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)

    def elementwise(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1)
        n = flat.numel()
        padded = -(-n // VECTOR_SPAN) * VECTOR_SPAN
        if padded != n:
            flat = F.pad(flat, (0, padded - n))
        out = torch.empty_like(flat)
        for start in range(0, padded, ELEMENTWISE_BLOCK):
            out[start : start + ELEMENTWISE_BLOCK] = fn(flat[start : start + ELEMENTWISE_BLOCK])
        return out[:n].view(x.shape)

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return _wide(dtype)


def _padded(x: torch.Tensor, count: int, dtype: torch.dtype, *, dim: int = 0) -> torch.Tensor:
    """``x`` in ``dtype``, zero-padded along ``dim`` to ``count``: one contiguous buffer, one converting copy."""
    m = x.shape[dim]
    if m == count:
        return x.to(dtype)
    shape = list(x.shape)
    shape[dim] = count
    out = x.new_empty(shape, dtype=dtype)
    out.narrow(dim, 0, m).copy_(x)
    out.narrow(dim, m, count - m).zero_()
    return out


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype the tiles compute in: float32 for the 16-bit types (oneDNN's GEMMs, outside MKL's strict mode)."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


@dataclass(frozen=True)
class TiledCUDAKernels(TiledCPUKernels):
    """The same fixed-shape tiles on a CUDA device, in full float32 (no TF32, no reduced-precision reductions:
    :func:`pin_cuda_reductions`). A CUDA elementwise kernel runs the same code on every element whatever its place,
    so :meth:`elementwise` is the op itself; the self-check holds every claim to a measurement on the device
    before a run (``docs/exact-mode.md``). Not yet run on a GPU: :func:`kernels_for` returns it only when
    :func:`invariance_problems` and :func:`decode_attention_problems` find nothing there."""

    tiles_per_call: int = 8
    """GEMM tiles, and attention batch elements, per ``bmm`` call: always exactly this many (zeros added, or the
    last call overlapping the one before). cuBLAS picks its algorithm by the batch count too: an H200's float32
    tiles gave a row other bits at 1 tile than among 8."""
    name: str = "cuda-tiled"

    def elementwise(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return fn(x)

    def _tile_count(self, tiles: int) -> int:
        return max(tiles, self.tiles_per_call)

    def _batch_products(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``bmm`` calls of exactly ``tiles_per_call`` batch elements, GEMM tiles (:meth:`_tile_count` gives a linear
        at least that many) and attention's alike: the last call overlaps the one before (same shape, same bits
        for what it redoes); a smaller batch is zero-padded (a copy of fewer than that many elements of ``b``)."""
        g, count = self.tiles_per_call, a.shape[0]
        if count < g:
            a, b = pad_rows(a, g), pad_rows(b, g)
        out = a.new_empty(a.shape[0], a.shape[1], b.shape[2])
        for start in range(0, a.shape[0], g):
            first = min(start, a.shape[0] - g)
            out[first : first + g] = torch.bmm(a[first : first + g], b[first : first + g])
        return out[:count]


_CUDA_PRECISION = (
    (torch.backends.cuda.matmul, "allow_tf32"),
    (torch.backends.cudnn, "allow_tf32"),
    (torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction"),
    (torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction"),
)
"""torch's CUDA settings that let a product round below float32 (TF32, 16-bit reductions)."""


def pin_cuda_reductions() -> None:
    """Full float32 products on CUDA: every :data:`_CUDA_PRECISION` setting off, for the whole process (exact
    mode's tiles compute 16-bit operands in float32; TF32 would round them again, by shape)."""
    for owner, name in _CUDA_PRECISION:
        setattr(owner, name, False)


@contextmanager
def cuda_reductions_pinned() -> Iterator[None]:
    """:func:`pin_cuda_reductions` for the block only (``make gpu-check``'s exact section)."""
    saved = [getattr(owner, name) for owner, name in _CUDA_PRECISION]
    pin_cuda_reductions()
    try:
        yield
    finally:
        for (owner, name), value in zip(_CUDA_PRECISION, saved, strict=True):
            setattr(owner, name, value)


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zeros appended along its first dimension up to ``rows`` (as it is when it has as many)."""
    return _padded(t, rows, t.dtype) if rows > t.shape[0] else t


def attend(kernels: ExactKernels, q, k, v, masked, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Scaled dot-product attention of ``q [B, Mq, hn]`` over ``k, v [B, W, hn]``; ``masked [B or 1, Mq, W]``
    (True: excluded); the probabilities rounded to the model's ``dtype``. The training forward and the decode step
    (whose cached keys and values may be stored wider) both run it, so both compute a row the same way."""
    scores = kernels.bmm(q, k.transpose(1, 2)) * scale
    scores = scores.float().masked_fill(masked, float("-inf"))
    probs = kernels.softmax(scores).to(dtype)
    return kernels.bmm(probs, v)


class PlainKernels:
    """torch's own products, untiled: the contrast :func:`invariance_problems` is read against (not exact)."""

    name: str = "plain"
    min_rows: int = 1

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)

    def bmm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.bmm(a, b)

    def softmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)

    def elementwise(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return fn(x)

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype


@dataclass(frozen=True)
class CUDANativeKernels(PlainKernels):
    """torch's own products on CUDA in the model's dtype (cuBLAS, no tiles): the fast candidate, used only where
    the device's check admits it (:func:`admit_kernels`)."""

    name: str = "cuda-native"
    min_rows: int = 1
    wide: WideWeights = field(default_factory=WideWeights, compare=False, repr=False)


PRODUCT_CHECKS = 8
"""How many (dtype, product, shape) cases :func:`invariance_problems` tries."""

ELEMENTWISE_WIDTHS = (37, 96)
"""Row widths of the elementwise probe: an odd one (a lone row ends in a scalar tail) and one whose 1,500 rows
span 144,000 elements (split over every thread count)."""

REDUCTION_WIDTHS = (49_999, 65_536)
"""Vocabulary sizes of the reduction probe: wide enough for ATen to split a lone row over its threads."""


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` intra-op threads (restored after)."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _probe_rows(rows: int, width: int, threads: int) -> list[int]:
    """The rows a thread split cuts (ATen splits ``rows x width`` elements into ``threads`` equal runs), plus the
    first, the last and a few in between."""
    numel, chunk = rows * width, -(-rows * width // threads)
    cut = {min(rows - 1, (j * chunk) // width) for j in range(1, threads) if j * chunk < numel}
    return sorted(cut | {0, rows - 1, rows // 3, rows // 2, (2 * rows) // 3})


def product_problems(
    kernels: ExactKernels, *, seed: int = 0, device: torch.device | str = "cpu"
) -> list[str]:
    """Where ``kernels`` give a GEMM or attention row other bits alone than among many, at shapes wide enough for
    MKL to split one GEMM over its threads (a decode step's), float32 and bfloat16, on ``device``."""
    g = torch.Generator().manual_seed(seed)
    found = []
    for dtype in (torch.float32, torch.bfloat16):
        for k, n in ((2048, 64), (1024, 1536)):
            x = torch.randn(256, k, generator=g).to(device, dtype)
            w = torch.randn(n, k, generator=g).to(device, dtype)
            if not torch.equal(kernels.linear(x[:1], w)[0], kernels.linear(x, w)[0]):
                found.append(f"{str(dtype)[6:]} linear, K = {k}, N = {n}")
        p = torch.softmax(torch.randn(16, 64, 2048, generator=g), -1).to(device, dtype)
        v = torch.randn(16, 2048, 64, generator=g).to(device, dtype)
        if not torch.equal(kernels.bmm(p[:1, :1], v[:1])[0, 0], kernels.bmm(p, v)[0, 0]):
            found.append(f"{str(dtype)[6:]} bmm over 2048 keys, 1 row of 1 batch vs 64 rows of 16")
        scores = torch.randn(256, 2048, generator=g).to(device, dtype)
        if not torch.equal(kernels.softmax(scores[:1])[0], kernels.softmax(scores)[0]):
            found.append(f"{str(dtype)[6:]} softmax over 2048")
    return found


def elementwise_problems(
    kernels: ExactKernels, *, threads: tuple[int, ...], seed: int = 0, device: torch.device | str = "cpu"
) -> list[str]:
    """Where :meth:`ExactKernels.elementwise` gives a row's elements other bits alone than inside a tensor of 1,500
    rows (contiguous, and as the strided half a gated MLP takes), for each op of :data:`ACTIVATIONS`, float32
    and bfloat16, at each thread count."""
    g = torch.Generator().manual_seed(seed)
    found = []
    rows = 1500
    for dtype in (torch.float32, torch.bfloat16):
        for width in ELEMENTWISE_WIDTHS:
            both = (torch.randn(rows, 2 * width, generator=g) * 4).to(device, dtype)
            gated = both[:, :width]  # a view: torch.chunk(x, 2, -1)[0] in megatron's gated MLP
            plain = gated.contiguous()
            for name, fn in ACTIVATIONS.items():
                for t in threads:
                    with torch_threads(t):
                        bad = [
                            r
                            for x in (plain, gated)
                            for full in (kernels.elementwise(fn, x),)
                            for r in _probe_rows(rows, width, t)
                            if not torch.equal(kernels.elementwise(fn, x[r : r + 1])[0], full[r])
                        ]
                    if bad:
                        found.append(f"{str(dtype)[6:]} {name}, width {width}, {t} threads (rows {bad[:4]})")
    return found


def _sum_of_exp(kernels: ExactKernels, x: torch.Tensor) -> torch.Tensor:
    """The head's reduction (the cross-entropy's sum of exponentials), on at least ``kernels.min_rows`` rows."""
    return torch.exp(pad_rows(x, kernels.min_rows)).sum(-1)[: x.shape[0]]


def reduction_problems(
    kernels: ExactKernels, *, threads: tuple[int, ...], seed: int = 0, device: torch.device | str = "cpu"
) -> list[str]:
    """Where the head's row reduction (given ``kernels.min_rows`` rows) gives a lone row other bits than the same
    row among 64 (a device may pick its split by the number of rows), float32, at vocabularies a lone row is split
    at, at each thread count."""
    g = torch.Generator().manual_seed(seed)
    found = []
    for vocab in REDUCTION_WIDTHS:
        x = (torch.randn(64, vocab, generator=g) * 3).to(device)
        for t in threads:
            with torch_threads(t):
                if not torch.equal(_sum_of_exp(kernels, x[:1])[0], _sum_of_exp(kernels, x)[0]):
                    found.append(f"float32 sum of exp over {vocab}, one row vs 64, {t} threads")
    return found


DECODE_POSITIONS = (0, 1, 7, 63, 64, 127, 200, 255)
"""Positions of :func:`decode_attention_problems`'s one-token queries, in a causal pass of 256 (the H200 measured
flash's short queries off at 64, 127, 511, 2047 and 4095 of 4096)."""


def decode_attention_problems(
    kernels: ExactKernels, *, seed: int = 0, device: torch.device | str = "cpu"
) -> list[str]:
    """The teacher-forced decode check: a one-token query at each of :data:`DECODE_POSITIONS` (and a two-query
    prefill stack) over the same keys must give the bits of its row of the full causal pass, float32 and bfloat16,
    8 heads of a key/value group stacked as rows as exact mode's attention stacks them."""
    g = torch.Generator().manual_seed(seed)
    width, hn, per = 256, 64, 8
    found = []
    causal = torch.ones(width, width, dtype=torch.bool).triu(1)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(1, per * width, hn, generator=g).to(device, dtype)
        k = torch.randn(1, width, hn, generator=g).to(device, dtype)
        v = torch.randn(1, width, hn, generator=g).to(device, dtype)
        full_mask = causal.repeat(per, 1).view(1, per * width, width).to(device)
        full = attend(kernels, q, k, v, full_mask, hn**-0.5, dtype).view(per, width, hn)
        kc, vc = k, v  # the cache stores them in the model's dtype, as the training forward holds them
        bad = []
        for stack in [(p,) for p in DECODE_POSITIONS] + [(5, 6)]:
            rows = torch.tensor(stack)
            qd = q.view(per, width, hn)[:, rows].reshape(1, per * len(stack), hn)
            md = causal[rows].repeat(per, 1).view(1, per * len(stack), width).to(device)
            got = attend(kernels, qd, kc, vc, md, hn**-0.5, dtype).view(per, len(stack), hn)
            if not torch.equal(got, full[:, rows]):
                bad.append(stack if len(stack) > 1 else stack[0])
        if bad:
            found.append(f"{str(dtype)[6:]} decode attention, query positions {bad} of {width}")
    return found


def check_threads(device: torch.device | str) -> tuple[int, ...]:
    """The thread counts the self-check runs its elementwise and reduction probes at: :data:`CHECK_THREADS` and the
    process's own on a CPU, the process's own elsewhere (a GPU kernel's split does not follow torch's threads)."""
    own = torch.get_num_threads()
    if torch.device(device).type != "cpu":
        return (own,)
    return tuple(sorted({*CHECK_THREADS, own}))


def invariance_checks(device: torch.device | str = "cpu") -> int:
    """How many cases :func:`invariance_problems` tries on ``device``."""
    per_thread = 2 * len(ELEMENTWISE_WIDTHS) * len(ACTIVATIONS) + len(REDUCTION_WIDTHS)
    return PRODUCT_CHECKS + 2 + per_thread * len(check_threads(device))


def invariance_problems(
    kernels: ExactKernels, *, seed: int = 0, device: torch.device | str = "cpu"
) -> list[str]:
    """Every case where ``kernels`` give a row other bits alone than among many: products
    (:func:`product_problems`), a one-token decode query against the training rows
    (:func:`decode_attention_problems`), elementwise ops and the head's reduction at each of
    :func:`check_threads`; empty when none."""
    threads = check_threads(device)
    return [
        *product_problems(kernels, seed=seed, device=device),
        *decode_attention_problems(kernels, seed=seed, device=device),
        *elementwise_problems(kernels, threads=threads, seed=seed, device=device),
        *reduction_problems(kernels, threads=threads, seed=seed, device=device),
    ]


def tiled_kernels(device: torch.device | str) -> TiledCPUKernels:
    """The tiled kernels for ``device``'s kind (not yet checked: :func:`kernels_for` checks them)."""
    return TiledCUDAKernels() if torch.device(device).type == "cuda" else TiledCPUKernels()


@dataclass(frozen=True)
class Admission:
    """Which row-invariant kernels a run uses on a device, and why the candidates tried before them were refused."""

    device: str
    chosen: str
    """The admitted kernels' name."""
    refused: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """``(candidate name, the cases it failed)`` for each candidate tried before the admitted one."""

    def text(self) -> str:
        if not self.refused:
            return f"{self.chosen} on {self.device}"
        why = "; ".join(
            f"{name}: {len(cases)} case(s) not row-invariant ({cases[0]})" for name, cases in self.refused
        )
        return f"{self.chosen} on {self.device} (refused: {why})"


def candidates_for(device: torch.device | str) -> tuple[ExactKernels, ...]:
    """The kernels :func:`admit_kernels` tries on ``device``, fastest first; the tiles last. On a CPU, the tiles
    alone (torch's own products are known to fail there: module docstring); on CUDA, torch's own products in the
    model's dtype (cuBLAS, untiled) before the full-float32 tiles: admitted only where the device's own check
    passes."""
    if torch.device(device).type == "cuda":
        return (CUDANativeKernels(), TiledCUDAKernels())
    return (TiledCPUKernels(),)


def admit_kernels(
    device: torch.device | str,
    candidates: tuple[ExactKernels, ...] | None = None,
    *,
    check: Callable[..., list[str]] | None = None,
) -> tuple[ExactKernels, Admission]:
    """The first of ``candidates`` (default :func:`candidates_for`) that passes the row-invariance check on
    ``device`` (:func:`invariance_problems`: products, decode attention against the training rows, elementwise ops
    and the head's reduction at every thread count it checks), and the :class:`Admission` that names it and the
    refused ones; raises, naming every failing case of the last candidate, when none passes."""
    kind = torch.device(device).type
    if kind not in ("cpu", "cuda"):
        raise ValueError(
            f"exact mode on {kind}: no row-invariant kernels for this device (allowed: cpu, cuda). "
            "See docs/exact-mode.md"
        )
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("exact mode on cuda: torch sees no CUDA device in this process")
        pin_cuda_reductions()
    check = check or invariance_problems
    tried = candidates if candidates is not None else candidates_for(device)
    refused: list[tuple[str, tuple[str, ...]]] = []
    for kernels in tried:
        problems = check(kernels, device=device)
        if not problems:
            return kernels, Admission(str(device), kernels.name, tuple(refused))
        refused.append((kernels.name, tuple(problems)))
    last, problems = refused[-1]
    if kind == "cpu":
        raise RuntimeError(
            f"exact mode: the row-invariant CPU kernels are not row-invariant in this process "
            f"({'; '.join(problems)}; MKL_CBWR = {os.environ.get('MKL_CBWR', 'unset')}, "
            f"{torch.get_num_threads()} threads). Set MKL_CBWR=AUTO,STRICT in the environment before the "
            "process's first matrix product (tim train does in exact mode), or run with OMP_NUM_THREADS=1"
        )
    name = torch.cuda.get_device_name(torch.device(device))
    raise RuntimeError(
        f"exact mode on {name}: no candidate kernels are row-invariant on this device "
        f"({'; '.join(f'{n}: {len(c)} case(s)' for n, c in refused)}; the last, {last}: {'; '.join(problems)}). "
        "See docs/exact-mode.md for what a CUDA path needs"
    )


def kernels_for(device: torch.device | str) -> ExactKernels:
    """The admitted row-invariant kernels for ``device`` (:func:`admit_kernels`)."""
    return admit_kernels(device)[0]
