"""Block-FP8 checkpoints (DeepSeek-V3 / Kimi-K2's format; tim_megatron/trainer/weights/fp8.py): the format, a tiny
FP8 checkpoint made locally from the tiny DeepSeek-V3 that loads within the quantization error of its source,
``tim dequantize``, and the named refusals. The trainer loading the same FP8 checkpoint is checked in
tests/workers/family_worker.py (``fp8_*`` in the DeepSeek-V3 family's single scenario)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BLOCK = (128, 128)
"""The published block size; the tiny model's 576-row kv projection ends in a partial block."""


def test_quantize_matches_the_published_layout_and_stays_within_the_e4m3_error():
    from tim_megatron.trainer.weights.fp8 import block_error_bound, dequantize, quantize, scale_shape

    g = torch.Generator().manual_seed(0)
    # rows of very different sizes, so that each block has its own scale; 200 x 300 leaves partial blocks
    w = torch.randn(200, 300, generator=g) * torch.logspace(-3, 1, 200)[:, None]
    q, scale_inv = quantize(w, BLOCK)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32
    assert tuple(scale_inv.shape) == scale_shape((200, 300), BLOCK) == (2, 3)
    assert scale_shape((576, 7168), BLOCK) == (5, 56)  # Kimi-K2's kv_a_proj_with_mqa and its published scales
    back = dequantize(q, scale_inv, BLOCK)
    assert torch.equal(back[130, 260], q[130, 260].float() * scale_inv[1, 2])  # block (1, 2), a partial one
    err = (back - w).abs()
    assert bool((err <= block_error_bound(w, BLOCK)).all())
    assert float(err.max()) > 0  # it is a lossy format: the test compares against something real
    with pytest.raises(
        ValueError, match=r"needs _scale_inv of shape \(2, 3\) for blocks \[128, 128\], got \(2, 2\)"
    ):
        dequantize(q, scale_inv[:, :2], BLOCK, name="w")


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory):
    """The tiny DeepSeek-V3 checkpoint and a block-FP8 copy of it."""
    from tim_megatron.models.tiny import ensure_tiny_checkpoint
    from tim_megatron.recipe import load_recipe
    from tim_megatron.trainer.weights.fp8_checkpoint import convert_checkpoint

    r = load_recipe(ROOT / "recipes/tiny-deepseek-v3/grpo.yaml").recipe
    src = ensure_tiny_checkpoint(
        r.model.dims, seed=r.model.tiny_seed, warmup_steps=r.model.tiny_warmup_steps, task=r.data.task
    )
    dst = tmp_path_factory.mktemp("fp8") / "tiny-fp8"
    convert_checkpoint(src, dst, to="fp8", block=BLOCK)
    return src, dst


def test_tiny_fp8_checkpoint_loads_within_the_quantization_error_of_its_source(tiny_fp8):
    from safetensors import safe_open

    from tim_megatron.trainer.hf_config import dims_from_hf, read_hf_config
    from tim_megatron.trainer.weights import HFCheckpoint
    from tim_megatron.trainer.weights.fp8 import block_error_bound, quantizable

    src, dst = tiny_fp8
    cfg = read_hf_config(dst)
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    assert dims_from_hf(cfg) == dims_from_hf(read_hf_config(src))
    with safe_open(dst / "model.safetensors", "pt") as f:
        stored = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    kv = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert stored[kv] == "F8_E4M3" and stored[kv + "_scale_inv"] == "F32"
    assert stored["model.embed_tokens.weight"] == "F32" and stored["model.layers.1.mlp.gate.weight"] == "F32"
    a, b = HFCheckpoint(src), HFCheckpoint(dst)
    assert b.fp8 is not None and b.fp8.block == BLOCK
    assert b.keys() == a.keys()  # the scales are consumed, not loaded as tensors of their own
    quantized = 0
    for name in sorted(a.keys()):
        want, got = a.get(name), b.get(name)
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        if quantizable(name, want):
            quantized += 1
            assert bool(((got - want).abs() <= block_error_bound(want, BLOCK)).all()), name
        else:
            assert torch.equal(got, want), name
    assert quantized >= 20  # every attention projection, dense MLP, shared and routed expert of both layers


def _dequantize_cli(src: Path, dst: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tim_megatron.cli", "dequantize", str(src), str(dst)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_dequantize_writes_bfloat16_that_transformers_loads(tiny_fp8, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from tim_megatron.trainer.weights import HFCheckpoint
    from tim_megatron.trainer.weights.fp8 import dequantize, quantizable, quantize

    src, dst = tiny_fp8
    out = tmp_path / "bf16"
    res = _dequantize_cli(dst, out)
    assert res.returncode == 0, res.stdout + res.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["torch_dtype"] == "bfloat16"
    q, plain = HFCheckpoint(dst), HFCheckpoint(out)
    assert plain.fp8 is None and plain.keys() == q.keys()
    kv = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert plain.get(kv).dtype == torch.bfloat16 and torch.equal(plain.get(kv), q.get(kv).to(torch.bfloat16))
    # transformers on the bf16 copy computes what the source model computes with each linear weight replaced by its
    # own quantize -> dequantize -> bfloat16, done here on transformers' own save of the source (so the scales went
    # to the right blocks of the right tensors); the source model itself differs by FP8's error
    ids = torch.arange(3, 35).remainder(64)[None]
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(tmp_path / "resaved")
    tensors = load_file(tmp_path / "resaved" / "model.safetensors")
    for name, t in tensors.items():
        if quantizable(name, t):
            tensors[name] = dequantize(*quantize(t, BLOCK), BLOCK).to(torch.bfloat16).float()
    save_file(tensors, tmp_path / "resaved" / "model.safetensors", metadata={"format": "pt"})
    with torch.no_grad():
        ref = model(input_ids=ids).logits.log_softmax(-1)
        got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(
            input_ids=ids
        ).logits.log_softmax(-1)
        expected = AutoModelForCausalLM.from_pretrained(tmp_path / "resaved", dtype=torch.float32)
        want = expected(input_ids=ids).logits.log_softmax(-1)
    assert float((got - want).abs().max()) < 1e-5
    assert float((got - ref).abs().max()) > 1e-3  # the control: FP8 did change the model
    again = _dequantize_cli(dst, out)
    assert again.returncode != 0 and "already exists; refusing to overwrite it" in again.stdout + again.stderr
    assert "Traceback" not in again.stdout + again.stderr


def test_the_engine_refuses_a_quantized_checkpoint_by_key(tiny_fp8):
    from tim_megatron.rollout.base import RolloutInputError
    from tim_megatron.rollout.vllm_engine import check_model_for_engine

    with pytest.raises(RolloutInputError, match=r"quantization_config.quant_method = 'fp8'.*tim dequantize"):
        check_model_for_engine(tiny_fp8[1], on_gpu=False, tensor_parallel=1)


def test_float8_weights_without_their_scales_are_named(tiny_fp8, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from tim_megatron.trainer.weights import HFCheckpoint, WeightLoadError

    broken = tmp_path / "broken"
    shutil.copytree(tiny_fp8[1], broken)
    tensors = load_file(broken / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight"
    del tensors[name + "_scale_inv"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(
        WeightLoadError, match=rf"{name}' is float8_e4m3fn but its scales .*_scale_inv' are missing"
    ):
        HFCheckpoint(broken).get(name)
    # tim dequantize stops on it, leaving neither the destination nor its temporary folder beside it
    res = _dequantize_cli(broken, tmp_path / "out")
    assert res.returncode != 0 and "_scale_inv' are missing" in res.stdout + res.stderr
    assert "Traceback" not in res.stdout + res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"]
