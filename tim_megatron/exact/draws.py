"""Counter-based sampling: a token drawn as a pure function of (sample seed, position, logits), on any device.

Exact mode samples every row of a rollout in one forward. A stateful generator per row (``torch.Generator``) lives
on the CPU and draws one row at a time; a counter-based draw needs no state: the uniform for vocabulary entry
``i`` of the token at response position ``p`` of the sample with seed ``s`` is a hash of ``(s, p, i)``. The same
integer arithmetic runs on the CPU and on a CUDA device (int64 products wrap modulo 2^64 on both), so a row's
uniforms do not depend on the device, on the other rows of the batch, on their order or on how many were drawn
before: a resumed, regenerated or re-batched row draws the same token from the same logits. (The float64 ``log``
of the Gumbel noise may differ in the last bit between devices, which could flip a near-tie; it has not run on
a GPU.)

The token is the Gumbel-max choice ``argmax_i (z_i + g_i)`` with ``g_i = -log(-log u_i)``, which samples
``softmax(z)`` exactly (for greedy decoding ``g = 0``). The hash is SplitMix64's finaliser (Steele, Lea and
Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014), applied twice: once to the row's key
``s * 2^32 + p``, once to that result xor ``i``; the top 52 bits make the uniform (:func:`unit_interval`). ``tests/test_exact_draws.py`` checks the integer arithmetic
against a Python reference modulo 2^64 and the draw's frequencies against the distribution it samples.
"""

from __future__ import annotations

import torch

_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1


def _signed(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` on int64 is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser of ``x + golden`` on int64 tensors (the bits of the unsigned result)."""
    z = x + _signed(_GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    return z ^ _shr(z, 31)


def splitmix64_reference(x: int) -> int:
    """The same function on Python integers modulo 2^64 (the tests' reference)."""
    z = (x + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """int64 hash bits -> float64 in (0, 1): the top 52 bits, centred, so the extremes are 2^-53 and 1 - 2^-53
    (both exact in float64: a draw is never 0 or 1, so ``-log(-log u)`` is finite)."""
    return (_shr(bits, 12).double() + 0.5) * 2.0**-52


def uniforms(
    *, seeds: torch.Tensor, positions: torch.Tensor, count: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """``[rows, count]`` float64 uniforms in (0, 1): entry ``(r, i)`` a function of ``(seeds[r], positions[r], i)``
    only, on ``device`` (default: the device of ``seeds``; the keys are checked where they are, before moving).
    ``seeds`` below 2^31 and ``positions`` below 2^32 (int64)."""
    if seeds.shape != positions.shape or seeds.dim() != 1:
        raise ValueError(
            f"uniforms: seeds {tuple(seeds.shape)} and positions {tuple(positions.shape)} must be [rows]"
        )
    if len(seeds) and (int(seeds.min()) < 0 or int(seeds.max()) >= 1 << 31):
        raise ValueError("uniforms: seeds must lie in [0, 2^31)")
    if len(positions) and (int(positions.min()) < 0 or int(positions.max()) >= 1 << 32):
        raise ValueError("uniforms: positions must lie in [0, 2^32)")
    device = seeds.device if device is None else device
    key = splitmix64(seeds.long().to(device) * (1 << 32) + positions.long().to(device))
    index = torch.arange(count, dtype=torch.long, device=device)
    return unit_interval(splitmix64(key[:, None] ^ index[None, :]))


def gumbel_argmax(
    scores: torch.Tensor, *, seeds: torch.Tensor, positions: torch.Tensor, greedy: bool = False
) -> torch.Tensor:
    """One token per row of ``scores [rows, V]`` (logits or log-probabilities; ``-inf`` never drawn): a draw from
    ``softmax(scores)`` keyed by each row's sample seed and response position (``[rows]`` int64), or the argmax
    when ``greedy``. Returns ``[rows]`` int64 on ``scores``' device."""
    z = scores.double()
    if not greedy:
        u = uniforms(seeds=seeds, positions=positions, count=z.shape[-1], device=z.device)
        z = z - torch.log(-torch.log(u))
    return z.argmax(-1)
