"""Where each rank runs: its node, host and device (the judge finds devices shared by mistake and counts)."""

from __future__ import annotations

import os
import socket


def node_of(environ=None) -> tuple[int, str]:
    """(node index, node name): torchrun's node rank (``GROUP_RANK``), else Slurm's; the Slurm node name, else
    the host name (two simulated nodes on one machine share a host name but not a Slurm name)."""
    env = os.environ if environ is None else environ
    node = int(env.get("GROUP_RANK", env.get("SLURM_NODEID", 0)))
    return node, env.get("SLURMD_NODENAME") or socket.gethostname()


def probe(rank: int, local_rank: int) -> dict:
    """This rank's place and device."""
    import torch

    node, host = node_of()
    out = {
        "rank": rank,
        "local_rank": local_rank,
        "node": node,
        "host": host,
        "pid": os.getpid(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    if torch.cuda.is_available():
        i = torch.cuda.current_device()
        p = torch.cuda.get_device_properties(i)
        out.update(
            device=f"cuda:{i}",
            device_name=p.name,
            device_uuid=str(getattr(p, "uuid", "")) or None,
            pci_bus=f"{getattr(p, 'pci_domain_id', 0):04x}:{getattr(p, 'pci_bus_id', 0):02x}:"
            f"{getattr(p, 'pci_device_id', 0):02x}",
            device_bytes=int(p.total_memory),
            visible_devices=torch.cuda.device_count(),
        )
    else:
        out.update(
            device="cpu", cpus=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        )
    return out


def infiniband_ports(root: str = "/sys/class/infiniband") -> list[dict]:
    """This node's RDMA ports (InfiniBand or RoCE; NCCL's ``IB`` network uses both) with their state and rate."""
    from pathlib import Path

    out = []
    base = Path(root)
    if not base.is_dir():
        return out
    for dev in sorted(base.iterdir()):
        for port in sorted((dev / "ports").glob("*")):

            def read(name: str, port=port) -> str:
                try:
                    return (port / name).read_text().strip()
                except OSError:
                    return ""

            rate = read("rate")  # e.g. "200 Gb/sec (4X HDR)"
            try:
                gbps = float(rate.split()[0])
            except (IndexError, ValueError):
                gbps = None
            out.append(
                {
                    "device": dev.name,
                    "port": port.name,
                    "state": read("state"),  # e.g. "4: ACTIVE"
                    "link_layer": read("link_layer"),
                    "rate_gbit_s": gbps,
                }
            )
    return out
