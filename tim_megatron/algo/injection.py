"""Controlled mismatch, for causality experiments (VeXact style).

Objective level (objective-level-hacking paper): per-token weights multiplying the loss terms.

* biased distortion phi = delta where pi_old < pi_low, else 1 (Eq. 17-18; delta > 1, < 1 or 0);
* unbiased noise xi ~ N(1, sigma^2), independent per token (Eq. 21).

Logprob level, applied to rollout logprobs (typically after VeXact made them equal to the trainer's):

* precision: probabilities recomputed from logits through a low-precision softmax (Eq. 45), with a
  quantizer of any mantissa width (7 bits = bfloat16, 10 = float16);
* noise: additive Gaussian noise of a given std on log-probabilities;
* drift: a biased shift of log-probabilities, optionally only for low-probability tokens.

Plus the surrogate J = sum A (phi - 1) (Eq. 23) used to watch objective-level hacking.
"""

from __future__ import annotations

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


# -------------------------------------------------------------------------------------- logprob level


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Round to ``bits`` explicit mantissa bits, half to even (bits=7 matches bfloat16 for normal numbers)."""
    if not 1 <= bits <= 23:
        raise ValueError(f"mantissa bits = {bits}: allowed 1..23")
    x32 = x.to(torch.float32)
    mant, exp = torch.frexp(x32)  # x = mant * 2**exp, |mant| in [0.5, 1)
    scale = float(2 ** (bits + 1))
    return torch.ldexp(torch.round(mant * scale) / scale, exp)


def quantized_token_logprobs(
    *, logits: torch.Tensor, tokens: torch.Tensor, mantissa_bits: int = 7, temperature: float = 1.0
) -> torch.Tensor:
    """log p~ of ``tokens`` with p~_i = Q(exp(Q(z_i)) / sum_j exp(Q(z_j))) (Eq. 45), z = logits / temperature.

    The sum runs in float32 over the whole last dimension; pass a chunk of positions at a time.
    """
    z = round_mantissa(logits.to(torch.float32) / temperature, mantissa_bits)
    lse = torch.logsumexp(z, dim=-1)
    zt = z.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    p = round_mantissa(torch.exp(zt - lse), mantissa_bits)
    return torch.log(p)


def add_noise(*, logprobs: torch.Tensor, std: float, seed: int) -> torch.Tensor:
    """log p + N(0, std^2), clamped to <= 0."""
    noise = torch.randn(logprobs.shape, generator=_generator(seed), dtype=torch.float32).to(logprobs.device)
    return (logprobs + std * noise.to(logprobs.dtype)).clamp(max=0.0)


def add_drift(
    *,
    logprobs: torch.Tensor,
    drift: float,
    reference_logprobs: torch.Tensor | None = None,
    pi_low: float | None = None,
) -> torch.Tensor:
    """log p + drift for every token, or only where the reference probability is below ``pi_low``; <= 0."""
    shift = torch.full_like(logprobs, drift)
    if pi_low is not None:
        ref = logprobs if reference_logprobs is None else reference_logprobs
        shift = torch.where(torch.exp(ref) < pi_low, shift, torch.zeros_like(shift))
    return (logprobs + shift).clamp(max=0.0)
