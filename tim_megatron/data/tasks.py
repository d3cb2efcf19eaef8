"""The built-in tasks by ``task.kind``: which problems, which reward, which format warm-up (arithmetic, or the
countdown lab task). Each task's own module knows only itself."""

from __future__ import annotations

import random

import torch

from tim_megatron.data import arithmetic, countdown
from tim_megatron.data.arithmetic import Problem
from tim_megatron.recipe.schema import TaskConfig


def task_problems(task: TaskConfig) -> list[Problem]:
    """Every problem of the built-in task ``task.kind``."""
    return countdown.all_problems(task) if task.kind == "countdown" else arithmetic.all_problems(task)


def task_reward_kind(task: TaskConfig) -> str:
    """The reward function of the built-in task (a kind of :func:`tim_megatron.data.rewards.reward`)."""
    return "countdown" if task.kind == "countdown" else "exact"


def problem_pool(task: TaskConfig, seed: int) -> list[Problem]:
    """The fixed prompt pool: every problem, or ``num_prompts`` of them drawn with ``seed``."""
    pool = task_problems(task)
    if task.num_prompts and task.num_prompts < len(pool):
        pool = random.Random(seed).sample(pool, task.num_prompts)
    return pool


def format_warmup_batch(*, tokenizer, task: TaskConfig, batch_size: int, generator: torch.Generator):
    """The task's format warm-up batch (input ids and labels on the answer and EOS only)."""
    warmup = countdown.warmup_batch if task.kind == "countdown" else arithmetic.warmup_batch
    return warmup(tokenizer=tokenizer, task=task, batch_size=batch_size, generator=generator)
