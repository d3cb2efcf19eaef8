"""In-process unit tests of bench/train_run.py (the benchmarks' throwaway ``tim train``), with the subprocess
stood in for: the command it runs, the rows it returns, the error a failed run raises. Seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tim_megatron.bench import train_run


def _fake_run(returncode: int, calls: list):
    def run(cmd, **_kw):
        calls.append(cmd)
        out = Path(next(a for a in cmd if a.startswith("run.output_dir=")).split("=", 1)[1]) / "r"
        out.mkdir()
        (out / "metrics.jsonl").write_text("".join(json.dumps({"step": i}) + "\n" for i in (1, 2)))
        return subprocess.CompletedProcess(cmd, returncode, "", "x" * 5000 + "the end")

    return run


def test_train_rows_runs_tim_train_in_a_temporary_folder_and_returns_its_rows(monkeypatch):
    calls: list = []
    monkeypatch.setattr(train_run.subprocess, "run", _fake_run(0, calls))
    rows, wall = train_run.train_rows(recipe="r.yaml", steps=2, overrides=["a=1"])
    assert rows == [{"step": 1}, {"step": 2}] and wall >= 0
    cmd = calls[0]
    assert cmd[:5] == [sys.executable, "-m", "tim_megatron.cli", "train", "r.yaml"]
    assert cmd[5] == "run.steps=2" and cmd[-1] == "a=1"
    assert not Path(cmd[6].split("=", 1)[1]).exists()  # removed after


def test_train_rows_raises_with_the_tail_of_stderr(monkeypatch):
    monkeypatch.setattr(train_run.subprocess, "run", _fake_run(3, []))
    with pytest.raises(RuntimeError, match=r"train r.yaml run.steps=1 .* exited 3:\nx+the end") as e:
        train_run.train_rows(recipe="r.yaml", steps=1, overrides=[])
    assert len(str(e.value).split("\n", 1)[1]) == 3000
