"""The Megatron trainer on real megatron-core (CPU, gloo): exact logprobs, TP/EP/DP equivalence, a train
step, HF round trip, checkpoint resume, and the patches (router replay, FP32 LM head) plus FP16 mode."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import free_port, importable, kill_tree, require

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "megatron_worker.py"
pytestmark = pytest.mark.megatron


def worker_cmd(scenario: str, out: Path, nproc: int = 1, overrides: tuple[str, ...] = ()) -> list[str]:
    if nproc == 1:
        return [sys.executable, str(WORKER), scenario, str(out), *overrides]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
        str(WORKER),
        scenario,
        str(out),
        *overrides,
    ]


def run_worker(
    scenario: str, out: Path, nproc: int = 1, overrides: tuple[str, ...] = (), env: dict | None = None
) -> dict:
    require(importable("megatron.core"), "megatron-core")
    res = subprocess.run(
        worker_cmd(scenario, out, nproc, overrides),
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {}), "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return torch.load(out / f"{scenario}.pt", weights_only=False)


def grad_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference, relative to the tensor's largest entry when that exceeds 1: the summed embedding
    gradient reaches tens, where float32 sums taken in another order differ in the 7th digit."""
    return ((got - want).abs().max() / want.abs().max().clamp(min=1)).item()


EQUIVALENCE_LAYOUTS = [("parallel.tp=2",), ("parallel.ep=2", "parallel.dp=2"), ("parallel.dp=2",)]
STACKED_EXPERT_LAYOUTS = [("parallel.tp=2",), ("parallel.ep=2", "parallel.dp=2")]
"""Where the grouped path's stacked experts are checked against the loop's checkpoint layout: expert-TP 2, EP 2."""
WIDTH_LAYOUTS = [
    (2, ("parallel.tp=2",)),
    (2, ("parallel.ep=2", "parallel.dp=2")),
    (2, ("parallel.dp=2",)),
    (2, ("parallel.tp=2", "parallel.ep=2", "parallel.expert_tp=1")),
    (4, ("parallel.tp=2", "parallel.ep=2", "parallel.dp=2")),
]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run_worker("single", tmp_path_factory.mktemp("single"))


@pytest.fixture(scope="module")
def tiny_ckpt():
    from tim_megatron.models.tiny import ensure_tiny_checkpoint
    from tim_megatron.recipe import load_recipe

    r = load_recipe(ROOT / "recipes/tiny-moe/grpo.yaml").recipe
    return ensure_tiny_checkpoint(
        r.model.dims, seed=r.model.tiny_seed, warmup_steps=r.model.tiny_warmup_steps, task=r.data.task
    )


def test_fp32_logprobs_equal_hf_transformers(single, tiny_ckpt):
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(WORKER.parent))
    from megatron_worker import fixed_batch

    batch, _mask, _ = fixed_batch()
    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(hf(input_ids=batch.input_ids).logits.float(), -1)
    ref = logp[:, :-1].gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    got = single["logprobs"][:, 1:]
    valid = torch.arange(1, batch.input_ids.shape[1])[None] < batch.lengths[:, None]
    err = (got - ref)[valid].abs().max().item()
    assert err < 1e-5, err
    ent_ref = -(logp.exp() * logp).sum(-1)[:, :-1]
    assert (single["entropy"][:, 1:] - ent_ref)[valid].abs().max().item() < 1e-5


def test_hf_round_trip_is_bit_exact(single, tiny_ckpt):
    from safetensors.torch import load_file

    orig = load_file(str(tiny_ckpt / "model.safetensors"))
    exported = single["export"]
    assert set(exported) == set(orig)
    for k, v in orig.items():
        assert exported[k].dtype == v.dtype and torch.equal(exported[k], v), k


def test_one_train_step_lowers_the_loss(single):
    assert single["applied"]
    assert single["loss_after"] < single["loss_before"] - 1e-4, (single["loss_before"], single["loss_after"])


def test_nan_guard_skips_then_aborts(single):
    assert single["nan_skipped"] == [True, True, True]  # nan_guard_max = 3 skips...
    assert "4 consecutive updates" in single["nan_abort"]  # ... and the 4th aborts
    assert single["nan_params_unchanged"]


@pytest.mark.parametrize("fp32", [False, True], ids=["bf16-head-setting", "fp32-head"])
def test_the_head_as_one_autograd_function_gives_the_checkpointed_heads_logprobs_and_gradients(
    single, two_ranks, fp32
):
    """Issue 57, item 3: the training forward's logprobs are the checkpointed chunk's bit for bit, and the gradients
    agree within 1e-5 (relative to the largest), at one rank and at TP2, with and without the fp32 head."""
    equivalence = [(lay, out) for (sc, lay), out in two_ranks.items() if sc == "equivalence"]
    assert len(equivalence) == 3
    for name, out in [("single", single), *equivalence]:
        new, old = out["heads"][f"fused=True fp32={fp32}"], out["heads"][f"fused=False fp32={fp32}"]
        assert new["function_calls"] == len(new["logprobs"]) >= 1 and old["function_calls"] == 0, name
        assert len(new["logprobs"]) == len(old["logprobs"])
        assert all(torch.equal(a, b) for a, b in zip(new["logprobs"], old["logprobs"], strict=True)), name
        worst = max(grad_error(new["grads"][k], old["grads"][k]) for k in old["grads"])
        assert worst < 1e-5, (name, worst)


def test_a_checkpoint_resumes_bit_for_bit_across_the_fused_and_foreach_adam(tmp_path):
    """Issue 57, item 1: torch's fused AdamW (the CUDA default without apex or transformer-engine) and its foreach
    AdamW (the CPU default) keep the same state, so a checkpoint of either resumes under the other: the loaded
    moments, steps and fp32 master weights are the saved ones bit for bit, and the next update equals the one the
    saving trainer makes after switching its kernel in memory (bf16 model, fp32 masters; megatron's distributed
    optimizer, as on CUDA, on one CPU rank)."""
    env = {"TIM_CKPT_DIR": str(tmp_path / "ckpt"), "TIM_DISTRIBUTED_OPTIMIZER": "1"}
    out = run_worker(
        "adam_kernels",
        tmp_path / "out",
        overrides=("trainer.dtype=bfloat16", "rollout.dtype=bfloat16"),
        env=env,
    )["adam_kernels"]
    assert set(out) == {"foreach->fused", "fused->foreach"}
    for way, r in out.items():
        assert r["tensors"] > 0 and r["state_bit_for_bit"], (way, r)
        assert r["kernel_after_load"] == way.split("->")[1], (way, r)
        assert r["next_update_bit_for_bit"], (way, r)


def test_the_finite_check_finds_one_nan_or_inf_in_one_element_of_one_bucket(single):
    """Issue 57: the check reads each gradient buffer once (min and max) with no float64 copy of it."""
    found = single["finite_check"]
    assert found.pop("clean") and found.pop("restored") and found.pop("buckets") >= 1
    assert found == {f"{bad}@{where}": False for bad in ("nan", "inf", "-inf") for where in ("first", "last")}


@pytest.mark.parametrize("layout", EQUIVALENCE_LAYOUTS, ids=["tp2", "ep2", "dp2"])
def test_parallel_layouts_match_single_process(single, two_ranks, layout):
    par = two_ranks[("equivalence", layout)]
    assert par["world_size"] == 2
    assert par["logprobs"].shape == single["logprobs"].shape
    assert (par["logprobs"] - single["logprobs"]).abs().max().item() < 1e-5
    assert set(par["grads"]) == set(single["grads"])
    worst = max(grad_error(par["grads"][k], single["grads"][k]) for k in single["grads"])
    assert worst < 1e-5, worst
    # The comparison covers real gradients: every non-expert tensor, and most experts (a few get no token).
    dense = {k: v for k, v in single["grads"].items() if ".experts." not in k}
    experts = {k: v for k, v in single["grads"].items() if ".experts." in k}
    assert all(float(v.abs().sum()) > 0 for v in dense.values())
    assert sum(float(v.abs().sum()) > 0 for v in experts.values()) >= len(experts) // 2


@pytest.mark.parametrize("layout", STACKED_EXPERT_LAYOUTS, ids=["etp2", "ep2"])
def test_the_stacked_experts_save_the_loops_sharded_tensors_at_etp2_and_ep2(two_ranks, layout):
    """Issue 57, item 4: on each rank of expert-TP 2 (a gated fc1's halves split) and of EP 2 (four experts each),
    every MoE layer's stacked experts save SequentialMLP's sharded entries on the same weights (keys, offsets,
    shapes, replica ids, numbers), and a distributed checkpoint of either, saved by both ranks, loads into a fresh
    other with the saver's weights."""
    ranks = two_ranks[("expert_shards", (*layout, "trainer.experts=grouped"))]["expert_shards"]
    assert len(ranks) == 2
    for r in ranks:
        assert r["layers"] >= 1 and r["compared"] >= 3 * r["layers"] and r["mismatch"] == [], r


@pytest.fixture(scope="module")
def widths_single(tmp_path_factory):
    return run_worker("widths", tmp_path_factory.mktemp("widths"))


TWO_RANK_JOBS = [
    *(("equivalence", layout) for layout in EQUIVALENCE_LAYOUTS),
    *(("widths", layout) for nproc, layout in WIDTH_LAYOUTS if nproc == 2),
    *(("expert_shards", (*layout, "trainer.experts=grouped")) for layout in STACKED_EXPERT_LAYOUTS),
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[tuple[str, tuple[str, ...]], dict]:
    """Every two-rank layout of the equivalence and widths scenarios, one after another in one torchrun of two
    processes (megatron-core's groups remade for each; the launcher's default group kept)."""
    out = tmp_path_factory.mktemp("two-ranks")
    jobs = [
        {"key": f"job{i}", "scenario": sc, "overrides": list(lay)}
        for i, (sc, lay) in enumerate(TWO_RANK_JOBS)
    ]
    (out / "jobs.json").write_text(json.dumps(jobs))
    require(importable("megatron.core"), "megatron-core")
    cmd = worker_cmd("many", out, 2, (str(out / "jobs.json"),))
    res = subprocess.run(
        cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return {
        (sc, lay): torch.load(out / f"job{i}.pt", weights_only=False)
        for i, (sc, lay) in enumerate(TWO_RANK_JOBS)
    }


@pytest.mark.parametrize("nproc,layout", WIDTH_LAYOUTS, ids=["tp2", "ep2", "dp2", "tp2xep2", "tp2xep2xdp2"])
def test_every_width_trains_like_one_process(widths_single, two_ranks, tmp_path, nproc, layout):
    """Issue 11: a batch whose width is not a multiple of TP crashed the update. Widths are forced (2..9, odd and
    even), so the test does not depend on what an engine samples on this machine."""
    if nproc == 2:
        par = two_ranks[("widths", layout)]
    else:
        par = run_worker("widths", tmp_path, nproc=nproc, overrides=layout)
    assert par["world_size"] == nproc
    widths = sorted(widths_single["loss"])
    assert widths == list(range(2, 10)) and sorted(par["loss"]) == widths
    for w in widths:
        assert par["applied"][w] and widths_single["applied"][w]
        assert par["logprobs"][w].shape == widths_single["logprobs"][w].shape == (4, w)
        assert abs(par["loss"][w] - widths_single["loss"][w]) < 1e-5, (
            w,
            par["loss"][w],
            widths_single["loss"][w],
        )
        one, many = widths_single["grads"][w], par["grads"][w]
        assert set(many) == set(one)
        worst = max(grad_error(many[k], one[k]) for k in one)
        assert worst < 1e-5, (w, worst)
        assert sum(float(v.abs().sum()) for v in one.values()) > 0  # real gradients are compared


def save_at_2_then_kill(out: Path, ck: Path, nproc: int, layout: tuple[str, ...], extra: dict) -> None:
    """The resume worker saves a checkpoint after step 2 into ``ck`` and is killed there (no chance to clean up)."""
    env = {
        **os.environ,
        "TIM_CKPT_DIR": str(ck),
        "TIM_STEPS": "4",
        "TIM_SAVE_AT": "2",
        "OMP_NUM_THREADS": "1",
        **extra,
    }
    proc = subprocess.Popen(
        worker_cmd("resume", out, nproc, layout),
        env=env,
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while not (ck / "SAVED").exists():
        assert proc.poll() is None, "worker exited before saving"
        assert time.time() < deadline
        time.sleep(0.5)
    kill_tree(proc)
    assert not list(ck.glob(".tmp_*"))


@pytest.mark.parametrize(("saved_on", "resumed_on"), [("grouped", "loop"), ("loop", "grouped")])
def test_a_checkpoint_resumes_across_the_two_expert_paths(tmp_path, saved_on, resumed_on):
    """The grouped path's stacked expert weights save the loop's per-expert sharded tensors (issue 57, item 4): a
    checkpoint saved with one path (weights and Adam's state, which megatron's optimizer saves by parameter) resumes
    with the other, and steps 3-4 and the final weights are those of an unbroken run on the path resumed with
    (float32: within 1e-6; the two paths' GEMMs may round apart). The distributed optimizer's bucket format is
    refused across the two (tests/test_stacked_experts.py)."""
    extra: dict[str, str] = {}
    base = run_worker(
        "resume",
        tmp_path / "a",
        1,
        (f"trainer.experts={resumed_on}",),
        env={"TIM_CKPT_DIR": str(tmp_path / "ck_a"), "TIM_STEPS": "4", **extra},
    )
    ck = tmp_path / "ck_b"
    save_at_2_then_kill(tmp_path / "b", ck, 1, (f"trainer.experts={saved_on}",), extra)
    resumed = run_worker(
        "resume",
        tmp_path / "c",
        1,
        (f"trainer.experts={resumed_on}",),
        env={"TIM_CKPT_DIR": str(ck), "TIM_STEPS": "4", "TIM_RESUME": "1", **extra},
    )
    assert sorted(resumed["losses"]) == [3, 4]
    for step in (3, 4):
        assert abs(resumed["losses"][step] - base["losses"][step]) <= 1e-6, (step, resumed, base["losses"])
    assert base["weights"].keys() == resumed["weights"].keys()
    assert any(".experts." in k for k in base["weights"])
    worst = max(float((resumed["weights"][k] - base["weights"][k]).abs().max()) for k in base["weights"])
    assert worst <= 1e-6, worst
    moved = max(
        float((base["weights"][k] - resumed["weights_at_start"][k]).abs().max()) for k in base["weights"]
    )
    assert moved > 1e-4  # steps 3-4 really changed the weights that were compared


@pytest.mark.parametrize(
    "nproc,layout,dist_opt",
    [
        (1, (), False),
        (2, ("parallel.tp=2",), False),
        (1, ("trainer.dtype=bfloat16", "rollout.dtype=bfloat16"), True),
    ],
    ids=["single", "tp2", "distributed-optimizer"],
)
def test_save_kill_resume_continues_exactly(tmp_path, nproc, layout, dist_opt):
    """``distributed-optimizer``: megatron's distributed optimizer (the trainer's choice on CUDA) on one CPU rank,
    bf16 as on a GPU: its own checkpoint format and load, whose shared Adam step once made the first update after
    a resume wrong."""
    extra = {"TIM_DISTRIBUTED_OPTIMIZER": "1"} if dist_opt else {}
    base = run_worker(
        "resume",
        tmp_path / "a",
        nproc,
        layout,
        env={"TIM_CKPT_DIR": str(tmp_path / "ck_a"), "TIM_STEPS": "4", **extra},
    )
    ck = tmp_path / "ck_b"
    save_at_2_then_kill(tmp_path / "b", ck, nproc, layout, extra)
    resumed = run_worker(
        "resume",
        tmp_path / "c",
        nproc,
        layout,
        env={"TIM_CKPT_DIR": str(ck), "TIM_STEPS": "4", "TIM_RESUME": "1", **extra},
    )
    assert sorted(resumed["losses"]) == [3, 4]
    for step in (3, 4):
        assert resumed["losses"][step] == base["losses"][step], (step, resumed["losses"], base["losses"])
    assert base["weights"].keys() == resumed["weights"].keys()
    # two updates after the resume: equal weights mean the optimizer state came back whole
    for name, w in base["weights"].items():
        assert torch.equal(resumed["weights"][name], w), name


# ----------------------------------------------------------------------------------------------- patches


def test_router_replay_uses_given_experts_after_router_perturbation(tmp_path):
    out = run_worker("replay", tmp_path, overrides=("remedies.router_replay=r2",))
    assert out["routed_shape"] == (2, 4, 14, 2)
    assert all(out["perturbation_changed_free_routing"])  # perturbed routers would route differently...
    assert all(out["replayed_equal_recorded"])  # ...but replay forces the recorded experts
    assert all(g > 0 for g in out["router_grad_abs_sum"])  # gradients still reach the router
    assert out["clean_after_record"] and out["clean_after_replay"] and out["clean_after_backward"]


def test_fp32_lm_head_is_fp32_and_closer_to_fp64(tmp_path):
    common = ("trainer.dtype=bfloat16", "rollout.dtype=bfloat16")
    bf = run_worker("fp32_head", tmp_path / "bf16", overrides=common)
    f32 = run_worker("fp32_head", tmp_path / "fp32", overrides=(*common, "remedies.fp32_lm_head=true"))
    assert f32["head_fp32"] and f32["logits_dtype"] == "torch.float32"  # the head GEMM runs in fp32...
    assert bf["logits_dtype"] == "torch.bfloat16"
    assert f32["body_dtype"] == "torch.bfloat16"  # ...while the rest stays bf16
    assert f32["head_weight_dtype"] == bf["head_weight_dtype"] == "torch.bfloat16"  # same weights as vLLM's
    assert f32["err"] < bf["err"] / 10, (f32["err"], bf["err"])


def test_fp16_loss_scale_backs_off_and_training_stays_finite(tmp_path):
    out = run_worker(
        "fp16",
        tmp_path,
        overrides=(
            "remedies.fp16=true",
            "trainer.dtype=null",
            "rollout.dtype=null",
            "trainer.initial_loss_scale=4294967296",
            "trainer.loss_scale_window=2",
        ),
        env={"TIM_STEPS": "26"},
    )
    assert out["dtype"] == "torch.float16"
    s = out["scales"]
    assert s[0] < 2**32  # the first step overflowed and backed off
    assert any(b > a for a, b in itertools.pairwise(s))  # ...and the scale grows again after clean steps
    assert sum(out["applied"]) >= 3
    assert all(torch.isfinite(torch.tensor(out["losses"])))
    applied_losses = [loss for loss, ok in zip(out["losses"], out["applied"], strict=True) if ok]
    assert applied_losses[-1] < applied_losses[0]


def test_patches_refuse_unknown_versions(monkeypatch):
    import importlib.metadata as md

    from patches import guard
    from patches.megatron import checkpoint_writer_signals, cpu_shims, router_replay

    real = md.version
    monkeypatch.setattr(guard.md, "version", lambda d: "0.99.0" if d == "megatron-core" else real(d))
    for mod in (cpu_shims, router_replay, checkpoint_writer_signals):
        with pytest.raises(
            guard.UnverifiedVersionError,
            match=r"targets megatron-core >=0\.16\.1,<0\.17 but megatron-core 0\.99\.0 is installed",
        ):
            guard.check_version(mod.SPEC)


# --------------------------------------------------------------------------------------------- bad input


def test_checkpoint_for_another_model_is_rejected(tmp_path):
    require(importable("megatron.core"), "megatron-core")
    from tim_megatron.models.tiny import ensure_tiny_checkpoint
    from tim_megatron.recipe import load_recipe
    from tim_megatron.trainer.hf_config import (
        CheckpointMismatchError,
        check_dims_match,
        dims_from_hf,
        read_hf_config,
    )

    r = load_recipe(ROOT / "recipes/tiny-moe/grpo.yaml").recipe
    other = ensure_tiny_checkpoint(
        r.model.dims.model_copy(update={"num_experts": 4}), warmup_steps=0, root=tmp_path
    )
    with pytest.raises(CheckpointMismatchError, match=r"model.dims.num_experts = 8 but the checkpoint has 4"):
        check_dims_match(r.model.dims, dims_from_hf(read_hf_config(other)), where=str(other))


def test_weights_for_another_model_are_rejected(tmp_path):
    from tim_megatron.models.tiny import ensure_tiny_checkpoint
    from tim_megatron.recipe.schema import ModelDims
    from tim_megatron.trainer.families.qwen3_moe import WEIGHTS as QWEN3_MOE
    from tim_megatron.trainer.weights.convert import HFCheckpoint, WeightLoadError, _combine

    ck = ensure_tiny_checkpoint(ModelDims(), warmup_steps=0, root=tmp_path)
    wrong = ModelDims(num_key_value_heads=4)  # 4 kv heads of 32 do not fit k_proj's 64 rows
    rule = next(r for r in QWEN3_MOE if r.combine == "qkv")
    parts = [HFCheckpoint(ck).get(n.replace("{L}", "0")) for n in rule.hf]
    with pytest.raises((RuntimeError, WeightLoadError)):
        _combine(rule, parts, wrong)
    with pytest.raises(WeightLoadError, match="missing from the checkpoint"):
        HFCheckpoint(ck).get("model.layers.9.self_attn.q_proj.weight")


def test_unsupported_architecture_is_named():
    from tim_megatron.trainer.hf_config import UnsupportedModelError, dims_from_hf

    with pytest.raises(
        UnsupportedModelError,
        match=r"'LlamaForCausalLM'.*supported: .*Qwen3ForCausalLM, Qwen3MoeForCausalLM.*trainer/families",
    ):
        dims_from_hf({"architectures": ["LlamaForCausalLM"]})


def test_world_size_must_match_the_layout():
    from tim_megatron.recipe.schema import ParallelismConfig
    from tim_megatron.trainer.parallel import dist_env_from_environ, init_parallel

    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    assert dist_env_from_environ(env).world_size == 1
    with pytest.raises(
        ValueError,
        match=r"parallel.tp x parallel.pp x parallel.dp = 2 x 1 x 1 = 2, but the launcher started 1",
    ):
        init_parallel(ParallelismConfig(tp=2), environ=env)


SHIELD = """
import multiprocessing, os, signal, time
from patches.megatron import checkpoint_writer_signals
checkpoint_writer_signals.shield()
from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
(server,) = multiprocessing.active_children()
os.kill(server.pid, signal.SIGTERM)  # what Slurm sends every process of the step on preemption or scancel
time.sleep(1)
fa._get_write_results_queue().put("alive")
print(fa._get_write_results_queue().get(), signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
"""


def test_checkpoint_writer_helper_survives_the_jobs_sigterm():
    """megatron's checkpoint-writer results queue lives in a helper process started at the first save; without the
    shield a job's SIGTERM kills it and the checkpoint written in answer to that SIGTERM fails."""
    require(importable("megatron.core"), "megatron-core")
    res = subprocess.run(
        [sys.executable, "-c", SHIELD], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["alive", "True"]  # and our own SIGTERM handling is restored as it was


def test_checkpoint_writer_helper_dies_with_its_rank():
    """The shielded helper must not outlive a rank killed with SIGKILL (no orphan processes after a fatal error)."""
    require(importable("megatron.core"), "megatron-core")
    import psutil

    code = (
        "import multiprocessing, time\n"
        "from patches.megatron import checkpoint_writer_signals\n"
        "checkpoint_writer_signals.shield()\n"
        "(server,) = multiprocessing.active_children()\n"
        "print(server.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    server = psutil.Process(int(proc.stdout.readline()))
    proc.kill()
    proc.wait()
    _, alive = psutil.wait_procs([server], timeout=30)
    assert not alive
