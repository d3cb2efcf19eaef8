"""Where two records of the same tokens part ways: per layer and component, the size of the difference, the
router's disagreement, and the first place a difference exceeds the tolerance. Pure functions of two
:class:`~tim_megatron.align.capture.Capture` s.

Components are compared in the order a layer computes them: ``attention`` (the residual stream after attention),
``router`` (its logits, then the chosen expert sets), ``experts`` (the residual stream after a MoE block; ``mlp``
after a dense one). Then ``final_norm`` and ``head`` (the logprobs, positions after the first of each sequence).
The first divergence is the first of these, in that order, whose difference exceeds the tolerance, or, for the
router, whose expert set differs for any token. Every difference is judged by one rule, the head's logprobs
included: the max |diff| in units of the tensor's largest entry when that exceeds 1 (:attr:`Diff.scaled`). Judged in
raw nats, the head would be held to a stricter rule than the layers (a logprob of size 10 that differs by 1e-2 differs
by 1e-3 of its size) and blamed for a fault that every layer before it keeps within the tolerance.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from tim_megatron.align.capture import Capture


@dataclass(frozen=True)
class Diff:
    """The difference of one captured tensor between the two sides."""

    max_abs: float
    mean_abs: float
    relative: float
    """mean |a - b| / mean |b|: the difference against the size of what is compared."""
    scaled: float
    """max |a - b| / max(1, max |b|): the largest difference in units of the largest entry when that exceeds 1
    (a residual stream of size 50 carries fp32 rounding of about 5e-6). The tolerance applies to this, for every
    component and the head alike."""


@dataclass
class LayerDiff:
    layer: int
    attention: Diff
    block: Diff
    """The residual stream after the MLP or MoE block."""
    moe: bool
    router_logits: Diff | None = None
    topk_disagreement: float | None = None
    """Share of (token, slot) expert choices that differ: 1 - |A ∩ B| / k, averaged over tokens."""
    expert_set_differs: float | None = None
    """Share of tokens whose expert set differs."""
    gate_max_abs: float | None = None
    """max |gate_a - gate_b| over the tokens whose expert sets agree (None when no set agrees)."""


@dataclass
class Alignment:
    """The comparison of two sides on the same tokens."""

    sides: tuple[str, str]
    tolerance: float
    tokens: int
    layers: list[LayerDiff]
    final_norm: Diff
    head: Diff
    tokens_differing_any_layer: float | None
    """Share of tokens whose expert set differs in at least one MoE layer (None for a dense model)."""
    first_divergence: dict | None = None
    """``{"layer": i or None, "component": ...}`` of the first difference above tolerance; None when none is."""
    notes: list[str] = field(default_factory=list)
    others: dict[str, dict] = field(default_factory=dict)
    """Comparisons that explain this one, by name (``before_fault``: the engine before a planted fault;
    ``without_replay``: the trainer routing itself under R3), each as :meth:`as_dict` gives it."""
    tolerance_from: dict | None = None
    """How the tolerance was chosen (:class:`~tim_megatron.align.floor.Tolerance` as a dict: given, float32's, or
    a multiple of the floor measured on this machine), as :func:`~tim_megatron.align.run.align` chose it; None
    from a caller that judged with its own number."""

    def as_dict(self) -> dict:
        return asdict(self)


def diff(a: torch.Tensor, b: torch.Tensor) -> Diff:
    d = (a.double() - b.double()).abs()
    if not d.numel():
        return Diff(0.0, 0.0, 0.0, 0.0)
    scale = b.double().abs().mean().item()
    mean, top = d.mean().item(), d.max().item()
    return Diff(
        max_abs=top,
        mean_abs=mean,
        relative=mean / scale if scale > 0 else (0.0 if mean == 0 else float("inf")),
        scaled=top / max(1.0, b.double().abs().max().item()),
    )


def _over(x: float, tolerance: float) -> bool:
    """Above the tolerance; a NaN (a side that produced NaN) counts as above."""
    return not x <= tolerance


def router_agreement(ids_a: torch.Tensor, ids_b: torch.Tensor, gates_a: torch.Tensor, gates_b: torch.Tensor):
    """(top-k disagreement, share of tokens whose set differs, max gate difference where the sets agree, per-token
    set-differs mask). Ids ascending within each row on both sides (:func:`~tim_megatron.align.capture.sorted_topk`)."""
    k = ids_a.shape[-1]
    common = (ids_a[:, :, None] == ids_b[:, None, :]).any(-1).sum(-1)  # |A ∩ B| per token
    differs = (ids_a != ids_b).any(-1)
    same = ~differs
    gate = (gates_a[same].double() - gates_b[same].double()).abs().max().item() if same.any() else None
    disagreement = (1 - common.double() / k).mean().item() if len(common) else 0.0
    return disagreement, differs.double().mean().item() if len(differs) else 0.0, gate, differs


def _head_rows(lengths: list[int]) -> torch.Tensor:
    """Rows that carry a logprob: every position after the first of its sequence."""
    keep = []
    for n in lengths:
        keep += [False] + [True] * (n - 1)
    return torch.tensor(keep, dtype=torch.bool)


def last_rows(lengths: list[int]) -> torch.Tensor:
    """Each sequence's last row: under routing replay the trainer routes it to a placeholder set (its output feeds
    no logprob of the sequence), so a comparison with replay leaves it out."""
    last = torch.zeros(sum(lengths), dtype=torch.bool)
    last[torch.tensor(lengths).cumsum(0) - 1] = True
    return last


def compare(a: Capture, b: Capture, *, tolerance: float, skip_last: bool = False) -> Alignment:
    """Every captured tensor of ``a`` against ``b`` (same sequences), and the first divergence. ``skip_last``:
    leave each sequence's last row out of the per-layer and final-norm figures (see :func:`last_rows`)."""
    if a.lengths != b.lengths:
        raise ValueError(
            f"tim align: the two sides saw different sequences ({a.lengths} vs {b.lengths} tokens)"
        )
    if a.num_layers != b.num_layers:
        raise ValueError(f"tim align: {a.side} has {a.num_layers} layers and {b.side} {b.num_layers}")
    keep = ~last_rows(a.lengths) if skip_last else torch.ones(sum(a.lengths), dtype=torch.bool)

    def get(c: Capture, component: str, layer: int = 0) -> torch.Tensor | None:
        t = c.get(component, layer)
        return None if t is None else t[keep]

    layers, first, any_differs = [], None, None
    for i in range(a.num_layers):
        att = diff(get(a, "attention", i), get(b, "attention", i))
        block = diff(get(a, "mlp", i), get(b, "mlp", i))
        moe = a.get("topk", i) is not None
        if moe != (b.get("topk", i) is not None):
            routed = a.side if moe else b.side
            raise ValueError(
                f"tim align: layer {i} is a MoE layer for {routed} only (the other side recorded no router there)"
            )
        ld = LayerDiff(layer=i, attention=att, block=block, moe=moe)
        order = [("attention", _over(att.scaled, tolerance))]
        if moe:
            ld.router_logits = diff(get(a, "router_logits", i), get(b, "router_logits", i))
            ld.topk_disagreement, ld.expert_set_differs, ld.gate_max_abs, differs = router_agreement(
                get(a, "topk", i), get(b, "topk", i), get(a, "gates", i), get(b, "gates", i)
            )
            any_differs = differs if any_differs is None else any_differs | differs
            router_off = _over(ld.router_logits.scaled, tolerance) or bool(differs.any())
            order.append(("router", router_off))
        order.append(("experts" if moe else "mlp", _over(block.scaled, tolerance)))
        if first is None:
            first = next(({"layer": i, "component": c} for c, off in order if off), None)
        layers.append(ld)
    norm = diff(get(a, "final_norm"), get(b, "final_norm"))
    rows = _head_rows(a.lengths)
    head = diff(a.get("logprobs")[rows], b.get("logprobs")[rows])
    if first is None:
        first = next(
            (
                {"layer": None, "component": c}
                for c, off in (
                    ("final_norm", _over(norm.scaled, tolerance)),
                    ("head", _over(head.scaled, tolerance)),
                )
                if off
            ),
            None,
        )
    return Alignment(
        sides=(a.side, b.side),
        tolerance=tolerance,
        tokens=int(keep.sum()),
        layers=layers,
        final_norm=norm,
        head=head,
        tokens_differing_any_layer=None if any_differs is None else any_differs.double().mean().item(),
        first_divergence=first,
    )


def judged(al: Alignment) -> dict[str, float]:
    """Every difference the tolerance judges (:attr:`Diff.scaled`), by place, in the order a forward computes them:
    ``layer i, attention``, ``layer i, router logits``, ``layer i, experts`` (or ``mlp``), ``final norm``, ``head``."""
    out: dict[str, float] = {}
    for ld in al.layers:
        out[f"layer {ld.layer}, attention"] = ld.attention.scaled
        if ld.router_logits is not None:
            out[f"layer {ld.layer}, router logits"] = ld.router_logits.scaled
        out[f"layer {ld.layer}, {'experts' if ld.moe else 'mlp'}"] = ld.block.scaled
    out["final norm"] = al.final_norm.scaled
    out["head"] = al.head.scaled
    return out
