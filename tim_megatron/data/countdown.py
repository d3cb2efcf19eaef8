"""The lab task: reach a target number with a chain of single digits, every running value written out.

A prompt is a target, ``37=``. A response is a chain that starts with one digit and applies one operator and
one digit per step, writing the running value after each step, left to right (no precedence):
``9+8=17+9=26+6=32+5=37``. The reward is 1 when the whole response has that form, every written value is
right and the last one (or the lone first digit) equals the target; anything else scores 0.

Why this task for the TIM lab (tim-megatron issue 13, item 3): many chains reach the same target, so the
policy keeps choosing among digits (tokens near and below pi_low = 0.1 keep appearing instead of the whole
response becoming one memorized answer); the response length is the policy's choice (a few large steps or
many small ones, 5 to over 100 tokens), so length can drift or surge; and every computed value is checked, so
the reward is exact. Only characters of the tiny tokenizer are used (digits, ``+-*=``).

The tiny model's warm-up (:func:`warmup_batch`) is supervised on random correct chains: the target of each is
where a random chain happens to end. It teaches the format and some arithmetic, not a strategy; RL starts
from a policy that is sometimes right.
"""

from __future__ import annotations

import re

import torch

from tim_megatron.data.arithmetic import Problem, sft_batch
from tim_megatron.recipe.schema import TaskConfig

DIGITS = tuple(range(1, 10))
_CHAIN = re.compile(r"[1-9](?:[-+*][1-9]=(?:0|[1-9][0-9]*))*")
_STEP = re.compile(r"([-+*])([1-9])=(0|[1-9][0-9]*)")


def _apply(value: int, op: str, digit: int) -> int:
    return value + digit if op == "+" else value - digit if op == "-" else value * digit


def targets(task: TaskConfig) -> list[int]:
    return list(range(task.min_target, task.max_target + 1))


def all_problems(task: TaskConfig) -> list[Problem]:
    return [Problem(f"{t}=", str(t)) for t in targets(task)]


def chain_value(response: str) -> int | None:
    """The final value of a well-formed chain whose every written value is right, else None."""
    text = response.strip()
    if not _CHAIN.fullmatch(text):
        return None
    value = int(text[0])
    for op, digit, written in _STEP.findall(text[1:]):
        value = _apply(value, op, int(digit))
        if value < 0 or str(value) != written:
            return None
    return value


def chain_reward(response: str, answer: str) -> float:
    """1.0 when ``response`` is a correct chain ending at the target ``answer``."""
    value = chain_value(response)
    return 1.0 if value is not None and str(value) == answer.strip() else 0.0


def random_chain(task: TaskConfig, generator: torch.Generator) -> tuple[int, str]:
    """(target, chain) of a random correct chain ending inside the task's target range.

    1..max_terms digits, each uniform over 1..9, operators uniform over ``task.ops``; a step that would leave
    the running value below 1 (``-``) or above twice the largest target (``*``) uses ``+`` instead."""
    ops = list(task.ops)

    def draw(n: int) -> int:
        return int(torch.randint(n, (1,), generator=generator))

    for _ in range(100_000):
        terms = 1 + draw(task.max_terms)
        value = DIGITS[draw(9)]
        text = str(value)
        for _ in range(terms - 1):
            op, digit = ops[draw(len(ops))], DIGITS[draw(9)]
            nxt = _apply(value, op, digit)
            if nxt < 1 or nxt > 2 * task.max_target:
                op, nxt = "+", value + digit
            value = nxt
            text += f"{op}{digit}={value}"
        if task.min_target <= value <= task.max_target:
            return value, text
    raise ValueError(
        f"data.task: no random chain of 1..{task.max_terms} digits with ops {task.ops} ended in "
        f"{task.min_target}..{task.max_target} in 100000 draws; widen the target range or raise max_terms"
    )


def warmup_batch(*, tokenizer, task: TaskConfig, batch_size: int, generator: torch.Generator):
    """``target= + chain + EOS`` sequences with labels on the chain and EOS only (supervised warm-up)."""
    eos = tokenizer.eos_token_id
    pairs = []
    for _ in range(batch_size):
        target, chain = random_chain(task, generator)
        pid = tokenizer.encode(f"{target}=", add_special_tokens=False)
        aid = [*tokenizer.encode(chain, add_special_tokens=False), eos]
        pairs.append((pid, aid))
    return sft_batch(pairs, pad=eos)
