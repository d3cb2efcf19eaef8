"""The device a collective takes its tensors on: NCCL reduces CUDA tensors only (a CPU tensor makes it raise), gloo
CPU tensors. Every tensor the project builds to reduce, gather or broadcast over ranks is made on
:func:`comm_device` of its group (``tests/test_structure.py`` fails on one made without a device)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def comm_device(group=None) -> torch.device:
    """The current CUDA device when ``group`` (default: the world) runs on NCCL; else the CPU (gloo, or no process
    group at all)."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
