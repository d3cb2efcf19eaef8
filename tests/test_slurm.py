"""Slurm launch against a real local Slurm (munged, slurmctld, slurmd on loopback, started here): make submit,
sweeps, a two-rank job, cancel and requeue with resume, new-recipe and plan, the 30B dry run, and safety."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slurm
FAST = "logging.wandb.mode=offline run.val_every=0 diagnostics.dumps.every=0 checkpoint.every=0 checkpoint.at_end=false"


def make(target: str, slurm, **variables) -> subprocess.CompletedProcess:
    args = [
        "make",
        "--no-print-directory",
        target,
        f"PY={sys.executable}",
        f"TIM={Path(sys.executable).parent / 'tim'}",
    ]
    args += [f"{k}={v}" for k, v in variables.items()]
    env = {**(slurm.env if slurm else os.environ), "OMP_NUM_THREADS": "2"}
    prefix = list(getattr(slurm, "prefix", []))  # the two-node cluster's clients run in its namespace
    return subprocess.run([*prefix, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def submitted(res) -> tuple[str, Path]:
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    job = re.search(r"submitted job (\d+)", res.stdout).group(1)
    run = Path(re.search(r"run folder: (\S+)", res.stdout).group(1))
    return job, run


def submit_tiny(slurm, out: Path, steps: int, extra: str = "") -> tuple[str, Path]:
    """`make submit` of the tiny GRPO recipe into ``out``; returns (job id, run folder)."""
    return submitted(
        make(
            "submit",
            slurm,
            RECIPE="recipes/tiny-moe/grpo.yaml",
            OVERRIDES=f"run.steps={steps} {FAST} run.output_dir={out} {extra}".strip(),
        )
    )


def job_log(run: Path, job: str) -> str:
    """The end of a job's Slurm log, for assertion messages."""
    return (run / "logs" / f"slurm-{job}.out").read_text()[-3000:]


def steps_logged(run: Path) -> list[int]:
    f = run / "metrics.jsonl"
    return [json.loads(line)["step"] for line in f.read_text().splitlines()] if f.exists() else []


# One two-rank job (TP=2, issue 11's failing layout, with forced odd and even widths) through the README's command;
# a two-rank DP job runs through Slurm in test_preflight.py's go run, and DP=2 with forced widths in
# test_loop.py::test_two_processes_over_gloo[dp2].
def test_make_submit_runs_a_two_rank_tiny_job_to_completion(slurm, tmp_path):
    from tests.test_loop import FORCED_WIDTHS, expected_widths

    widths = expected_widths(2)
    assert {w % 2 for w in widths} == {0, 1}, widths  # an odd and an even width, whatever is sampled
    job, run = submit_tiny(slurm, tmp_path, 2, " ".join(["parallel.tp=2", *FORCED_WIDTHS]))
    assert slurm.wait(job) == "COMPLETED", job_log(run, job)
    assert steps_logged(run) == [1, 2]
    assert json.loads((run / "run.json").read_text())["status"] == "completed"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["batch/width"] for r in rows] == widths
    assert (run / "job.sbatch").exists()
    assert len(list((run / "logs").glob(f"ranks-{job}/*/attempt_0/*/stdout.log"))) == 2  # one log per rank
    log = (run / "logs" / f"slurm-{job}.out").read_text()
    assert "tim-megatron job" in log
    logs = make("logs", slurm, JOB=job, ROOT=tmp_path)  # finds the run folder through run.json
    tail = "".join(log.splitlines(keepends=True)[-40:])
    assert logs.returncode == 0 and logs.stdout.endswith(tail), logs.stdout[-2000:] + logs.stderr
    missing = make("logs", slurm, JOB="999999", ROOT=tmp_path)
    assert missing.returncode != 0 and f"no run folder under {tmp_path} records job 999999" in missing.stderr


def test_tiny_sweep_jobs_complete_with_one_sweep_id(slurm, tmp_path):
    res = make(
        "sweep",
        slurm,
        SWEEP="recipes/sweeps/clipping-tiny.yaml",
        OVERRIDES=f"run.steps=2 {FAST} run.output_dir={tmp_path}",
    )
    assert res.returncode == 0, res.stdout + res.stderr
    jobs = re.findall(r"job (\d+)\s+(\S+)", res.stdout)
    assert len(jobs) == 3
    sweep_ids = set()
    for job, run in jobs:
        assert slurm.wait(job) == "COMPLETED"
        assert steps_logged(Path(run)) == [1, 2]
        sweep_ids.add(json.loads((Path(run) / "run.json").read_text())["sweep_id"])
    assert len(sweep_ids) == 1 and next(iter(sweep_ids)).startswith("clipping-tiny-")
    names = {Path(run).parent.name for _, run in jobs}
    assert names == {"clipping-tiny-token-clip-0.2", "clipping-tiny-clip-higher-0.28", "clipping-tiny-gspo"}


def _running_until(run: Path, step: int, job: str, slurm, timeout=300) -> None:
    t0 = time.time()
    while not steps_logged(run) or steps_logged(run)[-1] < step:
        assert time.time() - t0 < timeout, slurm.logs()
        assert local_slurm_state(job, slurm) in ("PENDING", "RUNNING", "CONFIGURING", None)
        time.sleep(1)


def local_slurm_state(job, slurm):
    out = slurm.run(["scontrol", "show", "job", "-o", job]).stdout
    m = re.search(r"JobState=(\S+)", out)
    return m.group(1) if m else None


def resume_to_the_end(cluster, run: Path, *, steps: int | None = None, recipe: list[str] = ()) -> None:
    """`tim submit --resume` of a stopped run: the new job starts after the latest checkpoint and logs every
    step up to ``steps`` exactly once. With ``recipe`` (the recipe and its overrides, ``run.steps`` left out) the
    run continues to two steps after its checkpoint under that recipe (``--allow-recipe-change``): a run long
    enough that no job can finish before the test stops it ends soon after the resume."""
    from tim_megatron.trainer.checkpoint import latest_checkpoint

    ck = latest_checkpoint(run / "checkpoints")
    assert ck is not None
    saved = json.loads((ck / "state.json").read_text())["step"]
    again = []
    if recipe:
        steps = saved + 2
        again = [*recipe, f"run.steps={steps}", "--allow-recipe-change"]
    res = subprocess.run(
        [*cluster.prefix, Path(sys.executable).parent / "tim", "submit", *again, "--resume", str(run)],
        capture_output=True,
        text=True,
        env=cluster.env,
        cwd=ROOT,
    )
    job2, _ = submitted(res)
    assert cluster.wait(job2) == "COMPLETED", job_log(run, job2)
    assert steps_logged(run) == list(range(1, steps + 1))
    assert f"steps {saved + 1}..{steps}" in (run / "logs" / f"slurm-{job2}.out").read_text()


def test_scancel_checkpoints_and_resubmit_resumes(slurm, tmp_path):
    # 300 steps: `make cancel` starts make and tim before scancel, seconds on a loaded machine, and 25 steps
    # of about 0.3 s once finished first. The resume goes on to two steps after the SIGTERM checkpoint.
    job, run = submit_tiny(slurm, tmp_path, 300)
    _running_until(run, 3, job, slurm)
    assert make("cancel", slurm, JOB=job).returncode == 0
    assert slurm.wait(job) == "CANCELLED"
    meta = json.loads((run / "run.json").read_text())
    assert meta["status"] == "preempted", meta
    resume_to_the_end(
        slurm, run, recipe=["recipes/tiny-moe/grpo.yaml", *FAST.split(), f"run.output_dir={tmp_path}"]
    )
    changes = json.loads((run / "run.json").read_text())["recipe_changes"]
    assert [c["changes"] for c in changes] == [{"run.steps": [300, meta["checkpoint_step"] + 2]}], changes


REQUEUE_HOLD_S = 3
"""Seconds a requeued job waits here before it may start again (Slurm's own hold is about 120)."""


def _skip_requeue_delay(job: str, slurm) -> None:
    """slurmctld holds a requeued job for about two minutes (Reason=BeginTime) before it may start again; the
    tests test the project's requeue, not that wait, so the hold is cut to a few seconds. Not to zero: slurmd
    refuses a launch whose credential was made in the same second as the revocation of the previous attempt's
    ("Job credential revoked", compared in whole seconds; seen once in a fresh-clone CI run), which is what
    Slurm's hold guards against."""
    out = slurm.run(["scontrol", "show", "job", "-o", job]).stdout
    m = re.search(r"StartTime=(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)", out)
    if "JobState=PENDING" in out and "Reason=BeginTime" in out and m:
        held_for = (datetime.fromisoformat(m.group(1)) - datetime.now()).total_seconds()
        if held_for > REQUEUE_HOLD_S:  # Slurm's own hold
            # After the sleep the revocation is seconds old, and the update schedules the job at once.
            time.sleep(REQUEUE_HOLD_S)
            slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])


def test_requeue_resumes_the_same_job(slurm, tmp_path):
    # Requeued at step 3 of 40: about ten seconds of steps left for scontrol to reach the job first.
    job, run = submit_tiny(slurm, tmp_path, 40)
    _running_until(run, 3, job, slurm)
    subprocess.run(
        ["scontrol", "requeue", job], env=slurm.env, check=True, capture_output=True
    )  # like a preemption
    t0 = time.time()
    while json.loads((run / "run.json").read_text()).get("status") != "completed":
        assert time.time() - t0 < 600, job_log(run, job)
        _skip_requeue_delay(job, slurm)
        time.sleep(2)
    assert steps_logged(run) == list(range(1, 41))
    assert "resumed_from" in (run / "run.json").read_text()


def _restarts(job: str, slurm) -> int:
    out = slurm.run(["scontrol", "show", "job", "-o", job]).stdout
    m = re.search(r"Restarts=(\d+)", out)
    return int(m.group(1)) if m else 0


def _time_limit_signal(job: str, slurm) -> None:
    """SIGTERM to the job's steps while the job stays RUNNING: what Slurm does before the time limit."""
    subprocess.run(["scancel", "--signal=TERM", job], env=slurm.env, check=True, capture_output=True)


def _ended(job: str, slurm, *, max_restarts: int, timeout: float = 900) -> str:
    """Wait for the job to end; fail as soon as it has been requeued more than ``max_restarts`` times."""
    t0 = time.time()
    while (state := local_slurm_state(job, slurm)) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
        assert _restarts(job, slurm) <= max_restarts, f"requeued {_restarts(job, slurm)} times"
        assert time.time() - t0 < timeout, f"job {job} still {state}"
        _skip_requeue_delay(job, slurm)
        time.sleep(2)
    return state


def test_a_resume_that_fails_at_start_up_is_not_requeued_forever(slurm, tmp_path):
    """Issue 14, finding 3: a requeued run whose start-up fails (here its model folder is gone) used to stay
    "preempted", and the job requeued itself again and again. It checkpoints, requeues once, fails by name."""
    import shutil

    from tim_megatron.recipe import load_recipe
    from tim_megatron.run_setup import model_path_for

    model = tmp_path / "model"
    shutil.copytree(model_path_for(load_recipe(ROOT / "recipes/tiny-moe/grpo.yaml").recipe), model)
    job, run = submit_tiny(slurm, tmp_path / "runs", 300, f"model.path={model}")
    _running_until(run, 2, job, slurm)
    shutil.rmtree(model)  # loaded already; the next attempt's start-up cannot find it
    _time_limit_signal(job, slurm)
    state = _ended(job, slurm, max_restarts=1)
    log = (run / "logs" / f"slurm-{job}.out").read_text()
    assert _restarts(job, slurm) == 1, log[-3000:]  # the SIGTERM checkpoint earned one requeue, no more
    assert state == "FAILED", log[-3000:]
    meta = json.loads((run / "run.json").read_text())
    assert (
        meta["status"] == "failed" and f"model.path = {model}: no such checkpoint folder" in meta["reason"]
    ), meta
    assert meta["attempt"] == f"{job}.1" and f"not requeueing attempt {job}.1" in log


def test_requeue_stops_at_cluster_max_requeues(slurm, tmp_path):
    job, run = submit_tiny(slurm, tmp_path, 300, "cluster.max_requeues=0")
    _running_until(run, 2, job, slurm)
    _time_limit_signal(job, slurm)
    _ended(job, slurm, max_restarts=0)
    meta = json.loads((run / "run.json").read_text())
    assert meta["status"] == "preempted" and meta["requeue_attempt"] is None, meta
    assert meta["requeue"].startswith("refused: the job was requeued 0 time(s), cluster.max_requeues = 0")
    assert f"not requeueing attempt {job}.0" in job_log(run, job)
    from tim_megatron.trainer.checkpoint import latest_good_checkpoint

    assert latest_good_checkpoint(run / "checkpoints").name == f"step_{meta['checkpoint_step']:08d}"


def test_dry_run_renders_the_4_node_30b_script(tmp_path):
    before = set(Path(ROOT / "runs").glob("*")) if (ROOT / "runs").exists() else set()
    res = make("submit", None, RECIPE="recipes/qwen3-30b-a3b/grpo-h100.yaml", DRY_RUN=1)
    assert res.returncode == 0, res.stderr
    s = res.stdout
    for line in [
        "#SBATCH --nodes=4",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --partition=h100",
        "#SBATCH --requeue",
        "#SBATCH --time=72:00:00",
        "PROCS_PER_NODE=8",
        "--rdzv_backend=c10d",
        'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "--container-image=ghcr.io/example/tim-megatron:latest",
        "--container-mounts=/scratch:/scratch,",
        "export HF_HOME=/scratch/hf",
        "export NCCL_DEBUG=WARN",
    ]:
        assert line in s, line
    after = set(Path(ROOT / "runs").glob("*")) if (ROOT / "runs").exists() else set()
    assert after == before  # nothing created, nothing submitted


def test_new_recipe_from_a_config_json_is_valid_and_sized(tmp_path):
    import shutil

    root = tmp_path / "recipes"
    shutil.copytree(ROOT / "recipes" / "qwen3-30b-a3b", root / "qwen3-30b-a3b")
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 1536,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 96,
        "vocab_size": 151936,
        "num_experts": 64,
        "num_experts_per_tok": 6,
        "moe_intermediate_size": 512,
        "intermediate_size": 4096,
        "norm_topk_prob": True,
        "rope_theta": 1e6,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    }
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))

    def new_recipe():
        return make(
            "new-recipe",
            None,
            FROM=root / "qwen3-30b-a3b",
            NAME="my-moe",
            HF=tmp_path / "hf" / "config.json",
            RECIPES_ROOT=root,
        )

    res = new_recipe()
    assert res.returncode == 0, res.stdout + res.stderr
    assert "fits" in res.stdout and "parameters" in res.stdout
    from tim_megatron.recipe import load_recipe
    from tim_megatron.recipe_check import check_dir

    assert all(err is None for _, err in check_dir(root / "my-moe"))
    r = load_recipe(root / "my-moe" / "grpo.yaml").recipe
    assert (r.model.dims.num_experts, r.model.dims.hidden_size, r.model.dims.head_dim) == (64, 1536, 96)
    assert (
        r.model.dims.num_experts % r.parallel.ep == 0
        and r.model.dims.num_key_value_heads % r.parallel.tp == 0
    )
    assert r.parallel.world_size == r.cluster.nodes * r.cluster.gpus_per_node
    again = new_recipe()
    assert again.returncode != 0 and "refusing to overwrite" in again.stdout + again.stderr


# -------------------------------------------------------------------------------------------- safety


@pytest.mark.parametrize("bad", ["a;touch X", "$(touch X)", "`touch X`", "a\nb"])
def test_hostile_job_names_are_rejected(bad, tmp_path):
    from tim_megatron.recipe import RecipeError, load_recipe
    from tim_megatron.slurm.render import RenderError, render

    with pytest.raises(RecipeError, match="run.name"):
        load_recipe(ROOT / "recipes/tiny-moe/grpo.yaml", [f"run.name={bad}"])
    r = load_recipe(ROOT / "recipes/tiny-moe/grpo.yaml", ["cluster.job_name=x"]).recipe.model_copy(deep=True)
    r.cluster.__dict__["job_name"] = bad  # a value that got past the schema some other way
    with pytest.raises(RenderError, match="cluster.job_name"):
        render(r, run_dir=tmp_path, job_name="ok")


def test_partition_and_time_injection_rejected(tmp_path):
    from tim_megatron.recipe import load_recipe
    from tim_megatron.slurm.render import RenderError, render

    for ov, key in (
        ["cluster.partition=cpu --wrap=touch", "cluster.partition"],
        ["cluster.time=1:00 $(id)", "cluster.time"],
    ):
        r = load_recipe(ROOT / "recipes/tiny-moe/grpo.yaml", [ov]).recipe
        with pytest.raises(RenderError, match=key):
            render(r, run_dir=tmp_path, job_name="x")


def test_shell_values_are_inert_and_secrets_stay_out(slurm, tmp_path):
    marker = tmp_path / "PWNED"
    hostile = f"$(touch {marker}) `touch {marker}` ; touch {marker}"
    secret = "sk-test-SECRET-do-not-leak-123"
    env = {**slurm.env, "WANDB_API_KEY": secret, "HF_TOKEN": secret, "OMP_NUM_THREADS": "2"}
    res = subprocess.run(
        [
            Path(sys.executable).parent / "tim",
            "submit",
            "recipes/tiny-moe/grpo.yaml",
            "run.steps=1",
            *FAST.split(),
            f"run.output_dir={tmp_path}",
            f"cluster.env={{PROBE: {json.dumps(hostile)}}}",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    job, run = submitted(res)
    assert slurm.wait(job) == "COMPLETED", job_log(run, job)
    assert not marker.exists()  # nothing ran
    script = (run / "job.sbatch").read_text()
    assert "export PROBE='" in script and secret not in script
    for f in run.rglob("*"):
        if f.is_file() and f.suffix in (".out", ".log", ".json", ".yaml", ".jsonl", ".sbatch", ".txt"):
            assert secret not in f.read_text(errors="ignore"), f
    from tim_megatron.recipe import load_recipe
    from tim_megatron.slurm.render import RenderError, render

    r = load_recipe(ROOT / "recipes/tiny-moe/grpo.yaml", ["cluster.env={WANDB_API_KEY: x}"]).recipe
    with pytest.raises(RenderError, match="secrets must not be written"):
        render(r, run_dir=tmp_path, job_name="x")


def test_run_names_cannot_escape_the_runs_folder(tmp_path):
    from tim_megatron.recipe import RecipeError, load_recipe

    for bad in ("../../etc", "/abs", "a/b"):
        with pytest.raises(RecipeError):
            load_recipe(ROOT / "recipes/tiny-moe/grpo.yaml", [f"run.name={bad}"])


# ------------------------------------------------------------------------------------------ two nodes


def test_two_node_job(two_nodes, tmp_path):
    """`make submit` with cluster.nodes=2 on a real two-node Slurm (two network namespaces on this machine):
    torchrun rendezvous across the nodes, one rollout engine per node, every sync verified per engine, metrics and
    checkpoints written. The run is one step off-policy on the overlapped schedule: each engine samples the next
    step's batch while the ranks update, and the checkpoint holds that batch for the resume. The engines run in
    processes of their own, and the second node's is killed during step 2's generation: it is restarted there and
    the job goes on. Then the second node is lost whole (its link cut, every process on it killed): Slurm holds it
    down and requeues the job, the job says so, and once the node is back the requeued job resumes from the step-10
    checkpoint, runs the lost steps again with the same numbers, and completes."""
    over = (
        f"run.steps=20 {FAST} checkpoint.every=10 run.output_dir={tmp_path} cluster.nodes=2 parallel.dp=2 "
        f"cluster.cpus_per_task=1 cluster.env.GLOO_SOCKET_IFNAME={two_nodes.IFACE} "
        "rollout.max_staleness=1 rollout.schedule=overlapped rl.correction.mode=tis "
        "rollout.engine_process=true rollout.fault_drill.kind=kill rollout.fault_drill.rank=1"
    )
    job, run = submitted(make("submit", two_nodes, RECIPE="recipes/tiny-moe/grpo.yaml", OVERRIDES=over))
    t0 = time.time()
    # Lost after step 12: the next checkpoint is step 20's, eight steps (seconds) away.
    while not steps_logged(run) or steps_logged(run)[-1] < 12:
        state = two_nodes.wait(job, until=("RUNNING", "COMPLETED", "FAILED", "CANCELLED"), timeout=600)
        assert state == "RUNNING", two_nodes.logs() + job_log(run, job)
        assert time.time() - t0 < 600, job_log(run, job)
        time.sleep(0.2)
    two_nodes.lose_node2()
    assert two_nodes.wait(job, until=("PENDING", "COMPLETED", "FAILED", "CANCELLED")) == "PENDING", job_log(
        run, job
    )
    assert _restarts(job, two_nodes) == 1  # Slurm requeued it (node failure), nothing else did
    before = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lost_at = before[-1]["step"]
    assert 12 <= lost_at < 20 and [r["step"] for r in before] == list(range(1, lost_at + 1))
    assert (
        json.loads((run / "run.json").read_text())["status"] == "running"
    )  # nothing on node1 could record it
    assert before[0]["rollout/engines"] == 2.0
    for r in before:
        # both engines verified at every sync: the eager probe after sync 1 (step 1's row), then each sync on the
        # samples it drew, reported with them when they are trained one step later (so none in step 2's row)
        if r["step"] != 2:
            assert r["sync/engine0/p80_abs_prob_diff"] <= 0.01 and r["sync/engine1/p80_abs_prob_diff"] <= 0.01
        assert r["offpolicy/age"] == min(r["step"] - 1, 1) and r["offpolicy/overlap_generate_seconds"] > 0
        assert r["faults/restarts"] == (1 if r["step"] == 2 else 0)  # the second node's engine, killed once
    ranks = sorted((run / "logs").glob(f"ranks-{job}/*/attempt_0/*/stdout.log"))
    assert len(ranks) == 2, ranks  # one torchrun per node, one rank each
    out = "\n".join(p.read_text() for p in ranks)
    assert "rollout engine 0 of 2: rank 0 on cpu" in out and "rollout engine 1 of 2: rank 1 on cpu" in out

    two_nodes.restore_node2()
    t0 = time.time()
    while (state := local_slurm_state(job, two_nodes)) != "COMPLETED":
        assert state not in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), two_nodes.logs() + job_log(
            run, job
        )
        assert time.time() - t0 < 600, job_log(run, job)
        _skip_requeue_delay(job, two_nodes)
        time.sleep(1)
    log = (run / "logs" / f"slurm-{job}.out").read_text()  # both attempts: the log is appended to
    assert f"job {job} attempt {job}.0: 2 node(s) x 1 rank(s)" in log and f"attempt {job}.1: 2 node(s)" in log
    assert f"Slurm requeued job {job} " in log and "after losing node(s): node2 (down" in log, log[-3000:]
    assert f"attempt {job}.1: the run completed" in log and "not requeueing" not in log, log[-3000:]
    again = f"steps 11..{lost_at} run again" if lost_at > 11 else "step 11 runs again"
    assert (
        f"attempt {job}.1 resumes from the checkpoint of step 10: attempt {job}.0 reached step {lost_at} and ended "
        f"without a record: its processes were killed"
        in log
        and again in log
    ), log[-3000:]
    meta = json.loads((run / "run.json").read_text())
    assert meta["status"] == "completed" and meta["attempt"] == f"{job}.1", meta
    earlier = meta["earlier_attempts"][-1]
    assert earlier["code"] == meta["code"]  # both attempts ran the same checkout
    assert {k: v for k, v in earlier.items() if k != "code"} | {"reason": None} == {
        "attempt": f"{job}.0", "status": "running", "step": lost_at, "start_step": 1, "reason": None
    }  # fmt: skip
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert all(
        r["offpolicy/age"] == 1 for r in rows[1:]
    )  # the resumed steps trained checkpointed batches too
    # The exact resume: the steps lost with the node, run again, drew and trained the same numbers. What a
    # process logs once (its kernels, remedies, engines) and wall-clock time aside.
    from tests.test_loop import _strip

    once = {k for k in rows[10] if k.startswith(("remedy/", "kernels/")) or k == "rollout/engines"} - set(
        before[10]
    )
    drop = [{k: v for k, v in r.items() if k not in once} for r in rows[10:lost_at]]
    assert _strip(drop) == _strip(before[10:lost_at])
