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

Everything else the forward runs is row-wise by construction on this CPU (norms, softmax, the vocab-parallel
cross-entropy reduce each row on its own, and ``tests/test_exact_kv.py`` checks the whole forward). A CUDA variant
needs batch-invariant versions of these kernels and of those row reductions (split-K and tile choices there depend
on the batch size); it plugs in here through :func:`kernels_for` without touching the sampler. None is verified
in this version, so :func:`kernels_for` refuses CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


class ExactKernels(Protocol):
    """Products whose every output row depends only on its own input row (and the other operand)."""

    name: str

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x [..., K] @ weight[N, K]^T -> [..., N]``; differentiable."""
        ...

    def bmm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a [B, M, K] @ b [B, K, N] -> [B, M, N]``; row ``(i, m)`` depends only on ``a[i, m]`` and ``b[i]``."""
        ...

    def softmax(self, x: torch.Tensor) -> torch.Tensor:
        """Softmax over the last dimension, each row on its own."""
        ...


@dataclass(frozen=True)
class TiledCPUKernels:
    """Fixed-shape tiles of ``linear_rows`` (GEMMs) and ``attention_rows`` (attention's ``bmm``) rows."""

    linear_rows: int = 32
    """Rows per GEMM tile of :meth:`linear` (a decode step pads its rows up to a multiple of this)."""
    attention_rows: int = 4
    """Rows per tile of :meth:`bmm` (a decode step's single query per head is padded to this)."""
    name: str = "cpu-tiled"

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
        tiles = -(-m // r) if m else 0
        if tiles == 0:
            return x.new_zeros(*lead, n)
        padded = F.pad(rows, (0, 0, 0, tiles * r - m)).view(tiles, r, k)
        out = torch.bmm(padded, weight.t().unsqueeze(0).expand(tiles, k, n))
        return out.reshape(tiles * r, n)[:m].reshape(*lead, n)

    def bmm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        batch, m, _k = a.shape
        r = self.attention_rows
        tiles = -(-m // r)
        padded = F.pad(a, (0, 0, 0, tiles * r - m))
        # One bmm per tile, over the whole batch: b is never copied per tile.
        parts = [torch.bmm(padded[:, t * r : (t + 1) * r], b) for t in range(tiles)]
        return torch.cat(parts, 1)[:, :m] if parts else a.new_zeros(batch, 0, b.shape[-1])

    def softmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)


def kernels_for(device: torch.device | str) -> ExactKernels:
    """The verified row-invariant kernels for ``device``; raises where none is."""
    kind = torch.device(device).type
    if kind == "cpu":
        return TiledCPUKernels()
    raise ValueError(
        f"exact mode on {kind}: no row-invariant kernels are verified for this device (CPU only in this version). "
        "A CUDA variant needs batch-invariant GEMM, bmm and row reductions; see tim_megatron/exact/kernels.py"
    )
