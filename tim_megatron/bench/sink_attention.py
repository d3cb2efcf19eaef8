"""gpt-oss's attention on CUDA: the trainer's sink attention (:class:`~tim_megatron.trainer.attention.
SinkFlexCoreAttention`, FlexAttention compiled, the sink through its log-sum-exp) against megatron-core's
materialized attention with sinks (``DotProductAttention``, ``softmax_type = learnable``), and its forward +
backward time against torch's SDPA without sinks (flash attention: what the other families run), at gpt-oss-20b's
layer shape (64 heads, 8 key/value heads of 64, a window of 128 in the windowed layers).

Prints, per layer kind (windowed, full): max |d out| and max |d grad| against the materialized attention in
float32 and bfloat16 (the materialized one's own bfloat16 error against float64 beside it), and the time ratio
``sink flex / sdpa`` in bfloat16. Needs CUDA: on the CPU FlexAttention has no backward (torch 2.13), and the kernel
checks there are tests/test_gpt_oss.py's.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch


def _materialized(q, k, v, sinks, *, window: int | None, scale: float) -> torch.Tensor:
    """The softmax over [scores, sink] with the scores in memory (megatron-core's local attention: float32)."""
    heads, groups, s = q.shape[1], k.shape[1], q.shape[2]
    k, v = k.repeat_interleave(heads // groups, 1), v.repeat_interleave(heads // groups, 1)
    i = torch.arange(s, device=q.device)
    allowed = i[None] <= i[:, None]
    if window:
        allowed &= i[:, None] - i[None] < window
    acc = torch.promote_types(q.dtype, torch.float32)  # float32, or float64 for the reference
    scores = (q.to(acc) @ k.to(acc).transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    sink = sinks.to(acc).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    return (probs @ v.to(acc)).to(q.dtype)


def _flex(q, k, v, sinks, *, window: int | None, scale: float, block_mask) -> torch.Tensor:
    from torch.nn.attention.flex_attention import AuxRequest

    from tim_megatron.trainer.attention import _compiled_flex_attention, sink_correction

    out, aux = _compiled_flex_attention()(
        q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, return_aux=AuxRequest(lse=True)
    )
    return sink_correction(out, aux.lse, sinks)


def _timed(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _time_layer(*, window: int | None, s: int, reps: int, scale: float) -> tuple[float, float]:
    """Median forward + backward seconds of the sink attention and of SDPA without sinks, bfloat16, 20B's heads."""
    from torch.nn.attention.flex_attention import create_block_mask

    from tim_megatron.trainer.attention import windowed_causal

    heads, groups, d, dev = 64, 8, 64, "cuda"
    bm = create_block_mask(windowed_causal(window), None, None, s, s, device=dev)
    q = torch.randn(1, heads, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, groups, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, groups, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    sinks = torch.randn(heads, device=dev, requires_grad=True)
    grad = torch.randn(1, heads, s, d, device=dev, dtype=torch.bfloat16)

    def flex_step():
        out = _flex(q, k, v, sinks, window=window, scale=scale, block_mask=bm)
        torch.autograd.grad(out, (q, k, v, sinks), grad)

    def sdpa_step():
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=True
        )
        torch.autograd.grad(out, (q, k, v), grad)

    return _timed(flex_step, reps), _timed(sdpa_step, reps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tim_megatron.bench sink_attention")
    ap.add_argument("--seq", type=int, default=4096, help="tokens per sequence (timing)")
    ap.add_argument("--check-seq", type=int, default=1024, help="tokens per sequence (accuracy)")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "sink attention: needs CUDA (FlexAttention has no CPU backward in torch 2.13); not measured here"
        )
        return 0
    from torch.nn.attention.flex_attention import create_block_mask

    from tim_megatron.trainer.attention import windowed_causal

    heads, groups, d, dev = 64, 8, 64, "cuda"
    scale = 1 / math.sqrt(d)
    g = torch.Generator(device=dev).manual_seed(0)
    for window in (128, None):
        kind = f"window {window}" if window else "full"
        s = args.check_seq
        bm = create_block_mask(windowed_causal(window), None, None, s, s, device=dev)
        base = [
            torch.randn(1, h, s, d, generator=g, device=dev, dtype=torch.float64)
            for h in (heads, groups, groups)
        ]
        sinks64 = torch.randn(heads, generator=g, device=dev, dtype=torch.float64)
        grad64 = torch.randn(1, heads, s, d, generator=g, device=dev, dtype=torch.float64)
        ref_in = [t.clone().requires_grad_() for t in (*base, sinks64)]
        ref = _materialized(*ref_in[:3], ref_in[3], window=window, scale=scale)
        ref_grads = torch.autograd.grad(ref, ref_in, grad64)
        for dtype in (torch.float32, torch.bfloat16):
            for name, fn in (("sink flex", "flex"), ("materialized", "mat")):
                xs = [t.to(dtype).requires_grad_() for t in base] + [sinks64.float().requires_grad_()]
                if fn == "flex":
                    out = _flex(*xs[:3], xs[3], window=window, scale=scale, block_mask=bm)
                else:
                    out = _materialized(*xs[:3], xs[3], window=window, scale=scale)
                grads = torch.autograd.grad(out, xs, grad64.to(dtype))
                d_out = float((out.double() - ref).abs().max())
                d_grad = max(
                    float((a.double() - b).abs().max()) for a, b in zip(grads, ref_grads, strict=True)
                )
                print(
                    f"{kind:10s} {dtype!s:15s} {name:13s} max |d out| {d_out:.2e}  max |d grad| {d_grad:.2e}"
                )
        t_flex, t_sdpa = _time_layer(window=window, s=args.seq, reps=args.reps, scale=scale)
        print(
            f"{kind:10s} bf16 forward + backward at {args.seq} tokens: sink flex {1e3 * t_flex:.2f} ms, sdpa without "
            f"sinks {1e3 * t_sdpa:.2f} ms: ratio {t_flex / t_sdpa:.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
