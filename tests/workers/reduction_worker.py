"""Exact mode's ordered reductions over 4 gloo ranks (tests/test_exact.py), with and without the patch.

    torchrun --nproc_per_node 4 tests/workers/reduction_worker.py OUT.json

For each buffer size, every rank holds its own random rows; rank 0 writes, per size: whether megatron's all-reduce
(``mappings._reduce``) and reduce-scatter (``_reduce_scatter_along_first_dim``) give the first row the same bits in
the whole buffer as alone, and whether they equal the rank-order fold of the gathered parts, patched and native.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from patches.megatron import cpu_shims, ordered_reductions  # noqa: E402

WIDTH = 8
ROWS = (4, 512, 8192)


def measure(mappings, group, rank: int, world: int) -> dict:
    out = {}
    for rows in ROWS:
        x = torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(1000 * rank + rows))
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        fold = ordered_reductions.ordered_sum(parts)
        full = mappings._reduce(x.clone(), group)
        alone = mappings._reduce(x[:1].clone(), group)
        per = rows // world
        scattered = mappings._reduce_scatter_along_first_dim(x.clone(), group)
        # the same first row of this rank's chunk, reduce-scattered in a buffer of one row per rank
        small = torch.cat([x[r * per : r * per + 1] for r in range(world)])
        scattered_small = mappings._reduce_scatter_along_first_dim(small, group)
        out[str(rows)] = {
            "reduce_row_alone_equal": torch.equal(full[:1], alone),
            "reduce_equals_fold": torch.equal(full, fold),
            "scatter_equals_fold": torch.equal(scattered, fold[rank * per : (rank + 1) * per]),
            "scatter_row_equal_in_small_buffer": torch.equal(scattered[:1], scattered_small),
        }
    flags = torch.tensor([[float(v) for v in m.values()] for m in out.values()])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # a property holds only if it holds on every rank
    return {
        k: dict(zip(m, map(bool, f.tolist()), strict=True))
        for (k, m), f in zip(out.items(), flags, strict=True)
    }


def main() -> None:
    dist.init_process_group("gloo")
    shims = cpu_shims.apply() if cpu_shims.needed() else None  # megatron's native path allocates on "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()
    from megatron.core.tensor_parallel import mappings

    group = dist.new_group(list(range(world)))
    native = measure(mappings, group, rank, world)
    handle = ordered_reductions.apply()
    try:
        patched = measure(mappings, group, rank, world)
    finally:
        handle.revert()
    if shims is not None:
        shims.revert()
    if rank == 0:
        Path(sys.argv[1]).write_text(
            json.dumps({"world": world, "native": native, "patched": patched}, indent=1)
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
