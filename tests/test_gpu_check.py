"""``make gpu-check`` without a GPU: the target says so and exits 0; its comparisons, the ~1B config, the
report format, and (``--cpu``) every section that can run on CPU, on real megatron-core and vLLM."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import require
from tim_megatron.gpu_check import Section, compare, run_sections
from tim_megatron.gpu_check.models import gpu_type_key, next_token_mask, probe_batch, qwen3_moe_1b_dims
from tim_megatron.gpu_check.report import Report, finding
from tim_megatron.gpu_check.sections import Bench
from tim_megatron.outcome import format_value
from tim_megatron.slurm.plan import param_count

ROOT = Path(__file__).resolve().parents[1]


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _python_ok(*args: str) -> subprocess.CompletedProcess:
    """``python ARGS`` from the repository root with 2 OpenMP threads; it must exit 0 (else the test fails showing
    the tails of its stdout and stderr)."""
    res = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"},
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return res


def test_make_gpu_check_without_a_gpu_says_so_and_exits_0(tmp_path):
    out = tmp_path / "report.json"
    # -o: never remake the venv stamp (a worktree has no .venv, and setup would reinstall the package)
    make = ["make", "--no-print-directory", "-o", ".venv/.tim-setup-stamp"]
    res = subprocess.run(
        [*make, "gpu-check", f"PY={sys.executable}", f"GPU_CHECK_JSON={out}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no CUDA GPU here (torch.cuda.is_available() is False), so nothing was measured" in res.stdout
    assert not out.exists()  # no report pretends to hold figures


# ------------------------------------------------------------------------------------------- compare


def test_logprob_gap_counts_only_the_masked_tokens():
    want = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    got = torch.tensor([[-1.1, -2.0, -3.0], [-0.5, -0.2, 50.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    gap = compare.logprob_gap(got=got, want=want, mask=mask)
    assert gap.tokens == 5
    assert gap.max == pytest.approx(0.3)
    assert gap.mean == pytest.approx((0.1 + 0.3) / 5)
    with pytest.raises(ValueError, match="shapes differ"):
        compare.logprob_gap(got=got[:, :2], want=want, mask=mask)
    with pytest.raises(ValueError, match="selects no tokens"):
        compare.logprob_gap(got=got, want=want, mask=torch.zeros_like(mask))


def test_verdict_rules():
    g = compare.Gap(max=2e-3, mean=1e-4, p99=1e-3, tokens=10)
    assert compare.judge_fp32(g) == ("fail", "max <= 0.001")
    assert compare.judge_fp32(compare.Gap(1e-3, 1e-4, 1e-4, 10))[0] == "ok"
    yard = compare.Gap(max=0.1, mean=0.01, p99=0.05, tokens=10)
    assert compare.judge_bf16(compare.Gap(0.2, 0.03, 0.1, 10), yardstick=yard)[0] == "ok"
    verdict, rule = compare.judge_bf16(compare.Gap(0.2, 0.031, 0.1, 10), yardstick=yard)
    assert verdict == "fail" and "3 x HF's own bf16 gap 1.00e-02" in rule
    assert compare.judge_step_ratio(1.1, 1.0)[1:] == ("ok", "<= 1.1x")
    assert compare.judge_step_ratio(1.2, 1.0)[1] == "fail"
    assert compare.judge_memory(81.0, 80.0)[1] == "fail"  # the plan must not underestimate
    assert compare.judge_memory(40.0, 80.0) == (0.5, "ok", "measured <= tim plan")
    assert compare.judge_exact(0.0)[0] == "ok" and compare.judge_exact(1e-9)[0] == "fail"


def test_topk_agreement_ignores_order_within_a_token():
    want = torch.tensor([[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]])
    got = torch.tensor([[[1, 0]], [[2, 3]], [[4, 6]], [[0, 1]]])
    assert compare.topk_agreement(got=got, want=want) == 0.5


def test_probe_batch_masks_what_is_beyond_each_sequence():
    ids, lengths = probe_batch(vocab=100, n=4, length=10)
    assert lengths.tolist() == [10, 8, 7, 5]
    assert (ids[1, 8:] == 0).all() and (ids[1, :8] >= 2).all()
    mask = next_token_mask(lengths, 10)
    assert mask.shape == (4, 9) and mask.sum(1).tolist() == [9, 7, 6, 4]


# ------------------------------------------------------------------------------------------ the ~1B model


def test_the_1b_config_is_qwen3_moe_shaped_and_about_1b_parameters():
    from transformers import AutoModelForCausalLM

    from tim_megatron.models.tiny import hf_config
    from tim_megatron.trainer.hf_config import check_dims_match, dims_from_hf

    d = qwen3_moe_1b_dims()
    c = param_count(d)
    total, active = c.total, c.active
    assert 0.9e9 < total < 1.1e9 and active < 0.6 * total
    assert (d.head_dim, d.num_attention_heads // d.num_key_value_heads, d.num_experts_per_tok) == (128, 4, 8)
    assert d.vocab_size == 151936 and not d.tie_word_embeddings and d.norm_topk_prob
    cfg = hf_config(d)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert sum(p.numel() for p in model.parameters()) == total
    hf = cfg.to_dict()
    hf["architectures"] = ["Qwen3MoeForCausalLM"]
    check_dims_match(d, dims_from_hf(hf), where="the ~1B config")  # the trainer accepts its checkpoint


def test_gpu_type_key_names_what_tim_plan_knows():
    gib = 2**30
    assert gpu_type_key("NVIDIA H200", 140 * gib) == "h200-141gb"
    assert gpu_type_key("NVIDIA H100 80GB HBM3", 80 * gib) == "h100-80gb"
    assert gpu_type_key("NVIDIA A100-SXM4-40GB", 40 * gib) == "a100-40gb"
    assert gpu_type_key("NVIDIA L40S", 45 * gib) is None


# ------------------------------------------------------------------------------------------ report, runner


def test_report_text_json_and_exit_code(tmp_path):
    r = Report(date="2026-11-22 12:00 UTC", device="NVIDIA H200, 139.8 GiB", versions={"torch": "2.11.0"})
    r.findings = [
        finding("parity 1b", "megatron fp32 vs HF fp32, max |dlogp|", 3.2e-6, "nats", "ok", "max <= 0.001"),
        finding("train step", "ours / bare", 1.04, "x", "ok", "<= 1.1x"),
        finding("vllm", "not run", None, "", "skip", "vllm is not installed"),
        finding("memory", "peak / plan", float("inf"), "x", "info"),
    ]
    r.seconds = 312.0
    text = r.text()
    assert text.splitlines()[0] == "make gpu-check, 2026-11-22 12:00 UTC: NVIDIA H200, 139.8 GiB"
    assert "3.20e-06 nats  pass (max <= 0.001)" in text
    assert "skip (vllm is not installed)" in text
    assert text.splitlines()[-1] == "  2 pass, 0 fail, 1 info, 1 skipped; 312 s (within the 600 s budget)"
    assert r.exit_code == 0
    saved = json.loads(r.save(tmp_path / "sub" / "r.json").read_text())
    assert saved["findings"][3]["value"] == "inf" and saved["versions"] == {"torch": "2.11.0"}
    r.findings.append(finding("checkpoint", "restored vs saved", 1e-3, "nats", "fail", "bit-identical"))
    assert r.exit_code == 1
    assert format_value(0.0, "nats") == "0 nats" and format_value(1.04, "x") == "1.04 x"


def test_saved_findings_keep_the_layout_of_reports_written_before_outcome(tmp_path):
    """docs/gpu-results/*.json and every older report: section, name, value, unit, verdict, rule; ``pass``."""
    r = Report(date="2026-11-22 12:00 UTC", device="cpu", versions={})
    r.findings = [
        finding("checkpoint", "restored", 0.0, "nats", "ok", "bit-identical"),
        finding("vllm", "not run", None, "", "skip", "vllm is not installed"),
    ]
    saved = json.loads(r.save(tmp_path / "r.json").read_text())
    assert list(saved) == ["date", "device", "versions", "findings", "seconds", "limit_seconds"]
    assert saved["findings"] == [
        {
            "section": "checkpoint",
            "name": "restored",
            "value": 0.0,
            "unit": "nats",
            "verdict": "pass",
            "rule": "bit-identical",
        },
        {
            "section": "vllm",
            "name": "not run",
            "value": None,
            "unit": "",
            "verdict": "skip",
            "rule": "vllm is not installed",
        },
    ]
    committed = sorted((ROOT / "docs" / "gpu-results").glob("*.json"))
    for path in committed:  # the same keys as the reports already committed
        old = json.loads(path.read_text())
        assert list(old) == list(saved), path
        assert all(list(f) == list(saved["findings"][0]) for f in old["findings"]), path


def test_runner_skips_what_cannot_run_here_and_reports_a_raising_section(tmp_path):
    def broken(bench):
        raise RuntimeError("CUDA out of memory")

    sections = (
        Section(
            "needs gpu",
            lambda b: [finding("needs gpu", "x", 1.0, "", "info")],
            needs_gpu=True,
        ),
        Section(
            "needs module",
            lambda b: [finding("needs module", "x", 1.0, "", "info")],
            needs="no_such_module_here",
        ),
        Section("ok", lambda b: [finding("ok", "x", 2.0, "", "ok")]),
        Section("broken", broken),
    )
    found = run_sections(Bench(device="cpu", workdir=tmp_path), sections)
    rows = [(f.group, f.name, f.status) for f in found]
    assert rows == [
        ("needs gpu", "not run", "skip"),
        ("needs module", "not run", "skip"),
        ("ok", "x", "ok"),
        ("ok", "section time", "info"),
        ("broken", "section raised", "fail"),
        ("broken", "section time", "info"),
    ]
    assert found[4].rule == "RuntimeError: CUDA out of memory"


# ----------------------------------------------------------------------------- the sections, on CPU

_SMALL_RANDOM = """
import json, sys
from pathlib import Path
from megatron.core.models.common.embeddings import rope_utils
from tim_megatron.gpu_check.layer_profile import compile_findings, profile_model
from tim_megatron.gpu_check.models import random_checkpoint
from tim_megatron.gpu_check.moe_layer import cuda_choices
from tim_megatron.gpu_check.report import finding, record
from tim_megatron.gpu_check.sections import Bench, Model, parity, train_step
from tim_megatron.recipe.schema import ModelDims
from tim_megatron.trainer.compile import apply
from tim_megatron.trainer.model import unwrap


def compile_wiring(parts):
    # trainer.compile's wiring on a built model, with dynamo's eager backend (Inductor's C++ compile is too slow for
    # CI), and the profile's CUDA-only report of it (compile_findings) run on that
    tr = parts.trainer
    eager_rope = rope_utils._apply_rotary_pos_emb_bshd
    c = apply(unwrap(tr.model), setting="auto", exact=False, on_gpu=True, backend="eager")
    wired = len(c.norms) + float(rope_utils._apply_rotary_pos_emb_bshd is not eager_rope) / 10
    before, tr.compiled = tr.compiled, c
    found = compile_findings("compile", parts)
    tr.compiled = before
    c.disable()
    left = sum("norm_fn" in vars(m) for m in c.norms) + float(rope_utils._apply_rotary_pos_emb_bshd is not eager_rope)
    return [*found, finding("compile", "norms, rope", wired), finding("compile", "left after disable", float(left))]


if __name__ == "__main__":
    work = Path(sys.argv[1])
    dims = ModelDims(hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     vocab_size=96, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    path = random_checkpoint(dims, work / "small-random")
    bench, model = Bench(device="cpu", workdir=work), Model("small random", path, str(path), dims)
    found = parity(bench, model, section="parity small", n=4, length=24)
    rebuild = []

    def also(parts):
        got, profiled = profile_model(parts, section="profile", cuda=False, repeat=3, levers=True, lever_repeat=1)
        rebuild.extend(lever.name for lever in profiled.rebuild)
        return got + compile_wiring(parts)

    found += train_step(bench, model, section="step", seqs=4, length=24, repeat=1, overrides=cuda_choices(), also=also)
    print(json.dumps({"findings": [record(f) for f in found], "rebuild": rebuild}))
"""


@pytest.fixture(scope="module")
def small_random(tmp_path_factory):
    """One process on a small random checkpoint: the ~1B parity section's path (both dtypes), then one train step
    on what ``auto`` takes on CUDA with the ``moe layer`` profile and ``trainer.compile``'s wiring."""
    require(_installed("megatron.core"), "megatron-core")
    work = tmp_path_factory.mktemp("small-random")
    res = _python_ok("-c", _SMALL_RANDOM, str(work))
    got = json.loads(res.stdout.strip().splitlines()[-1])
    got["work"] = work
    got["by_name"] = {(f["section"], f["name"]): f for f in got["findings"]}
    return got


@pytest.mark.megatron
def test_parity_on_a_random_checkpoint_goes_through_the_1b_path(small_random):
    """The ~1B section's path, scaled down: a random bf16 checkpoint, a recipe carrying its dims, both dtypes."""
    found = {f["name"]: f for f in small_random["findings"] if f["section"] == "parity small"}
    fp32 = found["megatron fp32 vs HF fp32, max |dlogp|"]
    assert fp32["verdict"] == "pass" and fp32["value"] < 1e-4, fp32
    assert found["megatron bf16 vs HF fp32, mean |dlogp|"]["verdict"] == "pass"
    assert (small_random["work"] / "small-random" / "config.json").exists()


@pytest.mark.megatron
def test_the_profiles_phases_add_up_to_the_step_and_every_lever_is_reported(small_random):
    """The ``moe layer`` profile on a real trainer (CPU): the named phases cover the step timed alone within 15% (the
    median over 3 steps, ours and bare), each phase the step passes through is clocked, the kernel classes sum to the
    profiled total with the GEMMs, grouped GEMMs, attention and Adam found by their operators, the backward listed by
    autograd node, the CUDA-only figures said so, and every lever of issue 57 either measured, left for a rebuild
    or skipped with its reason."""
    from tim_megatron.gpu_check.kernel_classes import CLASSES
    from tim_megatron.gpu_check.levers import LEVERS
    from tim_megatron.gpu_check.phases import PHASES

    rows = {name: f for (section, name), f in small_random["by_name"].items() if section == "profile"}
    for who in ("ours", "bare"):
        (cover,) = [f for n, f in rows.items() if n.startswith(f"named phases / {who} step")]
        assert 0.85 <= cover["value"] <= 1.0 and cover["verdict"] == "pass", cover
    ours = {p: rows[f"phase {p}: ours"]["value"] for p in PHASES}
    assert all(v > 0 for v in ours.values()), (
        ours
    )  # ours passes through every phase, the finite check included
    assert rows["phase finite check: ours"]["rule"] == "bare 0.000 ms"  # the bare step has none
    kernels = {c: rows[f"kernels {c}: ours"]["value"] for c in CLASSES}
    assert sum(kernels.values()) == pytest.approx(
        rows["kernels, all (CPU self time): ours"]["value"], rel=1e-6
    )
    assert all(kernels[c] > 0 for c in ("grouped GEMM", "GEMM", "attention", "optimizer")), kernels
    node = rows[
        "backward by autograd node, ours: "
        + next(n.split(": ")[1] for n in rows if "autograd node, ours" in n)
    ]
    assert (
        node["value"] > 0 and "AccumulateGrad x" in node["rule"] and "_GroupedLinearBackward" in node["rule"]
    )
    assert rows["GPU idle share"]["rule"] == "n/a on CPU"
    assert (
        rows["host syncs per step"]["verdict"] == "skip"
        and "n/a on CPU" in rows["host syncs per step"]["rule"]
    )
    for lever in LEVERS:
        label = f"lever {lever.item}: {lever.name}"
        hit = [f for n, f in rows.items() if n.startswith(label)]
        if lever.name in small_random["rebuild"]:
            assert not hit and lever.rebuild is not None
        else:
            assert len(hit) == 1, (label, list(rows))
            f = hit[0]
            assert (f["verdict"] == "skip" and f["rule"]) or (f["value"] > 0 and " -> " in f["rule"]), f
    measured = {n.split(":")[0] for n, f in rows.items() if n.startswith("lever") and f["verdict"] != "skip"}
    assert {
        "lever 1",
        "lever 2",
        "lever 3",
    } <= measured  # fused Adam and the norm patch as on CUDA, finite, head
    assert set(small_random["rebuild"]) == {lv.name for lv in LEVERS if lv.rebuild is not None}


@pytest.mark.megatron
def test_trainer_compile_wires_the_norms_and_rope_and_gives_the_eager_logprobs(small_random):
    """``trainer.compile`` on a built model (dynamo's ``eager`` backend: its tracing of megatron's call sites with
    eager kernels, as CI cannot afford Inductor's C++ compile): every RMSNorm and megatron's RoPE run compiled, the
    logprobs equal the eager ones, dynamo's seconds are reported, and disabling it leaves nothing behind."""
    by = small_random["by_name"]
    # the RMSNorms (input, pre-MLP, q and k in each of 2 layers, and the final one), then RoPE in the tenths
    assert by[("compile", "norms, rope")]["value"] == pytest.approx(2 * 4 + 1 + 0.1)
    assert by[("compile", "compile: logprobs compiled vs eager, max |dlogp|")]["value"] < 1e-6
    seconds = by[("compile", "compile: dynamo's seconds since the trainer's build")]
    assert seconds["value"] > 0 and "RMSNorm in 9 modules, megatron's RoPE" in seconds["rule"]
    assert by[("compile", "left after disable")]["value"] == 0


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.vllm
def test_cpu_run_of_every_section_that_can_run_on_cpu(tmp_path):
    require(_installed("megatron.core"), "megatron-core")
    require(_installed("vllm"), "vLLM")
    out = tmp_path / "report.json"
    res = _python_ok("-m", "tim_megatron.gpu_check", "--cpu", "--json", str(out), "--workdir", str(tmp_path))
    report = json.loads(out.read_text())
    assert report["device"].startswith("cpu (a test of the code path")
    got = {(f["section"], f["name"]): f for f in report["findings"]}

    def finding(section, name):
        return got[(section, name)]

    assert finding("parity tiny", "model: tiny MoE")["unit"] == "B params"
    fp32 = finding("parity tiny", "megatron fp32 vs HF fp32, max |dlogp|")
    assert (
        fp32["verdict"] == "pass" and fp32["value"] < 1e-4
    )  # the CPU trainer equals HF to 1e-5 (test_trainer)
    bf16 = finding("parity tiny", "megatron bf16 vs HF fp32, mean |dlogp|")
    assert bf16["verdict"] == "pass" and 0 < bf16["value"] < 0.1  # bf16 is never exact, never far
    assert finding("parity 1b", "not run")["rule"] == "needs a CUDA GPU"
    assert finding("train step", "ours / bare")["verdict"] == "info"  # CPU timings are not judged
    # the moe layer section: the 30B layer's structure at CPU sizes, on the kernels auto picks on CUDA
    for k in (1, 2):
        assert finding(f"moe layer x{k}", "kernels: attention sdpa, experts grouped")["verdict"] == "info"
    assert finding("moe layer", "one layer's forward + backward FLOPs (tim plan's formula)")["value"] > 0
    assert finding("moe layer", "per-layer MFU")["rule"] == "a CPU run: no GPU peak to divide by"
    # its profile at both sizes, one layer's kernel split, the rebuilt levers and the torch-only reference layer
    from tim_megatron.gpu_check.kernel_classes import CLASSES
    from tim_megatron.gpu_check.reference_layer import CASES

    for k in (1, 2):
        cover = [
            f for (s, n), f in got.items() if s == f"moe layer x{k}" and n.startswith("named phases / ours")
        ]
        assert len(cover) == 1 and cover[0]["verdict"] in ("pass", "warn"), cover
    for c in CLASSES:
        assert finding("moe layer", f"per layer: kernels {c}, ours")["unit"] == "ms"
    rebuilt = [f for (s, n), f in got.items() if s == "moe layer" and n.startswith("lever ")]
    assert len(rebuilt) == 2 and all(f["value"] > 0 and "rebuilt with" in f["rule"] for f in rebuilt), rebuilt
    for case in CASES:
        ref = finding("moe layer", f"ours / reference layer ({case.name})")
        assert ref["verdict"] == "info" and ref["value"] is not None and "reference" in ref["rule"], ref
    assert math.isfinite(finding("train step", "ours / bare")["value"])
    restore = finding("checkpoint", "restored vs saved model, max |dlogp|")
    assert restore["verdict"] == "pass" and restore["value"] == 0.0
    # the offload round trip: every part moved, the same bytes back, the same logprobs, a step after it
    moved = finding("offload", "state moved (params + grads + optimizer)")["value"]
    parts = [finding("offload", f"  of which {p}")["value"] for p in ("optimizer", "grads", "params")]
    assert all(v > 0 for v in parts) and math.isclose(sum(parts), moved)
    for name in ("state bytes after the round trips equal before", "a train step after the round trip: loss"):
        assert finding("offload", name)["verdict"] == "pass"
    assert finding("offload", "logprobs after vs before, max |dlogp|")["value"] == 0.0
    # the exact kernels' row-invariance check ran on this device, against torch's plain products
    from tim_megatron.exact.kernels import invariance_checks

    cases = invariance_checks("cpu")
    for kernels in ("cpu-tiled", "plain"):
        f = finding(
            "exact kernels", f"{kernels} kernels: cases where a row's bits depend on the batch (of {cases})"
        )
        assert 0 <= f["value"] <= cases and f["rule"]
    admitted = [n for s, n in got if s == "exact kernels" and n.startswith("admitted for exact runs: ")]
    assert admitted and admitted[0].endswith("(candidates, fastest first: cpu-tiled)"), admitted
    # a 5-step exact run on this device, every sampled token checked against the old pass
    run = finding("exact kernels", "exact run on cpu, top-8: steps with every token exact (of 5)")
    assert run["value"] == 5 and run["verdict"] == "pass" and "tokens checked" in run["rule"], run
    assert finding("vllm", "vLLM bf16 vs HF fp32, mean |dlogp|")["verdict"] == "pass"
    assert finding("vllm", "after wake_up vs before sleep, max |dlogp|")["value"] == 0.0
    assert finding("vllm", "native routed-expert capture")["verdict"] == "skip"
    assert not [f for f in report["findings"] if f["verdict"] == "fail"]
    assert "CPU figures, not GPU results" in res.stdout


def test_the_moe_layer_flops_are_one_layer_of_the_plans_formula():
    """The section's per-layer FLOPs at Qwen3-30B-A3B's layer shape (2 x 4096 tokens, forward + backward) against
    the formula written out: q/k/v/o projections, top-8 of the experts' three GEMMs, the router, the attention
    scores and weighted sum over the causal half; the norms are the only other parameters a token passes."""
    from tim_megatron.gpu_check.moe_layer import layer_dims, layer_train_flops

    d = layer_dims(1, small=False)
    h, L, seqs = d.hidden_size, 4096, 2
    attn = h * d.head_dim * (2 * d.num_attention_heads + 2 * d.num_key_value_heads)
    experts = d.num_experts_per_tok * 3 * h * d.moe_intermediate_size
    per_token = attn + experts + h * d.num_experts
    want = 3 * seqs * (2 * per_token * L + 2 * d.num_attention_heads * d.head_dim * L * L)
    got = layer_train_flops(small=False, sequences=seqs, length=L)
    assert abs(got / want - 1) < 1e-3, (got, want)


# ------------------------------------------------------------------------------------ the moe layer profile

KERNELS = {
    "GEMM": [
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel"
        "__5x_cublas",
        "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32_warpgroupsize1x1x1_execute_segment_k_off_kernel"
        "__5x_cublas",
        "nvjet_tst_192x192_64x4_2x1_v_bz_coopA_NTN",
        "nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_TNT",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>"
        "(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8::Params)",
        "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x3_tn",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, false, true, "
        "false>(cublasLt::cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*, float const*)",
        "void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false, cublasGemvParamsEx"
        "<int, cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float>, float> >"
        "(cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<float const>, float>, float, float)",
        "aten::mm",
        "aten::addmm",
    ],
    "grouped GEMM": [
        "void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::GemmUniversal"
        "<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >, cutlass::gemm::collective::CollectiveMma<"
        "cutlass::gemm::MainloopSm90ArrayTmaGmmaWarpSpecialized<4, cute::tuple<cute::C<2>, cute::C<1>, cute::C<1> >, "
        "cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>, cute::tuple<cute::C<128>, cute::C<256>, "
        "cute::C<64> >, cutlass::bfloat16_t> > > >(cutlass::gemm::kernel::GemmUniversal<...>::Params)",
        "void cutlass::Kernel<cutlass::gemm::kernel::GemmGrouped<cutlass::gemm::threadblock::MmaMultistage<"
        "cutlass::gemm::GemmShape<128, 128, 32>>, cutlass::epilogue::threadblock::Epilogue<>, "
        "(cutlass::gemm::kernel::GroupScheduleMode)0, false> >(cutlass::gemm::kernel::GemmGrouped<>::Params)",
        "aten::_grouped_mm",
    ],
    "attention": [
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
        "cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true, false, false, "
        "true, true, false, false>(pytorch_flash::Flash_fwd_params)",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8, 2, "
        "4, 2, false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t> >, true, "
        "true, false, false, false, false, false, false>(pytorch_flash::Flash_bwd_params)",
        "void pytorch_flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, false, "
        "false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t> > >"
        "(pytorch_flash::Flash_bwd_params)",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
        "cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)",
        "fmha_cutlassB_bf16_aligned_64x64_k128_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<"
        "cutlass::arch::Sm80, cutlass::bfloat16_t, true, false, true, 64, 64, 128, false>::Params)",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
    ],
    "index/gather/copy": [
        "void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, "
        "true>(at::cuda::detail::TensorInfo<c10::BFloat16, unsigned int>, at::cuda::detail::TensorInfo<long const, "
        "unsigned int>, int, int, unsigned int, unsigned int, long)",
        "void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<at::native::index_kernel_impl"
        "<at::native::OpaqueType<2> >(at::TensorIteratorBase&, c10::ArrayRef<long>, c10::ArrayRef<long>)::{lambda(char*,"
        " char const*, long)#1}>(at::TensorIteratorBase&, c10::ArrayRef<long>, c10::ArrayRef<long>)::{lambda(int)#1}>"
        "(long, at::native::gpu_index_kernel<>)",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>,"
        " unsigned int, 2, 128, 1>(at::native::(anonymous namespace)::OpaqueType<2u>*, at::native::(anonymous "
        "namespace)::CatArrInputTensorMetadata<at::native::(anonymous namespace)::OpaqueType<2u>, unsigned int, 128, 1>"
        ", at::native::(anonymous namespace)::TensorSizeStride<unsigned int, 4u>, int, unsigned int)",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::"
        "{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(c10::BFloat16)#1}, "
        "std::array<char*, 2ul>, 4, TrivialOffsetCalculator<1, unsigned int>, TrivialOffsetCalculator<1, unsigned int>,"
        " at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(int)",
        "void at::native::(anonymous namespace)::indexing_backward_kernel<c10::BFloat16, 4>(long const*, long const*, "
        "c10::BFloat16*, c10::BFloat16*, long, long, long, long, bool)",
        "void at::native::_scatter_gather_elementwise_kernel<128, 8, at::native::_cuda_scatter_gather_internal_kernel"
        "<true, float>::operator()<at::native::ReduceAdd>(at::TensorIterator&, long, long, long, at::native::ReduceAdd "
        "const&)::{lambda(int)#1}>(int, at::native::_cuda_scatter_gather_internal_kernel<true, float>)",
        "void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<at_cuda_detail::cub::DeviceRadixSortPolicy<long, long,"
        " unsigned int>::Policy900, false, long, long, unsigned int, int, int>(int*, int*, long*, long const*)",
        "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(at::cuda::detail::TensorInfo<float const, "
        "unsigned int>, unsigned int, unsigned int, bool, unsigned int, unsigned int)",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >"
        "(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)",
        "Memcpy DtoD (Device -> Device)",
        "Memcpy HtoD (Pinned -> Device)",
        "Memset (Device)",
        "aten::index_select",
        "aten::copy_",
        "aten::cat",
        "aten::scatter_add_",
    ],
    "elementwise/reduce": [
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
        "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
        "float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
        "float>, unsigned int, float, 4, 4>)",
        "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<float,"
        " float, float, at::native::binary_internal::MulFunctor<float> > >(at::TensorIteratorBase&, "
        "at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> > const&)::"
        "{lambda(int)#1}>(int, at::native::gpu_kernel_impl_nocast<>)",
        "void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel(at::TensorIteratorBase&)::"
        "{lambda()#1}::operator()() const::{lambda()#4}::operator()() const::{lambda(c10::BFloat16)#1}, "
        "std::array<char*, 2ul> >(int)",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous "
        "namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)",
        "void at::native::tensor_kernel_scan_innermost_dim<int, std::plus<int> >(int*, int const*, unsigned int, "
        "unsigned int, unsigned int, int, std::plus<int>)",
        "void (anonymous namespace)::elementwise_kernel_with_index<int, at::native::arange_cuda_out(c10::Scalar const&,"
        " c10::Scalar const&, c10::Scalar const&, at::Tensor&)::{lambda()#1}::operator()() const>(int)",
        "triton_poi_fused__to_copy_mul_rsqrt_0",
        "triton_red_fused__to_copy_add_mean_pow_1",
        "triton_per_fused_mul_sum_2",
        "aten::mul",
        "aten::aminmax",
    ],
    "optimizer": [
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "TensorListMetadata<5>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 5, "
        "(at::native::ADAM_MODE)1, false>, double*, double, double, double, double, double, bool, float const*, "
        "float const*>(at::native::(anonymous namespace)::TensorListMetadata<5>)",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "TensorListMetadata<1>, at::native::(anonymous namespace)::BinaryOpScalarFunctor<float, 1, 1, 0>, "
        "std::multiplies<float>, float>(at::native::(anonymous namespace)::TensorListMetadata<1>)",
        "void at::native::lpnorm_cleanup<float, (at::native::NormType)1, float, float>(float const*, "
        "at::native::TensorListAddresses, int)",
        "aten::_fused_adamw_",
        "aten::_foreach_add_",
        "Optimizer.step#AdamW.step",
    ],
    "communication": [
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "c10d::allreduce_",
    ],
    "other": ["my_custom_kernel_0", "_VocabParallelCrossEntropyBackward"],
}
"""Kernel names as torch.profiler reports them on H100/H200 (cuBLAS/cuBLASLt, CUTLASS, torch's flash and
memory-efficient attention, cuDNN's SDPA, CUTLASS's grouped GEMM under torch._grouped_mm and the grouped_gemm
package's, ATen's kernels, Inductor's Triton kernels, NCCL, the copies and sets), and the ATen operators the CPU
profile reports."""


def test_the_kernel_classifier_names_h100_and_h200_kernels():
    from tim_megatron.gpu_check.kernel_classes import CLASSES, classify

    assert set(KERNELS) == set(CLASSES)
    wrong = [
        (name[:80], cls, classify(name))
        for cls, names in KERNELS.items()
        for name in names
        if classify(name) != cls
    ]
    assert not wrong, wrong


def test_the_cpu_profile_classes_an_operator_by_the_operator_that_called_it():
    """On CPU ``torch._grouped_mm`` runs one ``aten::mm`` per expert and Adam's ``aten::mul``s run inside its step:
    each belongs to its caller's class (a real profile of both)."""
    from torch.profiler import ProfilerActivity, profile

    from tim_megatron.gpu_check.profile import split_events

    w = torch.nn.Parameter(torch.randn(4, 16, 16))
    x = torch.randn(8, 16)
    opt = torch.optim.AdamW([w], foreach=False)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y = torch._grouped_mm(x, w, offs=torch.tensor([2, 4, 6, 8], dtype=torch.int32))
        y.square().sum().backward()
        opt.step()
    split = split_events(prof.events(), cuda=False)
    assert split.seconds["grouped GEMM"] > 0 and split.seconds["optimizer"] > 0
    assert split.nodes and split.busy is None and split.idle_share is None
    mm = [e for e in prof.events() if e.name == "aten::mm" and e.cpu_parent is not None]
    from tim_megatron.gpu_check.kernel_classes import classify_event

    assert mm and {classify_event(e) for e in mm if e.cpu_parent.name == "aten::_grouped_mm"} == {
        "grouped GEMM"
    }


def test_the_phase_clock_splits_a_span_into_phases_and_reads_megatrons_timers():
    from tim_megatron.gpu_check.phases import OTHER, PHASES, PhaseClock

    clock = PhaseClock(cuda=False)
    clock.begin()
    clock.enter("forward")
    clock.enter("backward")
    clock.enter(OTHER)
    timer = clock.timers("optimizer-inner-step", log_level=1)
    timer.start(barrier=False)
    assert clock.current == "Adam"
    inner = clock.timers("a-timer-megatron-adds-later")
    inner.start()
    assert clock.current == "Adam"  # an unknown timer belongs to the phase it runs in
    inner.stop()
    timer.stop()
    assert clock.current == OTHER
    clock.end()
    got = clock.seconds()
    assert set(got) == {*PHASES, OTHER}
    span = clock.marks[-1][1] - clock.marks[0][1]
    assert sum(got.values()) == pytest.approx(span) and span <= clock.wall
    assert got["finite check"] == 0.0 and got["Adam"] > 0
