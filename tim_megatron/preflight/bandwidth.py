"""All-reduce bus bandwidth within each node, across nodes, and in the job's real TP, EP and DP groups.

nccl-tests' convention: ``algbw = bytes / seconds`` and ``busbw = algbw x 2(n-1)/n`` for an all-reduce over ``n``
ranks, which makes the figure comparable with the hardware's link bandwidth whatever ``n`` is. Sizes run from
1 MiB to 1 GiB on GPUs (capped at 16 MiB on CPU, where gloo copies through host memory); the judged figure is
the largest size's. Every group of one kind runs at the same time (the TP groups together, then the EP groups,
...), as they do in training.

Nominal figures, per GPU and direction, are what the links promise; measured ones are judged against them:

* within a node: NVLink of the SXM part named by ``cluster.gpu_type`` (:data:`NVLINK_GB_S`);
* across nodes: the node's fastest active RDMA port (``/sys/class/infiniband``); one port per GPU is the usual
  GPU-cluster layout, and the one-rank-per-node test uses one GPU;
* on CPU (gloo) and wherever the hardware is unknown: none (``null``), and nothing is judged.

The transport NCCL really uses is read from its own log (``NCCL_DEBUG=INFO`` into ``preflight/nccl/``): a job that
falls back to sockets where InfiniBand exists is caught here.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

MIB = 1 << 20
GPU_SIZES = tuple(MIB * 4**i for i in range(6))
"""1 MiB, 4 MiB, ..., 1 GiB."""
CPU_MAX_BYTES = 16 * MIB
NVLINK_GB_S = {
    "a100-40gb": 300.0,
    "a100-80gb": 300.0,
    "h100-80gb": 450.0,
    "h100-94gb": 450.0,
    "h200-141gb": 450.0,
    "b200-180gb": 900.0,
}
"""NVLink bandwidth per GPU and direction, GB/s (NVLink 3: 12 links, NVLink 4: 18 links of 25 GB/s; NVLink 5:
1.8 TB/s both ways). An all-reduce's bus bandwidth cannot exceed it without in-switch reduction (NVLS)."""
NCCL_NETWORK = re.compile(r"Using network (\S+)")


def bus_factor(n: int) -> float:
    return 2 * (n - 1) / n


def algbw_busbw(nbytes: int, seconds: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes) for an all-reduce of ``nbytes`` over ``n`` ranks in ``seconds``."""
    alg = nbytes / seconds / 1e9 if seconds > 0 else float("nan")
    return alg, alg * bus_factor(n)


def sizes(on_gpu: bool) -> tuple[int, ...]:
    return GPU_SIZES if on_gpu else tuple(s for s in GPU_SIZES if s <= CPU_MAX_BYTES)


def time_allreduce(group, *, nbytes: int, device, warmup: int, iters: int) -> float:
    """Mean seconds of one all-reduce of ``nbytes`` (float32) over ``group``, after ``warmup`` untimed ones."""
    import torch
    import torch.distributed as dist

    t = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    for _ in range(warmup):
        dist.all_reduce(t, group=group)
    _sync(device)
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t, group=group)
    _sync(device)
    return (time.perf_counter() - t0) / iters


def _sync(device) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def group_plan(ranks_info: list[dict]):
    """``(kind, members, group)`` for every group to measure, built the same way on every rank (collective):
    each node's ranks, the first rank of each node, then this rank's TP, EP and DP groups (megatron-core's)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    nodes = sorted({d["node"] for d in ranks_info})
    by_node = {n: sorted(d["rank"] for d in ranks_info if d["node"] == n) for n in nodes}
    plan = []
    for n in nodes:
        members = by_node[n]
        plan.append(("node", members, dist.new_group(members) if len(members) > 1 else None))
    if len(nodes) > 1:
        leaders = [by_node[n][0] for n in nodes]
        plan.append(("inter-node", leaders, dist.new_group(leaders)))
    for kind, get in (
        ("tp", ps.get_tensor_model_parallel_group),
        ("ep", ps.get_expert_model_parallel_group),
        ("dp", ps.get_data_parallel_group),
    ):
        g = get()
        plan.append((kind, sorted(dist.get_process_group_ranks(g)), g))
    return plan


def measure(ranks_info: list[dict], *, rank: int, device, on_gpu: bool) -> list[dict]:
    """This rank's timings in every group it belongs to (all ranks call; kinds are separated by barriers)."""
    import torch.distributed as dist

    plan = group_plan(ranks_info)
    warmup, iters = (5, 20) if on_gpu else (1, 3)
    out = []
    for kind in dict.fromkeys(k for k, _, _ in plan):
        dist.barrier()
        for k, members, group in plan:
            if k != kind or rank not in members or len(members) < 2:
                continue
            times = [
                {
                    "bytes": n,
                    "seconds": time_allreduce(group, nbytes=n, device=device, warmup=warmup, iters=iters),
                }
                for n in sizes(on_gpu)
            ]
            out.append({"kind": kind, "ranks": members, "sizes": times})
    dist.barrier()
    return out


def nccl_networks(folder: Path, *, host: str, pid: int) -> list[str]:
    """The networks NCCL said it uses (``IB``, ``Socket``, a plugin's name) in this process's debug file."""
    found: list[str] = []
    for f in Path(folder).glob(f"{host}.{pid}*"):
        for m in NCCL_NETWORK.finditer(f.read_text(errors="replace")):
            if m.group(1) not in found:
                found.append(m.group(1))
    return found


def nominal_gb_s(*, span: str, backend: str, gpu_type: str | None, ib_gb_s: float | None) -> float | None:
    if backend != "nccl":
        return None
    if span == "intra-node":
        return NVLINK_GB_S.get(gpu_type or "")
    return ib_gb_s


def node_ib_gb_s(ports: list[dict]) -> float | None:
    """The fastest active RDMA port of a node, GB/s (None without one)."""
    rates = [p["rate_gbit_s"] / 8 for p in ports if "ACTIVE" in p.get("state", "") and p.get("rate_gbit_s")]
    return max(rates) if rates else None


def combine(
    per_rank: list[list[dict]],
    *,
    ranks_info: list[dict],
    layout: dict,
    ports: dict[int, list[dict]],
    networks: dict[int, list[str]],
) -> list[dict]:
    """One entry per group: the slowest member's time per size, algbw and busbw, the span (within a node or
    across nodes), the nominal figure, and for groups across nodes the transports NCCL reported."""
    node_of = {d["rank"]: d["node"] for d in ranks_info}
    groups: dict[tuple, dict[int, float]] = {}
    for records in per_rank:
        for rec in records:
            key = (rec["kind"], tuple(rec["ranks"]))
            slot = groups.setdefault(key, {})
            for s in rec["sizes"]:
                slot[s["bytes"]] = max(slot.get(s["bytes"], 0.0), s["seconds"])
    out = []
    for (kind, members), times in groups.items():
        n = len(members)
        nodes = sorted({node_of.get(r, 0) for r in members})
        span = "intra-node" if len(nodes) == 1 else "inter-node"
        ib = [node_ib_gb_s(ports.get(nd, [])) for nd in nodes]
        ib_known = [x for x in ib if x is not None]
        rows = []
        for nbytes in sorted(times):
            alg, bus = algbw_busbw(nbytes, times[nbytes], n)
            rows.append({"bytes": nbytes, "seconds": times[nbytes], "algbw_gb_s": alg, "busbw_gb_s": bus})
        entry = {
            "kind": kind,
            "ranks": list(members),
            "nodes": nodes,
            "span": span,
            "backend": layout["backend"],
            "sizes": rows,
            "bytes": rows[-1]["bytes"],
            "busbw_gb_s": rows[-1]["busbw_gb_s"],
            "nominal_gb_s": nominal_gb_s(
                span=span,
                backend=layout["backend"],
                gpu_type=layout.get("gpu_type"),
                ib_gb_s=min(ib_known) if ib_known and len(ib_known) == len(ib) else None,
            ),
            "infiniband": bool(ib_known),
        }
        if span == "inter-node":
            seen: list[str] = []
            for r in members:
                seen += [x for x in networks.get(r, []) if x not in seen]
            entry["network"] = seen if layout["backend"] == "nccl" else ["gloo (TCP)"]
        out.append(entry)
    order = {"node": 0, "inter-node": 1, "tp": 2, "ep": 3, "dp": 4}
    return sorted(out, key=lambda e: (order.get(e["kind"], 9), e["ranks"]))
