"""Run megatron-core on CPU over gloo. Applies only when CUDA is absent.

Each shim and why it is needed (megatron-core 0.16.1, torch 2.13 CPU):

1. ``torch.cuda.current_device`` returns ``"cpu"``: megatron-core places new tensors with
   ``device=torch.cuda.current_device()`` in rotary embeddings, the router, tensor-parallel layers,
   mappings and the DDP grad buffers.
2. ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` and
   ``torch.cuda.get_rng_state`` use the CPU generator: the model-parallel RNG tracker forks "the CUDA
   RNG" around dropout and initialization. (``torch.cuda.manual_seed`` is already a lazy no-op on CPU
   builds, so every tracker state starts from the CPU generator's state; RL recipes use no dropout.)
3. ``torch.cuda.synchronize`` is a no-op: distributed checkpointing synchronizes "the GPU" before
   handing tensors to its file writers.
4. :func:`cuda_placement_to_cpu`: megatron's optimizers, grad scaler, grad clipping and checkpoint
   strategies create buffers with a literal ``device='cuda'``, call ``.cuda()`` and check ``param.type()``
   against ``'torch.cuda.FloatTensor'``. The context manager redirects those to CPU. It is entered only
   around DDP and optimizer construction, optimizer steps and checkpoint I/O, never around the forward.

The router's unbound ``te_general_gemm`` (no transformer-engine) is not CPU-only: ``no_te_router_gemm.py``.

Not shims, but CPU choices made by the trainer: the ``allgather`` MoE token dispatcher (``alltoall``
creates CUDA streams) and an explicit boolean causal mask (``get_default_causal_mask`` allocates on
"cuda").
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

from patches.guard import Handle, check_version, set_attr
from patches.specs import megatron_core_patch

SPEC = megatron_core_patch(
    name="megatron-cpu-shims",
    reason="megatron-core assumes CUDA for device placement, RNG state and optimizer buffers.",
    targets=(
        "torch.cuda.current_device",
        "torch.cuda.get_rng_state",
        "torch.cuda.synchronize",
        "megatron.core.tensor_parallel.random._get_cuda_rng_state",
        "megatron.core.tensor_parallel.random._set_cuda_rng_state",
    ),
)


def needed() -> bool:
    return not torch.cuda.is_available()


def apply() -> Handle:
    """Install shims 1-3 (idempotent per process is the caller's job: keep the handle)."""
    check_version(SPEC)
    if not needed():
        raise RuntimeError("megatron-cpu-shims must not be applied when CUDA is available")
    import megatron.core.tensor_parallel.random as tp_random

    h = Handle(SPEC.name)
    set_attr(h, torch.cuda, "current_device", lambda: "cpu")
    set_attr(h, torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    set_attr(h, torch.cuda, "synchronize", lambda device=None: None)
    set_attr(
        h,
        tp_random,
        "_get_cuda_rng_state",
        lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state(),
    )
    set_attr(
        h,
        tp_random,
        "_set_cuda_rng_state",
        lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state),
    )
    return h


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_placement_to_cpu():
    """Shim 4: inside, ``device='cuda'`` means CPU and CPU tensors report CUDA type names."""
    if not needed():
        yield
        return
    with _CudaToCpu():
        yield
