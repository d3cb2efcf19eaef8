"""Faulty datasets (issue 21, item 7 and the data entries of the tracebacks list), each tried for real through
``PromptSource`` (HF ``datasets``, pyarrow, the tiny model's tokenizer) and one ``tim train``.

Every test below fails on the code before the fix (checked by running this file against it) and passes now.

Item 7, a prompt longer than ``data.max_prompt_tokens``, or empty (``tim_megatron/data/*``, ``run_setup.py``)
  * A JSON Lines row whose prompt is ``max_prompt_tokens + 1`` tokens of the run's tokenizer. Before: loaded
    without a word; the run died at the step that drew it with ``rollout: prompt 3 has 17 tokens`` (a batch
    index, not the row), and every resume died the same way. Now ``PromptSource`` encodes every prompt as the
    rollout will (``encode_prompt``) and raises a ``DataError`` naming the file, the line, the token count and
    the limit; ``tim train`` gets it in setup, before the trainer and the engines start, exits 2 and marks
    the run failed with that reason. A prompt of exactly the limit still loads.
  * A chat prompt under a tokenizer with a chat template. Before: ``encode_prompt`` returned
    ``list(apply_chat_template(..., tokenize=True))``, which under transformers 5 is the keys of a
    ``BatchEncoding`` (``['input_ids', 'attention_mask']``): every chat prompt was "2 tokens" of strings. Now
    the template's text is encoded, the count includes the template, and a prompt that fits only without it
    is refused.
  * Empty prompts: ``""``, whitespace, an empty list of chat messages, chat messages with empty contents; and
    an empty answer. Before: loaded (an empty prompt reached the engine and stopped the run there). Now one
    error lists every faulty row by file and line (parquet: file and row index), and says what is allowed.
  * Built-in task prompts longer than the limit (``data.task.max_operand`` large): named with the prompt.

Tracebacks list, data entries (``tim_megatron/data/files.py``, ``checks.py``), table-driven
  * Chat prompts with non-dict items (``[{"role": ..}, "hi"]``). Before: ``AttributeError: 'str' object has no
    attribute 'get'`` traceback. Now: the file, line, message index, its type, and what is allowed.
  * A non-UTF-8 JSON Lines file. Before: ``UnicodeDecodeError`` traceback. Now: file, line, the byte, "UTF-8".
  * A broken JSON Lines row. Before: "could not load the dataset (DatasetGenerationError: An error occurred
    while generating the dataset)", no line. Now: file, line, column and the JSON error.
  * An empty file (and one of blank lines). Before: "could not load the dataset (StopIteration: )". Now: "is
    empty", with what is allowed.
  * A relative path that does not exist (``data/train.jsonl``). Before: taken for a Hub dataset name (offline:
    23 s of retries, then "Couldn't reach 'data/train.jsonl' on the Hub"). Now: a value with a file suffix,
    a leading ``.``, ``/`` or ``~``, more than one ``/``, or whose first part is a local folder is a path, and
    a missing path is "no such file or folder" at once; ``owner/name`` is still a Hub name.
  * Also refused by name now: a JSON value that is not an object, a prompt that is a number, a file of another
    format (``.csv``), a folder mixing parquet and JSON Lines.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tim_megatron.data.sources import DataError

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/tiny-moe/grpo.yaml"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def _recipe(*overrides: str):
    from tim_megatron.recipe import load_recipe

    return load_recipe(RECIPE, list(overrides)).recipe


def _source(path, *overrides: str, tokenizer=None):
    from tim_megatron.data.sources import PromptSource

    r = _recipe("data.train.kind=file", f"data.train.path={path}", *overrides)
    return PromptSource(r.data, seed=0, tokenizer=tokenizer)


def _tokenizer(*, chat_template: str | None = None):
    """The tiny model's own tokenizer (character level), as ``model.path: tiny`` runs get it."""
    from tim_megatron.models.tiny import build_tokenizer

    tok = build_tokenizer(_recipe().model.dims.vocab_size)
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _error(fn) -> str:
    with pytest.raises(DataError) as e:
        fn()
    return str(e.value)


# ------------------------------------------------------------------------------------------------ item 7


def test_item7_a_prompt_over_the_limit_is_named_by_file_and_line_at_load(tmp_path):
    cap = _recipe().data.max_prompt_tokens
    ok = "1+" * ((cap - 2) // 2) + "1="  # the tiny tokenizer has one token per character
    long = ok + "1" * (cap + 1 - len(ok))
    f = _jsonl(
        tmp_path / "train.jsonl", [{"prompt": "1+1=", "answer": "2"}] * 2 + [{"prompt": long, "answer": "0"}]
    )
    tok = _tokenizer()
    assert len(tok.encode(long, add_special_tokens=False)) == cap + 1
    msg = _error(lambda: _source(f, tokenizer=tok))
    for part in ("data.train.path", f"{f} line 3", f"{cap + 1} tokens", f"data.max_prompt_tokens = {cap}"):
        assert part in msg, (part, msg)
    exact = _jsonl(tmp_path / "exact.jsonl", [{"prompt": long[:cap], "answer": "0"}])
    assert len(_source(exact, tokenizer=tok).train) == 1  # the limit itself is allowed


def test_item7_chat_prompts_are_counted_with_the_chat_template(tmp_path):
    from tim_megatron.data.sources import encode_prompt

    tok = _tokenizer(chat_template=CHAT_TEMPLATE)
    chat = [{"role": "user", "content": "1+1="}]
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == "user: 1+1=\nassistant: "
    ids = encode_prompt(tok, chat)
    assert ids == tok.encode(text, add_special_tokens=False) and all(isinstance(i, int) for i in ids)
    f = _jsonl(tmp_path / "chat.jsonl", [{"prompt": chat, "answer": "2"}])
    msg = _error(
        lambda: _source(f, "data.max_prompt_tokens=16", tokenizer=tok)
    )  # 4 tokens of content, 22 in all
    assert f"{f} line 1: {len(text)} tokens" in msg, msg
    assert len(_source(f, f"data.max_prompt_tokens={len(text)}", tokenizer=tok).train) == 1


@pytest.mark.parametrize(
    "row, problem",
    [
        ({"prompt": "", "answer": "1"}, "the prompt at 'prompt' is empty"),
        ({"prompt": " \n\t", "answer": "1"}, "the prompt at 'prompt' is empty"),
        ({"prompt": [], "answer": "1"}, "the prompt at 'prompt' is an empty list of chat messages"),
        (
            {"prompt": [{"role": "user", "content": "  "}], "answer": "1"},
            "every chat message of the prompt at 'prompt' is empty",
        ),
        ({"prompt": "1+1=", "answer": ""}, "the answer at 'answer' is empty"),
    ],
    ids=["empty", "blank", "no-messages", "empty-messages", "empty-answer"],
)
def test_item7_empty_prompts_and_answers_are_refused_at_load(tmp_path, row, problem):
    f = _jsonl(tmp_path / "t.jsonl", [{"prompt": "1+1=", "answer": "2"}, row])
    msg = _error(lambda: _source(f))
    assert f"{f} line 2: {problem}" in msg and "allowed:" in msg, msg


def test_item7_every_faulty_row_is_listed_and_parquet_rows_by_index(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "ds"
    folder.mkdir()
    pq.write_table(pa.table({"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}), folder / "a.parquet")
    pq.write_table(pa.table({"prompt": ["3+3=", "", "4+4="], "answer": ["6", "0", ""]}), folder / "b.parquet")
    msg = _error(lambda: _source(folder))
    assert f"data.train.path = {folder}: 2 bad row(s)" in msg, msg
    assert f"{folder / 'b.parquet'} row index 1: the prompt at 'prompt' is empty" in msg, msg
    assert f"{folder / 'b.parquet'} row index 2: the answer at 'answer' is empty" in msg, msg
    long = tmp_path / "long"
    long.mkdir()
    _jsonl(long / "a.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    (long / "b.jsonl").write_text(
        '\n{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "11+11=", "answer": "22"}\n'
    )
    msg = _error(lambda: _source(long, "data.max_prompt_tokens=5", tokenizer=_tokenizer()))
    assert f"{long / 'b.jsonl'} line 4: 6 tokens" in msg, msg  # blank lines counted, as an editor shows them


def test_item7_built_in_task_prompts_over_the_limit_are_named():
    from tim_megatron.data.sources import PromptSource

    r = _recipe("data.task.max_operand=12", "data.max_prompt_tokens=5")
    msg = _error(lambda: PromptSource(r.data, seed=0, tokenizer=_tokenizer()))
    assert msg.startswith("data.task: 9 prompt(s) outside 1..data.max_prompt_tokens = 5 tokens"), msg
    assert "the built-in arithmetic prompt '10+10=': 6 tokens" in msg and "; and 4 more" in msg, msg


@pytest.mark.slow
def test_item7_tim_train_refuses_a_long_row_before_the_engines_start(tmp_path):
    from tests.test_loop import FAST, tim_train

    cap = _recipe().data.max_prompt_tokens
    f = _jsonl(
        tmp_path / "train.jsonl",
        [{"prompt": "1+1=", "answer": "2"}, {"prompt": "1" * (cap + 1), "answer": "1"}],
    )
    res = tim_train(
        [
            str(RECIPE),
            "run.steps=1",
            f"run.output_dir={tmp_path / 'r'}",
            *FAST,
            "data.train.kind=file",
            f"data.train.path={f}",
        ],
        tmp_path,
        check=False,
    )
    out = (res.stdout + res.stderr).replace("\n", " ")
    assert res.returncode == 2, out[-3000:]
    assert f"error: DataError: data.train.path: 1 prompt(s) outside 1..data.max_prompt_tokens = {cap}" in out
    assert f"{f} line 2: {cap + 1} tokens" in out
    assert "rollout engine" not in out  # setup stopped before the engines were built
    (run_json,) = (tmp_path / "r").rglob("run.json")
    meta = json.loads(run_json.read_text())
    assert meta["status"] == "failed" and f"{f} line 2" in meta["reason"]
    assert not list((tmp_path / "r").rglob("metrics.jsonl"))


# ------------------------------------------------------------------------------------- tracebacks list

BAD_FILES = [
    (
        "chat-non-dict",
        "t.jsonl",
        b'{"prompt": [{"role": "user", "content": "1+1="}, "hi"], "answer": "2"}\n',
        [
            "line 1: chat message 1 of the prompt at 'prompt' is a JSON string ('hi'), not an object",
            "allowed:",
        ],
    ),
    (
        "chat-list-of-strings",
        "t.jsonl",
        b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": ["1+1="], "answer": "2"}\n',
        ["line 2: chat message 0", "not an object", '{"role": "...", "content": "..."}'],
    ),
    (
        "not-utf8",
        "t.jsonl",
        b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "2"}\n',
        ["line 2: not UTF-8 text (byte 0xe9", "allowed: UTF-8"],
    ),
    (
        "broken-row",
        "t.jsonl",
        b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n',
        ["line 2: not valid JSON (Expecting value at column 1)", "allowed: one JSON object per line"],
    ),
    (
        "text-then-chat",
        "t.jsonl",
        b'{"prompt": "1+1=", "answer": 2}\n\n{"prompt": [{"role": "user", "content": "1+1="}], "answer": 2}\n',
        ["line 3: a chat prompt, but the first row's prompt is text (allowed: one kind in every row)"],
    ),
    ("empty-file", "t.jsonl", b"", ["is empty (no JSON rows)", "allowed: one JSON object per line"]),
    ("blank-lines", "t.jsonl", b"\n  \n", ["is empty (no JSON rows)"]),
    ("not-an-object", "t.jsonl", b'["1+1=", "2"]\n', ["row index 0: a JSON string, not an object"]),
    (
        "number-prompt",
        "t.jsonl",
        b'{"prompt": 5, "answer": "2"}\n',
        ["line 1: the prompt at 'prompt' is a JSON number"],
    ),
    (
        "other-format",
        "t.csv",
        b"prompt,answer\n1+1=,2\n",
        ["is not a dataset file (suffix '.csv')", "allowed: a .parquet"],
    ),
]


@pytest.mark.parametrize("name, filename, content, parts", BAD_FILES, ids=[c[0] for c in BAD_FILES])
def test_tracebacks_bad_files_get_named_errors(tmp_path, name, filename, content, parts):
    f = tmp_path / filename
    f.write_bytes(content)
    msg = _error(lambda: _source(f))
    assert msg.startswith("data.train.path: ") and str(f) in msg, msg
    for part in parts:
        assert part in msg, (part, msg)


@pytest.mark.parametrize("value", ["data/train.jsonl", "data/train", "a/b/c", "nested/x.parquet"])
def test_tracebacks_a_missing_relative_path_is_not_a_hub_name(tmp_path, monkeypatch, value):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()  # "data/train": its folder is here, so it is a path
    t0 = time.monotonic()
    msg = _error(lambda: _source(value))
    assert f"data.train.path = {value}: no such file or folder (relative to {tmp_path})" in msg, msg
    assert "Hub dataset name (owner/name)" in msg and time.monotonic() - t0 < 5  # no Hub lookup, no retries
    from tim_megatron.data.files import is_hub_name

    assert not is_hub_name(value)
    assert is_hub_name("BytedTsinghua-SIA/DAPO-Math-17k") and is_hub_name("HuggingFaceH4/aime_2024")


def test_tracebacks_a_folder_mixing_formats_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["1+1="], "answer": ["2"]}), tmp_path / "a.parquet")
    _jsonl(tmp_path / "b.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    msg = _error(lambda: _source(tmp_path))
    assert f"data.train.path = {tmp_path}: the folder holds both .parquet and .jsonl files" in msg, msg


def test_good_files_still_load_with_their_rows_located(tmp_path):
    f = tmp_path / "ok.jsonl"
    f.write_text(
        '{"prompt": [{"role": "user", "content": "1+1="}], "answer": 2}\n\n'
        '{"prompt": [{"role": "system", "content": "x"}, {"content": "2+2="}], "answer": 4}\n'
    )
    src = _source(f, tokenizer=_tokenizer())
    assert [it.answer for it in src.train] == ["2", "4"]
    assert [it.meta["at"] for it in src.train] == [f"{f} line 1", f"{f} line 3"]
    assert src.train[1].prompt == [{"role": "system", "content": "x"}, {"role": "user", "content": "2+2="}]
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps([{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]))
    assert [it.meta["at"] for it in _source(arr).train] == [f"{arr} row index 0", f"{arr} row index 1"]
