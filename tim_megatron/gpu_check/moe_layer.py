"""``make gpu-check`` section ``moe layer``: what one MoE layer of Qwen3-30B-A3B's shape costs to train on this GPU.

The project's own train step (:func:`~tim_megatron.gpu_check.sections.train_step`: ours against a bare
megatron-core step, and on CUDA the peak memory against ``tim plan``) runs on random checkpoints of the real layer
shape (hidden 2048, 32 heads on 4 key/value heads of 128, 128 experts of width 768, top-8, vocabulary 151,936) with
1 and with 2 layers, 2 x 4096 tokens in bfloat16. One layer's forward and backward is the difference of the two
models' forward + backward times; its MFU is that layer's FLOPs by ``tim plan``'s own formula
(:func:`~tim_megatron.slurm.step_plan.model_forward_flops`, 3 forwards for a forward and backward) over the time
and the GPU's dense bf16 peak (``GPU_PEAK_BF16_FLOPS``).

Each model is also profiled (:mod:`~tim_megatron.gpu_check.layer_profile`): its step phase by phase (CUDA events),
kernel class by kernel class (``torch.profiler``; the 2-layer split less the 1-layer one is one layer's), the
backward by autograd node, the GPU's idle share, host syncs and peak memory per phase, ours and bare alike; at one
layer each lever of issue 57 is switched off alone (:mod:`~tim_megatron.gpu_check.levers`). Then the torch-only
reference layer (:mod:`~tim_megatron.gpu_check.reference_layer`) runs at the same shape and tokens, in the same
process, with balanced and with routed rows, with and without q/k norm and RoPE: ours / reference is our per-layer
forward + backward over its.

Pass rules on a GPU: per-layer MFU >= :data:`LAYER_MFU_TARGET`, ours / bare within
:data:`~tim_megatron.gpu_check.compare.STEP_RATIO_TARGET`, peak <= plan, ours / reference on the same work within
:data:`SAME_WORK_TARGET`. Under ``--cpu`` the same code path runs on a small shape with what ``auto`` picks on CUDA
(grouped experts, torch's fused attention, fused AdamW, the indexed dispatcher, the sync-free grad norm): CPU
figures, labelled so and not judged.
"""

from __future__ import annotations

from dataclasses import replace

from tim_megatron.gpu_check.report import finding
from tim_megatron.outcome import Outcome
from tim_megatron.recipe.schema import GPU_PEAK_BF16_FLOPS, ClusterConfig, ModelDims

LAYER_MFU_TARGET = 0.20
"""The per-layer MFU a GPU must reach at the 30B layer shape (``cluster.assumed_mfu``'s default)."""

GPU_KERNELS = ("trainer.experts=grouped", "trainer.attention=sdpa", "trainer.optimizer_kernel=fused")
"""What ``auto`` picks on CUDA; named, so that the CPU run takes the same code path (:func:`cuda_choices` adds the
dispatcher)."""
SAME_WORK_TARGET = 1.3
"""Our layer's forward + backward over the torch-only reference layer doing the same work, at most (on a GPU)."""


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


def cuda_choices() -> tuple[str, ...]:
    """The recipe settings that make a CPU trainer take what ``auto`` takes on CUDA (:data:`GPU_KERNELS`, and the
    dispatcher ``auto`` resolves to on CUDA, where this tree has :func:`~tim_megatron.trainer.dispatch.resolve_dispatcher`)."""
    try:
        from tim_megatron.trainer.dispatch import resolve_dispatcher
    except ImportError:
        return GPU_KERNELS
    return (*GPU_KERNELS, f"trainer.moe_dispatcher={resolve_dispatcher('auto', on_gpu=True)}")


def _value(outs: list[Outcome], prefix: str) -> float:
    return next(o.value for o in outs if o.name.startswith(prefix) and o.value is not None)


def moe_layer(bench, *, section: str) -> list[Outcome]:
    """The section (module docstring)."""
    from tim_megatron.gpu_check.layer_profile import profile_model
    from tim_megatron.gpu_check.models import random_checkpoint
    from tim_megatron.gpu_check.sections import Model, train_step

    gpu = bench.on_gpu
    seqs, length = (2, 4096) if gpu else (2, 128)
    overrides = () if gpu else cuda_choices()
    repeat = 3
    lever_repeat = 3 if gpu else 1  # on CPU the levers' path is tested, not timed
    out: list[Outcome] = []
    fwd_bwd: dict[int, float] = {}
    profiled = {}
    models = {}
    for k in (1, 2):
        d = layer_dims(k, small=not gpu)
        path = random_checkpoint(d, bench.workdir / f"moe-layer-x{k}", device=bench.device)
        model = Model(f"Qwen3-30B-A3B layer shape x{k}" + ("" if gpu else " (CPU sizes)"), path, str(path), d)
        models[k] = model
        here = f"{section} x{k}"

        def also(parts, here=here, k=k):
            found, profiled[k] = profile_model(
                parts, section=here, cuda=gpu, repeat=repeat, levers=k == 1, lever_repeat=lever_repeat
            )
            return found

        got = train_step(
            bench,
            model,
            section=here,
            seqs=seqs,
            length=length,
            repeat=repeat,
            overrides=overrides,
            also=also,
        )
        out += got
        fwd_bwd[k] = _value(got, "  ours: forward + backward")
        bench.free()
    if 1 in profiled and profiled[1].rebuild:
        out += rebuilt_levers(
            bench,
            models[1],
            profiled[1],
            section=section,
            seqs=seqs,
            length=length,
            overrides=overrides,
            repeat=lever_repeat,
        )
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
    if len(profiled) == 2:
        out += per_layer_findings(section, profiled[1], profiled[2], cuda=gpu)
        out += reference_findings(bench, section, profiled[1], profiled[2], seqs=seqs, length=length)
    out += mfu_findings(
        section, per_layer=per_layer, flops=flops, peak=peak, gpu=gpu, gpu_type=bench.gpu_type
    )
    return out


def per_layer_findings(section: str, one, two, *, cuda: bool) -> list[Outcome]:
    """One layer's share, the 2-layer model's less the 1-layer one's: its phases and its kernel classes."""
    from tim_megatron.gpu_check.kernel_classes import CLASSES
    from tim_megatron.gpu_check.layer_profile import fwd_bwd, ms

    ours, bare = fwd_bwd(two.ours) - fwd_bwd(one.ours), fwd_bwd(two.bare) - fwd_bwd(one.bare)
    out = [
        finding(
            section,
            "per layer: forward + backward by the phase clocks, ours",
            ms(ours),
            "ms",
            "info",
            f"bare {ms(bare):.3f} ms" + ("" if cuda else "; CPU clocks"),
        )
    ]
    do, db = two.split_ours.minus(one.split_ours), two.split_bare.minus(one.split_bare)
    for c in CLASSES:
        out.append(
            finding(
                section, f"per layer: kernels {c}, ours", ms(do[c]), "ms", "info", f"bare {ms(db[c]):.3f} ms"
            )
        )
    return out


def reference_findings(bench, section: str, one, two, *, seqs: int, length: int) -> list[Outcome]:
    """The torch-only layer at the same shape and tokens, each case: its seconds and ours / reference."""
    from tim_megatron.gpu_check.layer_profile import fwd_bwd, ms
    from tim_megatron.gpu_check.reference_layer import CASES, SAME_WORK, ReferenceLayer, timed_case

    gpu = bench.on_gpu
    ours = fwd_bwd(two.ours) - fwd_bwd(one.ours)
    layer = ReferenceLayer(layer_dims(1, small=not gpu), sequences=seqs, length=length, device=bench.device)
    out = []
    try:
        for case in CASES:
            t = timed_case(layer, case, repeat=5 if gpu else 1, warm=2 if gpu else 1)  # CPU: the path
            ratio = ours / t if t > 0 else None
            status, rule = "info", f"reference {ms(t):.3f} ms, torch alone, deterministic algorithms off"
            if case == SAME_WORK:
                rule += "; the same work as ours"
                if gpu and ratio is not None:
                    status = "ok" if ratio <= SAME_WORK_TARGET else "fail"
                    rule += f", <= {SAME_WORK_TARGET:g}"
            out.append(finding(section, f"ours / reference layer ({case.name})", ratio, "x", status, rule))
    finally:
        del layer
        bench.free()
    return out


def rebuilt_levers(
    bench, model, base, *, section: str, seqs: int, length: int, overrides, repeat: int
) -> list[Outcome]:
    """The levers that need another build (:attr:`~tim_megatron.gpu_check.levers.Lever.rebuild`): our step on a
    trainer built with the old path, against the profiled trainer's (``base``, measured before it closed)."""
    from tim_megatron.gpu_check.layer_profile import apply_as_on_cuda, lever_finding
    from tim_megatron.gpu_check.phases import PhaseClock, clocked, instrumented, loss_marked, medians
    from tim_megatron.gpu_check.sections import _loss_fn, _random_batch

    out = []
    for lever in base.rebuild:
        settings = lever.rebuild()

        def measure(tr):
            apply_as_on_cuda(tr)  # as the profiled trainer was
            _, batch, mask, adv = _random_batch(model, seqs=seqs, length=length, seed=0, prompt=length // 4)
            loss_fn = _loss_fn(tr.recipe, tr.logprobs(batch)[0].logprobs, mask, adv)
            clock = PhaseClock(cuda=bench.on_gpu)
            with instrumented(tr, clock):
                step = lambda: tr.train_step(batch, loss_marked(clock, loss_fn), lr=1e-6)  # noqa: E731
                clocked(clock, step)
                return medians([clocked(clock, step) for _ in range(repeat)])

        off = bench.with_trainer(
            model,
            measure,
            dtype="bfloat16",
            micro_batch=seqs,
            max_model_len=length,
            overrides=(*overrides, *settings),
        )
        found = lever_finding(section, lever, base.ours, off)
        out.append(replace(found, rule=f"{found.rule}; rebuilt with {', '.join(settings)}"))
    return out


def mfu_findings(
    section: str, *, per_layer: float, flops: float, peak: float, gpu: bool, gpu_type
) -> list[Outcome]:
    out = []
    if not gpu:
        out.append(finding(section, "per-layer MFU", None, "", "info", "a CPU run: no GPU peak to divide by"))
        return out
    if not peak:
        out.append(finding(section, "per-layer MFU", None, "", "skip", f"no bf16 peak known for {gpu_type}"))
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
