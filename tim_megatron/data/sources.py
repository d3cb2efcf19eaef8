"""Prompt sources: the built-in arithmetic task, DAPO-Math-17k, AIME24, or any parquet/jsonl file.

Every source is deterministic: the prompts of step ``s`` depend only on (seed, s), so a resumed run sees
the same prompts as an uninterrupted one. Real datasets load through HF ``datasets`` by hub name (on a
cluster) or from a local parquet/jsonl file or folder (here, and in tests) (``files.py``).

Every row is checked when the source is built, before any engine starts: present, typed and non-empty
(``checks.py``), and, given the run's tokenizer, no longer than ``data.max_prompt_tokens`` as the rollout will
encode it. Errors name the file and line (or the dataset and row index) and what is allowed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from tim_megatron.data.checks import bad_rows, row_problem
from tim_megatron.data.errors import DataError, listing
from tim_megatron.data.files import read_dataset
from tim_megatron.data.tasks import problem_pool, task_problems, task_reward_kind
from tim_megatron.recipe.schema import DataConfig, DatasetConfig

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

DEFAULTS = {
    # kind: (hub name, prompt column, answer column, reward)
    "dapo_math": ("BytedTsinghua-SIA/DAPO-Math-17k", "prompt", "reward_model.ground_truth", "math"),
    "aime24": ("HuggingFaceH4/aime_2024", "problem", "answer", "math"),
    "file": (None, "prompt", "answer", "math"),
}


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


def _load_rows(cfg: DatasetConfig, *, where: str) -> tuple[list[dict], str]:
    """The rows used (``cfg.limit``), each checked (prompt and answer present, typed and non-empty) and located
    (``row``: its index, ``at``: its file and line or row index); and the start of messages about them."""
    hub, prompt_key, answer_key, _ = DEFAULTS[cfg.kind]
    prompt_key = cfg.prompt_key or prompt_key
    answer_key = cfg.answer_key or answer_key
    path = cfg.path or hub
    if path is None:
        raise DataError(f"{where}.path is required for kind = file")

    first: list[str] = []  # the kind of prompt of the first row: "text" or "chat"

    def check(row: dict) -> str | None:  # a JSON row as written; missing columns are named below, as columns
        p, a = _get(row, prompt_key), _get(row, answer_key)
        if p is None or a is None:
            return None
        problem = row_problem(p, a, prompt_key=prompt_key, answer_key=answer_key)
        kind = "chat" if isinstance(p, list) else "text"
        if not first:
            first.append(kind)
        if problem is None and kind != first[0]:  # one column holds one type: the loader stops at a mix
            return (
                f"a {kind} prompt, but the first row's prompt is {first[0]} (allowed: one kind in every row)"
            )
        return problem

    table = read_dataset(str(path), split=cfg.split, key=f"{where}.path", check=check)
    ds = table.dataset
    cols = set(ds.column_names)
    for key, what in ((prompt_key, "prompt_key"), (answer_key, "answer_key")):
        if key.split(".")[0] not in cols:
            raise DataError(
                f"{where}.path = {path}: dataset columns are {sorted(cols)}; expected a column '{key.split('.')[0]}' "
                f"for {where}.{what} = {key!r} (kind = {cfg.kind})"
            )
    rows, problems = [], []
    for i, row in enumerate(ds):
        if cfg.limit and i >= cfg.limit:
            break
        p, a = _get(row, prompt_key), _get(row, answer_key)
        problem = row_problem(p, a, prompt_key=prompt_key, answer_key=answer_key)
        if problem:
            problems.append(f"{table.locate(i)}: {problem}")
        else:
            rows.append({"prompt": p, "answer": str(a), "row": i, "at": table.locate(i)})
    if problems:
        raise bad_rows(table.head, problems)
    if not rows:
        raise DataError(f"{where}.path = {path}: the dataset is empty")
    return rows, table.head


def _as_prompt(p: Any, kind: str) -> str | list[dict]:
    if isinstance(p, list):  # chat messages (DAPO-Math-17k); a column of them may hold role: null
        return [{"role": m.get("role") or "user", "content": m["content"]} for m in p]
    return f"{p}\n{BOXED_INSTRUCTION}" if kind == "aime24" else p


class PromptSource:
    """Items for training steps and validation, every one checked when the source is built."""

    def __init__(self, data: DataConfig, *, seed: int, tokenizer=None):
        """``seed``: the run's seed, used unless ``data.seed`` fixes the data on its own.

        ``tokenizer``: the run's tokenizer. Given, every prompt is encoded as the rollout will encode it (chat
        template included) and one longer than ``data.max_prompt_tokens`` is an error here, naming its file and
        line, instead of at the step that draws it (and again at every resume)."""
        self.data = data
        self.tokenizer = tokenizer
        """The run's tokenizer (None: the source only draws items; :meth:`encode` and :meth:`decode` need one)."""
        self.seed = seed = data.seed if data.seed is not None else seed
        self.train, train_head = self._items(data.train, "data.train")
        val_head = "data.task"
        if data.val is not None:
            self.val, val_head = self._items(data.val, "data.val")
        elif data.train.kind == "arithmetic":
            pool = task_problems(data.task)
            rng = random.Random(seed + 7)
            kind = task_reward_kind(data.task)
            self.val = [
                Item(p.prompt, p.answer, kind) for p in rng.sample(pool, min(data.val_prompts, len(pool)))
            ]
        else:
            self.val = []
        if tokenizer is not None:
            self._check_lengths(self.train, tokenizer, where=train_head)
            self._check_lengths(self.val, tokenizer, where=val_head)

    def _items(self, cfg: DatasetConfig, where: str) -> tuple[list[Item], str]:
        """The items of one dataset, and how messages about them start (the recipe key, maybe its value)."""
        if cfg.kind == "arithmetic":
            kind = task_reward_kind(self.data.task)
            pool = problem_pool(self.data.task, self.seed)
            return [Item(p.prompt, p.answer, kind) for p in pool], "data.task"
        reward = DEFAULTS[cfg.kind][3]
        rows, head = _load_rows(cfg, where=where)
        items = [
            Item(_as_prompt(r["prompt"], cfg.kind), r["answer"], reward, {"row": r["row"], "at": r["at"]})
            for r in rows
        ]
        return items, head

    def _check_lengths(self, items: list[Item], tokenizer, *, where: str) -> None:
        cap = self.data.max_prompt_tokens
        bad = []
        for it in items:
            n = len(encode_prompt(tokenizer, it.prompt))
            if not 1 <= n <= cap:
                at = it.meta.get("at") or f"the built-in {self.data.task.kind} prompt {it.prompt!r}"
                bad.append(f"{at}: {n} tokens")
        if bad:
            raise DataError(
                listing(
                    f"{where}: {len(bad)} prompt(s) outside 1..data.max_prompt_tokens = {cap} tokens (the "
                    "model's tokenizer, chat template included)",
                    bad,
                )
                + f". Allowed: 1..{cap} tokens; shorten or drop these prompts, or raise data.max_prompt_tokens "
                "(rollout.max_model_len must hold it plus rollout.max_tokens)"
            )

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

    def encode(self, items: list[Item]) -> list[list[int]]:
        """The items' prompts as the rollout engines get them (:func:`encode_prompt`)."""
        return [encode_prompt(self._tok(), it.prompt) for it in items]

    def decode(self, token_ids: list[int]) -> str:
        """A response's text, as rewards read it."""
        return self._tok().decode(token_ids, skip_special_tokens=True)

    def _tok(self):
        if self.tokenizer is None:
            raise ValueError(
                "this PromptSource was built without a tokenizer: pass tokenizer= to encode or decode"
            )
        return self.tokenizer

    def validation_items(self, n: int) -> list[Item]:
        return self.val[:n]


def encode_prompt(tokenizer, prompt: str | list[dict]) -> list[int]:
    """The prompt's token ids as the rollout engines get them: chat messages through the tokenizer's chat
    template (with the generation prompt), or joined by newlines when it has none; no special tokens added."""
    if isinstance(prompt, list):
        if getattr(tokenizer, "chat_template", None):
            # the template's text, then its tokens: apply_chat_template(tokenize=True) returns token ids in
            # transformers 4 but a BatchEncoding (a dict) in transformers 5
            prompt = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        else:
            prompt = "\n".join(m["content"] for m in prompt)
    return list(tokenizer.encode(prompt, add_special_tokens=False))
