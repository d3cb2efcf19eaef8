"""Process-group setup from torchrun or Slurm environment variables: TP, EP and DP over NCCL or gloo."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from tim_megatron.dist_env import DistEnv, dist_env_from_environ
from tim_megatron.recipe.schema import ParallelismConfig


def backend_for_device() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_parallel(
    parallel: ParallelismConfig,
    *,
    seed: int = 1234,
    environ: dict[str, str] | None = None,
    timeout_minutes: float = 60.0,
) -> DistEnv:
    """Initialize torch.distributed (if needed) and megatron-core's parallel groups for ``parallel``.

    The process group gets an explicit timeout (``parallel.timeout_minutes``): PyTorch's default (10 minutes
    for NCCL's watchdog) is shorter than a long step's slowest phase."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    env = dist_env_from_environ(environ)
    if env.world_size != parallel.world_size:
        raise ValueError(
            f"parallel.tp x parallel.pp x parallel.dp = {parallel.tp} x {parallel.pp} x {parallel.dp} = {parallel.world_size}, "
            f"but the launcher started {env.world_size} process(es) ({env.launcher})"
        )
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend_for_device(),
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    elif dist.get_world_size() != env.world_size:
        raise RuntimeError(
            f"torch.distributed is already initialized with world size {dist.get_world_size()}, expected {env.world_size}"
        )
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        distributed_timeout_minutes=int(max(1, timeout_minutes)),
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return env


def teardown_parallel(*, keep_default_group: bool = False) -> None:
    """Destroy megatron-core's groups and (unless ``keep_default_group``) torch.distributed's default group.
    Keeping it lets the next trainer of a launcher's ranks start in the same processes: a default group is made
    once per launch (torchrun's store holds its keys), megatron-core's groups any number of times."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized() and not keep_default_group:
        dist.destroy_process_group()


def dp_group():
    """The data-parallel process group once megatron-core's groups exist (None before: the default group)."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group() if ps.model_parallel_is_initialized() else None
