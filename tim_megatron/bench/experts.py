"""Routed experts: the grouped path (:mod:`tim_megatron.trainer.experts`, stacked expert weights) against the same
grouped GEMMs over per-expert weights stacked at every GEMM (the layout the grouped path had before its weights were
stacked) and against megatron-core's loop over experts (``SequentialMLP``): the same weights and tokens, forward +
backward, at 64 and 128 experts.

The modules are built as the trainer builds them (megatron-core's local spec, one rank); the tokens arrive grouped
by expert with a random top-k routing, as the dispatcher hands them over. On CPU torch's grouped GEMM runs one GEMM
per expert itself, so the ratios depend on the shape and the dtype; ``trainer.experts: auto`` keeps the loop on CPU
either way (the project's CPU figures were measured on it). The GPU figure is ``make gpu-check``'s ``moe layer``
section.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tim_megatron import outcome


class _PerExpertGroupedLinear(torch.autograd.Function):
    """The grouped GEMM over per-expert weights: stacked into one transient tensor in the forward, again in the
    backward, and the stacked gradient split back per expert (what stacking the parameters removes)."""

    @staticmethod
    def forward(ctx, x, offs, *weights):
        ctx.save_for_backward(x, offs, *weights)
        return torch._grouped_mm(x, torch.stack(weights).transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, grad):
        x, offs, *weights = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = torch._grouped_mm(grad, torch.stack(weights), offs=offs)
        grad_w = torch._grouped_mm(grad.t(), x, offs=offs).unbind(0)
        return grad_x, None, *grad_w


def per_expert_grouped(loop, x: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
    """``SequentialMLP`` ``loop``'s experts run as two grouped GEMMs over its per-expert weights."""
    offs = torch.cumsum(tokens_per_expert, 0).to(torch.int32)
    w1 = [e.linear_fc1.weight for e in loop.local_experts]
    w2 = [e.linear_fc2.weight for e in loop.local_experts]
    gate, up = torch.chunk(_PerExpertGroupedLinear.apply(x, offs, *w1), 2, dim=-1)
    h = (torch.nn.functional.silu(gate) * up * probs.unsqueeze(-1)).to(x.dtype)
    return _PerExpertGroupedLinear.apply(h, offs, *w2), None


def expert_modules(*, experts: int, hidden: int, width: int, dtype: torch.dtype):
    """megatron-core's SequentialMLP and the grouped path's stacked experts on the same weights, as the trainer
    builds them (needs megatron-core's parallel state)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.experts import SequentialMLP

    from tim_megatron.trainer.experts import STACKED, stacked_experts_class

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
    stacked = stacked_experts_class()(experts, cfg, sub.experts.submodules, pg_collection=pgs)
    with torch.no_grad():
        for attr, linear, _ in STACKED:
            getattr(stacked, attr).copy_(torch.stack([getattr(e, linear).weight for e in loop.local_experts]))
    return loop, stacked


def run(
    *, experts: int, tokens: int, topk: int, hidden: int, width: int, repeat: int, dtype: torch.dtype
) -> dict:
    loop, stacked = expert_modules(experts=experts, hidden=hidden, width=width, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    choice = torch.rand(tokens, experts, generator=g).topk(topk, -1).indices.flatten()
    counts = torch.bincount(choice, minlength=experts)
    rows = int(counts.sum())
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    probs = torch.rand(rows, generator=g)
    grad = torch.randn(rows, hidden, generator=g).to(dtype)
    paths = {
        "loop": loop,
        "per-expert grouped": lambda xi, c, p: per_expert_grouped(loop, xi, c, p),
        "stacked grouped": stacked,
    }

    def step(module):
        xi = x.clone().requires_grad_()
        out, _ = module(xi, counts, probs)
        out.backward(grad)
        return out

    want = step(loop).detach().float()
    diff = {n: float((step(m).detach().float() - want).abs().max()) for n, m in paths.items() if n != "loop"}

    def timed(module) -> float:
        t = time.perf_counter()
        step(module)
        return time.perf_counter() - t

    times: dict[str, list[float]] = {n: [] for n in paths}
    for _ in range(repeat):  # interleaved, so drift hits every path alike
        for n, m in paths.items():
            times[n].append(timed(m))
    return {
        "seconds": {n: statistics.median(t) for n, t in times.items()},
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
        f"[experts] stacked grouped GEMMs vs per-expert grouped GEMMs vs the loop over experts, forward + backward, "
        f"{a.tokens} tokens x top-{a.topk}, hidden {a.hidden}, width {a.width}, {a.dtype}, "
        f"{torch.get_num_threads()} threads, device={device} (a CPU figure: the GPU one is make gpu-check's moe layer)"
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
            s = r["seconds"]
            print(
                f"  {experts:3d} experts: loop {s['loop'] * 1e3:8.1f} ms, per-expert grouped "
                f"{s['per-expert grouped'] * 1e3:8.1f} ms, stacked grouped {s['stacked grouped'] * 1e3:8.1f} ms; "
                "outputs differ from the loop's by at most "
                + ", ".join(f"{d:.2e} ({n})" for n, d in r["max_abs_diff"].items())
            )
            for against in ("per-expert grouped", "loop"):
                o = outcome.Outcome(
                    f"CPU: stacked grouped / {against} at {experts} experts",
                    "info",
                    value=s["stacked grouped"] / s[against],
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
