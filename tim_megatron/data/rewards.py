"""Rewards: exact answers for the built-in task, checked chains for the countdown lab task, and math-verify
on ``\\boxed{}`` answers for math datasets."""

from __future__ import annotations

import re

from tim_megatron.data.arithmetic import exact_answer_reward
from tim_megatron.data.countdown import chain_reward


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces), or None."""
    i = text.rfind("\\boxed")
    if i < 0:
        return None
    j = text.find("{", i)
    if j < 0:
        return None
    depth = 0
    for k in range(j, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            depth -= 1
            if depth == 0:
                return text[j + 1 : k]
    return None


_ANSWER_LINE = re.compile(r"Answer\s*:\s*(.+)", re.IGNORECASE)


def math_reward(response: str, answer: str) -> float:
    """1.0 when the response's final answer equals the reference under math-verify.

    The answer is the last ``\\boxed{}`` (DAPO-Math-17k and AIME24 instructions ask for one), else the
    last ``Answer: ...`` line (DAPO's own prompt wording).
    """
    from math_verify import parse, verify

    pred = last_boxed(response)
    if pred is None:
        lines = _ANSWER_LINE.findall(response)
        pred = lines[-1].strip() if lines else None
    if pred is None:
        return 0.0
    try:
        gold = parse(f"${answer}$")
        got = parse(f"${pred}$")
        return 1.0 if gold and got and verify(gold, got) else 0.0
    except Exception:
        return 0.0


def reward(kind: str, response: str, answer: str) -> float:
    if kind == "exact":
        return exact_answer_reward(response, answer)
    if kind == "countdown":
        return chain_reward(response, answer)
    if kind == "math":
        return math_reward(response, answer)
    raise ValueError(f"reward kind {kind!r}: allowed exact, countdown, math")
