"""The update's own paths, new against old, measured in one process (issue 57, items 1-3).

* the LM head and logprob: one autograd function (:class:`tim_megatron.trainer.logprobs._HeadLogprobs`) against
  each chunk under activation checkpointing (its GEMM and cross-entropy run again in the backward), forward and
  backward over ``tokens`` positions of a ``vocab``-wide head;
* the finite check: one ``aminmax`` per gradient buffer (:func:`~tim_megatron.trainer.megatron_trainer.all_finite`)
  against the float64 sum it replaced;
* Adam: torch's fused AdamW against its foreach AdamW on ``params`` parameters in a few tensors;
* the grad norm: :func:`patches.megatron.sync_free_grad_norm.l2_norm` (foreach norms, no host read) against
  megatron-core's local fallback (a norm and a host read per tensor), on ``norm_tensors`` tensors.

Each line prints new / old (below 1: the new path is faster). On CPU these are CPU figures: the host syncs the new
paths remove cost nothing there, so the GPU's gain is not shown by them (``make gpu-check`` measures it).
"""

from __future__ import annotations

import argparse
import time

import torch


def _best(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def head(
    *, tokens: int, hidden: int, vocab: int, chunk: int, repeat: int, device: str
) -> tuple[float, float]:
    import os

    import torch.distributed as dist

    from tim_megatron.trainer.logprobs import HeadSpec, token_logprobs

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29571")
        dist.init_process_group("gloo", rank=0, world_size=1)
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(1, 1)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, 1, hidden, generator=g).to(device=device, dtype=torch.bfloat16).requires_grad_()
    w = (
        (torch.randn(vocab, hidden, generator=g) * 0.02)
        .to(device=device, dtype=torch.bfloat16)
        .requires_grad_()
    )
    ids = torch.randint(vocab, (1, tokens), generator=g).to(device)

    def step(fused: bool):
        h.grad = w.grad = None
        lp = token_logprobs(
            hidden=h,
            input_ids=ids,
            weight=w,
            spec=HeadSpec(chunk=chunk, fused=fused),
            sequence_parallel=False,
        ).logprobs
        lp.sum().backward()

    return _best(lambda: step(True), repeat), _best(lambda: step(False), repeat)


def finite(*, elements: int, repeat: int, device: str) -> tuple[float, float]:
    from tim_megatron.trainer.megatron_trainer import all_finite

    buf = torch.randn(elements, generator=torch.Generator().manual_seed(1)).to(device)
    return (
        _best(lambda: all_finite([buf]), repeat),
        _best(lambda: torch.isfinite(buf.sum(dtype=torch.float64)).item(), repeat),
    )


def adam(*, params: int, tensors: int, repeat: int, device: str) -> tuple[float, float]:
    out = []
    for kw in ({"fused": True}, {"foreach": True}):
        ps = [torch.nn.Parameter(torch.zeros(params // tensors, device=device)) for _ in range(tensors)]
        for p in ps:
            p.grad = torch.full_like(p, 1e-3)
        o = torch.optim.AdamW(ps, lr=1e-4, **kw)
        out.append(_best(o.step, repeat))
    return out[0], out[1]


def grad_norm(*, tensors: int, size: int, repeat: int, device: str) -> tuple[float, float]:
    from megatron.core.utils import local_multi_tensor_l2_norm

    from patches.megatron import cpu_shims
    from patches.megatron.sync_free_grad_norm import l2_norm

    grads = [torch.randn(size, device=device) for _ in range(tensors)]
    flag = torch.zeros(1, dtype=torch.int, device=device)

    def old():
        with cpu_shims.cuda_placement_to_cpu():
            local_multi_tensor_l2_norm(0, flag, [grads], False)

    return _best(lambda: l2_norm(0, flag, [grads], False), repeat), _best(old, repeat)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tim_megatron.bench step_paths")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32_768)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    where = "CPU" if a.device == "cpu" else a.device
    print(f"[step_paths] device={a.device} threads={torch.get_num_threads()} ({where} figures)")
    rows = [
        (
            f"head + logprob fwd+bwd, {a.tokens} x {a.vocab} (one function / checkpointed chunks)",
            head(
                tokens=a.tokens,
                hidden=a.hidden,
                vocab=a.vocab,
                chunk=a.chunk,
                repeat=a.repeat,
                device=a.device,
            ),
        ),
        (
            "finite check, 50M fp32 gradients (aminmax / float64 sum)",
            finite(elements=50_000_000, repeat=a.repeat, device=a.device),
        ),
        (
            "AdamW step, 20M parameters in 64 tensors (fused / foreach)",
            adam(params=20_000_000, tensors=64, repeat=a.repeat, device=a.device),
        ),
        (
            "grad norm, 266 tensors of 64k (foreach, no host read / megatron's fallback)",
            grad_norm(tensors=266, size=65_536, repeat=a.repeat, device=a.device),
        ),
    ]
    for label, (new, old) in rows:
        print(f"  {label:<80} {new * 1e3:8.1f} ms / {old * 1e3:8.1f} ms = {new / old:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
