"""The plumbing under a step's phases: timers, CPU seconds, and the reductions over ranks that make every rank end a
phase with the same numbers (:mod:`tim_megatron.rl.phases`, :mod:`tim_megatron.rl.partial`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tim_megatron.algo.stats import Stats
from tim_megatron.comm import comm_device
from tim_megatron.rollout.base import RolloutEngine
from tim_megatron.trainer.parallel import dp_group


@dataclass
class Timer:
    """Wall seconds per named phase of a step: ``with timer("rollout"): ...`` adds to ``times["time/rollout"]``."""

    times: dict[str, float] = field(default_factory=dict)

    def __call__(self, name: str):
        timer = self

        class _T:
            def __enter__(self):
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                timer.times[f"time/{name}"] = (
                    timer.times.get(f"time/{name}", 0.0) + time.perf_counter() - self.t
                )

        return _T()


def process_tree_cpu_seconds() -> float:
    """CPU seconds (user + system) this process and its descendants (vLLM's engine core, an engine's workers) have
    used so far, live or reaped (a reaped process's time is in its parent's ``children_*`` times): a step's
    difference is its CPU cost, whatever the cores it ran on. Ranks started by torchrun are siblings, not
    children: each counts its own tree."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in (me, *me.children(recursive=True)):
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:  # ended between the listing and the reading
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def reduce_dp(s: Stats) -> Stats:
    """``s`` summed over the data-parallel group."""
    return s.all_reduce(dp_group())


def sum_over_dp(values: list[float]) -> list[float]:
    """``values`` summed over the data-parallel group (float64)."""
    g = dp_group()
    t = torch.tensor(values, dtype=torch.float64, device=comm_device(g))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, group=g)
    return t.tolist()


def sum_over_engines(rollout: RolloutEngine, values: list[float]) -> list[float]:
    """Each engine's numbers counted once: only its first rank contributes."""
    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    if not rollout.layout.is_leader(global_rank()):
        t.zero_()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def max_over_world(values: list[float]) -> list[float]:
    """The element-wise maximum of ``values`` over every rank."""
    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def global_rank() -> int:
    """This process's rank in the world (0 without torch.distributed)."""
    return dist.get_rank() if dist.is_initialized() else 0


def engine_block(items: list, rollout: RolloutEngine) -> tuple[list, int]:
    """This engine's block of ``items`` (the same on all of the engine's ranks, which must submit identical
    requests), and the index of its first item in ``items``."""
    block = rollout.layout.block(len(items), rollout.engine_index)
    return [items[i] for i in block], block.start
