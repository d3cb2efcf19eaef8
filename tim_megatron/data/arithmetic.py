"""The built-in task: seeded arithmetic prompts like ``3+4=`` with an exact-answer reward.

Small enough for the tiny MoE to learn by RL on a laptop CPU in minutes, and verifiable exactly.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from tim_megatron.recipe.schema import TaskConfig


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def all_problems(task: TaskConfig) -> list[Problem]:
    rng = range(task.max_operand + 1)
    return [
        Problem(f"{a}{op}{b}=", str(_apply(a, op, b)))
        for op in task.ops
        for a, b in itertools.product(rng, rng)
    ]


def possible_answers(task: TaskConfig) -> list[str]:
    return sorted({p.answer for p in all_problems(task)}, key=lambda s: (len(s), s))


def exact_answer_reward(response: str, answer: str) -> float:
    """1.0 when the response (up to end of text, whitespace stripped) is exactly the answer."""
    return 1.0 if response.strip() == answer else 0.0


def warmup_batch(*, tokenizer, task: TaskConfig, batch_size: int, generator: torch.Generator):
    """``prompt + random answer + EOS`` sequences with labels on the answer and EOS only (format SFT)."""
    pool = all_problems(task)
    answers = possible_answers(task)
    eos = tokenizer.eos_token_id
    pairs = []
    for _ in range(batch_size):
        p = pool[int(torch.randint(len(pool), (1,), generator=generator))]
        ans = answers[int(torch.randint(len(answers), (1,), generator=generator))]
        pid = tokenizer.encode(p.prompt, add_special_tokens=False)
        aid = [*tokenizer.encode(ans, add_special_tokens=False), eos]
        pairs.append((pid, aid))
    return sft_batch(pairs, pad=eos)


def sft_batch(pairs: list[tuple[list[int], list[int]]], *, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt ids, answer ids)`` pairs as a right-padded batch: input ids (padded with ``pad``) and labels
    on the answer tokens only (-100 on the prompt and the padding)."""
    width = max(len(p) + len(a) for p, a in pairs)
    ids = torch.full((len(pairs), width), pad, dtype=torch.long)
    lab = torch.full((len(pairs), width), -100, dtype=torch.long)
    for i, (p, a) in enumerate(pairs):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        lab[i, len(p) : len(p) + len(a)] = torch.tensor(a)
    return ids, lab
