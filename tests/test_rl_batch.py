"""In-process unit tests of the step's batching (rl/batch.py): rows, padding, row order, data-parallel shards.
No megatron-core, no vLLM, no subprocess: seconds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tim_megatron.rl.batch import FINISH, StepBatch, concat, from_samples, rank_rows
from tim_megatron.rl.objective import LossRows
from tim_megatron.rollout.base import FleetLayout, Sample

LAYERS, TOP_K = 2, 2


def _sample(prompt_index: int, sample_index: int, *, prompt_len: int, response_len: int, engine: int = 0):
    """A sample whose token ids and logprobs encode where they are, so any misplaced row or column shows."""
    tag = 100 * prompt_index + 10 * sample_index
    positions = prompt_len + response_len - 1
    return Sample(
        prompt_ids=[tag + 1] * prompt_len,
        response_ids=[tag + 2 + k for k in range(response_len)],
        logprobs=[-(tag + k) / 1000.0 for k in range(response_len)],
        finish_reason="length" if response_len >= 3 else "stop",
        routed_experts=np.full((positions, LAYERS, TOP_K), (tag // 10) % 7, dtype=np.int64),
        prompt_index=prompt_index,
        sample_index=sample_index,
        engine=engine,
    )


def _block(prompts: list[int], *, group: int = 2, total_prompts: int = 4, engine: int = 0) -> StepBatch:
    groups = [
        [
            _sample(p, s, prompt_len=2 + p % 2, response_len=1 + (p + s) % 3, engine=engine)
            for s in range(group)
        ]
        for p in prompts
    ]
    rewards = [[float(p * 10 + s) for s in range(group)] for p in prompts]
    return from_samples(groups, rewards, total_rows=total_prompts * group, num_moe_layers=LAYERS, top_k=TOP_K)


def test_from_samples_places_every_token_and_numbers_rows_globally():
    b = _block([2, 3])
    assert b.row.tolist() == [4, 5, 6, 7]  # prompt index x group size + sample index
    assert b.rewards.tolist() == [20.0, 21.0, 30.0, 31.0]
    assert b.group_size == 2 and b.total_rows == 8 and b.engine.tolist() == [0, 0, 0, 0]
    # prompt 2: prompt_len 2, responses 3 and 1 tokens; prompt 3: prompt_len 3, responses 1 and 2
    assert b.lengths.tolist() == [5, 3, 4, 5] and b.prompt_lens.tolist() == [2, 2, 3, 3] and b.width == 5
    assert b.truncated.tolist() == [True, False, False, False]
    assert b.finish.tolist() == [FINISH["length"], FINISH["stop"], FINISH["stop"], FINISH["stop"]]
    for i in range(len(b)):
        p, n = int(b.prompt_lens[i]), int(b.lengths[i])
        assert b.response_mask[i].tolist() == [False] * p + [True] * (n - p) + [False] * (b.width - n)
        assert (b.input_ids[i, n:] == 0).all() and (b.rollout_logprobs[i, n:] == 0).all()
    tag = 100 * 3 + 10 * 1  # prompt 3, sample 1: its 2 response tokens and logprobs, right after the prompt
    assert b.input_ids[3, 3:5].tolist() == [tag + 2, tag + 3]
    assert b.rollout_logprobs[3, 3:5].tolist() == pytest.approx([-tag / 1000.0, -(tag + 1) / 1000.0])
    assert b.routed_experts.shape == (LAYERS, 4, 5, TOP_K) and b.routed_experts.dtype == torch.int16
    assert int(b.routed_experts[0, 3, 0, 0]) == (tag // 10) % 7


def test_rows_select_and_trim_the_padding():
    b = _block([2, 3])
    one = b.rows(torch.tensor([1]))  # prompt 2, sample 1: 3 tokens
    assert one.width == 3 and one.row.tolist() == [5] and one.routed_experts.shape == (LAYERS, 1, 3, TOP_K)
    assert torch.equal(one.input_ids[0], b.input_ids[1, :3])
    two = b.rows(torch.tensor([3, 0]))  # any order, kept as given
    assert two.row.tolist() == [7, 4] and two.width == 5 and two.rewards.tolist() == [31.0, 20.0]


def test_concat_pads_to_the_widest_and_keeps_order():
    a, b = _block([0], total_prompts=2), _block([1], total_prompts=2, engine=1)
    both = concat([b, a])
    assert both.row.tolist() == [2, 3, 0, 1] and both.engine.tolist() == [1, 1, 0, 0]
    assert both.width == max(a.width, b.width)
    assert (
        torch.equal(both.input_ids[2, : a.width], a.input_ids[0])
        and (both.input_ids[2, a.width :] == 0).all()
    )
    assert both.routed_experts.shape == (LAYERS, 4, both.width, TOP_K)
    assert len(concat([a, a.rows(torch.tensor([], dtype=torch.long)), b])) == 4  # empty parts are skipped


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_trainer_shard_gives_each_dp_rank_its_rows_in_row_order(dp_size):
    """One process, the whole step in one block but shuffled: each data-parallel rank gets rows
    [d N / D, (d + 1) N / D) in row order, whatever order the engine returned them in."""
    block = _block([0, 1, 2, 3])
    shuffled = block.rows(torch.tensor([5, 2, 7, 0, 3, 6, 1, 4]))
    layout = FleetLayout(world=1, ranks_per_engine=1)
    per = 8 // dp_size
    seen = []
    for d in range(dp_size):
        mine = rank_rows(shuffled, layout=layout, rank=0, dp_rank=d, dp_size=dp_size)
        assert mine.row.tolist() == list(range(d * per, (d + 1) * per))
        assert mine.rewards.tolist() == [float((r // 2) * 10 + r % 2) for r in mine.row.tolist()]
        seen += mine.row.tolist()
    assert seen == list(range(8))


def test_loss_inputs_select_the_same_rows_everywhere():
    n, width = 4, 3
    loss_rows = LossRows(
        old=torch.arange(n * width, dtype=torch.float32).view(n, width),
        rollout=-torch.arange(n * width, dtype=torch.float32).view(n, width),
        mask=torch.tensor([[1, 1, 0]] * n, dtype=torch.bool),
        advantages=torch.tensor([0.0, 1.0, 2.0, 3.0]),
        weights=torch.ones(n, width) * torch.arange(n).view(n, 1),
    )
    sub = loss_rows.rows(torch.tensor([2, 0]))
    assert sub.advantages.tolist() == [2.0, 0.0] and sub.old[0].tolist() == [6.0, 7.0, 8.0]
    assert sub.rollout[1].tolist() == [0.0, -1.0, -2.0] and sub.weights[:, 0].tolist() == [2.0, 0.0]
    moved = sub.to(torch.device("cpu"))
    assert all(
        torch.equal(x, y)
        for x, y in zip(
            (moved.old, moved.rollout, moved.mask, moved.advantages, moved.weights),
            (sub.old, sub.rollout, sub.mask, sub.advantages, sub.weights),
            strict=True,
        )
    )


def test_cat_padded_pads_the_narrow_with_zeros_at_the_end_and_leaves_other_dims():
    from tim_megatron.rl.batch import cat_padded

    a = torch.tensor([[1, 2, 3]])
    b = torch.tensor([[4], [5]])
    assert cat_padded([a, b], pad_dim=1, cat_dim=0).tolist() == [[1, 2, 3], [4, 0, 0], [5, 0, 0]]
    rows = [torch.tensor([0, 1]), torch.tensor([2])]  # 1-D: nothing to pad, concatenated as they are
    assert cat_padded(rows, pad_dim=1, cat_dim=0).tolist() == [0, 1, 2]
    routed_a = torch.ones(2, 1, 3, 2, dtype=torch.int16)  # [layers, rows, width, k]
    routed_b = torch.full((2, 2, 1, 2), 7, dtype=torch.int16)
    out = cat_padded([routed_a, routed_b], pad_dim=2, cat_dim=1)
    assert out.shape == (2, 3, 3, 2) and out.dtype == torch.int16
    assert out[:, 1:, 1:].eq(0).all() and out[:, 1:, :1].eq(7).all() and out[:, :1].eq(1).all()
