"""Controlled mismatch, for causality experiments (VeXact style).

Objective level (objective-level-hacking paper): per-token weights multiplying the loss terms.

* biased distortion phi = delta where pi_old < pi_low, else 1 (Eq. 17-18; delta > 1, < 1 or 0);
* unbiased noise xi ~ N(1, sigma^2), independent per token (Eq. 21).

Sampling level (``diagnostics.sampling_injection``): the rollout samples from mu = perturb(pi) instead of the
policy pi and logs mu's logprobs, so the tokens trained on are drawn from mu, as with a real mismatch
(:func:`perturbed_logprobs`: Eq. 45's low-precision softmax with real bfloat16/float16 casts, zero-mean logit
noise, or the phi distortion applied to the sampling probabilities).

Plus the surrogate J = sum A (phi - 1) (Eq. 23) used to watch objective-level hacking.
"""

from __future__ import annotations

import math

import torch

from tim_megatron.algo.stats import Stats


def _generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(seed) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def step_seed(seed: int, step: int, salt: int = 0) -> int:
    """A per-step seed that does not depend on the parallel layout."""
    return (seed * 1_000_003 + step * 7919 + salt * 104_729) & 0x7FFF_FFFF


# ------------------------------------------------------------------------------------ objective level


def biased_distortion(
    *, old_logprobs: torch.Tensor, mask: torch.Tensor, delta: float, pi_low: float
) -> torch.Tensor:
    """phi: ``delta`` for tokens with pi_old < pi_low, 1 elsewhere (0 on padding)."""
    low = torch.exp(old_logprobs.detach()) < pi_low
    phi = torch.where(low, torch.full_like(old_logprobs, delta), torch.ones_like(old_logprobs))
    return phi.masked_fill(~mask.bool(), 0.0).detach()


def unbiased_noise(
    *, shape: tuple[int, ...], sigma: float, seed: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """xi ~ N(1, sigma^2) per token, reproducible from ``seed`` (draw for the global batch, then slice)."""
    z = torch.randn(shape, generator=_generator(seed), dtype=torch.float32)
    return (1.0 + sigma * z).to(device)


def objective_surrogate(
    *, advantages: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, delta: float, pi_low: float
) -> Stats:
    """Sums behind J = sum_{i,t} A_{i,t} (phi_{i,t} - 1) with phi from :func:`biased_distortion`."""
    m = mask.bool()
    adv = advantages.unsqueeze(-1).expand_as(old_logprobs) if advantages.dim() == 1 else advantages
    phi = biased_distortion(old_logprobs=old_logprobs, mask=m, delta=delta, pi_low=pi_low)
    j = (adv.to(torch.float64) * (phi.to(torch.float64) - 1.0))[m]
    s = Stats()
    s.add_sum("J", j.sum())
    s.add_sum("tokens", m.sum())
    s.add_sum("low_tokens", ((torch.exp(old_logprobs) < pi_low) & m).sum())
    return s


# ------------------------------------------------------------------------------------- sampling level

LOW_PRECISION = {"bfloat16": torch.bfloat16, "float16": torch.float16}
"""The formats Eq. 45's quantizer Q can be: real torch dtypes, cast to and back."""


def quantize(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """Q(x): a real cast to ``dtype`` and back to float32 (round to nearest even, with the format's subnormals,
    underflow to 0 and overflow to inf)."""
    if dtype not in LOW_PRECISION:
        raise ValueError(f"quantize dtype = {dtype!r}: allowed {sorted(LOW_PRECISION)}")
    return x.to(torch.float32).to(LOW_PRECISION[dtype]).to(torch.float32)


def low_precision_softmax(*, logits: torch.Tensor, dtype: str) -> torch.Tensor:
    """Eq. 45: p~_i = Q(exp(Q(z_i)) / sum_j exp(Q(z_j))) over the last dimension, from float32 logits ``z``.

    The exponentials and their sum are float32 (Eq. 45 quantizes only the logits and the quotient). ``logits``
    must be float32: rounding logits that a low-precision head already rounded does nothing."""
    if logits.dtype != torch.float32:
        raise ValueError(f"low_precision_softmax needs float32 logits (got {logits.dtype})")
    zq = quantize(logits, dtype)
    return quantize(torch.exp(zq - torch.logsumexp(zq, dim=-1, keepdim=True)), dtype)


def sampling_noise(*, seed: int, sample_seed: int, position: int, vocab: int) -> torch.Tensor:
    """Standard normal noise over the vocabulary for one sample's token ``position`` (0 = the first response
    token), a function of (injection seed, sample seed, position) only, so every engine and layout draws the same."""
    g = _generator((seed * 1_000_003 + sample_seed) * 65_537 + position)
    return torch.randn(vocab, generator=g, dtype=torch.float32)


def perturbed_logprobs(
    *,
    logits: torch.Tensor,
    kind: str,
    dtype: str = "bfloat16",
    std: float = 0.0,
    delta: float = 1.0,
    pi_low: float = 0.1,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """log mu over the last dimension, for the sampling distribution mu = perturb(pi), pi = softmax(logits).

    ``logits`` are float32 and already divided by the temperature. Every mu is normalised (its exp sums to 1;
    -inf where mu is 0, and such a token is never sampled):

    * ``precision``: mu = p~ / sum p~ with p~ from Eq. 45 (:func:`low_precision_softmax`) in ``dtype``;
    * ``noise``: mu = softmax(logits + std * noise), ``noise`` standard normal per vocabulary entry (zero-mean
      logit noise: no token is preferred on average);
    * ``bias``: mu_i = pi_i phi_i / sum_j pi_j phi_j with phi_i = ``delta`` where pi_i < ``pi_low``, else 1 (the
      distortion phi of Eq. 17-18, put into the sampling probabilities instead of the loss weights).
    """
    z = logits.to(torch.float32)
    if kind == "precision":
        p = low_precision_softmax(logits=z, dtype=dtype)
        return torch.log(p) - torch.log(p.sum(-1, keepdim=True))
    if kind == "noise":
        if noise is None or noise.shape != z.shape:
            raise ValueError("noise injection needs standard normal noise of the logits' shape")
        return torch.log_softmax(z + std * noise.to(z.dtype), dim=-1)
    if kind == "bias":
        if not delta > 0:
            raise ValueError(f"bias injection needs delta > 0 (got {delta})")
        low = torch.softmax(z, dim=-1) < pi_low
        return torch.log_softmax(torch.where(low, z + math.log(delta), z), dim=-1)
    raise ValueError(f"sampling injection type {kind!r}: allowed precision, noise, bias")
