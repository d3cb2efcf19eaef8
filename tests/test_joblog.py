"""Job logs and run records read back from run folders (``tim_megatron/slurm/joblog.py``, ``run_record.py``):
``tim logs`` on logs holding anything (bytes that are not UTF-8, a sparse 3 GB file, huge lines, terminal escapes,
FIFOs, links), ``find_run`` on hostile run.json files, and the job script's requeue decision, which reads run.json
only through ``python -m tim_megatron.slurm.run_record``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tim_megatron.cli import app
from tim_megatron.slurm import joblog, run_record
from tim_megatron.slurm.submit import find_run

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "launch" / "tim.sbatch"
JOB = "42"
HOSTILE = "a\x1b]0;pwned\x07 b\x1b[2J c\x1b]8;;http://x/\x1b\\link\x1b]8;;\x1b\\ d\u202ee f\x9b31m g\r h"
"""An OSC title, a clear-screen, an OSC 8 link, U+202E, a C1 CSI and a carriage return."""


def shown_safely(text: str) -> bool:
    """Whether ``text`` holds nothing a terminal acts on but newlines and tabs."""
    return all(c.isprintable() or c in "\n\t" for c in text)


def run_folder(root: Path, *, job: str = JOB, name: str = "r", meta: dict | None = None) -> Path:
    d = root / name / "20260101-000000"
    (d / "logs").mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"job_ids": [job], "status": "running", **(meta or {})}, indent=1))
    return d


def finishes(fn, *, within: float = 30.0, fifo: Path | None = None):
    """``fn()``'s result, failing (not hanging) when it blocks, e.g. in a FIFO's open, which waits for a writer;
    ``fifo`` is then opened for writing once so that the blocked reader can end."""
    out: dict = {}

    def call():
        try:
            out["result"] = fn()
        except BaseException as e:  # handed to the test
            out["error"] = e

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(within)
    if t.is_alive():
        if fifo is not None:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"blocked for {within} s")
    if "error" in out:
        raise out["error"]
    return out["result"]


def logs(root: Path, *args: str, job: str = JOB):
    res = CliRunner().invoke(app, ["logs", job, "--root", str(root), *args])
    assert not isinstance(res.exception, Exception) or isinstance(res.exception, SystemExit), repr(
        res.exception
    )
    return res


# ------------------------------------------------------------------------------------------------ tim logs


def test_logs_shows_a_log_with_bytes_that_are_not_utf8(tmp_path):
    """Before: a UnicodeDecodeError traceback, nothing printed."""
    d = run_folder(tmp_path)
    (d / "logs" / f"slurm-{JOB}.out").write_bytes(b"start\ncrash dump \xff\xfe\x80 here\nend\n")
    res = logs(tmp_path)
    assert res.exit_code == 0, res.output
    assert res.stdout == "start\ncrash dump \ufffd\ufffd\ufffd here\nend\n"


def test_logs_reads_the_end_of_a_sparse_3_gb_log(tmp_path):
    """Before: the whole file read (MemoryError or 21 s), then gigabytes of NUL bytes written."""
    d = run_folder(tmp_path)
    log = d / "logs" / f"slurm-{JOB}.out"
    with open(log, "wb") as f:
        f.write(b"first line\n")
        f.truncate(3 * 2**30)  # a hole: NUL bytes that take no disk space
        f.seek(0, os.SEEK_END)
        f.write(b"".join(b"line %d\n" % i for i in range(50)))
    res = logs(tmp_path, "--lines", "52")
    assert res.exit_code == 0, res.output[-2000:]
    out = res.stdout
    assert out.endswith("".join(f"line {i}\n" for i in range(50))) and len(out) < 2000, out[-2000:]
    # what was read of the hole is one counted run; the log is longer than the part read, and that is said
    assert re.match(r"\[\.\.\.\] \[\.\.\. (\d+) NUL bytes \.\.\.\]line 0\n", out)
    assert "first line" not in out and "at most its last" in res.stderr and "50 of the 52 lines" in res.stderr


def test_read_tail_reads_at_most_its_bound(tmp_path):
    log = tmp_path / "big.log"
    with open(log, "wb") as f:
        f.truncate(3 * 2**30)
    tail = joblog.read_tail(log, lines=40)
    assert tail.size == 3 * 2**30 and len(tail.data) == joblog.MAX_TAIL_BYTES
    assert tail.start == tail.size - joblog.MAX_TAIL_BYTES and not tail.whole_first_line
    small = joblog.read_tail(log, lines=40, max_bytes=1000, chunk=300)
    assert len(small.data) == 1000 and small.start == 3 * 2**30 - 1000


def test_logs_clips_a_huge_line(tmp_path):
    """Before: an 8 MiB line printed whole."""
    d = run_folder(tmp_path)
    (d / "logs" / f"slurm-{JOB}.out").write_bytes(b"a" * (8 * 2**20) + b"\nlast\n")
    res = logs(tmp_path, "--lines", "2")
    assert res.exit_code == 0, res.output[-2000:]
    assert len(res.stdout) < 2 * joblog.MAX_LINE_CHARS and res.stdout.endswith("\nlast\n")
    assert re.search(r"a \[\.\.\. \d+ more characters \.\.\.\]\n", res.stdout)


def test_logs_escapes_terminal_controls(tmp_path):
    """Before: the OSC title, clear-screen, OSC 8 link, U+202E and C1 CSI reached the terminal as they are."""
    d = run_folder(tmp_path)
    (d / "logs" / f"slurm-{JOB}.out").write_text(f"ok\tcolumn\n{HOSTILE}\n", encoding="utf-8")
    res = logs(tmp_path)
    assert res.exit_code == 0, res.output
    assert shown_safely(res.stdout) and res.stdout.startswith("ok\tcolumn\n"), repr(res.stdout)
    assert "\\x1b]0;pwned\\x07" in res.stdout and "\\u202e" in res.stdout and "\\x9b31m" in res.stdout


@pytest.mark.parametrize("lines", ["-1", "0"])
def test_logs_rejects_lines_below_one(tmp_path, lines):
    """Before: ``--lines -1`` printed all but the first line, ``--lines 0`` the whole log."""
    d = run_folder(tmp_path)
    (d / "logs" / f"slurm-{JOB}.out").write_text("one\ntwo\n")
    res = logs(tmp_path, "--lines", lines)
    assert res.exit_code == 2 and res.stdout == ""
    assert f"--lines = {lines}:" in res.stderr and "allowed: a whole number >= 1" in res.stderr


def test_logs_refuses_a_fifo_log_by_name(tmp_path):
    """Before: ``tim logs`` waited forever for a writer."""
    d = run_folder(tmp_path)
    log = d / "logs" / f"slurm-{JOB}.out"
    os.mkfifo(log)
    res = finishes(lambda: logs(tmp_path), fifo=log)
    assert res.exit_code == 2 and res.stdout == ""
    assert "a FIFO (named pipe); allowed: a regular file" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


@pytest.mark.parametrize("target", ["/dev/zero", "outside"])
def test_logs_refuses_a_log_that_is_a_link(tmp_path, target):
    """Before: the link was followed (``/dev/zero``: MemoryError; another file: printed)."""
    d = run_folder(tmp_path / "runs")
    outside = tmp_path / "secret.txt"
    outside.write_text("the reader's own file\n")
    (d / "logs" / f"slurm-{JOB}.out").symlink_to(target if target.startswith("/") else outside)
    res = logs(tmp_path / "runs")
    assert res.exit_code == 2 and "secret" not in res.stdout
    assert "is a symbolic link" in res.stderr and "only plain files are read" in res.stderr


def test_logs_refuses_a_logs_folder_that_is_a_link(tmp_path):
    """Before: ``logs/`` linked to another folder was read through."""
    d = run_folder(tmp_path / "runs")
    other = tmp_path / "other"
    other.mkdir()
    (other / f"slurm-{JOB}.out").write_text("someone else's log\n")
    (d / "logs").rmdir()
    (d / "logs").symlink_to(other)
    res = logs(tmp_path / "runs")
    assert res.exit_code == 2 and "someone" not in res.stdout and "is a symbolic link" in res.stderr


def test_logs_names_a_missing_run_and_a_missing_log(tmp_path):
    d = run_folder(tmp_path)
    res = logs(tmp_path)
    assert res.exit_code == 2 and f"{d}/logs/slurm-{JOB}.out does not exist yet" in res.stderr
    res = logs(tmp_path, job="7")
    assert res.exit_code == 2 and f"no run folder under {tmp_path} records job 7" in res.stderr
    res = logs(tmp_path, job="../../x")
    assert res.exit_code == 2 and "not a Slurm job id" in res.stderr


lines_of_text = st.lists(
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=30).map(lambda s: s.replace("\n", "")),
    max_size=12,
)


@given(raw=st.binary(max_size=400), lines=st.integers(1, 20))
@settings(max_examples=150, deadline=None)
def test_any_bytes_show_as_printable_lines(raw, lines):
    tail = joblog.Tail(raw, 0, len(raw), True)
    text, _ = joblog.tail_lines(tail, lines)
    assert shown_safely(text)
    assert text.count("\n") <= lines


@given(rows=lines_of_text, lines=st.integers(1, 20))
@settings(max_examples=150, deadline=None)
def test_a_printable_log_shows_as_it_is(rows, lines):
    rows = ["".join(c for c in r if c.isprintable() or c == "\t") for r in rows]
    data = "".join(r + "\n" for r in rows).encode()
    text, notes = joblog.tail_lines(joblog.Tail(data, 0, len(data), True), lines)
    assert text == "".join(r + "\n" for r in rows[-lines:]) and notes == []


def test_read_tail_stops_once_it_holds_the_lines(tmp_path):
    log = tmp_path / "x.log"
    log.write_bytes(b"".join(b"%05d\n" % i for i in range(10_000)))
    tail = joblog.read_tail(log, lines=3, chunk=12)
    assert len(tail.data) == 24 and tail.whole_first_line  # two chunks hold 4 newlines: 3 whole lines read
    assert joblog.tail_lines(tail, 3)[0] == "09997\n09998\n09999\n"


# -------------------------------------------------------------------------------------------------- find_run


def _deep(d: Path) -> None:
    (d / "run.json").write_text("[" * 200_000 + "]" * 200_000)


def _fifo(d: Path) -> None:
    os.mkfifo(d / "run.json")


def _zero(d: Path) -> None:
    (d / "run.json").symlink_to("/dev/zero")


def _link(d: Path) -> None:
    good = d.parent / "elsewhere.json"
    good.write_text(json.dumps({"job_ids": [JOB]}))
    (d / "run.json").symlink_to(good)


def _huge(d: Path) -> None:
    (d / "run.json").write_text(json.dumps({"job_ids": [JOB], "pad": "x" * run_record.MAX_RECORD_BYTES}))


@pytest.mark.parametrize("make", [_deep, _fifo, _zero, _link, _huge], ids=lambda f: f.__name__[1:])
def test_find_run_skips_a_run_json_it_must_not_read(tmp_path, make):
    """Before: deep nesting raised RecursionError, a FIFO blocked, ``/dev/zero`` ran out of memory, a link was
    followed (its target recorded the job) and a 16 MiB record was read whole."""
    d = tmp_path / "r" / "20260101-000000"
    d.mkdir(parents=True)
    make(d)
    assert finishes(lambda: find_run(JOB, tmp_path), fifo=d / "run.json") is None
    good = run_folder(tmp_path, name="s")
    assert finishes(lambda: find_run(JOB, tmp_path), fifo=d / "run.json") == good


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"[1, 2]", "holds list, not a JSON object"),
        (b'{"a": "\xff"}', "not UTF-8 (byte 7)"),
        (b"{", "not JSON"),
        (b"[" * 100_000, "nested too deep to parse"),
        (b'{"n": ' + b"9" * 5000 + b"}", "not JSON"),
    ],
)
def test_read_record_names_why_a_record_is_not_read(tmp_path, raw, why):
    (tmp_path / "run.json").write_bytes(raw)
    with pytest.raises(run_record.RecordError, match=re.escape(why)):
        run_record.read_record(tmp_path)


def test_record_constants_match_the_run_folder_writer():
    from tim_megatron.run_dir import MAX_META_BYTES, META_FILE

    assert (run_record.RECORD_FILE, run_record.MAX_RECORD_BYTES) == (META_FILE, MAX_META_BYTES)


# -------------------------------------------------------------------------------------------- the job script


def _script_line(pattern: str) -> re.Match:
    """The one line of the job script that matches ``pattern`` (anchored at the line's first non-blank)."""
    found = [m for line in SCRIPT.read_text().splitlines() if (m := re.fullmatch(pattern, line.strip()))]
    assert len(found) == 1, (pattern, found)
    return found[0]


def _bash(snippet: str, run_dir: Path, *, attempt: str = f"{JOB}.0", state: str = "FAILED"):
    """``snippet`` of the job script run by bash, with the variables it reads and the job's python on PATH."""
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "RUN_DIR": str(run_dir),
        "HOST_PYTHON": "python",  # as rendered for a job without a container
        "attempt": attempt,
        "state": state,
    }
    return subprocess.run(["bash", "-c", snippet], capture_output=True, text=True, env=env, timeout=60)


def requeue_condition() -> str:
    """The job script's test that requeues a checkpointed attempt (after its REQUEUE and RUNNING tests)."""
    return _script_line(r'if \[ "\$REQUEUE" = 1 \] && \[ "\$state" = RUNNING \] && (.+); then').group(1)


def completed_condition() -> str:
    """The job script's test that a run completed (the branch that says so)."""
    lines = [line.strip() for line in SCRIPT.read_text().splitlines()]
    at = lines.index('echo "attempt $attempt: the run completed"')
    return re.fullmatch(r"elif (.+); then", lines[at - 1]).group(1)


@pytest.mark.parametrize(
    ("meta", "requeued"),
    [
        ({"requeue_attempt": f"{JOB}.0"}, True),
        ({"requeue_attempt": None, "note": {"requeue_attempt": f"{JOB}.0"}}, False),
        ({"note": f'"requeue_attempt": "{JOB}.0"'}, False),
        ({"requeue_attempt": f"{JOB}.1"}, False),
        ({"requeue_attempt": [f"{JOB}.0"]}, False),
    ],
    ids=["top-level", "nested", "in-a-string", "other-attempt", "not-a-string"],
)
def test_the_job_requeues_on_the_top_level_mark_only(tmp_path, meta, requeued):
    """Before: the script's grep matched a nested ``requeue_attempt`` (a FAILED run requeued itself)."""
    d = tmp_path / "run"
    d.mkdir()
    (d / "run.json").write_text(json.dumps({"status": "failed", **meta}, indent=1))
    res = _bash(requeue_condition(), d)
    assert res.returncode == (0 if requeued else 1), res.stderr
    assert res.stdout == ""


@pytest.mark.parametrize(
    ("text", "completed"),
    [
        (json.dumps({"status": "completed"}), True),  # written compactly: the old grep wanted indent=1
        (json.dumps({"status": "failed", "x": {"status": "completed"}}, indent=1), False),
        (json.dumps({"status": "failed"}, indent=1), False),
    ],
    ids=["compact", "nested", "failed"],
)
def test_the_job_says_completed_from_the_top_level_status(tmp_path, text, completed):
    d = tmp_path / "run"
    d.mkdir()
    (d / "run.json").write_text(text)
    assert _bash(completed_condition(), d).returncode == (0 if completed else 1)


def test_the_job_logs_a_clean_status_line(tmp_path):
    """Before: the "not requeueing" line echoed run.json's status/reason/requeue lines with their escapes."""
    echo = _script_line(r'echo "not requeueing attempt \$attempt \(job \$state\): .+"').group(0)
    d = tmp_path / "run"
    d.mkdir()
    meta = {"status": "failed", "reason": HOSTILE + "x" * 5000, "requeue": "refused\nnext line"}
    (d / "run.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False))  # U+202E and C1 stay raw
    res = _bash(echo, d)
    assert res.returncode == 0 and res.stderr == ""
    out = res.stdout
    assert shown_safely(out), out[:300]
    assert out.startswith(
        f"not requeueing attempt {JOB}.0 (job FAILED): status = 'failed'; reason = 'a\\x1b]0;"
    )
    assert out.endswith("; requeue = 'refused\\nnext line'\n") and out.count("\n") == 1
    assert shown_safely(out) and len(out) < 100 + run_record.MAX_STATUS_CHARS
    (tmp_path / "raw").mkdir()  # hand-written: a raw ESC in a string (not JSON, but grep printed it)
    (tmp_path / "raw" / "run.json").write_text('{\n "status": "failed",\n "reason": "' + HOSTILE + '"\n}')
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "run.json")
    for bad, why in (("missing", "cannot be read"), ("fifo", "a FIFO"), ("raw", "not JSON")):
        res = _bash(echo, tmp_path / bad)
        out = res.stdout
        assert res.returncode == 0 and f"{tmp_path / bad}/run.json: " in out and why in out, out
        assert shown_safely(out) and out.count("\n") == 1, out


def test_the_job_script_reads_run_json_only_through_the_reader():
    script = SCRIPT.read_text()
    reads = [line for line in script.splitlines() if "run.json" in line and not line.lstrip().startswith("#")]
    assert reads == [], "run.json is read other than through tim_megatron.slurm.run_record"
    calls = re.findall(r'"\$HOST_PYTHON" -m tim_megatron\.slurm\.run_record (\S+)', script)
    assert sorted(set(calls)) == sorted(run_record.TOOL_COMMANDS), calls


def test_a_container_job_reads_run_json_with_the_submitting_python():
    """The script's end runs on the first node outside the container, where the image's python is not: a
    container job reads run.json with the python that submitted it; other jobs with the one on the job's PATH."""
    from tim_megatron.recipe import load_recipe
    from tim_megatron.slurm.render import values

    recipe = ROOT / "recipes" / "qwen3-30b-a3b" / "gspo.yaml"
    plain = values(load_recipe(recipe).recipe, run_dir=ROOT / "runs" / "x", job_name="j")
    boxed = values(
        load_recipe(recipe, ["cluster.container_image=nvcr.io/x:1"]).recipe,
        run_dir=ROOT / "runs" / "x",
        job_name="j",
    )
    assert plain["HOST_PYTHON"] == "python"
    assert boxed["HOST_PYTHON"] in (sys.executable, f"'{sys.executable}'")


@given(
    reason=st.one_of(
        st.text(),
        st.integers(),
        st.none(),
        st.lists(st.text(), max_size=5),
        st.dictionaries(st.text(max_size=5), st.text(), max_size=3),
    ),
    status=st.text(max_size=300),
)
@settings(max_examples=100, deadline=None)
def test_any_status_and_reason_print_as_one_clipped_printable_line(reason, status):
    line = run_record.status_summary({"status": status, "reason": reason, "requeue": status})
    assert line.isprintable() and len(line) <= run_record.MAX_STATUS_CHARS
    assert line.startswith("status = ")
