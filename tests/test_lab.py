"""The TIM lab: the countdown task, the grid runner's aggregation and verdict rules, the early warning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tim_megatron.data.countdown import all_problems, chain_reward, chain_value, random_chain, warmup_batch
from tim_megatron.recipe import RecipeError, load_recipe
from tim_megatron.recipe.schema import TaskConfig

ROOT = Path(__file__).resolve().parents[1]
COUNTDOWN = TaskConfig(kind="countdown", min_target=10, max_target=40, max_terms=12)

# ------------------------------------------------------------------------------------ the countdown task


@pytest.mark.parametrize(
    ("response", "target", "reward"),
    [
        ("9+8=17+9=26+6=32+5=37", "37", 1.0),
        (" 9+8=17+9=26+6=32+5=37 ", "37", 1.0),  # surrounding whitespace is not part of the chain
        ("7", "7", 1.0),  # a lone digit is a chain
        ("5*7=35+2=37", "37", 1.0),  # left to right, no precedence
        ("9-4=5*8=40", "40", 1.0),
        ("9+8=17+9=26+6=32+5=38", "37", 0.0),  # a wrong running value
        ("9+8=17+9=26", "37", 0.0),  # stops short
        ("9+8=17+9=26+6=32+5=37+1=38", "37", 0.0),  # overshoots
        ("9+8=017", "17", 0.0),  # no leading zeros
        ("10+7=17", "17", 0.0),  # one digit per step
        ("9+0=9", "9", 0.0),  # digits are 1..9
        ("2-3=-1", "-1", 0.0),  # never below zero
        ("9+8=17 so 17", "17", 0.0),  # nothing but the chain
        ("", "17", 0.0),
    ],
)
def test_chain_reward(response, target, reward):
    assert chain_reward(response, target) == reward


def test_random_chains_are_correct_and_end_in_range():
    g = torch.Generator().manual_seed(0)
    task = TaskConfig(kind="countdown", min_target=10, max_target=40, max_terms=12, ops=["+", "-", "*"])
    lengths = set()
    for _ in range(300):
        target, chain = random_chain(task, g)
        assert 10 <= target <= 40
        assert chain_value(chain) == target and chain_reward(chain, str(target)) == 1.0
        lengths.add(len(chain))
    assert min(lengths) <= 10 and max(lengths) >= 40  # the chains' lengths vary widely


def test_warmup_batch_labels_the_chain_and_eos_only():
    from tim_megatron.models.tiny import build_tokenizer

    tok = build_tokenizer(64)
    ids, labels = warmup_batch(
        tokenizer=tok, task=COUNTDOWN, batch_size=8, generator=torch.Generator().manual_seed(1)
    )
    for row, lab in zip(ids.tolist(), labels.tolist(), strict=True):
        eq = row.index(tok.convert_tokens_to_ids("="))  # the prompt ends at its '='
        prompt = tok.decode(row[:eq])
        assert all(x == -100 for x in lab[: eq + 1])
        kept = [x for x in lab if x != -100]
        assert kept[-1] == tok.eos_token_id
        chain = tok.decode(kept[:-1])
        assert chain_reward(chain, prompt) == 1.0


def test_prompt_source_serves_countdown_targets_with_their_reward():
    from tim_megatron.data.rewards import reward
    from tim_megatron.data.sources import PromptSource

    r = load_recipe(ROOT / "recipes/tiny-moe/countdown.yaml").recipe
    src = PromptSource(r.data, seed=3)
    assert {it.prompt for it in src.train} == {p.prompt for p in all_problems(r.data.task)}
    assert all(it.reward == "countdown" for it in [*src.train, *src.val])
    item = src.step_items(1, 1)[0]
    assert reward(item.reward, "9", item.answer) == 0.0  # 9 is below every target


def test_countdown_target_range_is_checked_at_load():
    with pytest.raises(RecipeError, match="data.task.max_target"):
        load_recipe(None, ["data.task.kind=countdown", "data.task.min_target=50", "data.task.max_target=40"])
    with pytest.raises(RecipeError, match="max_terms"):
        load_recipe(None, ["data.task.kind=countdown", "data.task.max_target=200", "data.task.max_terms=12"])
