"""`tim train` under careless input and faults (issue 21: items 12, 13, 17 and three entries of its tracebacks list).

Each entry: what was tried, what happened before, what happens now.

* Item 12, `--run-dir` into an existing folder. Tried: `--nproc 3` with a layout of 2 processes (and
  `--nproc 0`) into a new path, into a run folder of another recipe and into a folder of someone's files; then
  a start that failed (a missing model) retried with the corrected recipe. Before: the folder was created and
  `recipe.yaml` and `run.json` written (an existing `run.json` overwritten, the run's files mixed with foreign
  ones) before `--nproc` was checked, and the corrected retry was refused as "started with another recipe".
  Now: `--nproc` and the layout are checked before any folder is created or written; a folder that is not a
  run folder is refused by name, untouched; a folder where no step ever ran takes the corrected recipe (the
  change is recorded in `run.json`'s `recipe_changes`).
* Item 13, SIGTERM to `tim train --nproc 2`. Before: the ranks checkpointed and `run.json` said `preempted`,
  but the exit code was torchrun's 1 (with a traceback), not the documented 75; a SIGTERM during teardown
  left `completed` with exit 1. Now: the launcher passes the signal to the ranks (not to torchrun, which
  kills its ranks 30 s later and exits 1), and its exit code follows `run.json`: 75 for `preempted`, 0 for
  `completed`.
* Item 17, a run folder that turns read-only mid-run (a read-only bind mount after step 1; root writes
  through mode bits). Before: every step ran, then writing `curves.png` failed: exit 1 with a traceback,
  status `running`. Now: rank 0 writes `run.json` at every step, so the next step stops the run with
  `RunDirNotWritable` naming the path; the message says that `run.json` could not be written either (its
  status is out of date); exit 2, no traceback.
* Tracebacks list, `--nproc 0` and `--nproc -1`. Before: one process ran. Now: a named error, exit 2.
* Tracebacks list, `--timeout-minutes` overshoot. Before: a SIGTERM during start-up was only noted, so the
  run started its engines and ran a whole first step (and `tim lab` SIGKILLed it 60 s later). Now: during
  start-up the signal stops the run at once: status `preempted` (reason: during start-up), exit 75, no step.
* Tracebacks list, a read-only `checkpoints/`. Before: a `PermissionError` traceback at the first save. Now:
  the folders a run writes are checked at the start of the attempt: `RunDirNotWritable` names the folder,
  status `failed` with that reason, exit 2, before any engine starts. A write refused later (the error
  arriving wrapped, as torch's checkpoint writer wraps it) is named the same way.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import importable, require
from tests.test_loop import FAST, ROOT, TIM, metrics, tim_train

GRPO = "recipes/tiny-moe/grpo.yaml"


def _meta(d: Path) -> dict:
    return json.loads((d / "run.json").read_text())


def _tree(d: Path) -> dict[str, bytes]:
    """Every file under ``d`` with its bytes (the state a refused call must leave alone)."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _tim(args: list[str], *, timeout: int = 600) -> subprocess.CompletedProcess:
    return tim_train(args, ROOT, timeout=timeout, check=False)


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [*TIM, "train", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
        start_new_session=True,  # a stray signal to the test's group never reaches it
    )


def _wait(cond, proc: subprocess.Popen, what: str, timeout: float = 400) -> None:
    t0 = time.time()
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(
                f"ended (exit {proc.returncode}) before {what}: {proc.stdout.read()[-3000:]}"
            )
        assert time.time() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.05)


def _status(d: Path) -> str | None:
    with contextlib.suppress(OSError, ValueError):
        return _meta(d).get("status")
    return None


def _rows(d: Path) -> int:
    with contextlib.suppress(OSError):
        return len((d / "metrics.jsonl").read_text().splitlines())
    return 0


@contextlib.contextmanager
def _read_only(path: Path):
    """``path`` read-only through a bind mount of itself: root cannot write there either."""
    require(os.geteuid() == 0 and shutil.which("mount"), "root and mount (a read-only bind mount)")
    subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _run_folder(tmp: Path, overrides: list[str]) -> Path:
    from tim_megatron.recipe import load_recipe
    from tim_megatron.run_dir import write_resolved

    d = tmp / "run"
    d.mkdir()
    write_resolved(load_recipe(ROOT / GRPO, overrides), d)
    return d


# ------------------------------------------------------------------------ item 12 and --nproc: no touch


def test_bad_nproc_and_foreign_folders_are_refused_before_anything_is_written(tmp_path):
    new = tmp_path / "new"
    other = _run_folder(tmp_path, ["optim.lr=5e-4"])  # a run folder of another recipe
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("my notes")
    (foreign / "recipe.yaml").write_text("not a run's\n")
    before = {d: _tree(d) for d in (other, foreign)}
    cases = [
        (["--nproc", "0", "--run-dir", str(new)], "--nproc 0: the number of processes", new),
        (["--nproc", "-1", "--run-dir", str(other)], "--nproc -1: the number of processes", other),
        (
            ["parallel.tp=2", "--nproc", "3", "--run-dir", str(other)],
            "--nproc 3: the recipe's layout needs parallel.tp x pp x dp = 2 x 1 x 1 = 2 process(es); "
            "give --nproc 2",
            other,
        ),
        (["--run-dir", str(foreign)], "the folder exists and is not a run folder", foreign),
    ]
    for extra, message, d in cases:
        res = _tim([GRPO, "run.steps=1", *FAST, *extra], timeout=300)
        assert res.returncode == 2, (extra, res.stdout[-2000:], res.stderr[-2000:])
        assert message in " ".join(res.stderr.split()) and "Traceback" not in res.stderr, (extra, res.stderr)
        if d is new:
            assert not new.exists()
        else:
            assert _tree(d) == before[d], extra  # not a byte written, not even run.lock
    assert "'notes.txt', 'recipe.yaml'" in " ".join(res.stderr.split())


def test_a_folder_where_no_step_ran_takes_the_corrected_recipe(tmp_path):
    from tim_megatron.recipe import load_recipe
    from tim_megatron.run_dir import RecipeChangeError, adopt_recipe, load_run, mark_failed

    d = _run_folder(tmp_path, ["model.path=/missing"])
    mark_failed(d, "FileNotFoundError: model.path = /missing: no such checkpoint folder")
    fixed = load_recipe(ROOT / GRPO, ["optim.lr=5e-4"])
    # not a retry (tim submit --resume): a change still needs the flag
    with pytest.raises(RecipeChangeError, match="started with another recipe"):
        adopt_recipe(d, fixed)
    assert set(adopt_recipe(d, fixed, retry=True)) == {"model.path", "optim.lr"}
    assert load_run(d).recipe.optim.lr == 5e-4
    (change,) = _meta(d)["recipe_changes"]
    assert change["from_step"] == 1 and change["note"] == "no step had run in this folder"
    assert _meta(d)["overrides"] == ["optim.lr=5e-4"]
    (d / "metrics.jsonl").write_text('{"step": 1}\n')  # once a step ran, a change needs the flag again
    with pytest.raises(RecipeChangeError, match="started with another recipe"):
        adopt_recipe(d, load_recipe(ROOT / GRPO), retry=True)


# ------------------------------------------------------------------------------ item 13: exit codes


def test_run_json_status_changes_only_as_a_run_does(tmp_path):
    from tim_megatron.run_dir import (
        StatusTransitionError,
        mark_failed,
        mark_finished,
        mark_stopped,
        set_status,
    )

    d = _run_folder(tmp_path, [])
    assert _meta(d)["status"] == "created"
    with pytest.raises(StatusTransitionError, match="'created' -> 'completed'"):
        mark_finished(d, "completed", step=1, wall_seconds=1.0)
    with pytest.raises(StatusTransitionError, match="status = 'done'; allowed: created, submitted"):
        set_status(d, "done")
    assert _meta(d)["status"] == "created"  # a refused change writes nothing
    set_status(d, "running")
    mark_finished(d, "completed", step=1, wall_seconds=1.0)
    assert _meta(d)["status"] == "completed"
    mark_stopped(d, "SIGTERM")  # a resume stopped during start-up
    with pytest.raises(StatusTransitionError, match="'preempted' -> 'completed'"):
        mark_finished(d, "completed", step=2, wall_seconds=1.0)
    mark_failed(d, "x")
    assert _meta(d)["status"] == "failed"


@pytest.mark.parametrize("status", [["failed"], {"a": 1}, 7, "done"])
def test_a_status_no_run_writes_is_refused_by_name_not_a_traceback(tmp_path, status):
    """Issue 56: ``"status": ["failed"]`` in run.json ended a resume in ``TypeError: unhashable type``."""
    from tim_megatron.run_dir import StatusTransitionError, attempt, update_meta

    d = _run_folder(tmp_path, [])
    update_meta(d, lambda m: m.update(status=status))
    with (
        pytest.raises(StatusTransitionError, match=r"run.json: its status is .*, which no run writes"),
        attempt(d),
    ):
        pass


@pytest.mark.parametrize(
    "raised, named",
    [
        (
            OSError(errno.ENOSPC, "No space left on device", "/dev/shm/torch_1_2"),
            r"shared memory \(/dev/shm\) is full",
        ),
        (
            RuntimeError("unable to write to file </torch_55_1_2>: No space left on device (28)"),
            r"shared memory \(/dev/shm\) is full",
        ),
        (
            OSError(errno.EROFS, "Read-only file system", "/dev/shm/x"),
            r"shared memory \(/dev/shm\) refuses writes",
        ),
    ],
)
def test_a_full_or_read_only_shared_memory_is_not_called_a_full_disk(tmp_path, raised, named):
    """Issue 56: a full /dev/shm (Docker's default is 64 MiB) was reported as "the disk holding RUN is full", and a
    read-only /dev/shm was not named."""
    from tim_megatron.run_dir import SharedMemoryError, attempt

    d = _run_folder(tmp_path, [])
    with pytest.raises(SharedMemoryError, match=named) as e, attempt(d):
        raise raised
    assert "--shm-size" in str(e.value) and "disk" not in str(e.value)
    assert _meta(d)["status"] == "failed" and _meta(d)["reason"].startswith("shared memory (/dev/shm)")
    full = tmp_path / "full"  # the run folder's own full disk is still its disk
    d2 = _run_folder(full, []) if full.mkdir() is None else None
    from tim_megatron.run_dir import DiskFullError

    with pytest.raises(DiskFullError, match="the disk holding"), attempt(d2):
        raise OSError(errno.ENOSPC, "No space left on device", str(d2 / "checkpoints" / "x"))


def test_each_attempt_records_the_code_it_ran(tmp_path, monkeypatch):
    """Issue 61, item 1: run.json names the commit, whether the tree was clean (and a hash of the diff when not),
    the project's version and the libraries'; an earlier attempt keeps its own."""
    from tim_megatron import code_record as cr
    from tim_megatron.run_dir import attempt, read_meta

    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "a"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    monkeypatch.setattr(cr, "ROOT", repo)
    d = _run_folder(tmp_path, [])
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    hashes = []
    for restart, change in enumerate([None, "x = 2\n", "x = 3\n", "x = 3\n"]):
        if change is not None:
            (repo / "a.py").write_text(change)
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))
        with attempt(d):
            pass
        code = read_meta(d)["code"]
        assert code["commit"] == head and code["version"] and "torch" in code["libraries"], code
        assert code["clean"] is (change is None)
        hashes.append(code["diff_sha256"])
    assert (
        hashes[0] is None and hashes[1] != hashes[2] == hashes[3]
    )  # the same uncommitted state, the same hash
    earlier = read_meta(d)["earlier_attempts"]
    assert [e["code"]["clean"] for e in earlier] == [True, False, False]
    monkeypatch.setattr(cr, "ROOT", tmp_path / "no-repo")
    assert cr.code_record()["commit"] is None and "not a git checkout" in cr.code_record()["why"]


def test_run_json_status_is_written_from_run_dir_only():
    """Every status is set through tim_megatron/run_dir/record.py's functions (the one writer of run.json); no other
    module writes one itself, the rest of the run_dir package included."""
    rx = re.compile(
        r'\[\s*"status"\s*\]\s*=[^=]|\.update\(\s*status\s*=|"status"\s*:\s*"(created|submitted|running|completed|'
        r'preempted|failed)"'
    )
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted((ROOT / "tim_megatron").rglob("*.py"))
        if p.relative_to(ROOT).as_posix() != "tim_megatron/run_dir/record.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if rx.search(line)
    ]
    assert found == []


def test_the_launcher_exit_code_follows_the_ranks_record(tmp_path):
    from tim_megatron.run_dir import attempt_id, set_status, settle_launcher_exit

    d = _run_folder(tmp_path, [])

    def settle(status, code, *, ranks_started=True, stopped_by=None, **extra):
        set_status(d, "running")  # an attempt began (a run completes only from running)
        set_status(d, status, attempt=attempt_id() if ranks_started else "before", **extra)
        return settle_launcher_exit(d, code, attempt_before="before", stopped_by=stopped_by)

    # torchrun exits 1 whenever a rank exits non-zero (75 included), and when it gets a signal itself
    assert settle("preempted", 1) == 75
    assert settle("completed", 1, stopped_by="SIGTERM") == 0
    assert settle("failed", 1, reason="x") == 1 and settle("failed", 0, reason="x") == 1
    assert settle("running", 1) == 1 and _meta(d)["status"] == "failed"
    assert "launcher exited with code 1" in _meta(d)["reason"]
    # ranks stopped before they recorded an attempt: the launcher records the stop
    assert settle("completed", 1, ranks_started=False, stopped_by="SIGTERM") == 75
    assert _meta(d)["status"] == "preempted" and "during start-up" in _meta(d)["reason"]
    assert _meta(d)["requeue_attempt"] is None


def test_each_attempt_records_how_the_one_before_it_ended(tmp_path, monkeypatch):
    """A new attempt keeps the earlier attempt's end in ``earlier_attempts``: one whose processes were killed (a lost
    node) left ``running`` and is written down as such; the resume's console line names it and the steps run again."""
    from tim_megatron.run_dir import attempt, mark_failed, mark_finished, read_meta, record_step, resume_note

    d = _run_folder(tmp_path, [])
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    for restart, end in enumerate(("killed", "failed", "preempted", "resumed")):
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))
        with attempt(d):
            pass  # the attempt's start-up (the run itself is not needed here)
        if end == "killed":
            record_step(d, 13)  # steps 1..13 logged, then SIGKILL: nothing records the end
        elif end == "failed":
            record_step(d, 14)
            mark_failed(d, RuntimeError("Connection closed by peer [10.0.0.2]:5000\nmore"))
        elif end == "preempted":
            record_step(d, 20)
            mark_finished(d, "preempted", step=20, wall_seconds=1.0, max_requeues=3)
    meta = read_meta(d)
    assert meta["attempt"] == "77.3" and [e["attempt"] for e in meta["earlier_attempts"]] == [
        "77.0",
        "77.1",
        "77.2",
    ]
    killed, failed, preempted = meta["earlier_attempts"]
    assert (
        killed["status"] == "running" and killed["step"] == 13 and "processes were killed" in killed["reason"]
    )
    assert failed["status"] == "failed" and failed["reason"].startswith(
        "RuntimeError: Connection closed by peer"
    )
    assert preempted["status"] == "preempted" and preempted["step"] == 20
    # the notes each resume prints (from the checkpoints of steps 10, 10 and 20)
    assert resume_note({**meta, "attempt": "77.1", "earlier_attempts": [killed]}, start_step=11) == (
        "attempt 77.1 resumes from the checkpoint of step 10: attempt 77.0 reached step 13 and ended without a "
        "record: its processes were killed (a lost node, the out-of-memory killer or SIGKILL); steps 11..13 run again"
    )
    assert resume_note({**meta, "attempt": "77.2", "earlier_attempts": [failed]}, start_step=14).endswith(
        "reached step 14 and failed (RuntimeError: Connection closed by peer [10.0.0.2]:5000); step 14 runs again"
    )
    long = {**failed, "reason": "E: " + "x" * 300 + "\nsecond line"}  # the first line only, clipped at 200
    assert resume_note({**meta, "attempt": "77.2", "earlier_attempts": [long]}, start_step=14).endswith(
        "failed (E: " + "x" * 197 + "... (103 more characters)); step 14 runs again"
    )
    assert resume_note(meta, start_step=21).endswith("attempt 77.2 reached step 20 and was preempted")
    assert resume_note({"attempt": "x"}, start_step=21) is None and resume_note(meta, start_step=1) is None


def test_sigterm_to_two_ranks_exits_75_when_preempted_and_0_in_teardown(tmp_path):
    require(importable("megatron.core", "vllm"), "megatron-core and vLLM")
    d = tmp_path / "run"
    proc = _start([GRPO, "--nproc", "2", "run.steps=6", *FAST, "--run-dir", str(d)])  # SIGTERM after step 1
    try:
        _wait(lambda: _rows(d) >= 1, proc, "step 1")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
        meta = _meta(d)
        assert (proc.returncode, meta["status"]) == (75, "preempted"), (meta, out[-3000:])
        assert (
            meta["checkpoint_step"] in range(1, 6)
            and "ranks done: run.json status preempted, exit code 75" in out
        )

        # The resume finishes; the SIGTERM comes once run.json says completed, while the ranks tear down.
        proc = _start(["--resume", str(d), "--nproc", "2"])
        _wait(lambda: _status(d) == "completed", proc, "completed")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
        assert (proc.returncode, _status(d)) == (0, "completed"), out[-3000:]
        assert [r["step"] for r in metrics(d)] == [1, 2, 3, 4, 5, 6]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


# --------------------------------------------------------------------------- start-up SIGTERM, retry


def test_sigterm_during_start_up_stops_at_once_even_on_a_retried_folder(tmp_path):
    """A start that failed (missing model) leaves a folder the corrected command may use (item 12); a SIGTERM
    while that second start is still setting up ends it at once, as preempted with exit 75."""
    require(importable("megatron.core", "vllm"), "megatron-core and vLLM")
    d = tmp_path / "run"
    args = [GRPO, "run.steps=3", *FAST, "--run-dir", str(d)]
    res = _tim([*args, f"model.path={tmp_path / 'missing-model'}"])
    assert res.returncode == 2 and _status(d) == "failed", res.stderr[-2000:]

    proc = _start(args)
    try:
        _wait(lambda: _status(d) == "running", proc, "the attempt started")
        proc.send_signal(signal.SIGTERM)
        t0 = time.time()
        out, _ = proc.communicate(timeout=300)
        took = time.time() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    meta = _meta(d)
    assert proc.returncode == 75, (meta, out[-3000:])
    assert meta["status"] == "preempted" and "SIGTERM during start-up" in meta["reason"], meta
    assert meta["requeue_attempt"] is None and _rows(d) == 0  # no step ran, no checkpoint to requeue on
    assert "stopped by SIGTERM during start-up, before the first step" in out and "Traceback" not in out
    assert meta["recipe_changes"][0]["note"] == "no step had run in this folder"
    assert took < 60, took  # before: start-up, a whole step and a checkpoint


# ---------------------------------------------------------------------------- item 17: unwritable


def test_write_refusals_are_named_and_recorded(tmp_path):
    from tim_megatron.run_dir import RunDirNotWritable, attempt

    d = _run_folder(tmp_path, [])
    (d / "checkpoints").mkdir()
    # a writer that wraps the OSError (as torch's checkpoint writer does) is still a named refusal
    shard = d / "checkpoints" / "step_00000001" / "x.distcp"
    with (
        pytest.raises(RunDirNotWritable, match=re.escape(f"cannot write {shard}: Permission denied")),
        attempt(d),
    ):
        try:
            raise PermissionError(errno.EACCES, "Permission denied", str(shard))
        except OSError as e:
            raise RuntimeError("CheckpointException ranks: {0: ...}") from e
    assert _meta(d)["status"] == "failed" and _meta(d)["reason"].startswith("cannot write")
    # reading a file elsewhere that is not readable is not a run-folder problem
    with pytest.raises(PermissionError), attempt(d):
        raise PermissionError(errno.EACCES, "Permission denied", "/etc/shadow-of-a-model")

    refused = "cannot write .*run.json .Read-only file system.*nothing ran"
    with _read_only(d), pytest.raises(RunDirNotWritable, match=refused), attempt(d):
        raise AssertionError("the whole folder read-only: run.json cannot be written, nothing starts")


def test_a_read_only_checkpoints_folder_fails_by_name_before_the_engines_start(tmp_path):
    d = _run_folder(tmp_path, ["run.steps=1", *FAST])
    (d / "checkpoints").mkdir()
    with _read_only(d / "checkpoints"):
        res = _tim(["--resume", str(d)])
    assert res.returncode == 2, res.stderr[-3000:]
    err = " ".join(res.stderr.split())
    assert f"RunDirNotWritable: cannot write in {d / 'checkpoints'}: Read-only file system" in err
    assert "run.json records the failure" in err and "Traceback" not in res.stderr
    meta = _meta(d)
    assert meta["status"] == "failed" and "checkpoints: Read-only file system" in meta["reason"], meta


def test_a_run_folder_turning_read_only_stops_the_run_at_the_next_step(tmp_path):
    require(importable("megatron.core", "vllm"), "megatron-core and vLLM")
    d = tmp_path / "run"
    proc = _start([GRPO, "run.steps=20", *FAST, "--run-dir", str(d)])
    try:
        _wait(lambda: _rows(d) >= 1, proc, "step 1")
        with _read_only(d):
            out, _ = proc.communicate(timeout=300)
            rows = _rows(d)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 2, out[-3000:]
    assert rows <= 3, rows  # stopped at the first step that wrote after the change, not at step 20
    text = " ".join(out.split())
    assert "RunDirNotWritable: cannot write" in text and "Read-only file system" in text, out[-3000:]
    assert "run.json could not be written either (Read-only file system): its status (running) is out" in text
    assert "Traceback" not in out
