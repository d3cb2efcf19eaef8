"""Where a process sits in a run, from torchrun's or Slurm's environment variables (no process group is made here:
:mod:`tim_megatron.trainer.parallel` makes it)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits among the run's processes."""

    rank: int
    """This process's global rank."""
    world_size: int
    """How many processes the run has."""
    local_rank: int
    """Its rank among the processes on this machine."""
    master_addr: str
    """The address rank 0 listens on for the process group's rendezvous."""
    master_port: int
    """Its port."""
    launcher: str
    """torchrun, slurm or single."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dist_env_from_environ(environ: dict[str, str] | None = None) -> DistEnv:
    """Where this process sits: torchrun's variables first, then Slurm's (``srun`` one task per rank)."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            launcher="torchrun",
        )
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        if "MASTER_ADDR" not in env:
            raise RuntimeError(
                "Slurm launch without MASTER_ADDR: the sbatch script must export the first node's address"
            )
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=env["MASTER_ADDR"],
            master_port=int(env.get("MASTER_PORT", 29500)),
            launcher="slurm",
        )
    return DistEnv(
        rank=0,
        world_size=1,
        local_rank=0,
        master_addr="127.0.0.1",
        master_port=_free_port(),
        launcher="single",
    )
