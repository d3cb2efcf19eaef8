"""The BF16 softmax experiment (objective-level-hacking paper, Appendix C.1, Table 2), through our injection code.

Logits are drawn in float32, z ~ N(0, logit_std^2) over a vocabulary. The low-precision sampling distribution is
mu = p~ / sum p~ with p~ = Q(exp(Q(z)) / sum exp(Q(z))) (Eq. 45), Q a real cast to ``dtype`` and back: exactly
what ``diagnostics.sampling_injection.type: precision`` samples from
(:func:`~tim_megatron.algo.injection.perturbed_logprobs`). A token is sampled from mu and the ratio
p_fp32 / mu of its two probabilities is recorded. KL is KL(mu || p_fp32) over the whole vocabulary, averaged over
samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tim_megatron.algo.injection import perturbed_logprobs


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
    dtype: str = "bfloat16",
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
        logmu = perturbed_logprobs(logits=z, kind="precision", dtype=dtype)
        mu = torch.exp(logmu)
        tok = torch.multinomial(mu, 1, generator=g)
        ratios.append(torch.exp(logp.gather(-1, tok).double() - logmu.gather(-1, tok).double()).squeeze(-1))
        kl_sum += float(torch.where(mu > 0, mu * (logmu - logp), 0.0).sum(-1).double().sum())
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
