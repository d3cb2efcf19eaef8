"""Rollout engines that fail without losing the step (rollout.engine_process, rollout/process_engine.py): real vLLM
engines in processes of their own, faults planted by the fire drill (rollout.fault_drill), on CPU.

A killed, hung or raising engine is restarted on its rank, loads the weights it held, scores its witness probe as
its predecessor did, bit for bit, and the lost call runs again with the same seeds: the run's samples and metrics
are the unfaulted run's. An engine that fails on every restart stops the run after the budget with a named error
and a checkpoint that resumes. An engine process never outlives its rank, every call is bounded by
rollout.faults.timeout_s, and weights cross in one shared buffer whatever the number of tensors."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import importable, require, run_ok, train_in_one_process
from tests.test_loop import TIM, _strip, metrics, run_folder, tim_train
from tim_megatron.recipe import RecipeError, load_recipe

ROOT = Path(__file__).resolve().parents[1]
TINY = "recipes/tiny-moe/grpo.yaml"
QUIET = ["logging.wandb.mode=disabled", "run.val_every=0", "checkpoint.every=0"]
OWN = ["rollout.engine_process=true", "rollout.faults.timeout_s=20"]
MANY = ["model.dims.num_layers=4", "model.dims.num_experts=128", "model.tiny_warmup_steps=0"]
"""The tiny MoE with 4 layers of 128 experts: 1,536 expert tensors, 1,575 in all."""


def _faultless(rows: list[dict]) -> list[dict]:
    """Every metric but wall-clock time, the faults' own, and what a (re)start reports once (kernels, remedies)."""
    once = ("faults/", "remedy/", "kernels/", "rollout/engines")
    return [{k: v for k, v in r.items() if not k.startswith(once)} for r in _strip(rows)]


def _tokens(run: Path) -> dict[int, list]:
    """Every dumped token (step, row, position, token id, rollout logprob), by step."""
    import pyarrow.parquet as pq

    out = {}
    for f in sorted((run / "dumps").glob("step_*.parquet")):
        t = pq.read_table(f, columns=["seq", "position", "token_id", "pi_infer"]).to_pylist()
        out[int(f.stem.split("_")[1])] = [tuple(r.values()) for r in t]
    return out


# ------------------------------------------------------------------------------------------ two ranks


def _two_ranks(tmp: Path, *extra: str) -> tuple[Path, str]:
    """A 4-step run on two ranks, one engine process each: its folder and its console output."""
    args = [TINY, "--nproc", "2", "parallel.dp=2", "run.steps=4", "diagnostics.dumps.every=1", *QUIET, *OWN]
    res = run_ok([*TIM, "train", *args, *extra, f"run.output_dir={tmp}"], threads=1, timeout=900)
    return run_folder(tmp), res.stdout + res.stderr


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    tmp = tmp_path_factory.mktemp("faults2")
    kill, hang = (
        ["rollout.fault_drill.kind=kill"],
        ["rollout.fault_drill.kind=hang_in_reply", "rollout.faults.timeout_s=5"],
    )
    return {
        "clean": _two_ranks(tmp / "clean"),
        # step 3: after the sync of step 2, which (rollout.sync_check = every) ran no probe
        "killed": _two_ranks(
            tmp / "killed", *kill, "rollout.fault_drill.rank=1", "rollout.fault_drill.step=3"
        ),
        # three steps are enough for a fault at step 2 (its sync feeds step 3)
        "sync_killed": _two_ranks(tmp / "sync", "run.steps=3", *kill, "rollout.fault_drill.phase=sync"),
        "hung": _two_ranks(tmp / "hung", "run.steps=3", *hang, "rollout.fault_drill.rank=1"),
    }


def test_an_engine_killed_mid_generation_is_restarted_and_the_samples_are_the_same(two_rank_runs):
    """Rank 1's engine is killed at step 3 of 4 after generating its block, before it answers: the run completes,
    one restart is recorded with its block regenerated, and every sampled token and logprob of every step equals
    the unfaulted run's (vLLM's seeded sampling: the same seeds in a batch of the same composition). Step 2's sync
    ran no probe (rollout.sync_check = every probes the first and last syncs), yet the restarted engine's witness
    (the probe an engine scores right after every load) is compared with its predecessor's: equal, bit for bit;
    at the steps without a restart nothing was compared, and the metric is absent, not 0.0."""
    (clean, _), (killed, console) = two_rank_runs["clean"], two_rank_runs["killed"]
    rows = metrics(killed)
    assert [r["faults/restarts"] for r in rows] == [0, 0, 1, 0]
    assert rows[2]["faults/prompts_regenerated"] == 8.0  # rank 1's block of the 16 prompts
    assert rows[2]["faults/seconds_lost"] > 0
    assert [r["faults/witness_checks"] for r in rows] == [0, 0, 1, 0]
    assert rows[2]["faults/witness_max_abs_prob_diff"] == 0.0
    assert [r for r in rows if "faults/witness_max_abs_prob_diff" in r] == [rows[2]]
    assert not any(
        "sync/probe_p80_abs_prob_diff" in r for r in rows[1:3]
    )  # no probe after the syncs of steps 1-2
    assert _tokens(killed) == _tokens(clean) and len(_tokens(clean)) == 4
    assert _faultless(rows) == _faultless(metrics(clean))
    assert json.loads((killed / "run.json").read_text())["status"] == "completed"
    line = "fault: rank 1's rollout engine died during generate at step 3: its process ended (signal SIGKILL)"
    assert line in console


def test_an_engine_processs_own_log_goes_to_the_ranks_engine_log_not_the_console(two_rank_runs):
    """Issue 56: the engine process's vLLM warnings went to the console (28 per start) while logs/engine.log
    counted 8. The engine process now routes its library output to its rank's engine log, and the console's
    count of warnings reads the file, every process's records included."""
    for name in ("clean", "killed"):
        run, console = two_rank_runs[name]
        assert not re.search(r"^\S*(INFO|WARNING|DEBUG) \d\d-\d\d \d", console, re.M), console[-3000:]
        logs = {p.name: p.read_text() for p in (run / "logs").glob("engine*.log")}
        assert set(logs) == {"engine.log", "engine.rank1.log"}, sorted(logs)
        started = [n for n, text in logs.items() if "vllm" in text and " WARNING " in text]
        assert sorted(started) == sorted(logs), {n: len(t) for n, t in logs.items()}
        n = len(re.findall(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING ", logs["engine.log"], re.M))
        assert f"engine log: {n} warning" in console, (n, console[-2000:])
    assert "fault: rank 1's restarted rollout engine loaded the weights its predecessor held" in console
    assert "the witness probe's 30 logprobs equal bit for bit" in console


@pytest.mark.parametrize("name, rank, regenerated", [("sync_killed", 0, 0), ("hung", 1, 8)])
def test_a_kill_in_the_weight_push_and_a_hang_on_two_ranks_keep_the_samples(
    two_rank_runs, name, rank, regenerated
):
    """Two ranks, a fault at step 2 on one of them: rank 0's engine killed during the weight load of step 2's sync,
    or rank 1's engine stopped (SIGSTOP) in the middle of its answer to step 2's generation (half of it written:
    a read that waits for the rest is bounded too), found by the 5 s timeout within 5 s more, its block of 8
    prompts generated again. The other rank waits at the next collective; one restart, and every sampled token and
    logprob, and every metric but the faults' and wall-clock time, equal the unfaulted run's. The killed load runs
    again on the restarted engine, which loads nothing first: no witness to compare, and the metric is absent."""
    (clean, _), (run, console) = two_rank_runs["clean"], two_rank_runs[name]
    rows = metrics(run)
    assert [r["faults/restarts"] for r in rows] == [0, 1, 0]
    assert rows[1]["faults/prompts_regenerated"] == regenerated
    assert [r["faults/witness_checks"] for r in rows] == [0, 0 if name == "sync_killed" else 1, 0]
    assert [r for r in rows if "faults/witness_max_abs_prob_diff" in r] == (
        [] if name == "sync_killed" else [rows[1]]
    )
    if name == "hung":
        assert 5 <= rows[1]["faults/detect_seconds"] <= 5 + 5
    assert _tokens(run) == {s: t for s, t in _tokens(clean).items() if s <= 3}
    # the sync after a run's last step checks the probe instead of the next step's samples: step 3's sync metrics
    # differ from those of the 4-step run's step 3 by design
    same, base = _faultless(rows), _faultless(metrics(clean)[:3])
    for r in (same[-1], base[-1]):
        for k in [k for k in r if k.startswith("sync/")]:
            del r[k]
    assert same == base
    phase, how = ("sync", "died") if name == "sync_killed" else ("generate", "hung")
    assert f"fault: rank {rank}'s rollout engine {how} during {phase} at step 2" in console, console[-3000:]


def test_the_report_has_a_section_on_the_faults(two_rank_runs, tmp_path):
    from tim_megatron.report.build import build_report, fault_rows
    from tim_megatron.report.runs import load_runs

    (clean, _), (killed, _) = two_rank_runs["clean"], two_rank_runs["killed"]
    (row,) = [f for f in fault_rows(load_runs([killed], [])) if f["restarts"]]
    assert row["restarts"] == 1 and row["prompts_regenerated"] == 8 and row["steps"] == [3]
    build_report([clean, killed], tmp_path / "report")
    page = (tmp_path / "report" / "index.html").read_text()
    assert "Rollout engine faults" in page and "<td>3</td>" in page


# ------------------------------------------------------------------------------------------ one rank


@contextlib.contextmanager
def _open_file_limit(soft: int):
    """This process's open-file limit lowered to ``soft`` (as ``ulimit -n``), inherited by what it starts."""
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, old[1]), old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, old)


@pytest.fixture(scope="module")
def one_rank_runs(tmp_path_factory) -> dict[str, dict]:
    """Runs of one rank in one worker process, at an open-file limit of 1024 (ulimit -n 1024)."""
    tmp = tmp_path_factory.mktemp("faults1")
    drills = {
        "clean": [],
        # two steps of the 1,575-tensor model: each sync crosses in one buffer (per tensor: 1,575 descriptors)
        "many_tensors": [*MANY, "run.steps=2", "data.prompts_per_step=4", "rollout.n=4"],
        "wake_raised": ["rollout.fault_drill.kind=raise", "rollout.fault_drill.phase=wake"],
        "every_restart": [
            "rollout.fault_drill.kind=kill",
            "rollout.fault_drill.every_attempt=true",
            "rollout.faults.max_restarts_per_step=1",
            "checkpoint.every=1",
        ],
    }
    with _open_file_limit(1024):
        return train_in_one_process(
            [
                {
                    "name": name,
                    "recipe": TINY,
                    "overrides": [*QUIET, *OWN, "run.steps=3", "diagnostics.dumps.every=1", *extra],
                    "output_dir": str(tmp / name),
                }
                for name, extra in drills.items()
            ],
            tmp / "worker",
        )


def test_a_wake_up_that_raises_is_recovered_with_the_same_samples(one_rank_runs):
    """A wake-up that raises (before step 2's sync) costs one restart and nothing else. (A kill during the weight
    load and a hang are tested on two ranks above.)"""
    name, step, regenerated = "wake_raised", 2, 0
    res, clean = one_rank_runs[name], one_rank_runs["clean"]
    assert res["error"] is None and res["exit"] == 0, res["error"]
    run, base = Path(res["run_dir"]), Path(clean["run_dir"])
    rows = metrics(run)
    assert [r["faults/restarts"] for r in rows] == [1 if r["step"] == step else 0 for r in rows]
    assert rows[step - 1]["faults/prompts_regenerated"] == regenerated
    assert (
        rows[step - 1]["faults/witness_checks"] == 1
        and rows[step - 1]["faults/witness_max_abs_prob_diff"] == 0.0
    )
    assert _tokens(run) == _tokens(base)
    assert _faultless(rows) == _faultless(metrics(base))


def test_a_model_of_1575_tensors_syncs_into_its_engine_process_at_an_open_file_limit_of_1024(one_rank_runs):
    """The tiny MoE with 4 layers of 128 experts (1,575 tensors), two steps at ``ulimit -n 1024``: each sync
    crosses in one shared buffer (one descriptor; one per tensor ran out of open files at the first sync, and the
    rank's EMFILE was counted as an engine fault and restarted), and no engine fault is counted."""
    res = one_rank_runs["many_tensors"]
    assert res["error"] is None and res["exit"] == 0, res["error"]
    rows = metrics(Path(res["run_dir"]))
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["sync/tensors"] for r in rows] == [1575.0, 1575.0]  # 4 x 128 x 3 expert tensors, and 39 more
    assert [r["faults/restarts"] for r in rows] == [0.0, 0.0]


def test_an_engine_that_dies_on_every_restart_stops_the_run_with_a_checkpoint_that_resumes(
    one_rank_runs, tmp_path
):
    """Killed at step 2 and again in its restart: past rollout.faults.max_restarts_per_step = 1 the run stops with
    EngineLost naming the rank, the phase and the cause, keeps step 1's checkpoint, and a resume without the drill
    finishes the run with the unfaulted run's numbers."""
    res = one_rank_runs["every_restart"]
    assert res["exit"] != 0 and res["error"] is not None
    err = res["error"]
    assert "EngineLost" in err and "rank 0's rollout engine died during generate at step 2" in err, err
    assert "its process ended (signal SIGKILL)" in err, err
    assert "rollout.faults.max_restarts_per_step = 1 allows no more" in err and "step_00000001" in err, err
    run = Path(res["run_dir"])
    assert json.loads((run / "run.json").read_text())["status"] == "failed"
    assert (run / "checkpoints" / "step_00000001" / "state.json").exists()
    again = [TINY, *QUIET, *OWN, "run.steps=3", "diagnostics.dumps.every=1", "checkpoint.every=1"]  # no drill
    tim_train([*again, "--run-dir", str(run), "--allow-recipe-change"], tmp_path)
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert _faultless(rows) == _faultless(metrics(Path(one_rank_runs["clean"]["run_dir"])))


# ------------------------------------------------------------------------------------------ one engine, no trainer


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie has ended: it holds nothing and runs nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _state(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return "-"


def _children_of(pid: int) -> set[int]:
    """Every process whose parent chain reaches ``pid`` (a /proc scan)."""
    parents = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = {c for c, pp in parents.items() if pp == p} - out
        out |= kids
        todo += kids
    return out


@pytest.fixture(scope="module")
def engine_faults(tmp_path_factory) -> dict:
    """tests/workers/engine_worker.py through its scenarios (its results); then, while its engine is stopped
    (SIGSTOP) and the rank waits for its answer, the rank is killed (SIGKILL): ``left`` is every process of the
    rank's (the worker's pids and a /proc scan of its descendants just before the kill) still running 5 s later."""
    require(importable("vllm"), "vLLM")
    tmp = tmp_path_factory.mktemp("engine_worker")
    out, log = tmp / "results.json", (tmp / "worker.log").open("w")
    worker = ROOT / "tests/workers/engine_worker.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(worker), str(out)], cwd=ROOT, env=env, stdout=log, stderr=log
    )
    family: set[int] = set()
    try:
        t0, res = time.monotonic(), {}
        while not ("stopped" in res and _state(res["stopped"]["engine"]) == "T"):
            assert proc.poll() is None, (tmp / "worker.log").read_text()[-4000:]
            assert time.monotonic() - t0 < 600, (tmp / "worker.log").read_text()[-4000:]
            time.sleep(0.2)
            with contextlib.suppress(OSError, ValueError):
                res = json.loads(out.read_text())
        family = _children_of(proc.pid) | set(res["stopped"]["descendants"])
        res["family"] = sorted(family)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5 and any(_running(p) for p in family):
            time.sleep(0.05)
        res["left"] = {p: _state(p) for p in family if _running(p)}
        return res
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in family:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        log.close()


def test_an_engine_process_ends_with_its_rank_even_when_stopped(engine_faults):
    """A rank killed (SIGKILL) while its engine process is stopped (SIGSTOP, the hang drill) and the rank waits
    for it: within 5 s no process of the rank's is left (the engine's death signal, PR_SET_PDEATHSIG, needs none
    of its threads; no multiprocessing resource tracker). The engine was started from a thread that had ended long
    before (the overlapped schedule restarts engines from its sampling thread): the signal follows the rank's
    launcher thread, not that one, so the engine outlived it and answered."""
    res = engine_faults
    assert res["stopped"]["engine"] in res["family"]
    assert res["left"] == {}, res["left"]
    assert res["thread"] == {"starter_alive": False, "answered": True, "same_pid": True}


def test_the_ranks_own_errors_during_a_sync_are_its_own_not_an_engine_fault(engine_faults):
    """A weight stream that fails on the rank (an OSError with EMFILE, as an open-file limit raises) surfaces as
    that error; a sync at an open-file limit with no room left stops before it starts, naming the limit and the fix
    (an EMFILE from the rank's own send was taken for a dead engine and restarted). Neither restarts the engine."""
    assert engine_faults["own_error"] == {
        "raised": "OSError",
        "errno": errno.EMFILE,
        "restarts": 0.0,
        "same_pid": True,
    }
    res = engine_faults["no_room"]
    assert (res["raised"], res["restarts"], res["same_pid"]) == ("FileLimitError", 0.0, True), res
    assert "open-file limit (RLIMIT_NOFILE)" in res["message"] and "ulimit -n" in res["message"], res


def test_an_engine_that_stops_before_reading_a_large_request_is_found_within_the_timeout(engine_faults):
    """The engine stops (SIGSTOP) before it reads a request far larger than the socket's buffer, so the rank's
    write cannot finish: found by rollout.faults.timeout_s = 2 within 5 s more, restarted, the weights of the last
    update loaded from the buffer and the witness equal to the predecessor's, and the generation drawn again with
    the same samples."""
    res = engine_faults["hang_before_read"]
    f = res["faults"]
    assert f["faults/restarts"] == 1.0 and 2 <= f["faults/detect_seconds"] <= 2 + 5
    assert f["faults/witness_checks"] == 1.0 and f["faults/witness_max_abs_prob_diff"] == 0.0
    assert res["same_samples"] and engine_faults["reference"] == {"differs_from_checkpoint": True}


def test_a_restarted_engine_one_update_behind_is_caught_by_its_witness(engine_faults):
    """The stale drill: the engine is killed, and its restart keeps the checkpoint's weights instead of loading the
    update its predecessor held (one update behind). Its witness differs from the predecessor's: the named error,
    nothing counted as compared."""
    res = engine_faults["stale"]
    assert res["raised"] == "WitnessMismatch", res
    msg = res["message"]
    assert "rank 0's restarted rollout engine does not hold the weights its predecessor held" in msg, msg
    assert "of 30 witness probe logprobs differ" in msg and "a stale or partial load" in msg, msg
    assert res["faults"]["faults/witness_checks"] == 0.0


# ------------------------------------------------------------------------------------------ the wire, the buffer


def test_every_read_and_write_on_the_wire_is_bounded():
    """A reply cut in the middle, a request the other side never reads, a closed peer and an ended process, on a
    real socket pair: each found by its deadline (0.3 s here) or at once."""
    from tim_megatron.rollout.engine_wire import (
        WireClosed,
        WireTimeout,
        frame,
        read_frame,
        recv_frame,
        send_frames,
    )

    mine, theirs = socket.socketpair()
    mine.setblocking(False)
    theirs.sendall(frame(b"x" * 1000)[:500])
    t = time.monotonic()
    with pytest.raises(WireTimeout, match=r"reading a reply \(492 of 1000 bytes read\)"):
        recv_frame(mine, deadline=t + 0.3)
    with pytest.raises(WireTimeout, match="writing"):
        send_frames(mine, [bytes(8 << 20)], deadline=time.monotonic() + 0.3)
    assert time.monotonic() - t < 0.6 + 1
    t = time.monotonic()
    with pytest.raises(WireClosed):
        recv_frame(mine, deadline=t + 30, alive=lambda: False)  # nothing comes from a process that ended
    theirs.close()
    with pytest.raises(WireClosed):
        recv_frame(mine, deadline=t + 30)
    with pytest.raises(WireClosed):
        send_frames(mine, [b"x"], deadline=t + 30)
    assert time.monotonic() - t < 1
    mine.close()

    mine, theirs = socket.socketpair()  # a descriptor crosses beside a frame
    mine.setblocking(False)
    r, w = os.pipe()
    got: list = []
    reader = threading.Thread(target=lambda: got.append(read_frame(theirs, max_fds=1)))
    reader.start()
    send_frames(mine, [b"hello"], deadline=time.monotonic() + 5, fds=[r])
    reader.join(5)
    ((body, fds),) = got
    assert body == b"hello" and len(fds) == 1 and os.fstat(fds[0]).st_ino == os.fstat(r).st_ino
    for fd in (r, w, *fds):
        os.close(fd)
    mine.close()
    theirs.close()


def test_weights_cross_in_one_flat_buffer_with_an_index():
    """Tensors of three dtypes and shapes (a 0-d one, a transposed one) packed in the stream's order at aligned
    offsets, read back bit for bit through views of the mapped buffer; the next sync of the same tensors writes
    over the same buffer, one of other shapes gets a new one; an engine that keeps a view is refused."""
    from tim_megatron.rollout.flat_weights import ALIGN, FlatWeights, load_mapped

    g = torch.Generator().manual_seed(0)
    tensors = [
        ("a", torch.randn(3, 5, generator=g, dtype=torch.float32)),
        ("b", torch.tensor(1.5, dtype=torch.bfloat16)),
        ("c", torch.arange(7, dtype=torch.int64)),
        ("d", torch.randn(4, 6, generator=g).to(torch.bfloat16).t()),
    ]
    fw = FlatWeights()
    fw.pack(iter(tensors))
    assert [e.name for e in fw.index] == ["a", "b", "c", "d"] and fw.generation == 1
    assert all(e.offset % ALIGN == 0 for e in fw.index)

    def copied(views):
        return [(n, v.clone()) for n, v in views]

    back = load_mapped(fw.fd, fw.size, fw.index, copied)
    assert [n for n, _ in back] == ["a", "b", "c", "d"]
    for (_, v), (_, t) in zip(back, tensors, strict=True):
        assert v.dtype == t.dtype and v.shape == t.shape and torch.equal(v, t)
    fd = fw.fd
    fw.pack(iter([(n, t * 2 if t.is_floating_point() else t) for n, t in tensors]))
    assert fw.generation == 1 and fw.fd == fd
    assert torch.equal(load_mapped(fw.fd, fw.size, fw.index, copied)[0][1], tensors[0][1] * 2)
    fw.pack(iter([("a", torch.zeros(2, 2))]))
    assert fw.generation == 2 and [(e.name, e.shape) for e in fw.index] == [("a", (2, 2))]
    with pytest.raises(RuntimeError, match="kept a reference to the shared weight buffer"):
        load_mapped(fw.fd, fw.size, fw.index, lambda views: views)
    fw.close()


def test_a_sync_of_1536_tensors_opens_one_file_and_the_limit_is_checked_first():
    """1,536 tensors (4 layers x 128 experts x 3) take one open file, whatever their number; the check before a
    sync names the limit (RLIMIT_NOFILE) and the fix when even that does not fit."""
    from tim_megatron.rollout.flat_weights import FileLimitError, FlatWeights, check_open_file_limit

    before = len(os.listdir("/proc/self/fd"))
    fw = FlatWeights()
    fw.pack(
        (f"layers.{i // 384}.experts.{i % 384 // 3}.w{i % 3}", torch.full((4, 8), float(i)))
        for i in range(1536)
    )
    assert len(fw.index) == 1536 and len(os.listdir("/proc/self/fd")) == before + 1
    fw.close()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = len(os.listdir("/proc/self/fd"))  # the files open, and one more (the listing's own, closed again)
    resource.setrlimit(resource.RLIMIT_NOFILE, (room, hard))
    try:
        check_open_file_limit(needed=1, who="rank 0")
        with pytest.raises(
            FileLimitError, match=r"rank 0 has \d+ files open and an open-file limit \(RLIMIT_NOFILE\)"
        ):
            check_open_file_limit(needed=2, who="rank 0")
        with pytest.raises(FileLimitError, match=r"ulimit -n \d+ before tim train"):
            check_open_file_limit(needed=2, who="rank 0")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ------------------------------------------------------------------------------------------ the recipe


@pytest.mark.parametrize(
    "overrides, refused",
    [
        (
            ["rollout.fault_drill.kind=kill"],
            r"rollout.fault_drill.kind = kill with rollout.engine_process = false",
        ),
        (["rollout.engine_process=true", "diagnostics.vexact=exact"], r"with the 'trainer' rollout backend"),
        (
            ["rollout.engine_process=true", "rollout.tensor_parallel_size=2"],
            r"rollout.engine_process = true with rollout.tensor_parallel_size = 2",
        ),
        (
            ["rollout.engine_process=true", "rollout.fault_drill.kind=hang", "rollout.fault_drill.rank=3"],
            r"rollout.fault_drill.rank = 3: the run has ranks 0 to 0",
        ),
        (["rollout.fault_drill.phase=boot"], r"rollout.fault_drill.phase"),
        (
            [
                "rollout.engine_process=true",
                "rollout.fault_drill.kind=stale",
                "rollout.fault_drill.phase=sync",
            ],
            r"rollout.fault_drill.kind = stale with phase = sync, step = 2: .*allowed: phase generate or wake",
        ),
        (
            ["rollout.engine_process=true", "rollout.fault_drill.kind=stale", "rollout.fault_drill.step=1"],
            r"kind = stale with phase = generate, step = 1: .*step >= 2",
        ),
        (["rollout.fault_drill.kind=freeze"], r"rollout.fault_drill.kind"),
    ],
)
def test_the_recipe_refuses_a_drill_it_cannot_run(overrides, refused):
    with pytest.raises(RecipeError, match=refused):
        load_recipe(ROOT / TINY, overrides)
