"""Cost of the full per-step metric set, against the log-softmax every trainer already pays.

Times, per token, (a) everything the RL loop computes for TIM monitoring on a batch (mismatch for
old-vs-rollout and current-vs-rollout, rollout correction, surrogate J, response stats, loss clip stats,
and optionally routing agreement) and (b) ``torch.log_softmax`` over a [1024, 151936] logits block
(Qwen3's vocabulary), in the same process. Prints the ratio; the target is under 2%.
"""

from __future__ import annotations

import argparse
import time

import torch

from tim_megatron import outcome
from tim_megatron.algo import (
    compute_mismatch,
    objective_surrogate,
    response_metrics,
    response_stats,
    rollout_correction,
    routing_agreement_metrics,
    routing_agreement_stats,
)
from tim_megatron.algo.policy_loss import policy_loss_metrics, token_clip_loss


def _best(fn, repeat: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def run(
    *,
    tokens: int = 1_000_000,
    seq_len: int = 1024,
    vocab: int = 151_936,
    rows: int = 1024,
    layers: int = 48,
    top_k: int = 8,
    experts: int = 128,
    repeat: int = 3,
    device: str = "cpu",
) -> dict[str, float]:
    g = torch.Generator(device="cpu").manual_seed(0)
    b = tokens // seq_len
    infer = torch.log(torch.rand(b, seq_len, generator=g).clamp(1e-4)).to(device)
    old = (infer + 0.01 * torch.randn(b, seq_len, generator=g).to(device)).clamp(max=0)
    cur = (old + 0.01 * torch.randn(b, seq_len, generator=g).to(device)).clamp(max=0)
    mask = (torch.rand(b, seq_len, generator=g) > 0.1).to(device)
    adv = torch.randn(b, generator=g).to(device)
    ent = torch.rand(b, seq_len, generator=g).to(device)

    def metric_set():
        compute_mismatch(train_logprobs=old, infer_logprobs=infer, mask=mask, a="old", b="rollout")
        compute_mismatch(train_logprobs=cur, infer_logprobs=infer, mask=mask, a="current", b="rollout")
        _, _cs = rollout_correction(old_logprobs=old, rollout_logprobs=infer, mask=mask, mode="tis", c=2.0)
        objective_surrogate(advantages=adv, old_logprobs=old, mask=mask, delta=2.0, pi_low=0.1)
        response_metrics(response_stats(mask=mask, entropy=ent))
        _, ls = token_clip_loss(logprobs=cur, old_logprobs=old, advantages=adv, mask=mask)
        policy_loss_metrics(ls)

    n_tok = b * seq_len
    t_metrics = _best(metric_set, repeat)

    roll_e = torch.randint(experts, (layers, n_tok, top_k), generator=g, dtype=torch.int16).to(device)
    train_e = roll_e.clone()
    train_e[:, ::7, 0] = (train_e[:, ::7, 0] + 1) % experts

    def routing():
        routing_agreement_metrics(routing_agreement_stats(rollout_experts=roll_e, trainer_experts=train_e))

    t_routing = _best(routing, max(1, repeat - 1))

    logits = torch.randn(rows, vocab, generator=g).to(device)
    t_lsm = _best(lambda: torch.log_softmax(logits, dim=-1), repeat)

    per_tok_metrics = t_metrics / n_tok
    per_tok_routing = t_routing / n_tok
    per_tok_lsm = t_lsm / rows
    return {
        "tokens": n_tok,
        "metrics_s": t_metrics,
        "metrics_ns_per_token": per_tok_metrics * 1e9,
        "routing_s": t_routing,
        "routing_ns_per_token": per_tok_routing * 1e9,
        "log_softmax_ns_per_token": per_tok_lsm * 1e9,
        "ratio_metrics_vs_log_softmax": per_tok_metrics / per_tok_lsm,
        "ratio_routing_vs_log_softmax": per_tok_routing / per_tok_lsm,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tim_megatron.bench metrics")
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument(
        "--layers", type=int, default=48, help="MoE layers for routing agreement (Qwen3-30B-A3B: 48)"
    )
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    r = run(tokens=a.tokens, vocab=a.vocab, layers=a.layers, top_k=a.top_k, repeat=a.repeat, device=a.device)
    print(f"[metrics] device={a.device} tokens={r['tokens']:,} threads={torch.get_num_threads()}")
    print(
        f"  full TIM metric set        {r['metrics_s'] * 1e3:9.1f} ms  = {r['metrics_ns_per_token']:8.1f} ns/token"
    )
    print(
        f"  routing agreement ({a.layers} x top-{a.top_k}) {r['routing_s'] * 1e3:9.1f} ms  = {r['routing_ns_per_token']:8.1f} ns/token"
    )
    print(f"  torch.log_softmax [1024 x {a.vocab}]      = {r['log_softmax_ns_per_token']:8.1f} ns/token")
    o = outcome.judged(
        "ratio metrics / log_softmax",
        value=r["ratio_metrics_vs_log_softmax"] * 100,
        met=r["ratio_metrics_vs_log_softmax"] < 0.02,
        rule="< 2%",
        unit="%",
        group="metrics",
    )
    print("  " + outcome.target_line(o))
    print(
        f"  ratio routing / log_softmax  = {r['ratio_routing_vs_log_softmax'] * 100:.3f}%  (only with R3 or capture on)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
