"""The MoE token dispatcher: ``indexed`` (:mod:`tim_megatron.trainer.dispatch`) against megatron-core's all-gather
dispatcher (and, on CUDA, its all-to-all one, what ``auto`` took there before) at one rank, on the same router
output, forward + backward, under deterministic algorithms (as the trainer runs).

Two phases are timed separately, each with its backward: the permute (the routing plan or megatron's token counts,
the rows and their probabilities grouped by expert) and the combine (the experts' rows summed back per token). The
experts are not run. On CPU (the default) the host syncs that the indexed dispatcher removes cost nothing, so the
ratio is only the gathers' and sums' work against ``masked_select`` and ``index_add_``. ``--device cuda`` times the
same on the GPU (CUDA-synchronized clocks) and counts each dispatcher's host syncs per forward + backward
(``torch.cuda.set_sync_debug_mode``), at Qwen3-30B-A3B's shape with ``--tokens 8192 --hidden 2048``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from tim_megatron import outcome


def dispatchers(*, experts: int, topk: int, hidden: int, on_gpu: bool):
    """The dispatchers compared, as an MoE layer holds them (one rank; needs megatron-core's parallel state)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.token_dispatcher import (
        MoEAllGatherTokenDispatcher,
        MoEAlltoAllTokenDispatcher,
    )

    from tim_megatron.trainer.dispatch import indexed_dispatcher_class

    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=4,
        num_moe_experts=experts,
        moe_router_topk=topk,
        add_bias_linear=False,
        use_cpu_initialization=not on_gpu,
    )
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    local = list(range(experts))
    out = {"allgather": MoEAllGatherTokenDispatcher(experts, local, config=cfg, pg_collection=pgs)}
    if on_gpu:  # the all-to-all dispatcher creates CUDA streams
        out["alltoall"] = MoEAlltoAllTokenDispatcher(experts, local, config=cfg, pg_collection=pgs)
    out["indexed"] = indexed_dispatcher_class()(experts, local, config=cfg, pg_collection=pgs)
    return out


def _permute(d, x, probs, routing_map):
    h, p = d.dispatch_preprocess(x, routing_map, probs)
    h, p = d.token_dispatch(h, p)
    return d.dispatch_postprocess(h, p)


def _combine(d, y):
    return d.combine_postprocess(d.token_combine(d.combine_preprocess(y)))


def run(
    *, experts: int, topk: int, tokens: int, hidden: int, repeat: int, dtype: torch.dtype, device: str
) -> dict:
    on_gpu = device == "cuda"
    g = torch.Generator().manual_seed(0)
    chosen = torch.rand(tokens, experts, generator=g).topk(topk, -1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, chosen, True).to(device)
    probs = (torch.rand(tokens, experts, generator=g).to(device) * routing_map).float()
    x = torch.randn(tokens, 1, hidden, generator=g).to(device=device, dtype=dtype)
    grad_rows = torch.randn(tokens * topk, hidden, generator=g).to(device=device, dtype=dtype)
    grad_out = torch.randn(tokens, 1, hidden, generator=g).to(device=device, dtype=dtype)
    ds = dispatchers(experts=experts, topk=topk, hidden=hidden, on_gpu=on_gpu)

    def clock() -> float:
        if on_gpu:
            torch.cuda.synchronize()
        return time.perf_counter()

    def permute_step(d):
        xi = x.clone().requires_grad_()
        pi = probs.clone().requires_grad_()
        t = clock()
        rows, _, pp = _permute(d, xi, pi, routing_map)
        torch.autograd.backward([rows, pp], [grad_rows, torch.ones_like(pp)])
        return clock() - t, (rows.detach(), pp.detach())

    def combine_step(d):
        _permute(d, x, probs, routing_map)  # the dispatcher's state for the combine, not timed
        y = grad_rows.clone().requires_grad_()
        t = clock()
        out = _combine(d, y)
        out.backward(grad_out)
        return clock() - t, out.detach().float()

    want_rows, want_pp = permute_step(ds["allgather"])[1]
    got_rows, got_pp = permute_step(ds["indexed"])[1]
    want = combine_step(ds["allgather"])[1]
    result = {
        "equal": torch.equal(got_rows, want_rows) and torch.equal(got_pp, want_pp),
        "diff": float((combine_step(ds["indexed"])[1] - want).abs().max() / want.abs().max()),
        "syncs": {n: host_syncs(lambda d=d: (permute_step(d), combine_step(d))) for n, d in ds.items()}
        if on_gpu
        else {},
    }
    times = {(phase, n): [] for phase in ("permute", "combine") for n in ds}
    for _ in range(repeat):  # interleaved, so drift hits every dispatcher alike
        for n, d in ds.items():
            times[("permute", n)].append(permute_step(d)[0])
            times[("combine", n)].append(combine_step(d)[0])
    result["seconds"] = {k: statistics.median(v) for k, v in times.items()}
    return result


def host_syncs(fn) -> int:
    """How many times ``fn`` makes the host wait for the GPU (``torch.cuda.set_sync_debug_mode('warn')`` warns
    once per synchronizing call)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tim_megatron.bench dispatch")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=11)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1: the work, not the pool's waits)"
    )
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")

    from patches.megatron import cpu_shims
    from tim_megatron.recipe.schema import ParallelismConfig
    from tim_megatron.trainer.parallel import init_parallel, teardown_parallel

    shims = cpu_shims.apply() if cpu_shims.needed() else None
    init_parallel(ParallelismConfig(), environ={})  # one process on a free loopback port
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # as the trainer runs (trainer.deterministic)
    label = "CPU" if a.device == "cpu" else torch.cuda.get_device_name()
    print(
        f"[dispatch] indexed vs megatron-core's dispatchers at one rank, forward + backward, {a.tokens} tokens x "
        f"top-{a.topk}, hidden {a.hidden}, {a.dtype}, "
        + (f"{torch.get_num_threads()} threads, device=cpu (a CPU figure)" if a.device == "cpu" else label)
    )
    try:
        for experts in (64, 128):
            r = run(
                experts=experts,
                topk=a.topk,
                tokens=a.tokens,
                hidden=a.hidden,
                repeat=a.repeat,
                dtype=getattr(torch, a.dtype),
                device=a.device,
            )
            s = r["seconds"]
            names = sorted({n for _, n in s}, key=["allgather", "alltoall", "indexed"].index)
            print(
                f"  {experts:3d} experts: "
                + "; ".join(
                    f"{phase} " + ", ".join(f"{n} {s[(phase, n)] * 1e3:.2f} ms" for n in names)
                    for phase in ("permute", "combine")
                )
                + f"; rows and probabilities equal: {r['equal']}; combined outputs differ by at most "
                f"{r['diff']:.1e} of the largest"
            )
            if r["syncs"]:
                print(
                    "    host syncs per forward + backward: "
                    + ", ".join(f"{n} {c}" for n, c in r["syncs"].items())
                )
            for phase in ("permute", "combine"):
                for base in (n for n in names if n != "indexed"):
                    o = outcome.Outcome(
                        f"{label}: indexed / {base} {phase} at {experts} experts",
                        "info",
                        value=s[(phase, "indexed")] / s[(phase, base)],
                        unit="x",
                        rule=f"a {label} figure, not judged",
                        group="dispatch",
                    )
                    print("  " + outcome.target_line(o))
    finally:
        torch.use_deterministic_algorithms(was)
        teardown_parallel()
        if shims is not None:
            shims.revert()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
