"""The ``moe layer`` section's profile of one model: ours and the bare megatron-core step on the same trainer and
tokens, phase by phase, kernel class by kernel class, and (at one layer) without each lever of issue 57.

* phases (:mod:`~tim_megatron.gpu_check.phases`): the median over ``repeat`` steps of each, ours and bare
  interleaved, and how much of the step (timed on its own) the named phases cover;
* one step of each under ``torch.profiler`` (:mod:`~tim_megatron.gpu_check.profile`): the kernel classes, the
  backward's costliest autograd nodes, the GPU's idle share;
* one step of each with ``torch.cuda.set_sync_debug_mode`` on and the allocator's peak read at every phase boundary:
  host syncs and peak memory per phase (CUDA only);
* the levers (:mod:`~tim_megatron.gpu_check.levers`) that switch on the built trainer, each off alone against the
  trainer with all of them on, interleaved; those that need another build are returned for the caller.

CPU figures come out of the same code at small sizes; they test the path and are not GPU results.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tim_megatron.gpu_check.kernel_classes import CLASSES
from tim_megatron.gpu_check.levers import LEVERS, Lever
from tim_megatron.gpu_check.phases import (
    OTHER,
    PHASES,
    PhaseClock,
    clocked,
    instrumented,
    loss_marked,
    medians,
)
from tim_megatron.gpu_check.profile import KernelSplit, profile_step, top_nodes
from tim_megatron.gpu_check.report import finding
from tim_megatron.outcome import Outcome

COVERAGE_MIN = 0.85
"""The named phases must cover at least this share of the step timed on its own (the rest is ``other``)."""
TOP_NODES = 6
"""Autograd node kinds listed per step."""
GIB = 2**30


@dataclass
class Profiled:
    """One model's profile, for the per-layer differences (the 2-layer model's less the 1-layer one's)."""

    ours: dict[str, float] = field(default_factory=dict)
    """Median seconds per phase of our step, and ``step``."""
    bare: dict[str, float] = field(default_factory=dict)
    split_ours: KernelSplit | None = None
    split_bare: KernelSplit | None = None
    rebuild: list[Lever] = field(default_factory=list)
    """Levers that need a trainer built otherwise (measured by the caller after this trainer is closed)."""


def ms(seconds: float) -> float:
    return seconds * 1e3


def fwd_bwd(phases: dict[str, float]) -> float:
    """Forward, head + loss and backward: the step's part that the model's layers scale."""
    return phases["forward"] + phases["head + loss"] + phases["backward"]


def apply_as_on_cuda(trainer) -> list[str]:
    """On CPU, what the trainer applies on CUDA and not on CPU, so that the CPU run takes the GPU's path: the
    sync-free grad norm (``patches/megatron/sync_free_grad_norm.py``, where megatron bound its local fallback). Its
    handle joins the trainer's (reverted at close). Returns what was applied."""
    import torch

    from patches.megatron import sync_free_grad_norm

    if torch.cuda.is_available():
        return []
    names = [getattr(h, "name", None) for h in trainer._handles]
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if (
        sync_free_grad_norm.SPEC.name in names
        or clip_grads.l2_norm_impl is not utils.local_multi_tensor_l2_norm
    ):
        return []
    trainer._handles.append(sync_free_grad_norm.apply())
    return [sync_free_grad_norm.SPEC.name]


def covered(run: dict[str, float]) -> float:
    """The share of a step (timed alone) its named phases cover."""
    return sum(run[p] for p in PHASES) / run["step"] if run["step"] > 0 else 0.0


def phase_findings(section: str, ours: dict[str, float], bare: dict[str, float]) -> list[Outcome]:
    out = []
    for p in (*PHASES, OTHER):
        out.append(
            finding(section, f"phase {p}: ours", ms(ours[p]), "ms", "info", f"bare {ms(bare[p]):.3f} ms")
        )
    for who, d in (("ours", ours), ("bare", bare)):
        share = d["covered"]
        out.append(
            finding(
                section,
                f"named phases / {who} step ({ms(d['step']):.2f} ms, timed alone; median)",
                share,
                "x",
                "ok" if COVERAGE_MIN <= share <= 1.0 + (1.0 - COVERAGE_MIN) else "warn",
                f"the phases explain the step: within {COVERAGE_MIN:g}..{2 - COVERAGE_MIN:g}",
            )
        )
    return out


def split_findings(section: str, ours: KernelSplit, bare: KernelSplit, *, cuda: bool) -> list[Outcome]:
    what = "device time" if cuda else "CPU self time"
    out = [
        finding(
            section,
            f"kernels {c}: ours",
            ms(ours.seconds[c]),
            "ms",
            "info",
            f"bare {ms(bare.seconds[c]):.3f} ms",
        )
        for c in CLASSES
    ]
    out.append(
        finding(
            section,
            f"kernels, all ({what}): ours",
            ms(ours.total),
            "ms",
            "info",
            f"bare {ms(bare.total):.3f} ms",
        )
    )
    if cuda:
        out.append(
            finding(
                section,
                "GPU idle share of the profiled step: ours",
                ours.idle_share,
                "",
                "info",
                f"bare {bare.idle_share:.3f}; under the profiler (an upper bound)",
            )
        )
    else:
        out.append(finding(section, "GPU idle share", None, "", "skip", "n/a on CPU"))
    for who, split in (("ours", ours), ("bare", bare)):
        nodes = top_nodes(split, TOP_NODES)
        listed = "; ".join(f"{n} x{c} {ms(s):.2f} ms" for n, s, c in nodes)
        total = sum(split.nodes.values())
        out.append(
            finding(
                section,
                f"backward by autograd node, {who}: {sum(split.node_counts.values())} nodes",
                ms(total),
                "ms",
                "info",
                f"AccumulateGrad x{split.node_counts.get('torch::autograd::AccumulateGrad', 0)}; " + listed,
            )
        )
    return out


def syncs_and_memory(section: str, parts, *, cuda: bool) -> list[Outcome]:
    """Host syncs per phase and peak memory per phase, ours and bare (CUDA; CPU: said n/a)."""
    if not cuda:
        return [
            finding(
                section,
                "host syncs per step",
                None,
                "",
                "skip",
                "n/a on CPU (torch.cuda.set_sync_debug_mode)",
            ),
            finding(
                section, "peak memory per phase", None, "", "skip", "n/a on CPU (the CUDA allocator's peaks)"
            ),
        ]
    tr = parts.trainer
    out = []
    for who in ("ours", "bare"):
        clock = PhaseClock(cuda=True, memory=True)

        def counted(clock=clock, who=who):
            with clock.counting_syncs():
                parts.ours(loss_marked(clock, parts.loss_fn)) if who == "ours" else parts.bare()

        with instrumented(tr, clock):
            clocked(clock, counted)
        per = ", ".join(f"{p} {n}" for p, n in clock.syncs.items() if n)
        out.append(
            finding(
                section,
                f"host syncs per step: {who}",
                float(sum(clock.syncs.values())),
                "",
                "info",
                per or "none",
            )
        )
        peaks = ", ".join(f"{p} {b / GIB:.2f}" for p, b in clock.peaks.items())
        top = max(clock.peaks.values(), default=0.0)
        out.append(
            finding(section, f"peak memory per phase: {who}", top / GIB, "GiB", "info", f"GiB: {peaks}")
        )
    return out


def lever_findings(section: str, parts, *, cuda: bool, repeat: int) -> tuple[list[Outcome], list[Lever]]:
    """Each lever that switches on the trainer, off alone against all on (interleaved medians); the levers that need
    a rebuild, returned."""
    tr = parts.trainer
    out, rebuild = [], []
    clock = PhaseClock(cuda=cuda)
    with instrumented(tr, clock):

        def ours() -> dict[str, float]:
            return clocked(clock, lambda: parts.ours(loss_marked(clock, parts.loss_fn)))

        for lever in LEVERS:
            label = f"lever {lever.item}: {lever.name}"
            why = lever.available(tr)
            if why:
                out.append(finding(section, label, None, "", "skip", why))
                continue
            if lever.off is None:
                rebuild.append(lever)
                continue
            on, off = [], []
            with lever.off(tr):
                ours()  # warm: the old path's first step allocates what it needs
            for _ in range(repeat):
                on.append(ours())
                with lever.off(tr):
                    off.append(ours())
            out.append(lever_finding(section, lever, medians(on), medians(off)))
            if lever.item == 6:  # trainer.compile: also its seconds and its numbers
                out += compile_findings(section, parts)
    return out, rebuild


def lever_finding(section: str, lever: Lever, on: dict[str, float], off: dict[str, float]) -> Outcome:
    p = lever.phase
    return finding(
        section,
        f"lever {lever.item}: {lever.name}: step off / on",
        off["step"] / on["step"] if on["step"] > 0 else None,
        "x",
        "info",
        f"step {ms(on['step']):.2f} -> {ms(off['step']):.2f} ms; {p} {ms(on[p]):.3f} -> {ms(off[p]):.3f} ms",
    )


def compile_findings(section: str, parts) -> list[Outcome]:
    """What ``trainer.compile`` compiled, dynamo's compile seconds since the trainer was built, and the logprobs
    compiled against eager."""
    tr = parts.trainer
    compiled = tr.logprobs(parts.batch)[0].logprobs
    tr.compiled.disable()
    try:
        eager = tr.logprobs(parts.batch)[0].logprobs
    finally:
        tr.compiled.enable()
    return [
        finding(
            section,
            "compile: dynamo's seconds since the trainer's build",
            tr.compiled.seconds(),
            "s",
            "info",
            tr.compiled.functions,
        ),
        finding(
            section,
            "compile: logprobs compiled vs eager, max |dlogp|",
            float((compiled - eager).abs().max()),
            "nats",
            "info",
            "fused kernels round otherwise than eager ones (never in exact mode)",
        ),
    ]


def profile_model(
    parts, *, section: str, cuda: bool, repeat: int, levers: bool, lever_repeat: int | None = None
) -> tuple[list[Outcome], Profiled]:
    """The profile of the module docstring on :func:`~tim_megatron.gpu_check.sections.train_step`'s trainer."""
    tr = parts.trainer
    out = []
    applied = apply_as_on_cuda(tr)
    if applied:
        out.append(finding(section, "applied as on CUDA", None, "", "info", ", ".join(applied)))
    res = Profiled()
    clock = PhaseClock(cuda=cuda)
    runs_o, runs_b = [], []
    with instrumented(tr, clock):

        def ours():
            return clocked(clock, lambda: parts.ours(loss_marked(clock, parts.loss_fn)))

        ours(), clocked(clock, parts.bare)  # warm, with the hooks in place
        for _ in range(repeat):
            runs_o.append(ours())
            runs_b.append(clocked(clock, parts.bare))
    for run in (*runs_o, *runs_b):
        run["covered"] = covered(run)
    res.ours, res.bare = medians(runs_o), medians(runs_b)
    out += phase_findings(section, res.ours, res.bare)
    res.split_ours = profile_step(parts.ours, cuda=cuda)
    res.split_bare = profile_step(parts.bare, cuda=cuda)
    out += split_findings(section, res.split_ours, res.split_bare, cuda=cuda)
    out += syncs_and_memory(section, parts, cuda=cuda)
    if levers:
        found, res.rebuild = lever_findings(section, parts, cuda=cuda, repeat=lever_repeat or repeat)
        out += found
    return out, res
