"""What a dataset row must hold: a non-empty prompt (text or chat messages) and a non-empty answer.

Each check returns the problem in words, or None. The caller adds where the row is (file and line, or row
index), and :func:`bad_rows` makes one error of all the rows at fault. The prompt's
length in tokens is checked where the run's tokenizer is at hand (:class:`tim_megatron.data.sources.PromptSource`).
"""

from __future__ import annotations

from typing import Any

from tim_megatron.data.errors import DataError, listing

ROW_ALLOWED = (
    'allowed: a prompt that is a non-empty string or a list of chat messages {"role": "...", "content": "..."}, '
    "and an answer that is a non-empty string or a number"
)


def bad_rows(head: str, problems: list[str]) -> DataError:
    """One error for every faulty row (``problems``: each row's location and problem)."""
    return DataError(listing(f"{head}: {len(problems)} bad row(s)", problems) + f"; {ROW_ALLOWED}")


def row_problem(prompt: Any, answer: Any, *, prompt_key: str, answer_key: str) -> str | None:
    """What is wrong with a row's prompt (at ``prompt_key``) and answer (at ``answer_key``), or None."""
    if prompt is None:
        return f"no prompt at {prompt_key!r}"
    if answer is None:
        return f"no answer at {answer_key!r}"
    return prompt_problem(prompt, key=prompt_key) or answer_problem(answer, key=answer_key)


def prompt_problem(prompt: Any, *, key: str) -> str | None:
    if isinstance(prompt, str):
        return None if prompt.strip() else f"the prompt at {key!r} is empty"
    if not isinstance(prompt, list):
        return f"the prompt at {key!r} is a JSON {json_type(prompt)} ({_short(prompt)})"
    if not prompt:
        return f"the prompt at {key!r} is an empty list of chat messages"
    for k, message in enumerate(prompt):
        if not isinstance(message, dict):
            return (
                f"chat message {k} of the prompt at {key!r} is a JSON {json_type(message)} ({_short(message)}), "
                "not an object"
            )
        if not isinstance(message.get("content"), str):
            return (
                f"chat message {k} of the prompt at {key!r} has no text 'content' (found "
                f"{_short(message.get('content'))})"
            )
        if not isinstance(message.get("role"), str | None):
            return f"chat message {k} of the prompt at {key!r} has a 'role' that is not a string"
    if not any(m["content"].strip() for m in prompt):
        return f"every chat message of the prompt at {key!r} is empty"
    return None


def answer_problem(answer: Any, *, key: str) -> str | None:
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        return f"the answer at {key!r} is a JSON {json_type(answer)} ({_short(answer)})"
    if not str(answer).strip():
        return f"the answer at {key!r} is empty"
    return None


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, as the user who wrote the file would say it."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "null" if value is None else type(value).__name__


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
