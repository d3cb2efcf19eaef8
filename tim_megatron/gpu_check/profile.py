"""One step under ``torch.profiler``, split the ways the ``moe layer`` profile prints it.

* by kernel class (:mod:`~tim_megatron.gpu_check.kernel_classes`): on CUDA each kernel's device time (copies and
  sets included), on CPU each ATen operator's self time;
* the backward by autograd node (``autograd::engine::evaluate_function: <node>``): the device time of the kernels
  each node's evaluation launched (CUDA) or its CPU time, and how many nodes of each kind ran;
* the device's busy time: the union of its kernels' intervals; over the profiled span it gives the GPU's idle share
  (the time it waited for the host). CUDA only.

The profiler adds its own cost on the host (a record per operator), so the idle share under it is an upper bound
of the unprofiled step's; the kernel times themselves are the device's.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tim_megatron.gpu_check.kernel_classes import CLASSES, classify, classify_event

NODE_PREFIX = "autograd::engine::evaluate_function: "


@dataclass
class KernelSplit:
    """What one profiled step spent, by class (seconds)."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0.0))
    nodes: dict[str, float] = field(default_factory=dict)
    """Seconds per autograd node kind of the backward."""
    node_counts: Counter = field(default_factory=Counter)
    busy: float | None = None
    """Seconds the device ran anything (CUDA)."""
    span: float = 0.0
    """Seconds from the first to the last profiled event."""

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    @property
    def idle_share(self) -> float | None:
        """The share of the span the device ran nothing (None on CPU)."""
        if self.busy is None or self.span <= 0:
            return None
        return max(0.0, 1.0 - self.busy / self.span)

    def minus(self, other: KernelSplit) -> dict[str, float]:
        """Per class, this split's seconds less ``other``'s (the 2-layer step less the 1-layer one: one layer)."""
        return {c: self.seconds[c] - other.seconds[c] for c in CLASSES}


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def split_events(events, *, cuda: bool) -> KernelSplit:
    """A profile's events (``prof.events()``) as a :class:`KernelSplit`."""
    from torch.autograd import DeviceType

    out = KernelSplit()
    device, starts, ends = [], [], []
    for e in events:
        tr = e.time_range
        starts.append(tr.start)
        ends.append(tr.end)
        if e.name.startswith(NODE_PREFIX):
            node = e.name[len(NODE_PREFIX) :]
            us = e.device_time_total if cuda else e.cpu_time_total
            out.nodes[node] = out.nodes.get(node, 0.0) + us / 1e6
            out.node_counts[node] += 1
        if cuda:
            if e.device_type == DeviceType.CUDA:
                out.seconds[classify(e.name)] += (tr.end - tr.start) / 1e6
                device.append((tr.start, tr.end))
        elif e.device_type == DeviceType.CPU:
            out.seconds[classify_event(e)] += e.self_cpu_time_total / 1e6
    if cuda:
        out.busy = _union(device) / 1e6
    if starts:
        out.span = (max(ends) - min(starts)) / 1e6
    return out


def profile_step(step: Callable[[], object], *, cuda: bool) -> KernelSplit:
    """``step()`` once under ``torch.profiler`` (CPU, and CUDA on a GPU), split (:func:`split_events`)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    return split_events(prof.events(), cuda=cuda)


def top_nodes(split: KernelSplit, n: int) -> list[tuple[str, float, int]]:
    """The ``n`` autograd node kinds that took longest: (name, seconds, how many ran)."""
    ranked = sorted(split.nodes.items(), key=lambda kv: -kv[1])[:n]
    return [(name, s, split.node_counts[name]) for name, s in ranked]


def node_totals(split: KernelSplit) -> dict[str, float]:
    """Seconds per node kind, a kind's numbered variants together (``MmBackward0`` and ``MmBackward1``)."""
    out: dict[str, float] = defaultdict(float)
    for name, s in split.nodes.items():
        out[name.rstrip("0123456789")] += s
    return dict(out)
