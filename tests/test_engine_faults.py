"""Rollout engines that fail without losing the step (rollout.engine_process, rollout/process_engine.py): real vLLM
engines in processes of their own, faults planted by the fire drill (rollout.fault_drill), on CPU.

A killed, hung or raising engine is restarted on its rank, loads the weights it held, passes the check against
what it scored before, and the lost call runs again with the same seeds: the run's samples and metrics are the
unfaulted run's. An engine that fails on every restart stops the run after the budget with a named error and a
checkpoint that resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_ok, train_in_one_process
from tests.test_loop import TIM, _strip, metrics, run_folder, tim_train
from tim_megatron.recipe import RecipeError, load_recipe

ROOT = Path(__file__).resolve().parents[1]
TINY = "recipes/tiny-moe/grpo.yaml"
QUIET = ["logging.wandb.mode=disabled", "run.val_every=0", "checkpoint.every=0"]
OWN = ["rollout.engine_process=true", "rollout.faults.timeout_s=20"]


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
        ["rollout.fault_drill.kind=hang", "rollout.faults.timeout_s=5"],
    )
    return {
        "clean": _two_ranks(tmp / "clean"),
        "killed": _two_ranks(tmp / "killed", *kill, "rollout.fault_drill.rank=1"),
        # three steps are enough for a fault at step 2 (its sync feeds step 3)
        "sync_killed": _two_ranks(tmp / "sync", "run.steps=3", *kill, "rollout.fault_drill.phase=sync"),
        "hung": _two_ranks(tmp / "hung", "run.steps=3", *hang, "rollout.fault_drill.rank=1"),
    }


def test_an_engine_killed_mid_generation_is_restarted_and_the_samples_are_the_same(two_rank_runs):
    """Rank 1's engine is killed at step 2 of 4 after generating its block, before it answers: the run completes,
    one restart is recorded with its block regenerated, and every sampled token and logprob of every step equals
    the unfaulted run's (vLLM's seeded sampling: the same seeds in a batch of the same composition)."""
    (clean, _), (killed, console) = two_rank_runs["clean"], two_rank_runs["killed"]
    rows = metrics(killed)
    assert [r["faults/restarts"] for r in rows] == [0, 1, 0, 0]
    assert rows[1]["faults/prompts_regenerated"] == 8.0  # rank 1's block of the 16 prompts
    assert rows[1]["faults/seconds_lost"] > 0
    assert _tokens(killed) == _tokens(clean) and len(_tokens(clean)) == 4
    assert _faultless(rows) == _faultless(metrics(clean))
    assert json.loads((killed / "run.json").read_text())["status"] == "completed"
    line = "fault: rank 1's rollout engine died during generate at step 2: its process ended (signal SIGKILL)"
    assert line in console


@pytest.mark.parametrize("name, rank, regenerated", [("sync_killed", 0, 0), ("hung", 1, 8)])
def test_a_kill_in_the_weight_push_and_a_hang_on_two_ranks_keep_the_samples(
    two_rank_runs, name, rank, regenerated
):
    """Two ranks, a fault at step 2 on one of them: rank 0's engine killed during the weight load of step 2's sync,
    or rank 1's engine stopped (SIGSTOP) during step 2's generation, found by the 5 s timeout, its block of 8
    prompts generated again. The other rank waits at the next collective; one restart, and every sampled token and
    logprob, and every metric but the faults' and wall-clock time, equal the unfaulted run's."""
    (clean, _), (run, console) = two_rank_runs["clean"], two_rank_runs[name]
    rows = metrics(run)
    assert [r["faults/restarts"] for r in rows] == [0, 1, 0]
    assert rows[1]["faults/prompts_regenerated"] == regenerated
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
    assert row["restarts"] == 1 and row["prompts_regenerated"] == 8 and row["steps"] == [2]
    build_report([clean, killed], tmp_path / "report")
    page = (tmp_path / "report" / "index.html").read_text()
    assert "Rollout engine faults" in page and "<td>2</td>" in page


# ------------------------------------------------------------------------------------------ one rank


@pytest.fixture(scope="module")
def one_rank_runs(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("faults1")
    drills = {
        "clean": [],
        "wake_raised": ["rollout.fault_drill.kind=raise", "rollout.fault_drill.phase=wake"],
        "every_restart": [
            "rollout.fault_drill.kind=kill",
            "rollout.fault_drill.every_attempt=true",
            "rollout.faults.max_restarts_per_step=1",
            "checkpoint.every=1",
        ],
    }
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
    assert _tokens(run) == _tokens(base)
    assert _faultless(rows) == _faultless(metrics(base))


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
    ],
)
def test_the_recipe_refuses_a_drill_it_cannot_run(overrides, refused):
    with pytest.raises(RecipeError, match=refused):
        load_recipe(ROOT / TINY, overrides)
