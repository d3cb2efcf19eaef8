"""Which kernels the vLLM engine runs on a CPU: named by the project, not left to vLLM's choice by instruction set.

Machines of the project's kind come with an AMD EPYC (AVX-512, no AMX) or an Intel Xeon with AMX. Left to itself,
vLLM 0.32 picks its ``AMX_MLA`` attention backend for DeepSeek-style models on the Intel CPU, which refuses float32
weights and breaks the first weight reload (``kv_b_proj`` is emptied at load), and AMX variants of the MoE and
paged-attention kernels. So on CPU the engine

* names its attention backend (:func:`attention_backend`: ``CPU_MLA`` for multi-head latent attention,
  ``CPU_ATTN`` for every other model), which vLLM then uses whatever the CPU;
* applies :mod:`patches.vllm.cpu_portable_kernels`, so the AMX-only kernel choices take the vector path;
* reads back what it runs (:func:`running_kernels`) and refuses to go on when that is not what was named
  (:func:`kernel_problems`).

What stays CPU-specific: the dense GEMMs go through oneDNN (and the trainer's through ATen's oneDNN), which picks
AMX on an Intel CPU by itself, so bfloat16 results and sampled tokens still differ between the two kinds of CPU.

``tim doctor`` prints the CPU's instruction-set features (:func:`cpu_features`), the backend named and the one
vLLM would pick by itself (:func:`vllm_default_backend`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from tim_megatron.attention_kinds import attention_kind_of_config

MLA_BACKEND = "CPU_MLA"
"""vLLM's reference CPU backend for multi-head latent attention (any x86 CPU, float32 and bfloat16)."""
ATTENTION_BACKEND = "CPU_ATTN"
"""vLLM's CPU paged-attention backend, for every model without latent attention."""
EXPERTS_KERNEL = "CPUUnquantizedExperts"
"""vLLM's portable vector grouped GEMM for unquantized MoE experts."""


def moe_alignment() -> tuple[int, int]:
    """(hidden size, expert width per engine rank) multiples the named MoE kernel needs (vLLM's own numbers)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts as Kernel

    return Kernel.output_alignment, Kernel._intermediate_alignment()


def moe_shape_problem(*, hidden_size: int, expert_width: int, tensor_parallel: int) -> str:
    """Why the named MoE kernel cannot serve and reload these expert shapes ('' when it can). Measured on vLLM
    0.32: a hidden size off the multiple stops the engine at start ("No Unquantized MoE backend supports the
    deployment configuration"); an expert width per rank off it is zero-padded at load but not when weights are
    reloaded, so the first weight sync fails ("The size of tensor a (64) must match the size of tensor b (48)")."""
    hidden_multiple, width_multiple = moe_alignment()
    if hidden_size % hidden_multiple:
        return (
            f"hidden_size = {hidden_size}: vLLM's CPU MoE kernel needs a multiple of {hidden_multiple} (it does not "
            f"start otherwise); allowed: model.dims.hidden_size a multiple of {hidden_multiple} for CPU runs"
        )
    per_rank, left = divmod(expert_width, tensor_parallel)
    if left or per_rank % width_multiple:
        step = width_multiple * tensor_parallel
        return (
            f"moe_intermediate_size = {expert_width} ({expert_width / tensor_parallel:g} per engine rank at "
            f"rollout.tensor_parallel_size = {tensor_parallel}): vLLM's CPU MoE kernel pads an expert width that is "
            f"not a multiple of {width_multiple} when it loads the checkpoint but not when the trainer's weights are "
            f"reloaded, so the first weight sync would fail; allowed: a multiple of {width_multiple} per rank, such as "
            f"model.dims.moe_intermediate_size = {-(-expert_width // step) * step} for CPU runs"
        )
    return ""


def uses_mla(hf_config: Mapping) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight), by the attention kinds' own rule."""
    return attention_kind_of_config(hf_config).latent


def attention_backend(hf_config: Mapping) -> str:
    """The vLLM attention backend the engine names on CPU for a model with this ``config.json``."""
    return MLA_BACKEND if uses_mla(hf_config) else ATTENTION_BACKEND


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def cpu_features() -> dict[str, str | bool]:
    """The CPU's name and the instruction-set features vLLM's CPU kernels choose by (as torch detects them)."""
    import torch

    cpu = torch.cpu
    return {
        "cpu": _cpu_name(),
        "avx2": bool(cpu._is_avx2_supported()),
        "avx512": bool(cpu._is_avx512_supported()),
        "avx512_bf16": bool(cpu._is_avx512_bf16_supported()),
        "amx": bool(cpu._is_amx_tile_supported()),
    }


def vllm_default_backend(hf_config: Mapping) -> str:
    """The attention backend vLLM would pick on this CPU with none named (asked of vLLM's own CPU platform, which
    decides by latent attention and AMX alone: the head size, dtype and block size given are placeholders)."""
    import torch
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.selector import AttentionSelectorConfig

    selector = AttentionSelectorConfig(
        head_size=576, dtype=torch.bfloat16, kv_cache_dtype=None, block_size=16, use_mla=uses_mla(hf_config)
    )
    return _backend_name(CpuPlatform.get_attn_backend_cls(None, selector))


def _backend_name(path: str) -> str:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    for member in AttentionBackendEnum:
        try:
            if member.get_path() == path:
                return member.name
        except Exception:  # members without a path on this platform
            continue
    return path.rsplit(".", 1)[-1]


def _worker_kernels(worker) -> dict:
    """On the engine's worker: the attention backends, paged-attention instruction sets and MoE expert kernels
    of the loaded model."""
    backends, isas, experts = set(), set(), set()
    for mod in worker.model_runner.model.modules():
        backend = getattr(mod, "attn_backend", None)
        if backend is not None and hasattr(backend, "get_name"):
            backends.add(backend.get_name())
        isa = getattr(mod, "isa", None)
        if isinstance(isa, str):
            isas.add(isa)
        kernel = getattr(getattr(mod, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            experts.add(type(kernel.fused_experts).__name__)
    return {
        "attention_backends": sorted(backends),
        "attention_isa": sorted(isas),
        "moe_experts": sorted(experts),
    }


def running_kernels(llm) -> dict:
    """What the engine (``vllm.LLM``) runs: ``{attention_backends, attention_isa, moe_experts}``, sorted lists."""
    return llm.collective_rpc(_worker_kernels)[0]


def kernel_problems(running: Mapping, *, hf_config: Mapping, moe: bool) -> str:
    """Why the engine's kernels (:func:`running_kernels`) are not the ones named ('' when they are). vLLM falls back
    with only a log line when a named backend does not apply; and a read-back that finds nothing (a vLLM that moved
    the attributes read) is a problem too, not a pass."""
    want = attention_backend(hf_config)
    problems = []
    if running["attention_backends"] != [want]:
        problems.append(f"attention backends {running['attention_backends']}, named {want}")
    if not uses_mla(hf_config) and not running["attention_isa"]:
        problems.append("no paged-attention instruction set found on the attention layers")
    if "amx" in running["attention_isa"]:
        problems.append(f"paged-attention instruction sets {running['attention_isa']}, named the vector ones")
    if moe and running["moe_experts"] != [EXPERTS_KERNEL]:
        problems.append(f"MoE expert kernels {running['moe_experts'] or 'not found'}, named {EXPERTS_KERNEL}")
    if not problems:
        return ""
    return (
        "rollout: the vLLM engine runs other CPU kernels than the ones named: "
        + "; ".join(problems)
        + " (tim_megatron/rollout/cpu_kernels.py, patches/vllm/cpu_portable_kernels.py)"
    )


def report(*, mla: bool | None = None) -> list[dict]:
    """For ``tim doctor``, per kind of model (both, or only the kind ``mla`` says): the backend the engine names
    and, for latent attention (where vLLM's own pick depends on AMX), the one vLLM would pick by itself."""
    rows = []
    for kind in [mla] if mla is not None else [True, False]:
        cfg = {"kv_lora_rank": 512, "qk_rope_head_dim": 64} if kind else {}
        rows.append(
            {
                "mla": kind,
                "named": attention_backend(cfg),
                "vllm_alone": vllm_default_backend(cfg) if kind else None,
            }
        )
    return rows
