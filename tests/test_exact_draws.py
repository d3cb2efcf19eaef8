"""Exact mode's counter-based draws: the int64 hash is SplitMix64 modulo 2^64, a row's draw depends on its own
seed, position and logits only, and the draw samples the distribution it is given."""

from __future__ import annotations

import math

import pytest
import torch

from tim_megatron.exact.draws import (
    _signed,
    gumbel_argmax,
    splitmix64,
    splitmix64_reference,
    uniforms,
    unit_interval,
)


def test_the_int64_hash_is_splitmix64_modulo_two_to_the_64():
    inputs = [
        0,
        1,
        2,
        12345,
        (1 << 31) - 1,
        1 << 32,
        (1 << 62) + 7,
        (1 << 63) - 1,
        -1,
        -(1 << 63),
        -987654321,
    ]
    got = splitmix64(torch.tensor(inputs, dtype=torch.long)).tolist()
    want = [_signed(splitmix64_reference(x & ((1 << 64) - 1))) for x in inputs]
    assert got == want
    # SplitMix64's published first output for seed 0 (state advanced once by the golden gamma).
    assert splitmix64_reference(0) == 0xE220A8397B1DCDAF


def test_uniforms_lie_strictly_inside_zero_one_and_depend_on_seed_position_and_index_only():
    seeds = torch.tensor([0, 7, 7, (1 << 31) - 1])
    positions = torch.tensor([0, 0, 1, (1 << 32) - 1])
    u = uniforms(seeds=seeds, positions=positions, count=1000)
    assert u.dtype == torch.float64 and u.shape == (4, 1000)
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert not torch.equal(u[1], u[2])  # another position, another stream
    # One row alone, or among others in another order, draws the same bits.
    alone = uniforms(seeds=seeds[2:3], positions=positions[2:3], count=1000)
    flipped = uniforms(seeds=seeds.flip(0), positions=positions.flip(0), count=1000)
    assert torch.equal(alone[0], u[2]) and torch.equal(flipped, u.flip(0))
    # More vocabulary entries extend the stream; they do not reshuffle it.
    assert torch.equal(uniforms(seeds=seeds, positions=positions, count=10), u[:, :10])


@pytest.mark.parametrize(
    ("seeds", "positions", "match"),
    [([-1], [0], "seeds"), ([1 << 31], [0], "seeds"), ([0], [-1], "positions"), ([0, 1], [0], "must be")],
)
def test_uniforms_refuse_keys_outside_their_range(seeds, positions, match):
    with pytest.raises(ValueError, match=match):
        uniforms(seeds=torch.tensor(seeds), positions=torch.tensor(positions), count=3)


def test_the_gumbel_max_draw_samples_the_softmax_it_is_given():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    rows = 40_000
    scores = torch.log(p).expand(rows, -1)
    tokens = gumbel_argmax(scores, seeds=torch.arange(rows), positions=torch.full((rows,), 3))
    freq = torch.bincount(tokens, minlength=5).double() / rows
    # A fixed set of keys (no luck involved): each frequency within 4 binomial standard errors of p.
    se = torch.sqrt(p.double() * (1 - p.double()) / rows)
    assert bool(((freq - p.double()).abs() <= 4 * se + 1e-12).all()), freq.tolist()
    assert int(freq[4] * rows) == 0  # -inf is never drawn


def test_a_rows_token_does_not_depend_on_the_batch_around_it():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(16, 300, generator=g)
    seeds, positions = torch.arange(100, 116), torch.arange(16) * 5
    together = gumbel_argmax(z, seeds=seeds, positions=positions)
    one_by_one = torch.cat(
        [
            gumbel_argmax(z[i : i + 1], seeds=seeds[i : i + 1], positions=positions[i : i + 1])
            for i in range(16)
        ]
    )
    assert torch.equal(together, one_by_one)
    order = torch.randperm(16, generator=g)
    assert torch.equal(
        gumbel_argmax(z[order], seeds=seeds[order], positions=positions[order]), together[order]
    )


def test_greedy_is_the_argmax_and_a_draw_is_not_always_the_argmax():
    z = torch.tensor([[0.1, 2.0, 1.9], [3.0, -1.0, 2.99]]).repeat(50, 1)
    keys = {"seeds": torch.arange(100), "positions": torch.zeros(100, dtype=torch.long)}
    assert gumbel_argmax(z, greedy=True, **keys).tolist() == [1, 0] * 50
    drawn = gumbel_argmax(z, **keys)
    assert set(drawn[0::2].tolist()) >= {1, 2} and set(drawn[1::2].tolist()) >= {0, 2}


def test_uniform_bits_are_the_top_52_of_the_hash_and_never_reach_zero_or_one():
    u = uniforms(seeds=torch.tensor([5]), positions=torch.tensor([9]), count=64)[0].tolist()
    key = splitmix64_reference(5 * (1 << 32) + 9)
    assert u == [((splitmix64_reference(key ^ i) >> 12) + 0.5) * 2.0**-52 for i in range(64)]
    # The extremes: all-zero and all-one hash bits (int64 0 and -1), and the largest below each half.
    ends = unit_interval(torch.tensor([0, -1, (1 << 63) - 1, -(1 << 63)])).tolist()
    assert ends == [2.0**-53, 1 - 2.0**-53, 0.5 - 2.0**-53, 0.5 + 2.0**-53]
    assert all(0 < x < 1 and math.isfinite(-math.log(-math.log(x))) for x in ends)
    # a -inf score stays undrawable even at the largest uniform
    z = torch.tensor([[0.0, float("-inf")]])
    assert gumbel_argmax(z, seeds=torch.tensor([0]), positions=torch.tensor([0])).tolist() == [0]
