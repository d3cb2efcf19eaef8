"""``make gpu-check`` section ``moe layer``: what one MoE layer of Qwen3-30B-A3B's shape costs to train on this GPU.

The project's own train step (:func:`~tim_megatron.gpu_check.sections.train_step`: ours against a bare
megatron-core step, and on CUDA the peak memory against ``tim plan``) runs on random checkpoints of the real layer
shape (hidden 2048, 32 heads on 4 key/value heads of 128, 128 experts of width 768, top-8, vocabulary 151,936) with
1 and with 2 layers, 2 x 4096 tokens in bfloat16. One layer's forward and backward is the difference of the two
models' forward + backward times; its MFU is that layer's FLOPs by ``tim plan``'s own formula
(:func:`~tim_megatron.slurm.step_plan.model_forward_flops`, 3 forwards for a forward and backward) over the time
and the GPU's dense bf16 peak (``GPU_PEAK_BF16_FLOPS``).

Pass rules on a GPU: per-layer MFU >= :data:`LAYER_MFU_TARGET`, ours / bare within
:data:`~tim_megatron.gpu_check.compare.STEP_RATIO_TARGET`, peak <= plan. Under ``--cpu`` the same code path runs on
a small shape with the kernels ``auto`` picks on CUDA (grouped experts, torch's fused attention): CPU figures,
labelled so and not judged.
"""

from __future__ import annotations

from tim_megatron.gpu_check.report import finding
from tim_megatron.outcome import Outcome
from tim_megatron.recipe.schema import GPU_PEAK_BF16_FLOPS, ClusterConfig, ModelDims

LAYER_MFU_TARGET = 0.20
"""The per-layer MFU a GPU must reach at the 30B layer shape (``cluster.assumed_mfu``'s default)."""

GPU_KERNELS = ("trainer.experts=grouped", "trainer.attention=sdpa")
"""What ``auto`` picks on CUDA; named, so that the CPU run takes the same code path."""


def layer_dims(layers: int, *, small: bool) -> ModelDims:
    """Qwen3-30B-A3B's layer shape with ``layers`` layers (``small``: the same structure at CPU sizes)."""
    common = dict(
        num_layers=layers,
        norm_topk_prob=True,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if small:
        return ModelDims(
            hidden_size=256,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=512,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=128,
            intermediate_size=512,
            max_position_embeddings=512,
            **common,
        )
    return ModelDims(
        hidden_size=2048,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151_936,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        intermediate_size=6144,
        max_position_embeddings=40_960,
        **common,
    )


def layer_train_flops(*, small: bool, sequences: int, length: int) -> float:
    """One layer's forward + backward FLOPs by ``tim plan``'s formula: the 2-layer model's less the 1-layer one's,
    times 3 (a backward costs two forwards)."""
    from tim_megatron.slurm.step_plan import model_forward_flops

    one, two = (
        model_forward_flops(layer_dims(k, small=small), sequences=sequences, length=length) for k in (1, 2)
    )
    return 3 * (two - one)


def _value(outs: list[Outcome], prefix: str) -> float:
    return next(o.value for o in outs if o.name.startswith(prefix) and o.value is not None)


def moe_layer(bench, *, section: str) -> list[Outcome]:
    """The section (module docstring)."""
    from tim_megatron.gpu_check.models import random_checkpoint
    from tim_megatron.gpu_check.sections import Model, train_step

    gpu = bench.on_gpu
    seqs, length = (2, 4096) if gpu else (2, 128)
    overrides = () if gpu else GPU_KERNELS
    out: list[Outcome] = []
    fwd_bwd: dict[int, float] = {}
    for k in (1, 2):
        d = layer_dims(k, small=not gpu)
        path = random_checkpoint(d, bench.workdir / f"moe-layer-x{k}", device=bench.device)
        model = Model(f"Qwen3-30B-A3B layer shape x{k}" + ("" if gpu else " (CPU sizes)"), path, str(path), d)
        got = train_step(
            bench, model, section=f"{section} x{k}", seqs=seqs, length=length, repeat=3, overrides=overrides
        )
        out += got
        fwd_bwd[k] = _value(got, "  ours: forward + backward")
        bench.free()
    per_layer = fwd_bwd[2] - fwd_bwd[1]
    flops = layer_train_flops(small=not gpu, sequences=seqs, length=length)
    peak = GPU_PEAK_BF16_FLOPS.get(bench.gpu_type or "", 0.0) if gpu else 0.0
    out.append(
        finding(
            section, f"one layer's forward + backward, {seqs} x {length} tokens (x2 less x1)", per_layer, "s"
        )
    )
    out.append(
        finding(section, "one layer's forward + backward FLOPs (tim plan's formula)", flops / 1e12, "TFLOP")
    )
    if not gpu:
        out.append(finding(section, "per-layer MFU", None, "", "info", "a CPU run: no GPU peak to divide by"))
        return out
    if not peak:
        out.append(
            finding(section, "per-layer MFU", None, "", "skip", f"no bf16 peak known for {bench.gpu_type}")
        )
        return out
    mfu = flops / per_layer / peak if per_layer > 0 else 0.0
    status = "ok" if mfu >= LAYER_MFU_TARGET else "fail"
    out.append(
        finding(
            section, "per-layer MFU", mfu, "", status, f">= {LAYER_MFU_TARGET:g} of {peak / 1e12:.0f} TFLOP/s"
        )
    )
    assumed = ClusterConfig().assumed_mfu
    out.append(
        finding(
            section,
            "per-layer MFU / tim plan's cluster.assumed_mfu",
            mfu / assumed,
            "x",
            "ok" if mfu >= assumed else "warn",
            f"the plan's update time is a lower bound only at >= 1 (assumed {assumed:g})",
        )
    )
    return out
