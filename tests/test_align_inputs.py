"""``tim align``'s inputs, checked before any work: the real command line in a child process, given token files and
output folders that would crash or mislead a run. Each must end in one named error line (exit 2), with no tiny
checkpoint built, no trainer or engine started, no launcher run.

* ``--tokens`` with sequences of 2 to 4 tokens: vLLM's CPU attention died with SIGILL (exit 132, no message) on them
  on some CPUs. Before: accepted (on an AMD machine the comparison then ran). Now: at least 5 tokens per sequence
  (:data:`~tim_megatron.align.run.MIN_TOKENS`), named.
* ``--tokens`` holding ``true``: before, a boolean passed as token id 1. Now: named.
* ``--tokens`` with an id outside the vocabulary, under ``--nproc 2``: before, torchrun started both ranks, each
  printed the error and the launcher a traceback. Now: one error, before the launcher.
* ``--tokens`` a FIFO: before, the command blocked reading it forever. Now: refused, named.
* ``--out`` a regular file, a folder nobody may write in, a symbolic link: before, the whole comparison ran, then a
  traceback (or, for the link, the report was written where the link points). Now: named, before any work.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tim_megatron.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
TINY = "recipes/tiny-moe/grpo.yaml"
VOCAB = load_recipe(TINY).recipe.model.dims.vocab_size
MIN_TOKENS = 5
"""Sequences of at most 4 tokens crashed vLLM's CPU attention on an Intel AMX machine."""


def tim_align(tmp: Path, *args: str, tokens=None, timeout: int = 300):
    """``tim align TINY ARGS`` with its own (empty) checkpoint cache; the cache shows whether any work began."""
    cache = tmp / "cache"
    cache.mkdir(exist_ok=True)
    if tokens is not None:
        args = ("--tokens", str(tokens), *args)
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "tim_megatron.cli", "align", TINY, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "TIM_CACHE": str(cache), "OMP_NUM_THREADS": "2"},
    )
    res.seconds = time.monotonic() - t0
    return res


def refused(res, tmp: Path, *needles: str) -> str:
    """One error line naming ``needles`` (exit 2), and nothing built: no checkpoint in the cache, nothing else on
    the terminal (no engine log, no launcher, no traceback)."""
    out = res.stdout + res.stderr
    assert res.returncode == 2, (res.returncode, out[-3000:])
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and not res.stdout.strip(), out[-3000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert not [p for p in (tmp / "cache").rglob("*") if p.is_file()], "work began: the cache holds files"
    return lines[0]


def tokens_file(tmp: Path, seqs) -> Path:
    path = tmp / "tokens.json"
    path.write_text(json.dumps(seqs))
    return path


@pytest.mark.parametrize("length", [2, 3, 4])
def test_sequences_shorter_than_the_engine_takes_are_named(tmp_path, length):
    seqs = [list(range(1, 13)), list(range(1, length + 1))]
    res = tim_align(tmp_path, "--out", str(tmp_path / "out"), tokens=tokens_file(tmp_path, seqs))
    refused(res, tmp_path, "--tokens", "sequence 1 has", f"{length} tokens", f"at least {MIN_TOKENS}")
    assert not (tmp_path / "out").exists()


def test_a_boolean_is_not_a_token_id(tmp_path):
    path = tmp_path / "tokens.json"
    path.write_text("[[1, 2, 3, true, 5, 6]]")
    res = tim_align(tmp_path, "--out", str(tmp_path / "out"), tokens=path)
    refused(res, tmp_path, "--tokens", str(path), "true")


def test_an_id_outside_the_vocabulary_is_named_before_the_launcher(tmp_path):
    seqs = [list(range(1, 9)), [1, 2, 3, VOCAB, 4, 5]]
    res = tim_align(
        tmp_path, "--nproc", "2", "--out", str(tmp_path / "out"), tokens=tokens_file(tmp_path, seqs)
    )
    refused(res, tmp_path, "sequence 1 has ids", f"[{VOCAB}]", f"[0, {VOCAB})")


def test_a_fifo_as_the_tokens_file_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "tokens.json"
    os.mkfifo(fifo)
    res = tim_align(tmp_path, "--out", str(tmp_path / "out"), tokens=fifo, timeout=120)
    refused(res, tmp_path, "--tokens", str(fifo), "FIFO")


def test_out_that_is_a_file_a_link_or_unwritable_is_named_before_any_work(tmp_path):
    tokens = tokens_file(tmp_path, [list(range(1, 13))])
    regular = tmp_path / "a-file"
    regular.write_text("keep me\n")
    res = tim_align(tmp_path, "--out", str(regular), tokens=tokens)
    refused(res, tmp_path, "--out", str(regular), "a regular file")
    assert regular.read_text() == "keep me\n"

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / "link"
    link.symlink_to(elsewhere)
    res = tim_align(tmp_path, "--out", str(link), tokens=tokens)
    refused(res, tmp_path, "--out", str(link), "a symbolic link")
    assert not list(elsewhere.iterdir())

    inside_file = regular / "sub"  # a folder that cannot be created: its parent is a file
    res = tim_align(tmp_path, "--out", str(inside_file), tokens=tokens)
    refused(res, tmp_path, "--out", str(inside_file))

    if os.geteuid() == 0:  # modes do not bind root: a kernel folder no one may create files in
        locked = Path("/proc/1")
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
    try:
        res = tim_align(tmp_path, "--out", str(locked), tokens=tokens)
    finally:
        if locked.is_relative_to(tmp_path):
            locked.chmod(0o700)
    refused(res, tmp_path, "--out", str(locked), "cannot write")
