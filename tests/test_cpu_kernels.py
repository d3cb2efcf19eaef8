"""The vLLM engine's CPU kernels are named, not chosen by instruction set (tim_megatron/rollout/cpu_kernels.py,
patches/vllm/cpu_portable_kernels.py).

Machines of the project's kind have an AMD EPYC (no AMX) or an Intel Xeon with AMX. On the Intel one, vLLM 0.32
picks ``AMX_MLA`` for DeepSeek-style models (float32 refused, the first reload broken) and AMX variants of the
paged-attention, MoE and small-GEMM kernels. The test below runs vLLM's own selection functions in a child process
that reports AMX tiles, so it shows on any machine what an AMX CPU would get, with and without what the engine
names. The running engine's kernels are asserted for every family in tests/test_families.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import importable, require
from tim_megatron.rollout import cpu_kernels

ROOT = Path(__file__).resolve().parents[1]

_AS_IF_AMX = r"""
import json, sys
import torch
torch.cpu._is_amx_tile_supported = lambda: True  # what an Intel Xeon with AMX tiles reports
from vllm.model_executor.layers import utils as layer_utils
from vllm.model_executor.layers.fused_moe.experts import cpu_moe
from vllm.platforms.cpu import CpuPlatform
from vllm.v1.attention.backends import cpu_attn
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.selector import AttentionSelectorConfig
from tim_megatron.rollout import cpu_kernels

MLA = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}


def choices():
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        sel = AttentionSelectorConfig(head_size=576, dtype=dtype, kv_cache_dtype=None, block_size=16, use_mla=True)
        named = AttentionBackendEnum[cpu_kernels.attention_backend(MLA)]
        out[f"mla {dtype}"] = [
            cpu_kernels._backend_name(CpuPlatform.get_attn_backend_cls(None, sel)),
            cpu_kernels._backend_name(CpuPlatform.get_attn_backend_cls(named, sel)),
        ]
    out["attention isa"] = cpu_attn._get_attn_isa(torch.bfloat16, 128, 32)
    out["amx experts offered"] = cpu_moe.X86CPUUnquantizedExperts._supports_current_device()
    out["amx small gemm"] = layer_utils.check_cpu_sgl_kernel(64, 64, torch.bfloat16)
    return out


before = choices()
from patches.vllm import cpu_portable_kernels
cpu_portable_kernels.apply()
print("@@" + json.dumps({"before": before, "after": choices()}))
"""


def test_on_an_amx_cpu_the_engine_still_runs_the_portable_kernels():
    require(importable("vllm"), "vLLM")
    res = subprocess.run(
        [sys.executable, "-c", _AS_IF_AMX], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.rpartition("@@")[2])
    before, after = got["before"], got["after"]
    # vLLM by itself: the AMX choices (this is what the test would catch if the engine stopped naming them).
    for dtype in ("torch.float32", "torch.bfloat16"):
        assert before[f"mla {dtype}"] == ["AMX_MLA", "CPU_MLA"], before
    assert before["attention isa"] == "amx" and before["amx experts offered"] and before["amx small gemm"]
    # Named and patched: what an AMD EPYC runs.
    for dtype in ("torch.float32", "torch.bfloat16"):
        assert after[f"mla {dtype}"][1] == "CPU_MLA", after
    assert after["attention isa"] == "vec"
    assert not after["amx experts offered"] and not after["amx small gemm"]


def test_the_backend_named_for_each_kind_of_attention():
    assert cpu_kernels.attention_backend({"kv_lora_rank": 512, "qk_rope_head_dim": 64}) == "CPU_MLA"
    assert cpu_kernels.attention_backend({"head_dim": 32}) == "CPU_ATTN"
    assert cpu_kernels.attention_backend({"kv_lora_rank": 0}) == "CPU_ATTN"


@pytest.mark.parametrize(
    ("running", "named"),
    [
        ({"attention_backends": ["AMX_MLA"], "attention_isa": [], "moe_experts": []}, "CPU_MLA"),
        ({"attention_backends": ["CPU_ATTN"], "attention_isa": ["amx"], "moe_experts": []}, "vector"),
        (
            {
                "attention_backends": ["CPU_ATTN"],
                "attention_isa": ["vec"],
                "moe_experts": ["X86CPUUnquantizedExperts"],
            },
            "CPUUnquantizedExperts",
        ),
    ],
)
def test_an_engine_running_other_kernels_is_refused_by_name(running, named):
    cfg = (
        {"kv_lora_rank": 512, "qk_rope_head_dim": 64} if running["attention_backends"] == ["AMX_MLA"] else {}
    )
    assert named in cpu_kernels.kernel_problems(running, hf_config=cfg, moe=True)
    ok = {
        "attention_backends": [cpu_kernels.attention_backend(cfg)],
        "attention_isa": ["vec"],
        "moe_experts": [cpu_kernels.EXPERTS_KERNEL],
    }
    assert cpu_kernels.kernel_problems(ok, hf_config=cfg, moe=True) == ""
    # A read-back that finds nothing is a problem, not a pass.
    empty = {"attention_backends": ok["attention_backends"], "attention_isa": [], "moe_experts": []}
    assert "not found" in cpu_kernels.kernel_problems(empty, hf_config=cfg, moe=True)


@pytest.mark.parametrize(
    ("dims", "tp", "refused"),
    [
        (
            {"moe_intermediate_size": 48},
            1,
            r"moe_intermediate_size = 48 \(48 per engine rank .*a multiple of 32",
        ),
        ({"moe_intermediate_size": 64}, 2, None),
        ({"moe_intermediate_size": 96}, 2, r"moe_intermediate_size = 96 \(48 per engine rank at rollout"),
        ({"moe_intermediate_size": 96}, 1, None),
        ({"hidden_size": 80}, 1, r"hidden_size = 80: vLLM's CPU MoE kernel needs a multiple of 32"),
    ],
)
def test_moe_shapes_the_cpu_kernel_cannot_reload_are_refused_before_the_engine_starts(
    tmp_path, dims, tp, refused
):
    """Measured on vLLM 0.32 (CPU): expert widths 48 and 80 start but fail the first reload, 64, 96 and 160
    reload bit for bit; hidden size 80 does not start. The check reads the config.json, before any engine."""
    require(importable("vllm"), "vLLM")
    from tim_megatron.models.tiny import ensure_tiny_checkpoint
    from tim_megatron.recipe.schema import ModelDims
    from tim_megatron.rollout.vllm_engine import RolloutInputError, check_model_for_engine

    ck = ensure_tiny_checkpoint(ModelDims(**dims), warmup_steps=0, root=tmp_path)
    if refused is None:
        check_model_for_engine(ck, on_gpu=False, tensor_parallel=tp)
    else:
        with pytest.raises(RolloutInputError, match=refused):
            check_model_for_engine(ck, on_gpu=False, tensor_parallel=tp)
