"""Prompt sources: the built-in arithmetic task, DAPO-Math-17k, AIME24, or any parquet/jsonl file.

Every source is deterministic: the prompts of step ``s`` depend only on (seed, s), so a resumed run sees
the same prompts as an uninterrupted one. Real datasets load through HF ``datasets`` by hub name (on a
cluster) or from a local parquet/jsonl file or folder (here, and in tests).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tim_megatron.data.arithmetic import problem_pool, task_problems, task_reward_kind
from tim_megatron.recipe.schema import DataConfig, DatasetConfig

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

DEFAULTS = {
    # kind: (hub name, prompt column, answer column, reward)
    "dapo_math": ("BytedTsinghua-SIA/DAPO-Math-17k", "prompt", "reward_model.ground_truth", "math"),
    "aime24": ("HuggingFaceH4/aime_2024", "problem", "answer", "math"),
    "file": (None, "prompt", "answer", "math"),
}


class DataError(ValueError):
    pass


@dataclass(frozen=True)
class Item:
    prompt: str | list[dict]
    """Plain text, or chat messages (``[{"role": ..., "content": ...}]``) for the tokenizer's chat template."""
    answer: str
    reward: str = "exact"
    """exact (built-in arithmetic), countdown (the lab task's checked chains) or math (math-verify on a \\boxed{} answer)."""
    meta: dict = field(default_factory=dict, compare=False)


def _get(row: dict, dotted: str) -> Any:
    cur: Any = row
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _load_rows(cfg: DatasetConfig, *, where: str) -> list[dict]:
    import datasets

    hub, prompt_key, answer_key, _ = DEFAULTS[cfg.kind]
    prompt_key = cfg.prompt_key or prompt_key
    answer_key = cfg.answer_key or answer_key
    path = cfg.path or hub
    if path is None:
        raise DataError(f"{where}.path is required for kind = file")
    local = Path(path)
    try:
        if local.exists():
            files = (
                sorted(local.glob("**/*.parquet")) + sorted(local.glob("**/*.jsonl"))
                if local.is_dir()
                else [local]
            )
            if not files:
                raise DataError(f"{where}.path = {path}: no .parquet or .jsonl files in that folder")
            fmt = "parquet" if files[0].suffix == ".parquet" else "json"
            ds = datasets.load_dataset(fmt, data_files=[str(f) for f in files], split="train")
        elif "/" in str(path) and not str(path).startswith((".", "/")):
            ds = datasets.load_dataset(str(path), split=cfg.split)
        else:
            raise DataError(f"{where}.path = {path}: no such file or folder")
    except DataError:
        raise
    except Exception as e:  # network, format or schema errors from datasets
        raise DataError(
            f"{where}.path = {path}: could not load the dataset ({type(e).__name__}: {e})"
        ) from None
    cols = set(ds.column_names)
    for key, what in ((prompt_key, "prompt_key"), (answer_key, "answer_key")):
        if key.split(".")[0] not in cols:
            raise DataError(
                f"{where}.path = {path}: dataset columns are {sorted(cols)}; expected a column '{key.split('.')[0]}' "
                f"for {where}.{what} = {key!r} (kind = {cfg.kind})"
            )
    rows = []
    for i, row in enumerate(ds):
        if cfg.limit and i >= cfg.limit:
            break
        p, a = _get(row, prompt_key), _get(row, answer_key)
        if p is None or a is None:
            raise DataError(
                f"{where}.path = {path}: row {i} has no value at {prompt_key!r} or {answer_key!r}"
            )
        rows.append({"prompt": p, "answer": str(a), "row": i})
    if not rows:
        raise DataError(f"{where}.path = {path}: the dataset is empty")
    return rows


def _as_prompt(p: Any, kind: str) -> str | list[dict]:
    if isinstance(p, list):  # chat messages (DAPO-Math-17k)
        return [{"role": m.get("role", "user"), "content": m.get("content", "")} for m in p]
    text = str(p)
    return f"{text}\n{BOXED_INSTRUCTION}" if kind == "aime24" else text


class PromptSource:
    """Items for training steps and validation."""

    def __init__(self, data: DataConfig, *, seed: int):
        """``seed``: the run's seed, used unless ``data.seed`` fixes the data on its own."""
        self.data = data
        self.seed = seed = data.seed if data.seed is not None else seed
        self.train = self._items(data.train, "data.train")
        if data.val is not None:
            self.val = self._items(data.val, "data.val")
        elif data.train.kind == "arithmetic":
            pool = task_problems(data.task)
            rng = random.Random(seed + 7)
            kind = task_reward_kind(data.task)
            self.val = [
                Item(p.prompt, p.answer, kind) for p in rng.sample(pool, min(data.val_prompts, len(pool)))
            ]
        else:
            self.val = []

    def _items(self, cfg: DatasetConfig, where: str) -> list[Item]:
        if cfg.kind == "arithmetic":
            kind = task_reward_kind(self.data.task)
            return [Item(p.prompt, p.answer, kind) for p in problem_pool(self.data.task, self.seed)]
        reward = DEFAULTS[cfg.kind][3]
        return [
            Item(_as_prompt(r["prompt"], cfg.kind), r["answer"], reward, {"row": r["row"]})
            for r in _load_rows(cfg, where=where)
        ]

    def step_items(self, step: int, n: int) -> list[Item]:
        """The ``n`` prompts of step ``step`` (1-based): epochs of seeded permutations, no repeats within one."""
        out = []
        size = len(self.train)
        start = (step - 1) * n
        for k in range(start, start + n):
            epoch, idx = divmod(k, size)
            perm = list(range(size))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(perm)
            out.append(self.train[perm[idx]])
        return out

    def validation_items(self, n: int) -> list[Item]:
        return self.val[:n]


def encode_prompt(tokenizer, prompt: str | list[dict]) -> list[int]:
    if isinstance(prompt, list):
        if getattr(tokenizer, "chat_template", None):
            return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True))
        prompt = "\n".join(m["content"] for m in prompt)
    return list(tokenizer.encode(prompt, add_special_tokens=False))
