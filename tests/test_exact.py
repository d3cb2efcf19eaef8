"""Exact zero-mismatch sampling (``diagnostics.vexact: exact``) and injected mismatch in the sampling distribution.

Real megatron-core on CPU (gloo): the trainer samples from its own model with a KV cache (or one full forward per
token, the reference), on one rank and on two (DP2, TP2, EP2), and every sampled token's logprob equals the old
pass's bit for bit; the two samplers draw the same tokens with the same bits; a one-ulp difference (in a logged
logprob, in the cached keys, in one expert's output) stops the run on every rank, naming the step, row and
position. Injections change what is sampled and trained on, by a dose.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import importable, require, run_ok, train_in_one_process
from tests.test_loop import TIM, metrics, run_folder
from tim_megatron.recipe import RecipeError, load_recipe
from tim_megatron.rollout.exact_sampler import ExactMismatchError, check_exact

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "exact_worker.py"


VEXACT = ROOT / "recipes" / "tiny-moe" / "vexact.yaml"
QUIET = ["logging.wandb.mode=disabled", "checkpoint.every=0", "checkpoint.at_end=false"]


# ------------------------------------------------------------------------------------ the check itself


def test_a_one_ulp_difference_is_named_by_step_row_and_position():
    g = torch.Generator().manual_seed(0)
    old = torch.log(torch.rand(3, 8, generator=g))
    mask = torch.zeros(3, 8, dtype=torch.bool)
    mask[:, 4:7] = True
    old = old * mask
    rows, prompt_lens = torch.tensor([10, 11, 12]), torch.tensor([4, 4, 4])
    ok = check_exact(step=7, rows=rows, prompt_lens=prompt_lens, old=old, sampled=old.clone(), mask=mask)
    assert ok == {"exact/mismatched_tokens": 0.0, "exact/checked_tokens": 9.0}
    sampled = old.clone()
    sampled[1, 5] = torch.nextafter(old[1, 5], torch.tensor(0.0))  # one ulp
    assert sampled[1, 5] != old[1, 5] and abs(float(sampled[1, 5] - old[1, 5])) < 1e-6
    with pytest.raises(ExactMismatchError) as e:
        check_exact(step=7, rows=rows, prompt_lens=prompt_lens, old=old, sampled=sampled, mask=mask)
    msg = str(e.value)
    assert "step 7: 1 of 9 sampled tokens" in msg and "row 11 response token 1 (position 5)" in msg
    assert float(sampled[1, 5]).hex() in msg and float(old[1, 5]).hex() in msg
    sampled[1, 7] = 1.0  # off the response: not checked
    with pytest.raises(ExactMismatchError, match="1 of 9"):
        check_exact(step=7, rows=rows, prompt_lens=prompt_lens, old=old, sampled=sampled, mask=mask)


def test_the_shape_invariant_moe_patch_refuses_an_unknown_megatron_version(monkeypatch):
    import importlib.metadata as md

    from patches import guard
    from patches.megatron import shape_invariant_moe

    real = md.version
    monkeypatch.setattr(guard.md, "version", lambda d: "0.99.0" if d == "megatron-core" else real(d))
    with pytest.raises(guard.UnverifiedVersionError, match=r"megatron-shape-invariant-moe.*0\.99\.0"):
        shape_invariant_moe.apply(model=None)


# ----------------------------------------------------------------------------------------- recipe rules


@pytest.mark.parametrize(
    ("overrides", "keys"),
    [
        (["remedies.router_replay=r3"], "remedies.router_replay = r3 replays vLLM's experts"),
        (["rollout.top_p=0.9"], "rollout.top_p"),
        (["trainer.moe_dispatcher=alltoall"], "trainer.moe_dispatcher"),
        (["parallel.tp=4", "model.dims.num_key_value_heads=4"], "got parallel.tp = 4; allowed tp <= 2"),
        (["rl.correction.bypass=true"], "rl.correction.bypass"),
        (
            [
                "trainer.dtype=bfloat16",
                "rollout.dtype=bfloat16",
                "diagnostics.sampling_injection.type=precision",
            ],
            "remedies.fp32_lm_head",
        ),
        (
            ["diagnostics.sampling_injection.type=noise", "diagnostics.sampling_injection.engine=vllm"],
            "which vexact = exact does not use",
        ),
        (
            ["diagnostics.vexact=off", "diagnostics.sampling_injection.type=noise"],
            "needs diagnostics.vexact = exact",
        ),
        (
            [
                "diagnostics.vexact=off",
                "diagnostics.sampling_injection.type=noise",
                "diagnostics.sampling_injection.engine=vllm",
            ],
            "set rollout.sync_check = probe",
        ),
    ],
)
def test_exact_mode_refuses_what_it_cannot_honour(overrides, keys):
    with pytest.raises(RecipeError, match=keys.replace(".", r"\.")):
        load_recipe(VEXACT, overrides)


def test_removed_metric_only_modes_say_why_and_what_to_use():
    for value in ("recompute", "trainer_sampler"):
        with pytest.raises(RecipeError, match=f"'{value}' was removed: .* Use 'exact'"):
            load_recipe(VEXACT, [f"diagnostics.vexact={value}"])
    with pytest.raises(
        RecipeError, match="logprob_injection was removed: .* Use diagnostics.sampling_injection"
    ):
        load_recipe(VEXACT, ["diagnostics.logprob_injection.type=noise"])


def test_precision_injection_on_float32_logits_and_on_an_fp32_head_loads():
    assert load_recipe(ROOT / "recipes/tiny-moe/vexact-precision.yaml").recipe.trainer_dtype == "float32"
    bf16_head32 = load_recipe(
        VEXACT,
        [
            "trainer.dtype=bfloat16",
            "rollout.dtype=bfloat16",
            "remedies.fp32_lm_head=true",
            "diagnostics.sampling_injection.type=precision",
        ],
    )
    assert bf16_head32.recipe.diagnostics.sampling_injection.type == "precision"


def test_ordered_reductions_give_every_row_the_same_bits_over_four_gloo_ranks(tmp_path):
    """Issue 62, item 0: over 4 gloo ranks megatron's all-reduce gives a row other bits alone than inside a larger
    buffer (why exact mode refused expert groups over 2 ranks); patched (patches/megatron/ordered_reductions.py)
    the all-reduce and the reduce-scatter equal the rank-order fold of the gathered parts, whatever the buffer."""
    require(importable("megatron.core"), "megatron-core")
    from tests.conftest import free_port

    out = tmp_path / "reductions.json"
    worker = ROOT / "tests" / "workers" / "reduction_worker.py"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4"]
    run_ok([*torchrun, f"--master-port={free_port()}", str(worker), str(out)], threads=1, timeout=300)
    res = json.loads(out.read_text())
    assert res["world"] == 4
    assert not all(m["reduce_row_alone_equal"] for m in res["native"].values()), res["native"]
    for rows, m in res["patched"].items():
        assert all(m.values()), (rows, m)


def test_exact_mode_allows_any_expert_group_and_the_seed_papers_layout():
    """The 30B recipe's layout (TP 2, EP 8) is accepted in exact mode; TP over 2 still is not (the vocab-parallel
    cross-entropy's all-reduce is megatron's own)."""
    r = load_recipe(ROOT / "recipes/qwen3-30b-a3b/gspo.yaml", ["diagnostics.vexact=exact"]).recipe
    assert (r.parallel.tp, r.parallel.ep) == (2, 8)
    from tim_megatron.modes import modes_of

    assert "ordered_reductions" in modes_of(r).patches


# --------------------------------------------------------------------------------- the loop, bit for bit


LAYOUTS = {
    "single": (1, []),
    "dp2": (2, ["parallel.dp=2"]),
    "tp2": (2, ["parallel.tp=2"]),
    "ep2": (2, ["parallel.dp=2", "parallel.ep=2"]),
    "ep4": (
        4,
        ["parallel.dp=4", "parallel.ep=4"],
    ),  # the expert group's sums in rank order (ordered_reductions)
}
# The lab's exact arm (countdown chains, responses up to 120 tokens, fp32 head over a bf16 model), smaller: 4 prompts
# x 8 samples per step, a 20-step warm-up instead of 800 (the warm-up only shapes what the policy writes).
COUNTDOWN = ROOT / "recipes" / "tiny-moe" / "countdown.yaml"
COUNTDOWN_EXACT = [
    "diagnostics.vexact=exact",
    "remedies.fp32_lm_head=true",
    "data.prompts_per_step=4",
    "model.tiny_warmup_steps=20",
    "run.val_every=0",
]


def _check_exact_rows(d: Path, rows: list[dict], steps: int) -> None:
    import pyarrow.parquet as pq

    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert r["exact/mismatched_tokens"] == 0.0
        assert r["exact/checked_tokens"] == r["rollout/response_tokens"] > 0  # every sampled token, once
        assert r["mismatch/old_vs_rollout/rho_std"] == 0.0
        assert r["mismatch/old_vs_rollout/rho_min"] == r["mismatch/old_vs_rollout/rho_max"] == 1.0
        assert r["routing/rollout_vs_trainer/exact_match"] == 1.0  # the sampler's routing is the old pass's
        assert r["exact/kv_cache_mib"] > 0  # the KV-cached sampler ran
    experts = set()
    for step in range(1, steps + 1):
        t = pq.read_table(d / "dumps" / f"step_{step:08d}.parquet").to_pydict()
        assert len(t["pi_infer"]) == rows[step - 1]["rollout/response_tokens"]
        assert t["pi_infer"] == t["pi_old"] == t["pi_train"]
        experts |= {tuple(e) for e in t["routed_experts"]}
    # The capture is real routing, whatever was sampled: per layer, top-k distinct experts of the model's.
    dims = load_recipe(d / "recipe.yaml").recipe.model.dims
    k, n_exp = dims.num_experts_per_tok, dims.num_experts
    for e in experts:
        assert len(e) % k == 0 and all(0 <= x < n_exp for x in e), e
        assert all(len(set(e[i : i + k])) == k for i in range(0, len(e), k)), e


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_kv_cache_exact_mode_gives_rho_one_bit_for_bit_for_five_steps(layout, tmp_path):
    """Five countdown steps with the KV-cached exact sampler, routing recorded on both sides (r2 hooks), every
    step's tokens dumped; on one rank, DP2, TP2 and EP2 (experts split over the two data-parallel ranks)."""
    require(importable("megatron.core", "vllm"), "megatron-core and vLLM")
    nproc, extra = LAYOUTS[layout]
    args = [
        str(COUNTDOWN),
        "--nproc",
        str(nproc),
        *COUNTDOWN_EXACT,
        "run.steps=5",
        f"run.output_dir={tmp_path}",
        "diagnostics.dumps.every=1",
        "diagnostics.dumps.routed_experts=true",
        "remedies.router_replay=r2",
        "rollout.capture_routed_experts=true",
        *QUIET,
        *extra,
    ]
    run_ok([*TIM, "train", *args], threads=1, timeout=900)
    d = run_folder(tmp_path)
    rows = metrics(d)
    _check_exact_rows(d, rows, 5)
    assert max(r["batch/width"] for r in rows) > 40  # long responses: the cache spans many decode steps


@pytest.mark.slow
def test_kv_cache_and_full_forward_sample_the_same_tokens_with_the_same_bits(tmp_path):
    """The same recipe and seeds through both exact samplers, on one rank, with R2 routing capture and a noise
    injection in the sampling distribution: every dumped token, position, logprob (mu's and pi's) and captured
    expert set is the same (both run the forward on the row-invariant kernels, one cached, one full-width)."""
    require(importable("megatron.core", "vllm"), "megatron-core and vLLM")
    import pyarrow.parquet as pq

    runs = [
        {
            "name": sampler,
            "recipe": str(COUNTDOWN.relative_to(ROOT)),
            "overrides": [
                *COUNTDOWN_EXACT,
                "data.prompts_per_step=2",
                "rollout.max_tokens=48",
                "run.steps=2",
                "diagnostics.dumps.every=1",
                f"diagnostics.exact_sampler={sampler}",
                # R2 capture and a sampling injection ride along: both samplers must carry them the same way.
                "remedies.router_replay=r2",
                "rollout.capture_routed_experts=true",
                "diagnostics.dumps.routed_experts=true",
                "diagnostics.sampling_injection.type=noise",
                "diagnostics.sampling_injection.std=0.1",
                "diagnostics.sampling_injection.engine=trainer",
                *QUIET,
            ],
            "output_dir": str(tmp_path / sampler),
        }
        for sampler in ("kv-cache", "full-forward")
    ]
    done = train_in_one_process(runs, tmp_path / "worker")  # both runs in one process: the imports once
    dumps = {}
    for sampler in ("kv-cache", "full-forward"):
        assert done[sampler]["exit"] == 0, done[sampler]["error"]
        d = Path(done[sampler]["run_dir"])
        rows = metrics(d)
        assert all(r["exact/mismatched_tokens"] == 0.0 for r in rows)
        assert all((r["exact/kv_cache_mib"] > 0) == (sampler == "kv-cache") for r in rows)
        dumps[sampler] = [pq.read_table(d / "dumps" / f"step_{s:08d}.parquet").to_pydict() for s in (1, 2)]
    for a, b in zip(dumps["kv-cache"], dumps["full-forward"], strict=True):
        assert len(a["token_id"]) > 0
        assert a["pi_infer"] != a["pi_old"]  # the injection acted: the logged logprobs are mu's
        for key in ("seq", "position", "token_id", "pi_infer", "pi_old", "finish", "routed_experts"):
            assert a[key] == b[key], key


def test_the_kv_cached_decode_gives_the_training_forwards_bits_at_every_position(tmp_path):
    """Given tokens, no sampling: random sequences (prompt 1-8 tokens, 1-40 more) prefilled and then decoded one
    position per step through the KV cache; every position's logprob equals the old-logprob pass's (the training
    forward at the exact width), in float32 and in bfloat16 with the fp32 head, also at hidden size 1024, and on the
    tiny GLM-4.5 (sigmoid router)."""
    require(importable("megatron.core"), "megatron-core")
    for name, extra in (
        ("fp32", []),
        ("bf16", ["trainer.dtype=bfloat16", "rollout.dtype=bfloat16", "remedies.fp32_lm_head=true"]),
        # Wide enough for MKL to split one GEMM over its threads (K >= 896): exact mode's MKL setting at work.
        (
            "bf16-wide",
            [
                "trainer.dtype=bfloat16",
                "rollout.dtype=bfloat16",
                "remedies.fp32_lm_head=true",
                "model.dims.hidden_size=1024",
                "model.dims.moe_intermediate_size=1536",
                "model.tiny_warmup_steps=0",
            ],
        ),
        # One-row head chunks over a vocabulary of 65,536: ATen splits a lone row's sum over the threads unless the
        # head pads the chunk (5 of 123 positions differed without it, at 2 threads on AMD EPYC).
        (
            "chunk1-vocab65536",
            ["trainer.logprob_chunk=1", "model.dims.vocab_size=65536", "model.tiny_warmup_steps=0"],
        ),
        # GLM-4.5's sigmoid router (score-correction bias, routed scaling), shared expert, partial RoPE and q/k/v
        # biases, in float32: the router's sigmoid goes through the row-invariant elementwise kernel.
        (
            "glm4-sigmoid-router",
            [
                "recipe=recipes/tiny-glm4-moe/grpo.yaml",
                "diagnostics.vexact=exact",
                "trainer.dtype=float32",
                "rollout.dtype=float32",
            ],
        ),
    ):
        out = tmp_path / name
        recipe = [x for x in extra if x.startswith("recipe=")]  # the worker takes it first
        extra = [x for x in extra if not x.startswith("recipe=")]
        run_ok(
            [sys.executable, str(WORKER), "forced", str(out), *recipe, "rollout.max_model_len=64", *extra],
            threads=2,
            timeout=600,
        )
        res = torch.load(out / "forced-rank0.pt", weights_only=False)
        assert res["compared"] > 100 and res["width"] == 48, res
        assert res["differing"] == 0, res


def test_exact_mode_holds_at_four_threads_on_an_expert_width_that_splits_rows(tmp_path):
    """``tim train`` in exact mode at OMP_NUM_THREADS=4, a micro-batch of 256 rows and an expert width of 40 (the
    gated half's rows are no multiple of the vector width, and an expert's input is split between the threads):
    before the activations went through the row-invariant kernels, 2 of 2,886 tokens of step 1 differed by an
    ulp at 2 and at 4 threads (AMD EPYC); every step's tokens must now be exact."""
    require(importable("megatron.core"), "megatron-core")
    args = [
        "recipes/tiny-moe/vexact.yaml",
        "trainer.micro_batch_size=256",
        "data.prompts_per_step=32",
        "model.tiny_warmup_steps=0",
        "model.dims.moe_intermediate_size=40",
        "rollout.max_tokens=12",
        "run.steps=3",
        f"run.output_dir={tmp_path}",
        *QUIET,
    ]
    run_ok([*TIM, "train", *args], threads=4, timeout=600)
    rows = metrics(run_folder(tmp_path))
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["exact/mismatched_tokens"] == 0.0 and r["exact/checked_tokens"] > 2000, r
        assert r["response/length_mean"] > 8  # long responses: many decode steps through the cache


@pytest.mark.slow
@pytest.mark.parametrize("what", ["keys", "expert"])
def test_a_one_ulp_perturbation_inside_the_sampler_stops_the_run(what, tmp_path):
    """The real loop on one rank. At step 2 every key the sampler caches (every layer), or the output of one expert
    (the busiest in each MoE layer's call), moves by one ulp inside the sampler only (the old pass is untouched): the check stops the run
    at step 2, naming the row, the response token and its position."""
    require(importable("megatron.core", "vllm"), "megatron-core and vLLM")
    from tim_megatron.run_dir import write_resolved

    loaded = load_recipe(COUNTDOWN, [*COUNTDOWN_EXACT, "data.prompts_per_step=2", "run.steps=3", *QUIET])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_resolved(loaded, run_dir)
    out = tmp_path / "out"
    run_ok([sys.executable, str(WORKER), "perturb", str(out), what, str(run_dir)], threads=2, timeout=900)
    res = torch.load(out / "perturb-rank0.pt", weights_only=False)
    assert res["hits"] > 0, res  # the perturbation ran
    err = res["error"]
    assert err is not None and err["type"] == "ExactMismatchError", err
    assert "exact mode, step 2: " in err["message"]
    assert re.search(r"row \d+ response token \d+ \(position \d+\): sampled -?0x", err["message"]), err
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1]
    assert json.loads((run_dir / "run.json").read_text())["status"] == "failed"


@pytest.mark.slow
def test_a_one_ulp_nudge_stops_the_run_on_every_rank(tmp_path):
    """The real loop on two ranks (DP2); rank 1 moves one logged logprob by one ulp at step 2. Both ranks stop with
    ExactMismatchError (the one whose rows were fine too: no rank is left waiting in a collective)."""
    require(importable("megatron.core", "vllm"), "megatron-core and vLLM")
    from tim_megatron.run_dir import write_resolved

    loaded = load_recipe(VEXACT, ["run.steps=3", "run.val_every=0", "parallel.dp=2", *QUIET])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_resolved(loaded, run_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(WORKER), "nudge"]
    run_ok([*cmd, str(tmp_path / "out"), str(run_dir)], threads=1, timeout=900)
    outs = [torch.load(tmp_path / "out" / f"nudge-rank{r}.pt", weights_only=False) for r in (0, 1)]
    nudged = outs[1]["rank1"]["nudged"]
    for r, out in enumerate(outs):
        err = out[f"rank{r}"]
        assert err["type"] == "ExactMismatchError", err
        assert "step 2: 1 of " in err["message"]
        assert f"row {nudged['row']} response token 0 (position {nudged['position']})" in err["message"]
        assert f"vs old {nudged['before']}" in err["message"]
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1]
    assert json.loads((run_dir / "run.json").read_text())["status"] == "failed"


# ----------------------------------------------------------------------------------- sampling injection


@pytest.fixture(scope="module")
def doses(tmp_path_factory):
    require(importable("megatron.core", "vllm"), "megatron-core and vLLM")
    out = tmp_path_factory.mktemp("doses")
    run_ok([sys.executable, str(WORKER), "doses", str(out)], threads=2, timeout=1200)
    return torch.load(out / "doses-rank0.pt", weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["precision", "noise", "bias"])
def test_rho_std_rises_with_the_dose(doses, kind):
    """Zero run, then each dose: the mismatch the metrics see grows, a factor at each dose (the doses are far
    apart: measured margins 6.8x for precision, 11x and 21x for noise, 6.6x and 5.9x for bias)."""
    stds = [doses["zero"]["rho_std"], *(r["rho_std"] for r in doses[kind])]
    assert stds[0] == 0.0
    assert all(b > 2 * a for a, b in itertools.pairwise(stds)), stds
    # The policy's own logprobs still matched the old pass bit for bit (the worker ran check_exact), while mu's
    # logged logprobs differ from them on nearly every token pi does not take with probability exactly 1. Not on
    # every one, whatever was sampled: a float32 probability that a bfloat16 or float16 softmax happens to
    # represent exactly (seen: 1 token of 256 in a bfloat16 dose) gives the same logprob.
    assert all(r["mu_differs"] > 0.9 for r in doses[kind]), [
        (r["mu_differs"], r["certain_tokens"]) for r in doses[kind]
    ]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["noise", "bias"])
def test_injection_changes_the_tokens_and_the_gradient(doses, kind):
    """Same step, same seeds as the zero run: at the strongest dose, tokens drawn from mu differ from those drawn
    from pi, and so does the GRPO gradient computed on them. An injected sampler asked for the policy itself (the
    lab's policy evaluation, ``injection=False``) draws the zero run's tokens."""
    top = doses[kind][-1]
    assert top["tokens_differing"] > 0 and top["grad_max_diff"] > 0, top
    assert doses["policy_tokens_unchanged"]


@pytest.mark.slow
def test_an_injection_moves_the_gradient_only_through_the_tokens(doses):
    """With rl.correction.mode none the loss reads no rollout logprob: an injection changes the gradient only by
    changing what was sampled. (A bfloat16 softmax moves a tiny model's probabilities by ~1e-3 of their CDF, so in
    one step of 128 samples a token may or may not change: measured, none did.)"""
    for kind in ("precision", "noise", "bias"):
        for r in doses[kind]:
            if r["tokens_differing"] == 0:
                assert r["grad_max_diff"] == 0.0, r


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_logits_processor_samples_from_and_logs_mu(tmp_path):
    """engine: vllm. vLLM's own logged logprobs are log mu for the noise the sample's seed and position give (HF's
    float32 logits as the reference: vLLM float32 matches them to ~1e-5), far from log pi; the tokens differ from
    the same engine's unperturbed requests with the same seeds; greedy validation sees the policy itself."""
    require(importable("megatron.core", "vllm"), "megatron-core and vLLM")
    run_ok([sys.executable, str(WORKER), "vllm", str(tmp_path)], threads=2, timeout=900)
    out = torch.load(tmp_path / "vllm-rank0.pt", weights_only=False)
    assert out["tokens"] > 0
    assert out["logged_vs_mu_max"] < 1e-3, out
    assert out["logged_vs_pi_mean"] > 0.1, out  # logit noise of std 1: far from the policy's own logprobs
    assert out["tokens_differing"] > 0 and out["greedy_unchanged"], out
