"""The RL math imports neither megatron nor vLLM, and runs on whatever device its inputs are on."""

import ast
from pathlib import Path

import torch

ALGO = Path(__file__).resolve().parents[1] / "tim_megatron" / "algo"


def test_algo_has_no_engine_imports():
    for f in ALGO.glob("*.py"):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for n in names:
                assert not n.startswith(("megatron", "vllm", "transformer_engine", "apex")), (
                    f"{f.name} imports {n}"
                )
                # the algo package's own modules and two leaves that import nothing of the project: the detectors'
                # default settings (constants) and the device a collective takes its tensors on (torch only)
                leaf = n.startswith(
                    ("tim_megatron.algo", "tim_megatron.warning_defaults", "tim_megatron.comm")
                )
                assert not n.startswith("tim_megatron.") or leaf, f"{f.name} imports {n}"


def test_algo_runs_on_the_inputs_device():
    from tim_megatron.algo import compute_mismatch, rollout_correction, token_clip_loss

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    lp = torch.log(torch.rand(3, 4, device=dev).clamp(0.1))
    m = torch.ones(3, 4, dtype=torch.bool, device=dev)
    loss, _ = token_clip_loss(logprobs=lp, old_logprobs=lp, advantages=torch.ones(3, device=dev), mask=m)
    assert loss.device.type == dev
    w, _ = rollout_correction(old_logprobs=lp, rollout_logprobs=lp, mask=m, mode="tis")
    assert w.device.type == dev
    assert (
        compute_mismatch(train_logprobs=lp, infer_logprobs=lp, mask=m)["mismatch/old_vs_rollout/rho_std"]
        == 0.0
    )
