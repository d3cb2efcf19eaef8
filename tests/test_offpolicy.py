"""Off-policy rollouts by a bounded lag (rollout.max_staleness, tim_megatron/rl/offpolicy.py) and the per-token split
of the ratio into staleness and TIM (algo/mismatch.py ratio_split_stats): the split's arithmetic, the schedule's
ages, and real runs (exact mode and vLLM) on the tiny MoE, including a resume in the middle of a k-step-off run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import train_in_one_process
from tests.test_loop import _strip, metrics, tim_train
from tim_megatron.algo.mismatch import (
    mismatch_metrics,
    mismatch_stats,
    ratio_split_metrics,
    ratio_split_stats,
)
from tim_megatron.recipe import RecipeError, load_recipe
from tim_megatron.rl.batch import StepBatch
from tim_megatron.rl.offpolicy import Generated, Pending, StalenessError

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["logging.wandb.mode=disabled", "run.val_every=0", "diagnostics.dumps.every=0"]
OFF = ["rl.correction.mode=tis"]
"""An off-policy run weights its ratio by the behaviour policy (decoupled PPO around pi_t, TIS on pi_t / mu_s)."""
PARTIAL = [
    "rollout.max_staleness=2",
    "rollout.partial.tokens_per_step=12",
    "data.prompts_per_step=4",
    "rollout.n=4",
    "rollout.max_tokens=48",
    "rollout.max_model_len=64",
]
"""Partial rollouts on the countdown task: 12 tokens a step of answers up to 48 long, 16 rows a step."""
EXACT = ["diagnostics.vexact=exact", "trainer.dtype=float32", "rollout.dtype=float32"]
R3_DUMPS = ["remedies.router_replay=r3", "diagnostics.dumps.every=1", "diagnostics.dumps.routed_experts=true"]


def _logprobs(seed: int, shape=(6, 9)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return -torch.rand(shape, generator=g, dtype=torch.float32) * 5


# ------------------------------------------------------------------------------------------ the split


def test_staleness_plus_tim_is_the_total_for_every_token():
    cur, beh, roll = _logprobs(1), _logprobs(2), _logprobs(3)
    mask = torch.rand(cur.shape, generator=torch.Generator().manual_seed(4)) > 0.3
    s = ratio_split_stats(current=cur, behaviour=beh, rollout=roll, mask=mask)
    m = ratio_split_metrics(s)
    stale = (cur.double() - beh.double())[mask]
    tim = (beh.double() - roll.double())[mask]
    # the total is the parts' sum, token by token, so its sums are the sums of that sum
    assert float(s.sum("total_lr")) == float((stale + tim).sum())
    assert m["mismatch/total/log_ratio_abs_max"] == float((stale + tim).abs().max())
    assert m["mismatch/staleness/tokens"] == m["mismatch/tim/tokens"] == float(mask.sum())
    assert m["mismatch/staleness/log_ratio_abs_max"] > 0 and m["mismatch/tim/log_ratio_abs_max"] > 0


def test_on_policy_staleness_is_zero_and_tim_is_todays_mismatch_bit_for_bit():
    cur, roll = _logprobs(5), _logprobs(6)
    mask = torch.ones(cur.shape, dtype=torch.bool)
    split = ratio_split_metrics(ratio_split_stats(current=cur, behaviour=cur, rollout=roll, mask=mask))
    today = mismatch_metrics(
        mismatch_stats(train_logprobs=cur, infer_logprobs=roll, mask=mask), a="old", b="rollout"
    )
    assert (
        split["mismatch/staleness/log_ratio_abs_max"] == 0.0
        and split["mismatch/staleness/log_ratio_std"] == 0.0
    )
    for stat in ("log_ratio_mean", "log_ratio_std", "log_ratio_abs_mean", "tokens"):
        assert split[f"mismatch/tim/{stat}"] == today[f"mismatch/old_vs_rollout/{stat}"]


# ---------------------------------------------------------------------------------------- the schedule


def _batch(n: int = 2) -> StepBatch:
    z = torch.zeros(n, 3)
    return StepBatch(
        input_ids=z.long(),
        lengths=torch.full((n,), 3),
        prompt_lens=torch.ones(n, dtype=torch.long),
        response_mask=z.bool(),
        rollout_logprobs=z,
        rewards=torch.zeros(n),
        truncated=torch.zeros(n, dtype=torch.bool),
        row=torch.arange(n),
        engine=torch.zeros(n, dtype=torch.long),
        finish=torch.zeros(n, dtype=torch.long),
        group_size=2,
        total_rows=n,
    )


@pytest.mark.parametrize("k", [1, 2, 4])
def test_each_step_trains_a_batch_at_most_k_updates_old_and_samples_ahead(k):
    p, ages, sampled = Pending(k=k), [], []
    for step in range(1, 10):
        todo = p.to_sample(step)
        sampled.append(todo)
        for s in todo:
            p.add(
                Generated(
                    step=s,
                    version=step - 1,
                    batch=_batch(),
                    behaviour=torch.zeros(2, 3),
                    metrics={},
                    probe=[],
                )
            )
        ages.append(p.take(step).age(step))
        assert len(p.batches) == k  # the next k steps' batches wait
    assert sampled[0] == list(range(1, k + 2)) and all(s == [i + 1 + k] for i, s in enumerate(sampled[1:], 1))
    assert ages == [min(t - 1, k) for t in range(1, 10)]


def test_a_batch_older_than_k_is_never_trained():
    p = Pending(k=1)
    p.add(Generated(step=5, version=2, batch=_batch(), behaviour=torch.zeros(2, 3), metrics={}, probe=[]))
    with pytest.raises(
        StalenessError, match=r"step 5: its batch was sampled with the weights of update 2, 2 updates"
    ):
        p.take(5)
    with pytest.raises(StalenessError, match="step 6: no batch was sampled for it"):
        p.take(6)


def _sampled(step: int, version: int, n: int = 4) -> Generated:
    b = _batch(n)
    b.response_mask[:, 1:] = True
    b.rollout_logprobs = _logprobs(7 + step, (n, 3)) * b.response_mask
    return Generated(
        step=step,
        version=version,
        batch=b,
        behaviour=_logprobs(8 + step, (n, 3)) * b.response_mask,
        metrics={"reward": 0.5},
        probe=[[1]],
    )


def test_pending_batches_round_trip_through_their_checkpoint_form():
    p = Pending(k=2)
    p.add(_sampled(4, 1))
    tensors, plain = p.state()
    q = Pending.from_state(tensors, json.loads(json.dumps(plain)), k=2)
    g = q.take(4)
    b = p.batches[4].batch
    assert (g.version, g.metrics, g.probe, g.batch.total_rows) == (1, {"reward": 0.5}, [[1]], 4)
    assert torch.equal(g.batch.rollout_logprobs, b.rollout_logprobs) and torch.equal(
        g.behaviour, p.batches[4].behaviour
    )
    with pytest.raises(StalenessError, match="rollout.max_staleness = 2; this run has 3"):
        Pending.from_state(tensors, plain, k=3)


def _tamper(what: str, tensors: dict, plain: dict) -> None:
    entry = plain["batches"][0]
    if what == "nan behaviour":
        tensors["3.behaviour"][0, 2] = float("nan")
    elif what == "positive logprob":
        tensors["3.batch.rollout_logprobs"][1, 1] = 0.5
    elif what == "doubled total_rows":
        entry["total_rows"] *= 2
    elif what == "relabelled age":
        entry["version"] = 1
    elif what == "missing tensor":
        del tensors["3.batch.rewards"]
    elif what == "string metric":
        entry["metrics"] = {"reward": "abc"}
    elif what == "step as text":
        entry["step"] = "3"
    elif what == "wrong shape":
        tensors["3.batch.lengths"] = torch.ones(2, 2, dtype=torch.long)
    elif what == "float token ids":
        tensors["3.batch.input_ids"] = tensors["3.batch.input_ids"].float()
    elif what == "a step missing":
        plain["batches"] = plain["batches"][:1]
    elif what == "batches not a list":
        plain["batches"] = {"3": entry}
    elif what == "length past the row":
        tensors["3.batch.lengths"][0] = 99


@pytest.mark.parametrize(
    "what, refused",
    [
        (
            "nan behaviour",
            r"step 3's pending batch has log-probs that are not finite or above 0 \(behaviour\)",
        ),
        ("positive logprob", r"not finite or above 0 \(rollout_logprobs\)"),
        ("doubled total_rows", r"says it is part of 8 rows; this run's steps have 4"),
        (
            "relabelled age",
            r"step 3's pending batch says it was sampled with the weights of update 1; .* update 0",
        ),
        ("missing tensor", r"step 3's pending batch has no tensor 'batch.rewards'"),
        ("string metric", r"metrics are not a mapping of names to numbers"),
        ("step as text", r"a pending batch's step is '3'; a step is an integer"),
        ("wrong shape", r"lengths is torch.int64 \[2, 2\]; expected a integer tensor of shape \[4\]"),
        ("float token ids", r"input_ids is torch.float32 .*expected a integer tensor"),
        (
            "a step missing",
            r"after step 2 the pending batches are those of steps \[3, 4\]; the file holds \[3\]",
        ),
        ("batches not a list", r"pending batches' list is damaged"),
        ("length past the row", r"lengths outside its rows"),
    ],
)
def test_a_damaged_or_relabelled_pending_batch_is_refused_by_name(what, refused):
    """Issue 56 (a pending off-policy batch): tampered files, their checksums rewritten, ended in KeyError /
    TypeError tracebacks or were accepted (NaN behaviour log-probs, doubled total_rows, an age relabelled). Each is
    now refused by name, with the file, the step and what was expected."""
    p = Pending(k=2)
    p.add(_sampled(3, 0))  # after step 2 at k = 2: step 3 was sampled at step 1 (update 0),
    p.add(_sampled(4, 1))  # step 4 at step 2 (update 1)
    tensors, plain = p.state()
    plain = json.loads(json.dumps(plain))
    Pending.from_state(tensors, plain, k=2, step=2, total_rows=4, group_size=2, where="f")  # intact: loads
    _tamper(what, tensors, plain)
    with pytest.raises(StalenessError, match=f"^f: .*{refused}"):
        Pending.from_state(tensors, plain, k=2, step=2, total_rows=4, group_size=2, where="f")


def test_a_resume_that_would_drop_or_lacks_the_pending_batches_says_which():
    """Issue 56: an off-policy checkpoint resumed with rollout.max_staleness = 0 dropped its pending batches without
    a word; a missing pending file said "resume with the recorded value" although the value was the recorded one."""
    from tim_megatron.run_state import LoopState

    recipe = load_recipe(ROOT / "recipes/tiny-moe/grpo.yaml", []).recipe
    p = Pending(k=2)
    p.add(_sampled(3, 0))
    state = LoopState.create(recipe).state_dict()
    on_policy = LoopState.create(recipe)
    with pytest.raises(
        StalenessError, match=r"rollout.max_staleness = 2\); this run has rollout.max_staleness = 0"
    ):
        on_policy.load_state_dict(state, step=2, rank_state=p.state(), where="ckpt/rank0")
    off = LoopState.create(
        load_recipe(ROOT / "recipes/tiny-moe/grpo.yaml", ["rollout.max_staleness=2", *OFF]).recipe
    )
    with pytest.raises(StalenessError, match=r"\(ckpt/rank0 is missing\).*cannot continue exactly") as e:
        off.load_state_dict(state, step=2, rank_state=None, where="ckpt/rank0")
    assert "resume with the recorded value" not in str(e.value)


@pytest.mark.parametrize("damage", ["not safetensors", "no record", "record not json"])
def test_a_damaged_rank_state_file_is_a_named_checkpoint_error(tmp_path, damage):
    from safetensors.torch import save_file

    from tim_megatron.trainer.checkpoint import CheckpointError, load_rank_state, rank_state_file

    f = rank_state_file(tmp_path, 0)
    f.parent.mkdir(parents=True)
    if damage == "not safetensors":
        f.write_bytes(b"\x00" * 40)
    else:
        meta = None if damage == "no record" else {"plain": "{not json"}
        save_file({"x": torch.zeros(1)}, str(f), metadata=meta)
    with pytest.raises(CheckpointError, match=f"{f}: .*damaged"):
        load_rank_state(tmp_path, 0)


def test_the_recipe_refuses_what_cannot_split_or_aim():
    tiny = ROOT / "recipes/tiny-moe/grpo.yaml"
    with pytest.raises(RecipeError, match=r"rl.correction.bypass = true with rollout.max_staleness = 2"):
        load_recipe(tiny, ["rollout.max_staleness=2", "rl.correction.bypass=true"])
    with pytest.raises(RecipeError, match=r"rl.correction.target = tim with rl.correction.mode = none"):
        load_recipe(tiny, ["rl.correction.target=tim"])
    aimed = [
        "rollout.max_staleness=1",
        "rl.correction.mode=tis",
        "rl.proximal=sampled",
        "rl.correction.target=tim",
    ]
    assert load_recipe(tiny, aimed).recipe


@pytest.mark.parametrize(
    "overrides, refused",
    [
        ([], r"rollout.schedule = overlapped with rollout.max_staleness = 0: an on-policy step"),
        (["rollout.max_staleness=1", "diagnostics.vexact=exact"], r"with the 'trainer' rollout backend"),
        (["rollout.max_staleness=1", "trainer.offload_during_rollout=all"], r"offload_during_rollout = all"),
        (["rollout.max_staleness=1", "rollout.sleep_between_steps=true"], r"sleep_between_steps = True"),
        (
            ["rollout.max_staleness=1", "rollout.tensor_parallel_size=2"],
            r"tensor_parallel_size = 2: an engine",
        ),
    ],
)
def test_the_recipe_refuses_an_overlap_it_cannot_run(overrides, refused):
    tiny = ROOT / "recipes/tiny-moe/grpo.yaml"
    with pytest.raises(RecipeError, match=refused):
        load_recipe(tiny, ["rollout.schedule=overlapped", *overrides])
    assert load_recipe(tiny, ["rollout.schedule=overlapped", "rollout.max_staleness=1", *OFF]).recipe


# ------------------------------------------------------------------------------------------ real runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("offpolicy")
    ckpt = ["checkpoint.every=2", "checkpoint.keep=3"]
    exact = (
        train_in_one_process(  # exact mode has a worker of its own (its MKL settings hold for the process)
            [
                {
                    "name": "exact_k2",
                    "recipe": "recipes/tiny-moe/vexact.yaml",
                    "overrides": [*QUIET, *OFF, *ckpt, "run.steps=4", "rollout.max_staleness=2"],
                    "output_dir": str(tmp / "exact_k2"),
                },
                {  # partial rollouts in exact mode: the trainer samples every part at its own weights
                    "name": "partial_exact",
                    "recipe": "recipes/tiny-moe/countdown.yaml",
                    "overrides": [*QUIET, *OFF, *PARTIAL, *EXACT, "run.steps=3", "diagnostics.dumps.every=1"],
                    "output_dir": str(tmp / "partial_exact"),
                },
            ],
            tmp / "w1",
        )
    )
    vllm = train_in_one_process(
        [
            {
                "name": name,
                "recipe": "recipes/tiny-moe/grpo.yaml",
                "overrides": [
                    *QUIET,
                    *(OFF if k else []),
                    f"run.steps={steps}",
                    f"rollout.max_staleness={k}",
                ],
                "output_dir": str(tmp / name),
            }
            for name, k, steps in (("vllm_k0", 0, 2), ("vllm_k2", 2, 4))
        ]
        + [
            {  # the same k = 2 run on the overlapped schedule, checkpointed for the resume test
                "name": "vllm_k2_overlapped",
                "recipe": "recipes/tiny-moe/grpo.yaml",
                "overrides": [
                    *QUIET,
                    *OFF,
                    *ckpt,
                    "run.steps=4",
                    "rollout.max_staleness=2",
                    "rollout.schedule=overlapped",
                ],
                "output_dir": str(tmp / "vllm_k2_overlapped"),
            },
            *(
                {  # PPO's ratio against pi_s, and against pi_t, in one minibatch (one update a step), under R2
                    "name": f"r2_{proximal}",
                    "recipe": "recipes/tiny-moe/grpo.yaml",
                    "overrides": [
                        *QUIET,
                        "run.steps=2",
                        "rollout.max_staleness=1",
                        "rl.minibatches=1",
                        "optim.lr=3e-3",  # one update that moves the bf16 router enough to change some routes
                        "remedies.router_replay=r2",
                        "rl.correction.mode=tis",
                        f"rl.proximal={proximal}",
                        f"rl.correction.target={target}",
                    ],
                    "output_dir": str(tmp / f"r2_{proximal}"),
                }
                for proximal, target in (("sampled", "tim"), ("current", "total"))
            ),
            {  # a non-finite abort at k > 0 (Why item 6 of issue 58): every update's loss is +-inf
                "name": "abort_k1",
                "recipe": "recipes/tiny-moe/grpo.yaml",
                "overrides": [
                    *QUIET,
                    *OFF,
                    "run.steps=4",
                    "rollout.max_staleness=1",
                    "rl.minibatches=2",
                    "trainer.nan_guard_max=5",
                    "diagnostics.objective_injection.type=unbiased",
                    "diagnostics.objective_injection.sigma=.inf",
                ],
                "output_dir": str(tmp / "abort_k1"),
            },
            *(
                {  # partial rollouts with R3, in sequence and overlapped (checkpointed for the resume)
                    "name": name,
                    "recipe": "recipes/tiny-moe/countdown.yaml",
                    "overrides": [*QUIET, *OFF, *PARTIAL, *ckpt, *R3_DUMPS, "run.steps=3", *extra],
                    "output_dir": str(tmp / name),
                }
                for name, extra in (
                    ("partial", []),
                    ("partial_overlapped", ["rollout.schedule=overlapped"]),
                )
            ),
            {
                "name": "partial_resumed",
                "resume_of": "partial_overlapped",
                "from_step": 2,
                "output_dir": str(tmp / "partial_resumed"),
            },
        ],
        tmp / "w2",
    )
    out = {}
    for name, res in {**exact, **vllm}.items():
        if name == "abort_k1":
            assert "NonFiniteAbort" in (res["error"] or ""), res["error"]
        else:
            assert res["error"] is None and res["exit"] == 0, res["error"]
        out[name] = Path(res["run_dir"])
    return out


def test_exact_mode_with_k2_has_zero_tim_and_staleness_after_the_first_update(runs):
    rows = metrics(runs["exact_k2"])
    assert [r["offpolicy/age"] for r in rows] == [0, 1, 2, 2]  # never older than k
    assert all(r["mismatch/tim/log_ratio_abs_max"] == 0.0 for r in rows)  # every token, bit for bit
    assert all(r["exact/mismatched_tokens"] == 0 for r in rows if "exact/mismatched_tokens" in r)
    assert rows[0]["mismatch/staleness/log_ratio_abs_max"] == 0.0  # trained at its sampling weights
    assert all(r["mismatch/staleness/log_ratio_abs_max"] > 0 for r in rows[1:])  # the policy moved since


def test_vllm_with_k0_has_zero_staleness_and_tim_equal_to_todays_mismatch(runs):
    rows = metrics(runs["vllm_k0"])
    for r in rows:
        assert r["offpolicy/age"] == 0 and r["mismatch/staleness/log_ratio_abs_max"] == 0.0
        for stat in ("log_ratio_mean", "log_ratio_std", "log_ratio_abs_mean", "tokens"):
            assert r[f"mismatch/tim/{stat}"] == r[f"mismatch/old_vs_rollout/{stat}"]


def test_vllm_with_k2_trains_batches_up_to_two_updates_old(runs):
    rows = metrics(runs["vllm_k2"])
    assert [r["offpolicy/age"] for r in rows] == [0, 1, 2, 2]
    assert all(r["mismatch/staleness/log_ratio_abs_max"] > 0 for r in rows[1:])
    assert all(r["mismatch/old_vs_rollout/tokens"] == r["mismatch/total/tokens"] for r in rows)


def test_a_resume_in_the_middle_of_a_k_step_off_run_continues_exactly(runs, tmp_path):
    """The step-2 checkpoint holds the batches of steps 3 and 4, sampled at steps 1 and 2: resumed from it, steps
    3 and 4 equal the uninterrupted run's (exact mode: the trainer samples, so nothing depends on the engine)."""
    _resumes_from_step_2_exactly(runs["exact_k2"], tmp_path / "c")


def test_a_pending_batch_whose_rewards_were_changed_stops_the_resume_in_one_line(runs, tmp_path):
    """Issue 56: a pending batch's rewards flipped (1 - r) with the checksum rewritten was trained on while the
    stored reward mean was logged. The resume now rescores each row from its tokens and stops before any engine
    starts, with one line (the named error, the file, the row; no traceback) and the traceback in logs/errors.log."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tim_megatron.trainer.checkpoint import rank_state_file, write_checksums

    c = tmp_path / "c"
    shutil.copytree(runs["exact_k2"], c, ignore=shutil.ignore_patterns("step_00000004", "run.lock"))
    (c / "checkpoints" / "latest").write_text("step_00000002")
    folder = c / "checkpoints" / "step_00000002"
    f = rank_state_file(folder, 0)
    with safe_open(str(f), framework="pt") as h:
        meta, tensors = h.metadata(), {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118
    flipped = 1 - tensors["3.batch.rewards"]
    assert not torch.equal(flipped, tensors["3.batch.rewards"])
    tensors["3.batch.rewards"] = flipped
    save_file(tensors, str(f), metadata=meta)
    write_checksums(folder)  # the tamperer rewrote the checksum too
    res = tim_train(["--resume", str(c)], c, check=False)
    err = res.stderr
    assert res.returncode == 1 and "Traceback" not in err + res.stdout, err[-3000:]
    assert f"StalenessError: {f}: step 3's pending batch is not what step 3 sampled: row " in err, err[-3000:]
    assert "its response scores" in err and "tim train --resume" in err and "logs/errors.log" in err, err
    assert "Traceback" in (c / "logs" / "errors.log").read_text()
    assert json.loads((c / "run.json").read_text())["status"] == "failed"
    assert "rollout engine" not in res.stdout  # it stopped before any engine started


def _resumes_from_step_2_exactly(a: Path, c: Path) -> None:
    """Copy run ``a`` to ``c`` without its step-4 checkpoint, resume it from step 2 and compare every metric but
    wall-clock time with ``a``'s (what a restart reports once, such as the kernels, aside)."""
    shutil.copytree(a, c, ignore=shutil.ignore_patterns("step_00000004", "run.lock"))
    (c / "checkpoints" / "latest").write_text("step_00000002")
    assert sorted(p.name for p in (c / "checkpoints" / "step_00000002" / "rank_state").iterdir()) == [
        "rank00000.safetensors"
    ]
    tim_train(["--resume", str(c)], c)
    resumed, base = metrics(c), metrics(a)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    once = {k for k in base[0] if k.startswith(("remedy/", "kernels/")) or k == "rollout/engines"}
    drop = [{k: v for k, v in r.items() if k not in once} for r in resumed]
    assert _strip(drop) == _strip([{k: v for k, v in r.items() if k not in once} for r in base])


def test_the_overlapped_schedule_trains_the_sequential_schedules_numbers(runs):
    """Sampling beside the update changes when things run, not what: the same weights sample the same prompts
    with the same seeds, and pi_s comes from a copy of the sampling weights. Every metric but wall-clock time
    equals the sequential run's, bit for bit."""
    over, seq = metrics(runs["vllm_k2_overlapped"]), metrics(runs["vllm_k2"])
    assert [r["offpolicy/age"] for r in over] == [0, 1, 2, 2]
    # every step sampled a later batch on the thread (step 1: steps 2 and 3; then t + 2)
    assert all(r["offpolicy/overlap_generate_seconds"] > 0 and "time/ahead" in r for r in over)
    assert _strip(over) == _strip(seq)


def test_a_resume_in_the_middle_of_an_overlapped_run_continues_exactly(runs, tmp_path):
    """The overlapped schedule checkpoints after a step's sampling ahead is joined: the step-2 checkpoint holds
    the batches of steps 3 and 4, and a resumed run trains them as the uninterrupted one did."""
    _resumes_from_step_2_exactly(runs["vllm_k2_overlapped"], tmp_path / "c")


def test_a_proximal_policy_at_the_sampling_weights_moves_ppos_ratio_by_the_staleness(runs):
    """rl.proximal = sampled takes PPO's ratio against pi_s. Step 1 trains a batch sampled at its own weights
    (pi_s is pi_t): everything equals the default run's. Step 2 trains the same batch at the same weights in both
    runs (B_2, sampled by theta_0, trained by theta_1, in one update): PPO's denominator differs, so the ratio,
    exactly 1 against pi_t, spreads by the staleness part against pi_s."""
    sampled, current = metrics(runs["r2_sampled"]), metrics(runs["r2_current"])
    assert _strip(sampled[:1]) == _strip(current[:1])
    a, b = sampled[1], current[1]
    for key in ("mismatch/staleness/log_ratio_std", "mismatch/tim/log_ratio_std", "offpolicy/age"):
        assert a[key] == b[key]
    assert a["mismatch/staleness/log_ratio_std"] > 0.01
    assert a["actor/ratio_std"] > 10 * b["actor/ratio_std"]
    # exp(x) spreads as x does for small x: the ratio's spread is the staleness part's
    assert a["actor/ratio_std"] == pytest.approx(a["mismatch/staleness/log_ratio_std"], rel=0.25)


def test_r2_with_a_sampled_proximal_replays_the_routes_pi_s_was_computed_with(runs):
    """Issue 58, Why item 4: R2 with rl.proximal = sampled replayed pi_t's routes in the update, while PPO's
    denominator pi_s had been computed under the routes the trainer chose at the sampling weights. It now replays
    those. One update a step, so the update's forward runs at theta_t: replaying pi_t's routes gives pi_t itself
    (``mismatch/current_vs_rollout`` equals ``old_vs_rollout`` bit for bit, the R2 + current run), while replaying
    the sampling pass's routes, about 5% of which the update since changed (``routing/trainer_sampled_vs_current``),
    gives other logprobs."""
    sampled, current = metrics(runs["r2_sampled"])[1], metrics(runs["r2_current"])[1]
    for r in (sampled, current):
        assert r["offpolicy/age"] == 1 and r["remedy/replayed_tokens"] > 0
        assert 0 < r["routing/trainer_sampled_vs_current/exact_match"] <= 1
    mean = "log_ratio_mean"
    assert current[f"mismatch/current_vs_rollout/{mean}"] == current[f"mismatch/old_vs_rollout/{mean}"]
    # Replaying the sampling pass's routes gives other logprobs exactly where the update changed some routes (at
    # a tenfold learning rate it does, in the runs seen here; equal routes must give pi_t's bits).
    moved = sampled["routing/trainer_sampled_vs_current/exact_match"] < 1
    assert (
        sampled[f"mismatch/current_vs_rollout/{mean}"] != sampled[f"mismatch/old_vs_rollout/{mean}"]
    ) == moved
    # the pending batch kept the sampling pass's routes: a resume replays them too
    assert (
        sampled["routing/trainer_sampled_vs_current/exact_match"]
        == current["routing/trainer_sampled_vs_current/exact_match"]
    )


def test_an_abort_at_k_checkpoints_the_batch_the_step_took_to_train(runs):
    """Issue 58, Why item 6 (confirmed): a non-finite abort at step t > 1 with k > 0 checkpointed step t - 1 after
    the step had taken B_t and added B_{t+k}, so the last good checkpoint held the batches of the wrong steps and
    could not be resumed (refused: "after step 2 the pending batches are those of steps [3]; the file holds [4]").
    It now holds the loop's state as the aborted step found it: B_t, waiting."""
    from tim_megatron.run_state import LoopState
    from tim_megatron.trainer.checkpoint import latest_good_checkpoint, load_rank_state

    d = runs["abort_k1"]
    meta = json.loads((d / "run.json").read_text())
    assert meta["status"] == "failed" and meta["reason"].startswith("NonFiniteAbort") and meta["step"] == 3
    ck = latest_good_checkpoint(d / "checkpoints")
    assert ck.name == "step_00000002"
    recipe = load_recipe(ROOT / "recipes/tiny-moe/grpo.yaml", [*OFF, "rollout.max_staleness=1"]).recipe
    state = LoopState.create(recipe)
    state.load_state_dict(
        json.loads((ck / "state.json").read_text())["state"],
        step=2,
        rank_state=load_rank_state(ck, 0),
        total_rows=recipe.data.prompts_per_step * recipe.rollout.n,
        group_size=recipe.rollout.n,
    )
    (g,) = state.pending.batches.values()
    assert (g.step, g.version, state.start_step) == (3, 1, 3)  # B_3, sampled at step 2: trained next at age 1


# -------------------------------------------------------------------------------------- partial rollouts


def _dumps(d: Path):
    import pandas as pd

    return pd.concat([pd.read_parquet(f) for f in sorted((d / "dumps").glob("step_*.parquet"))])


def test_partial_rollouts_carry_every_tokens_version_and_split_its_ratio(runs):
    """Countdown answers of up to 48 tokens, 12 tokens a step, k = 2: a sequence is begun two steps before it is
    trained and finished at its step. Every token carries the version that sampled it, no token is older than k,
    at least 20% of the trained sequences hold tokens of two or more versions, and per token staleness + TIM is
    the total; tokens sampled at the training step's own weights have no staleness at all."""
    rows, t = metrics(runs["partial"]), _dumps(runs["partial"])
    assert [r["offpolicy/age"] for r in rows] == [0, 1, 2]  # the oldest token of each trained batch
    age = t["step"] - 1 - t["version"]
    assert age.between(0, 2).all()
    versions = t.groupby(["step", "seq"])["version"].nunique()
    assert len(versions) == 3 * 16 and (versions >= 2).mean() >= 0.2, versions.value_counts()
    for step, r in zip(range(1, 4), rows, strict=True):
        multi = (versions.loc[step] >= 2).mean()
        assert r["offpolicy/multi_version_frac"] == pytest.approx(multi)
        assert r["offpolicy/tokens_age_0_frac"] == pytest.approx((age[t["step"] == step] == 0).mean())
    assert ((t.log_ratio_staleness + t.log_ratio_tim - t.log_ratio_total).abs() <= 1e-12).all()
    assert (t.log_ratio_staleness[age == 0] == 0).all() and (t.log_ratio_staleness[age > 0] != 0).any()
    assert all(r["mismatch/staleness/tokens"] == r["mismatch/total/tokens"] > 0 for r in rows)


def test_partial_rollouts_in_exact_mode_have_zero_tim_for_every_token_of_every_version(runs):
    """The trainer samples every part of a sequence at the weights of its step, and scores it at once with the
    same weights and shapes: each token's pi_s is its sampled logprob bit for bit, whatever its version."""
    rows, t = metrics(runs["partial_exact"]), _dumps(runs["partial_exact"])
    assert (t.groupby(["step", "seq"])["version"].nunique() >= 2).any()
    assert (t.log_ratio_tim == 0).all() and (t.log_ratio_staleness[t.step - 1 - t.version > 0] != 0).any()
    assert all(r["mismatch/tim/log_ratio_abs_max"] == 0.0 and r["exact/mismatched_tokens"] == 0 for r in rows)
    assert all(r["exact/checked_tokens"] > 0 for r in rows)


def test_partial_rollouts_replay_each_tokens_routes_from_the_call_that_sampled_it(runs):
    """R3 with partial rollouts: the trainer replays, at position p, the experts of the engine call that sampled
    token p + 1. The samples of a prompt begin in one call, so the routes of their prompt's last position (which
    produced their first token) agree within the group, even after some were continued under newer weights
    (which route that position anew). The engine agrees with the trainer at each token's sampling weights, and
    the trainer at the sampling weights less with the trainer now."""
    rows, t = metrics(runs["partial"]), _dumps(runs["partial"])
    first = t[t.position == t.groupby(["step", "seq"]).position.transform("min")]
    routes = first.groupby(["step", "prompt"]).routed_experts.apply(lambda s: len({tuple(x) for x in s}))
    assert (routes == 1).all()
    for r in rows:
        assert r["remedy/replayed_tokens"] > 0 and r["routing/rollout_vs_trainer/exact_match"] > 0.9
    assert all(r["routing/trainer_sampled_vs_current/exact_match"] < 1 for r in rows[1:])
    assert "routing/trainer_sampled_vs_current/exact_match" not in rows[0]  # trained at its sampling weights


def test_partial_rollouts_overlapped_equal_the_sequential_schedule(runs):
    """The later batches' parts generated beside the update, scored from the copy of their sampling weights:
    every metric but wall-clock time, and every dumped token, equals the sequential run's."""
    over, seq = metrics(runs["partial_overlapped"]), metrics(runs["partial"])
    assert all("time/ahead" in r for r in over)
    assert _strip(over) == _strip(seq)
    a, b = _dumps(runs["partial_overlapped"]), _dumps(runs["partial"])
    assert a.reset_index(drop=True).equals(b.reset_index(drop=True))


def test_a_resume_in_the_middle_of_a_partial_run_continues_exactly(runs):
    """The step-2 checkpoint holds the batches of steps 3 and 4 in flight (their sequences, versions, pi_s and
    routes): resumed from it, step 3 equals the uninterrupted run's, and so does the checkpoint it ends with."""
    resumed, base = metrics(runs["partial_resumed"]), metrics(runs["partial_overlapped"])
    assert [r["step"] for r in resumed] == [1, 2, 3]
    once = {k for k in base[0] if k.startswith(("remedy/", "kernels/")) or k == "rollout/engines"}
    keep = [[{k: v for k, v in r.items() if k not in once} for r in rows] for rows in (resumed, base)]
    assert _strip(keep[0]) == _strip(keep[1])
    from tim_megatron.trainer.checkpoint import load_rank_state

    (a, pa), (b, pb) = (
        load_rank_state(runs[n] / "checkpoints" / "step_00000003", 0)
        for n in ("partial_resumed", "partial_overlapped")
    )
    assert pa == pb and [x["step"] for x in pa["batches"]] == [4, 5]  # B_4 and B_5 in flight, as they were
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_report_draws_the_split_by_age(runs, tmp_path):
    """The report of off-policy runs: the age, staleness and TIM curves, and the parts by the trained batch's age
    (each step trains one batch, so a step's metrics are its age's)."""
    from tim_megatron.report.build import build_report
    from tim_megatron.report.plots import by_age
    from tim_megatron.report.runs import load_runs

    build_report([runs["vllm_k2"], runs["exact_k2"]], tmp_path / "report")
    page = (tmp_path / "report" / "index.html").read_text()
    assert (
        "offpolicy_by_age.png" in page and (tmp_path / "report" / "offpolicy_by_age.png").stat().st_size > 0
    )
    assert "curve_mismatch-staleness-log_ratio_std.png" in page
    rows = metrics(runs["vllm_k2"])
    (run,) = load_runs([runs["vllm_k2"]], [])
    split = by_age(run)
    assert sorted(split) == [0, 1, 2] and split[2]["steps"] == 2  # steps 3 and 4
    assert split[2]["staleness"] == pytest.approx(
        (rows[2]["mismatch/staleness/log_ratio_std"] + rows[3]["mismatch/staleness/log_ratio_std"]) / 2
    )
    assert split[0]["staleness"] == 0.0 and split[1]["tim"] == rows[1]["mismatch/tim/log_ratio_std"]
    (exact,) = load_runs([runs["exact_k2"]], [])
    assert all(v["tim"] == 0.0 for v in by_age(exact).values())  # exact mode: no TIM at any age
