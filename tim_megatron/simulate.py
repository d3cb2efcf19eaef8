"""The BF16 softmax experiment (objective-level-hacking paper, Appendix C.1, Table 2), through our injection code.

Logits are drawn in float32, z ~ N(0, logit_std^2) over a vocabulary; the low-precision distribution is
p~ = Q(exp(Q(z)) / sum exp(Q(z))) (Eq. 45, :func:`~tim_megatron.algo.injection.quantized_token_logprobs`).
A token is sampled from p~ (renormalized), and the ratio p_fp32 / p~ of its two probabilities is
recorded. KL is KL(p~ || p_fp32) over the whole vocabulary, averaged over samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tim_megatron.algo.injection import quantized_token_logprobs, round_mantissa


@dataclass
class PrecisionResult:
    mean: float
    std: float
    max: float
    min: float
    kl: float
    samples: int


def simulate_precision(
    *,
    vocab: int = 2048,
    samples: int = 50_000,
    logit_std: float = 1.5,
    seed: int = 1234,
    mantissa_bits: int = 7,
    chunk: int = 2048,
) -> PrecisionResult:
    g = torch.Generator().manual_seed(seed)
    ratios = []
    kl_sum = 0.0
    done = 0
    while done < samples:
        n = min(chunk, samples - done)
        z = torch.randn(n, vocab, generator=g) * logit_std
        logp = torch.log_softmax(z, dim=-1)
        zq = round_mantissa(z, mantissa_bits)
        p_low = round_mantissa(torch.exp(zq - torch.logsumexp(zq, -1, keepdim=True)), mantissa_bits)
        q = p_low / p_low.sum(-1, keepdim=True)
        tok = torch.multinomial(q, 1, generator=g).squeeze(-1)
        lp_low = quantized_token_logprobs(logits=z, tokens=tok, mantissa_bits=mantissa_bits)
        lp = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        ratios.append(torch.exp(lp.double() - lp_low.double()))
        logq = torch.log(q.clamp_min(1e-45))
        kl_sum += float((q * (logq - logp)).sum(-1).double().sum())
        done += n
    r = torch.cat(ratios)
    return PrecisionResult(
        mean=float(r.mean()),
        std=float(r.std(unbiased=False)),
        max=float(r.max()),
        min=float(r.min()),
        kl=kl_sum / samples,
        samples=samples,
    )
