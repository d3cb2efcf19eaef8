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

_SMALL_RANDOM_PARITY = """
import json, sys
from pathlib import Path
from tim_megatron.gpu_check.models import random_checkpoint
from tim_megatron.gpu_check.report import record
from tim_megatron.gpu_check.sections import Bench, Model, parity
from tim_megatron.recipe.schema import ModelDims

if __name__ == "__main__":
    work = Path(sys.argv[1])
    dims = ModelDims(hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     vocab_size=96, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    path = random_checkpoint(dims, work / "small-random")
    found = parity(Bench(device="cpu", workdir=work), Model("small random", path, str(path), dims),
                   section="parity small", n=4, length=24)
    print(json.dumps([record(f) for f in found]))
"""


@pytest.mark.megatron
def test_parity_on_a_random_checkpoint_goes_through_the_1b_path(tmp_path):
    """The ~1B section's path, scaled down: a random bf16 checkpoint, a recipe carrying its dims, both dtypes."""
    require(_installed("megatron.core"), "megatron-core")
    res = _python_ok("-c", _SMALL_RANDOM_PARITY, str(tmp_path))
    found = {f["name"]: f for f in json.loads(res.stdout.strip().splitlines()[-1])}
    fp32 = found["megatron fp32 vs HF fp32, max |dlogp|"]
    assert fp32["verdict"] == "pass" and fp32["value"] < 1e-4, fp32
    assert found["megatron bf16 vs HF fp32, mean |dlogp|"]["verdict"] == "pass"
    assert (tmp_path / "small-random" / "config.json").exists()


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
