"""Routed experts: the grouped GEMM path (:mod:`tim_megatron.trainer.experts`) against megatron-core's loop over
experts (``SequentialMLP``), the same weights and tokens, forward + backward, at 64 and 128 experts.

Both modules are built as the trainer builds them (megatron-core's local spec, one rank); the tokens arrive
grouped by expert with a random top-k routing, as the dispatcher hands them over. On CPU torch's grouped GEMM runs
one GEMM per expert itself, so the ratio depends on the shape and the dtype; ``trainer.experts: auto`` keeps the
loop on CPU either way (the project's CPU figures were measured on it). The GPU figure is ``make gpu-check``'s
``moe layer`` section.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tim_megatron import outcome


def expert_modules(*, experts: int, hidden: int, width: int, dtype: torch.dtype):
    """megatron-core's SequentialMLP and the grouped experts on the same weights, as the trainer builds them (needs
    megatron-core's parallel state)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.experts import SequentialMLP

    from tim_megatron.trainer.experts import grouped_experts_class

    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=4,
        num_moe_experts=experts,
        moe_ffn_hidden_size=width,
        ffn_hidden_size=4 * hidden,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
    )
    sub = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False).submodules.mlp.submodules
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    loop = SequentialMLP(experts, cfg, sub.experts.submodules, pg_collection=pgs)
    grouped = grouped_experts_class()(experts, cfg, sub.experts.submodules, pg_collection=pgs)
    grouped.load_state_dict(loop.state_dict())
    return loop, grouped


def run(
    *, experts: int, tokens: int, topk: int, hidden: int, width: int, repeat: int, dtype: torch.dtype
) -> dict:
    loop, grouped = expert_modules(experts=experts, hidden=hidden, width=width, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    choice = torch.rand(tokens, experts, generator=g).topk(topk, -1).indices.flatten()
    counts = torch.bincount(choice, minlength=experts)
    rows = int(counts.sum())
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    probs = torch.rand(rows, generator=g)
    grad = torch.randn(rows, hidden, generator=g).to(dtype)

    def step(module):
        xi = x.clone().requires_grad_()
        out, _ = module(xi, counts, probs)
        out.backward(grad)
        return out

    want, got = step(loop), step(grouped)
    diff = float((got.detach().float() - want.detach().float()).abs().max())

    def timed(module) -> float:
        t = time.perf_counter()
        step(module)
        return time.perf_counter() - t

    t_loop, t_grouped = [], []
    for _ in range(repeat):  # interleaved, so drift hits both alike
        t_loop.append(timed(loop))
        t_grouped.append(timed(grouped))
    return {
        "loop_s": statistics.median(t_loop),
        "grouped_s": statistics.median(t_grouped),
        "rows": rows,
        "max_abs_diff": diff,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tim_megatron.bench experts")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    a = ap.parse_args(argv)

    from patches.megatron import cpu_shims
    from tim_megatron.recipe.schema import ParallelismConfig
    from tim_megatron.trainer.parallel import init_parallel, teardown_parallel

    shims = cpu_shims.apply() if cpu_shims.needed() else None
    init_parallel(ParallelismConfig(), environ={})  # one process on a free loopback port
    dtype = getattr(torch, a.dtype)
    device = "cpu"  # the modules and tensors are built on CPU, whatever the machine has
    print(
        f"[experts] grouped GEMM vs loop over experts, forward + backward, {a.tokens} tokens x top-{a.topk}, "
        f"hidden {a.hidden}, width {a.width}, {a.dtype}, {torch.get_num_threads()} threads, device={device}"
        + " (a CPU figure: the GPU one is make gpu-check's moe layer)"
    )
    try:
        for experts in (64, 128):
            r = run(
                experts=experts,
                tokens=a.tokens,
                topk=a.topk,
                hidden=a.hidden,
                width=a.width,
                repeat=a.repeat,
                dtype=dtype,
            )
            print(
                f"  {experts:3d} experts: loop {r['loop_s'] * 1e3:8.1f} ms, grouped {r['grouped_s'] * 1e3:8.1f} ms, "
                f"outputs differ by at most {r['max_abs_diff']:.2e}"
            )
            o = outcome.Outcome(
                f"grouped / loop at {experts} experts",
                "info",
                value=r["grouped_s"] / r["loop_s"],
                unit="x",
                rule="a CPU figure, not judged",
                group="experts",
            )
            print("  " + outcome.target_line(o))
    finally:
        teardown_parallel()
        if shims is not None:
            shims.revert()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
