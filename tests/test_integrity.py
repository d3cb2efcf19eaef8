"""Integrity of runs (issue 14, findings 3 to 6 and part of 8), with real megatron-core, vLLM, wandb and tmpfs.

* one owner for a run's status: a failure at any point, start-up included, is ``failed`` with its reason;
* the NaN guard checkpoints the last good state and stops with a message;
* a run folder is locked (its holder named) and resuming it with another recipe is refused or recorded;
* checkpoints and the tiny-model cache are checksummed: flipped bits are found, a bad latest checkpoint falls
  back to the newest good one, a bad cache is rebuilt;
* wandb without a network falls back to offline at once, a full disk is a failure with a reason, and no
  process outlives a run that was killed or failed.

The Slurm side (a resume that fails at start-up is not requeued forever, the requeue cap) is in test_slurm.py.

Issue 21 (hardening, round 3): wrong results, lost work and crashes. Each case was tried against the code before
the fix and failed there; the test named with it passes now (in this file unless another is named). The
attacks on code and data (items 1, 2, 9, 14, 15, 18 to 23) are listed in ``tests/test_security.py``.

* Item 3, two ``tim lab`` on one grid: the second deleted a run folder a live ``tim train`` held. Now a lab holds
  its grid's ``lab.lock`` (a second lab stops, naming the first), claims each run folder's ``run.lock`` before
  looking at it, skips a folder a live process holds, and hands its claim to the run
  (``test_lab_safety.py::test_a_second_lab_stops_and_a_killed_lab_takes_its_tim_train_along``,
  ``test_a_folder_a_live_process_holds_is_skipped_and_kept``).
* Item 4, killing ``tim lab`` left its runs training. Now they carry a parent-death signal (SIGKILL of the lab),
  and SIGTERM/SIGINT of the lab stops their process groups (same first test, and
  ``test_lab_safety.py::test_sigterm_on_the_lab_stops_its_runs_cleanly``).
* Item 5, a completed lab run was reused after its parent ``base.yaml`` changed. Now reuse is keyed on the
  resolved recipe's sha256 (``test_lab_safety.py::test_a_run_is_reused_only_under_the_same_resolved_recipe``,
  ``test_a_run_an_older_lab_made_is_judged_by_the_recipe_it_recorded``).
* Item 6, a checkpoint with ``checksums.json`` deleted loaded as "written by an older version" with corrupt
  weights. Now ``state.json`` records that checksums were written: a missing ``checksums.json`` is corruption
  (skipped, or every checkpoint failed); one from before checksums loads only with ``--trust-unverified``
  (``test_a_checkpoint_whose_checksums_json_was_deleted_is_corrupt``,
  ``test_a_checkpoint_from_before_checksums_loads_only_when_trusted``: ``tim train --resume`` and
  ``tim export-hf`` refuse it by name, the flag loads it with a warning).
* Item 7, a dataset row longer than ``data.max_prompt_tokens``, or empty, loaded; the run died mid-run naming a
  batch index. Now every row is checked at load with the run's tokenizer and chat template, named by file and
  line, before the engines start (``test_data_safety.py``, e.g.
  ``test_item7_tim_train_refuses_a_long_row_before_the_engines_start``). It also found that chat prompts were
  encoded as ``['input_ids', 'attention_mask']`` under transformers 5 (``test_item7_chat_prompts_are_counted_with_the_chat_template``).
* Item 8, a 400-digit integer in ``metrics.jsonl`` crashed ``tim report`` and ``tim lab --aggregate-only``.
  Now such a value costs only itself, with a notice naming file and line
  (``test_report_safety.py::test_a_value_no_float_holds_costs_only_that_value``); a 1 GB file is streamed,
  capped by a named error (``test_metrics_are_streamed_not_read_whole`` and the two cap tests there).
* Item 10, ``tim new-recipe`` from Mixtral-8x22B (1, 3 or 6 experts) wrote an invalid ``expert_tp``
  (``test_new_recipe_safety.py::test_new_recipe_writes_a_valid_expert_layout_for_any_expert_count``).
* Item 11, Qwen3-MoE with ``use_sliding_window: true`` or ``hidden_act: gelu`` was accepted; now refused by name
  (``test_new_recipe_safety.py::test_qwen3_sliding_window_and_other_activations_are_refused``).
* Item 12, ``--run-dir`` into an existing folder overwrote its ``run.json``; a failed call left ``recipe.yaml``
  and the corrected retry was refused (``test_train_safety.py::test_bad_nproc_and_foreign_folders_are_refused_before_anything_is_written``, ``test_a_folder_where_no_step_ran_takes_the_corrected_recipe``).
* Item 13, SIGTERM to ``tim train --nproc 2`` exited 1, not 75; a SIGTERM in teardown gave ``completed`` and 1
  (``test_train_safety.py::test_sigterm_to_two_ranks_exits_75_when_preempted_and_0_in_teardown``,
  ``test_the_launcher_exit_code_follows_the_ranks_record``).
* Item 16, duplicate YAML keys were accepted (the last won); now refused with both lines
  (``test_recipe_slurm_safety.py::test_duplicate_yaml_keys_are_refused_naming_file_key_and_both_lines``).
* Item 17, a run folder turning read-only let every step run, then failed at ``curves.png`` with status
  ``running``. Now the next step stops by name (``test_train_safety.py::test_a_run_folder_turning_read_only_stops_the_run_at_the_next_step``; a read-only ``checkpoints/`` before the engines start:
  ``test_a_read_only_checkpoints_folder_fails_by_name_before_the_engines_start``).
* Tracebacks list, each now a named error (key or option, value, what is allowed):
  ``new-recipe`` bad ``config.json`` values, deep nesting, a 5000-digit integer, an odd ``head_dim``, a
  dangling-link NAME, output folders of mode 0700 (``test_new_recipe_safety.py``); chat prompts with non-dict
  items, non-UTF-8 JSON Lines, a broken row, an empty file, a missing relative path taken for a Hub name
  (``test_data_safety.py::test_tracebacks_*``); ``recipe check`` on a symlink loop, ``--nodes 0``, ``tim plan``
  saying "fits" for a layout its nodes cannot hold (``test_recipe_slurm_safety.py::test_bad_input_is_a_named_error``); a read-only ``checkpoints/``, ``--nproc 0``/``-1``, ``--timeout-minutes`` overshooting because a
  SIGTERM during start-up was ignored (``test_train_safety.py``); lab ``dose: .nan``/``.inf`` and
  ``--only ' , '`` (``test_lab_safety.py``); every report notice printed twice (``test_report_safety.py``).
* Console: each step of ``make demo`` printed three vLLM lines, one of them ``RotaryEmbedding: Failed to load
  weights``. Now the engine logs at ``logging.engine_level``, that harmless warning is dropped on the vLLM it
  was read in (``test_versions.py::test_only_the_rotary_reload_warning_is_dropped``), and the library logs go
  to the run's ``logs/engine.log`` (``test_loop.py::test_run_folder_holds_recipe_metrics_dumps_png_summary_and_wandb`` checks that the console holds the step lines and no engine warning).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import require
from tests.test_loop import FAST, ROOT, TIM, metrics, tim_train

GRPO = "recipes/tiny-moe/grpo.yaml"
CKPT = ["checkpoint.every=1", "checkpoint.keep=3"]


def _meta(d: Path) -> dict:
    return json.loads((d / "run.json").read_text())


def _flip(path: Path, at: int, n: int = 8) -> None:
    """Flip every bit of ``n`` bytes at ``at``."""
    with open(path, "r+b") as f:
        f.seek(at)
        data = f.read(n)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in data))


def _lm_head(ck: Path):
    """(file, offset, length) of the LM-head weight inside a megatron dist checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(ck)).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "output_layer.weight")
    return ck / info.relative_path, info.offset, info.length


def _copy(trained: Path, tmp: Path) -> Path:
    d = tmp / "run"
    shutil.copytree(trained, d)
    return d


# ------------------------------------------------------------------------------ finding 6: checksums


def test_flipped_bits_in_the_lm_head_are_detected_and_skipped(trained, tmp_path):
    from tim_megatron.integrity import IntegrityWarning
    from tim_megatron.trainer.checkpoint import CheckpointError, latest_good_checkpoint, verify_checkpoint

    d = _copy(trained, tmp_path)
    root = d / "checkpoints"
    steps = [root / f"step_0000000{i}" for i in (1, 2, 3)]
    assert all(verify_checkpoint(p) == [] for p in steps)
    f, offset, length = _lm_head(steps[2])
    _flip(f, offset + length // 2)
    assert verify_checkpoint(steps[2]) == [
        f"{f.name}: sha256 mismatch (the content changed after it was written)"
    ]
    with pytest.warns(IntegrityWarning, match="step_00000003 is corrupt"):
        assert latest_good_checkpoint(root) == steps[1]
    for p in steps[:2]:
        _flip(*_lm_head(p)[:2])
    with pytest.warns(IntegrityWarning), pytest.raises(CheckpointError, match="every checkpoint failed"):
        latest_good_checkpoint(root)


def test_a_truncated_latest_checkpoint_resumes_from_the_older_one(trained, tmp_path):
    d = _copy(trained, tmp_path)
    f = d / "checkpoints" / "step_00000003" / "__0_1.distcp"
    os.truncate(f, f.stat().st_size // 2)
    res = tim_train(["--resume", str(d)], tmp_path)
    out = res.stdout + res.stderr
    assert "step_00000003 is corrupt, skipping it: __0_1.distcp" in out and "truncated?" in out, out[-3000:]
    assert "resuming from the newest intact checkpoint" in out
    meta = _meta(d)
    assert meta["status"] == "completed" and meta["resumed_from"].endswith("step_00000002"), meta
    assert [r["step"] for r in metrics(d)] == [1, 2, 3]
    from tim_megatron.trainer.checkpoint import verify_checkpoint

    assert verify_checkpoint(d / "checkpoints" / "step_00000003") == []  # written again, whole


def test_a_run_whose_only_checkpoint_is_corrupt_fails_by_name(trained, tmp_path):
    d = _copy(trained, tmp_path)
    for p in ("step_00000001", "step_00000002"):
        shutil.rmtree(d / "checkpoints" / p)
    f, offset, length = _lm_head(d / "checkpoints" / "step_00000003")
    _flip(f, offset + length // 2)
    res = tim_train(["--resume", str(d)], tmp_path, check=False)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "every checkpoint failed verification" in res.stderr and "sha256 mismatch" in res.stderr
    assert "Traceback" not in res.stderr
    meta = _meta(d)
    assert meta["status"] == "failed" and "sha256 mismatch" in meta["reason"], meta


def test_a_checkpoint_whose_checksums_json_was_deleted_is_corrupt(trained, tmp_path):
    """Item 6: on main a checkpoint without checksums.json loaded as "written by an older version" (one warning,
    exit 0), corrupt weights included. state.json now records that checksums were written."""
    from tim_megatron.integrity import IntegrityWarning
    from tim_megatron.trainer.checkpoint import CheckpointError, latest_good_checkpoint, verify_checkpoint

    d = _copy(trained, tmp_path)
    root = d / "checkpoints"
    steps = [root / f"step_0000000{i}" for i in (1, 2, 3)]
    _flip(*_lm_head(steps[2])[:2])
    (steps[2] / "checksums.json").unlink()
    assert verify_checkpoint(steps[2]) == [
        "checksums.json is missing, though state.json says it was written (deleted or not copied?)"
    ]
    with pytest.warns(IntegrityWarning, match="step_00000003 is corrupt"):
        assert latest_good_checkpoint(root) == steps[1]
    for p in steps[:2]:
        (p / "checksums.json").unlink()
    with pytest.warns(IntegrityWarning), pytest.raises(CheckpointError, match="every checkpoint failed"):
        latest_good_checkpoint(root, trust_unverified=True)  # trust covers old checkpoints, not deleted sums


def test_a_checkpoint_from_before_checksums_loads_only_when_trusted(trained, tmp_path):
    """Item 6: a checkpoint whose state.json predates checksums (no ``checksums`` key) and that has no
    checksums.json is refused by name, unless ``--trust-unverified``; then it loads with a warning."""
    from tim_megatron.integrity import IntegrityWarning
    from tim_megatron.trainer.checkpoint import CheckpointError, latest_good_checkpoint

    d = _copy(trained, tmp_path)
    for p in (d / "checkpoints").glob("step_*"):
        (p / "checksums.json").unlink()
        meta = json.loads((p / "state.json").read_text())
        del meta["checksums"]
        (p / "state.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="--trust-unverified"):
        latest_good_checkpoint(d / "checkpoints")
    with pytest.warns(IntegrityWarning, match="loading it unverified"):
        assert latest_good_checkpoint(d / "checkpoints", trust_unverified=True).name == "step_00000003"
    res = tim_train(["--resume", str(d)], tmp_path, check=False)
    assert res.returncode == 2 and "--trust-unverified" in res.stderr and "Traceback" not in res.stderr
    assert "rollout engine" not in res.stdout  # refused before vLLM starts
    assert _meta(d)["status"] == "failed" and "--trust-unverified" in _meta(d)["reason"]
    out = tmp_path / "hf"
    res = subprocess.run([*TIM, "export-hf", str(d), str(out)], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 2 and "--trust-unverified" in res.stderr and "Traceback" not in res.stderr
    assert not out.exists()
    res = subprocess.run(
        [*TIM, "export-hf", str(d), str(out), "--trust-unverified"], capture_output=True, text=True, cwd=ROOT
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "loading it unverified" in res.stderr and (out / "model.safetensors").exists()


def test_flipped_bits_in_the_tiny_model_cache_trigger_a_rebuild(tmp_path):
    from tim_megatron.integrity import IntegrityWarning
    from tim_megatron.models.tiny import ensure_tiny_checkpoint, verify_tiny_checkpoint
    from tim_megatron.recipe.schema import ModelDims, TaskConfig

    args = dict(warmup_steps=2, task=TaskConfig(max_operand=4), root=tmp_path / "cache")
    folder = ensure_tiny_checkpoint(ModelDims(), **args)
    weights = folder / "model.safetensors"
    good = weights.read_bytes()
    assert verify_tiny_checkpoint(folder) == []
    _flip(weights, len(good) // 2)
    assert verify_tiny_checkpoint(folder) == ["model.safetensors: sha256 mismatch"]
    with pytest.warns(IntegrityWarning, match=r"corrupt \(model.safetensors: sha256 mismatch\): rebuilding"):
        assert ensure_tiny_checkpoint(ModelDims(), **args) == folder
    assert weights.read_bytes() == good  # the build is deterministic: the rebuilt cache is the original
    (folder / "tokenizer.json").unlink()
    with pytest.warns(IntegrityWarning, match="tokenizer.json: missing"):
        ensure_tiny_checkpoint(ModelDims(), **args)
    assert verify_tiny_checkpoint(folder) == []


# --------------------------------------------------------------------- finding 5: run folders protected


def test_the_run_lock_names_its_holder_and_dies_with_it(tmp_path):
    from tim_megatron.run_lock import RunFolderBusy, hold

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from tim_megatron.run_lock import hold; hold(sys.argv[1]); "
            "print('held', flush=True); time.sleep(600)",
            str(tmp_path),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(
            RunFolderBusy, match=f"in use by pid {holder.pid} on {socket.gethostname()} since "
        ):
            hold(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    hold(tmp_path).release()  # SIGKILL released it: no stale lock


def test_two_runs_in_one_folder_the_second_stops_at_once(tmp_path):
    """The same command twice on one folder: on main both trained, interleaving their rows in metrics.jsonl."""
    d = tmp_path / "run"
    args = [GRPO, "run.steps=60", *FAST, "--run-dir", str(d)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(
        [*TIM, "train", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        t0 = time.time()
        while not (d / "metrics.jsonl").exists() or '"step": 1' not in (d / "metrics.jsonl").read_text():
            assert first.poll() is None and time.time() - t0 < 300, "the first run did not start training"
            time.sleep(0.2)
        second = subprocess.run(
            [*TIM, "train", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
        )
        assert first.poll() is None, "the second run ended only after the first one"
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"in use by pid {first.pid} on {socket.gethostname()} since" in second.stderr
        assert "Traceback" not in second.stderr
        _, err = first.communicate(timeout=600)
        assert first.returncode == 0, err[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    assert [r["step"] for r in metrics(d)] == list(range(1, 61))  # its own rows, once each
    assert _meta(d)["status"] == "completed" and _meta(d)["pid"] == first.pid


def test_resume_with_a_changed_recipe_is_refused_or_recorded(trained, tmp_path):
    d = _copy(trained, tmp_path)
    same = [GRPO, "run.steps=3", *FAST[:3], *CKPT, "--run-dir", str(d)]
    recipe_before = (d / "recipe.yaml").read_text()

    res = tim_train([*same, "run.steps=4", "optim.lr=5e-4"], tmp_path, check=False)
    assert res.returncode == 2, res.stderr[-2000:]
    err = " ".join(res.stderr.split())
    assert "2 key(s) differ" in err and "optim.lr: 0.0003 -> 0.0005" in err and "run.steps: 3 -> 4" in err
    assert "--allow-recipe-change" in err
    assert (d / "recipe.yaml").read_text() == recipe_before and _meta(d)["status"] == "completed"

    res = tim_train([*same, "model.dims.num_experts=4", "--allow-recipe-change"], tmp_path, check=False)
    assert res.returncode == 2 and "cannot change under a checkpoint: model.dims.num_experts" in res.stderr

    tim_train([*same, "run.steps=4", "optim.lr=5e-4", "--allow-recipe-change"], tmp_path)
    rows = metrics(d)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["actor/lr"] for r in rows] == [3e-4, 3e-4, 3e-4, 5e-4]
    (change,) = _meta(d)["recipe_changes"]
    assert change["from_step"] == 4
    assert change["changes"] == {"optim.lr": [0.0003, 0.0005], "run.steps": [3, 4]}
    from tim_megatron.run_dir import load_run

    assert load_run(d).recipe.optim.lr == 5e-4


def test_submit_resume_with_a_changed_recipe_renders_the_job_again(tmp_path):
    from tim_megatron.recipe import load_recipe
    from tim_megatron.run_dir import RecipeChangeError
    from tim_megatron.slurm.submit import adopt_recipe_for_job, prepare

    d, _ = prepare(load_recipe(ROOT / GRPO, ["cluster.time=01:00:00"]), output_dir=tmp_path)
    assert "#SBATCH --time=01:00:00" in (d / "job.sbatch").read_text()
    longer = load_recipe(ROOT / GRPO, ["cluster.time=05:00:00"])
    with pytest.raises(RecipeChangeError, match=r'cluster.time: "01:00:00" -> "05:00:00"'):
        adopt_recipe_for_job(d, longer)
    assert adopt_recipe_for_job(d, longer, allow_change=True) == {"cluster.time": ("01:00:00", "05:00:00")}
    assert "#SBATCH --time=05:00:00" in (d / "job.sbatch").read_text()
    assert _meta(d)["recipe_changes"][0]["changes"] == {"cluster.time": ["01:00:00", "05:00:00"]}


def test_a_different_model_shape_under_a_checkpoint_is_a_named_error(trained, tmp_path):
    d = _copy(trained, tmp_path)
    text = (d / "recipe.yaml").read_text()
    assert "    num_experts: 8\n" in text
    (d / "recipe.yaml").write_text(text.replace("    num_experts: 8\n", "    num_experts: 4\n"))  # by hand
    res = tim_train(["--resume", str(d)], tmp_path, check=False)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "CheckpointError" in res.stderr and "model.dims.num_experts: 8 -> 4" in res.stderr
    assert "Traceback" not in res.stderr
    meta = _meta(d)
    assert meta["status"] == "failed" and "model.dims.num_experts: 8 -> 4" in meta["reason"]


# -------------------------------------------------------------------------- findings 3, 4 and 8: status


def test_a_start_up_failure_sets_failed_with_its_reason(tmp_path):
    d = tmp_path / "run"
    res = tim_train(
        [GRPO, *FAST, f"model.path={tmp_path / 'missing-model'}", "--run-dir", str(d)], tmp_path, check=False
    )
    assert res.returncode == 2, res.stderr[-2000:]
    meta = _meta(d)
    assert meta["status"] == "failed" and "missing-model: no such checkpoint folder" in meta["reason"], meta


def test_the_nan_guard_checkpoints_the_last_good_state_and_stops(tmp_path):
    # sigma = inf makes every token weight +-inf, so every update's loss is non-finite whatever is sampled.
    # Two updates per step and nan_guard_max = 5: the 6th non-finite update, in step 3, aborts.
    d = tmp_path / "run"
    inf = ["diagnostics.objective_injection.type=unbiased", "diagnostics.objective_injection.sigma=.inf"]
    guard = ["rl.minibatches=2", "trainer.nan_guard_max=5"]
    res = tim_train([GRPO, "run.steps=8", *FAST, *inf, *guard, "--run-dir", str(d)], tmp_path, check=False)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    err = " ".join(res.stderr.split())
    assert "NonFiniteAbort: 6 consecutive updates had non-finite loss or gradients" in err
    assert "last good state checkpointed" in err and "step_00000002" in err
    meta = _meta(d)
    assert meta["status"] == "failed" and meta["reason"].startswith("NonFiniteAbort") and meta["step"] == 3
    assert [r["step"] for r in metrics(d)] == [1, 2]
    from tim_megatron.trainer.checkpoint import latest_good_checkpoint

    ck = latest_good_checkpoint(d / "checkpoints")
    state = json.loads((ck / "state.json").read_text())
    assert ck.name == "step_00000002" and state["step"] == 2
    assert state["updates"] == 0  # every update was skipped: the checkpoint holds the untouched weights


def test_the_run_status_owner_records_failures_and_requeue_marks(tmp_path, monkeypatch):
    from tim_megatron.recipe import load_recipe
    from tim_megatron.run_dir import DiskFullError, attempt, mark_finished, write_resolved

    d = tmp_path / "run"
    d.mkdir()
    write_resolved(load_recipe(ROOT / GRPO), d)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    with pytest.raises(KeyError), attempt(d):
        assert _meta(d)["status"] == "running" and _meta(d)["attempt"] == "77.0"
        raise KeyError("boom")
    assert _meta(d)["status"] == "failed" and _meta(d)["reason"] == "KeyError: 'boom'"
    with pytest.raises(DiskFullError, match="is full"), attempt(d):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert _meta(d)["reason"].startswith("disk full (No space left on device): OSError")
    with attempt(d):
        mark_finished(d, "preempted", step=5, wall_seconds=1.0, max_requeues=3)
    assert _meta(d)["status"] == "preempted" and _meta(d)["requeue_attempt"] == "77.0"
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    with attempt(d):
        assert _meta(d)["requeue_attempt"] is None  # an earlier attempt's mark never carries over
        mark_finished(d, "preempted", step=6, wall_seconds=1.0, max_requeues=3)
    assert _meta(d)["requeue_attempt"] is None and _meta(d)["requeue"].startswith("refused")


# ------------------------------------------------------------------------------------- finding 8: faults


def test_wandb_with_no_network_falls_back_to_offline_at_once(tmp_path):
    require(os.geteuid() == 0 and shutil.which("unshare") and shutil.which("ip"), "root, unshare and ip")
    script = (
        "import json, sys, warnings; from pathlib import Path; "
        "from tim_megatron.recipe import load_recipe; from tim_megatron.logging.tracker import Tracker; "
        "warnings.simplefilter('always'); r = load_recipe('recipes/tiny-moe/grpo.yaml').recipe; "
        "t = Tracker(r, run_dir=Path(sys.argv[1]), name='x/y', run_id='nonet1', enabled=True); "
        "t.log(1, {'a': 1.0}); mode = t.wandb.settings.mode if t.wandb else None; t.close(); print(json.dumps(mode))"
    )
    env = {**os.environ, "WANDB_API_KEY": "0" * 40, "PYTHONPATH": str(ROOT)}
    env.pop("WANDB_MODE", None)
    # A network namespace with loopback only: no route anywhere, as on a compute node without internet.
    res = subprocess.run(
        [
            "unshare",
            "--net",
            "sh",
            "-c",
            'ip link set lo up && exec "$0" -c "$1" "$2"',
            sys.executable,
            script,
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,  # a hang guard: wandb's own init waits 90 s and then raises
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == "offline"
    assert "cannot be reached" in res.stderr and "logging offline" in res.stderr
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_a_full_disk_fails_the_run_with_a_reason(tmp_path):
    require(os.geteuid() == 0 and shutil.which("mount"), "root and mount (for a small tmpfs)")
    disk = tmp_path / "disk"
    disk.mkdir()
    # 12 MiB: room for one 7.4 MB checkpoint of the tiny model, not for the second.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(disk)], check=True)
    try:
        d = disk / "run"
        res = tim_train(
            [GRPO, "run.steps=6", *FAST[:3], "checkpoint.every=1", "--run-dir", str(d)], tmp_path, check=False
        )
        meta = _meta(d)
        assert res.returncode == 2, (meta, res.stderr[-3000:])
        assert "is full" in res.stderr and "Traceback" not in res.stderr
        assert meta["status"] == "failed" and meta["reason"].startswith("disk full"), meta
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.parametrize("victim", ["launcher", "rank"])
def test_no_process_outlives_a_killed_or_failed_run(tmp_path, victim):
    """kill -9 of `tim train --nproc 2` (a dead launcher), or of one of its ranks (a fatal error in a rank).

    The real default path: each rank holds its in-process vLLM engine (issue 14 saw an orphan engine process of
    about 330 MB after a kill -9, when the engine still ran in processes of its own)."""
    import psutil

    d = tmp_path / "run"
    proc = subprocess.Popen(
        [
            *TIM,
            "train",
            "recipes/tiny-moe/grpo.yaml",
            "--nproc",
            "2",
            "run.steps=500",
            *FAST[1:],
            "logging.wandb.mode=offline",
            "--run-dir",
            str(d),
        ],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    family: list[psutil.Process] = []
    try:
        t0 = time.time()
        while not (d / "metrics.jsonl").exists() or '"step": 1' not in (d / "metrics.jsonl").read_text():
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.time() - t0 < 400, "no step logged"
            time.sleep(0.5)
        family = psutil.Process(proc.pid).children(recursive=True)
        ranks = {_rank_of(p): p for p in family if "tim_megatron.cli" in p.cmdline()}
        assert {"0", "1"} <= ranks.keys(), [p.cmdline() for p in family]
        os.kill(proc.pid if victim == "launcher" else ranks["1"].pid, signal.SIGKILL)
        code = proc.wait(timeout=300)
        _, alive = psutil.wait_procs(family, timeout=60)
        assert not alive, [(p.pid, p.cmdline()) for p in alive]
        if victim == "rank":
            assert code != 0
            meta = _meta(d)
            # rank 0 records the error it saw (its peer gone), or the launcher its exit code: never "running"
            assert meta["status"] == "failed" and meta["reason"], meta
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in family:
            if p.is_running():
                p.kill()


def _rank_of(p) -> str | None:
    import psutil

    try:
        return p.environ().get("RANK")
    except psutil.Error:
        return None
