"""Sufficient statistics that merge across micro-batches and data-parallel ranks.

Metrics such as a standard deviation cannot be averaged across ranks. Every metric in this package is
instead a function of sums, minima and maxima, which reduce exactly: three collectives per reduction
(one SUM, one MIN, one MAX), whatever the number of metrics.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tim_megatron.comm import comm_device

_DTYPE = torch.float64


class Stats:
    """Named float64 tensors, each reduced by sum, min or max."""

    __slots__ = ("maxs", "mins", "sums")

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.mins: dict[str, torch.Tensor] = {}
        self.maxs: dict[str, torch.Tensor] = {}

    # ---- building
    def add_sum(self, name: str, value: torch.Tensor | float) -> None:
        v = torch.as_tensor(value, dtype=_DTYPE).detach()
        self.sums[name] = self.sums[name] + v.to(self.sums[name].device) if name in self.sums else v.clone()

    def add_min(self, name: str, value: torch.Tensor | float) -> None:
        v = torch.as_tensor(value, dtype=_DTYPE).detach()
        self.mins[name] = (
            torch.minimum(self.mins[name], v.to(self.mins[name].device)) if name in self.mins else v.clone()
        )

    def add_max(self, name: str, value: torch.Tensor | float) -> None:
        v = torch.as_tensor(value, dtype=_DTYPE).detach()
        self.maxs[name] = (
            torch.maximum(self.maxs[name], v.to(self.maxs[name].device)) if name in self.maxs else v.clone()
        )

    def merge(self, other: Stats) -> Stats:
        for k, v in other.sums.items():
            self.add_sum(k, v)
        for k, v in other.mins.items():
            self.add_min(k, v)
        for k, v in other.maxs.items():
            self.add_max(k, v)
        return self

    @staticmethod
    def combine(parts: Iterable[Stats]) -> Stats:
        out = Stats()
        for p in parts:
            out.merge(p)
        return out

    # ---- reading
    def sum(self, name: str) -> torch.Tensor:
        return self.sums[name]

    def min(self, name: str) -> torch.Tensor:
        return self.mins[name]

    def max(self, name: str) -> torch.Tensor:
        return self.maxs[name]

    def __contains__(self, name: str) -> bool:
        return name in self.sums or name in self.mins or name in self.maxs

    # ---- distributed
    def all_reduce(self, group=None) -> Stats:
        """Reduce in place over ``group``; a no-op without an initialized process group of size > 1.

        Every rank must hold the same names with the same shapes (the metric functions guarantee it).
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) <= 1:
            return self
        for table, op in (
            (self.sums, dist.ReduceOp.SUM),
            (self.mins, dist.ReduceOp.MIN),
            (self.maxs, dist.ReduceOp.MAX),
        ):
            if not table:
                continue
            names = sorted(table)
            flat = torch.cat([table[n].reshape(-1) for n in names])
            device = comm_device(group)
            flat = flat.to(device)
            dist.all_reduce(flat, op=op, group=group)
            offset = 0
            for n in names:
                numel = table[n].numel()
                table[n] = flat[offset : offset + numel].reshape(table[n].shape).cpu()
                offset += numel
        return self


def safe_div(num: torch.Tensor | float, den: torch.Tensor | float) -> float:
    den = float(den)
    return float(num) / den if den > 0 else float("nan")


def std_from_sums(s1: torch.Tensor | float, s2: torch.Tensor | float, n: torch.Tensor | float) -> float:
    """Population std from sum and sum of squares (pass shifted values for accuracy)."""
    n = float(n)
    if n <= 0:
        return float("nan")
    mean = float(s1) / n
    var = float(s2) / n - mean * mean
    return max(var, 0.0) ** 0.5
