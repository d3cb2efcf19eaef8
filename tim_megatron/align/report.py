"""What ``tim align`` writes: ``align.json`` (every figure), ``align.txt`` (the table it prints) and ``align.png``
(max |diff| against layer, one line per component).

The output folder may be a run folder from elsewhere (``RUN/align``, as a failed sync check suggests): each file is
replaced by an atomic rename of a fresh temporary file (:func:`~tim_megatron.safe_files.write_atomic`), so a link
planted there is replaced, never written through."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from tim_megatron.align.compare import Alignment
from tim_megatron.align.floor import Tolerance
from tim_megatron.outcome import json_number
from tim_megatron.safe_files import describe, save_figure, write_atomic

FLOOR = 1e-12
"""Where an exact zero is drawn on the plot's log axis."""


def _g(x: float | None) -> str:
    if x is None:
        return "-"
    return "0" if x == 0 else f"{x:.2e}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def where(al: Alignment) -> str:
    """The first divergence in words."""
    return _where({"first_divergence": al.first_divergence, "tolerance": al.tolerance})


def text(al: Alignment, *, sequences: int) -> str:
    a, b = al.sides
    lines = [
        f"tim align: {a} vs {b}, {sequences} sequences, {al.tokens} tokens, tolerance {al.tolerance:.3g}",
        f"  {'layer':>5}  {'attention':>9}  {'router':>9}  {'block':>9}  {'rel':>8}  "
        f"{'top-k':>6}  {'set':>6}  {'gate':>9}",
    ]
    if al.tolerance_from is not None:
        lines.insert(1, f"  {Tolerance(**al.tolerance_from).describe()}")
    for ld in al.layers:
        rl = ld.router_logits.max_abs if ld.router_logits else None
        lines.append(
            f"  {ld.layer:>5}  {_g(ld.attention.max_abs):>9}  {_g(rl):>9}  {_g(ld.block.max_abs):>9}  "
            f"{_g(ld.block.relative):>8}  {_pct(ld.topk_disagreement):>6}  {_pct(ld.expert_set_differs):>6}  "
            f"{_g(ld.gate_max_abs):>9}"
        )
    lines += [
        f"  final norm {_g(al.final_norm.max_abs)}, head |dlogp| max {_g(al.head.max_abs)} "
        f"mean {_g(al.head.mean_abs)} (judged {_g(al.head.scaled)})",
        "  columns: attention, router (logits) and block (after the MLP/MoE) are max |diff| of the residual "
        "stream / logits; rel: the block's mean |diff| / mean |value|; top-k: expert choices that differ; set: "
        "tokens whose expert set differs; gate: max gating-weight diff where the sets agree. Diverged: max |diff| "
        "/ max(1, max |value|) above the tolerance (the head's |dlogp| too), or an expert set differs",
        f"  tokens whose expert set differs in at least one layer: {_pct(al.tokens_differing_any_layer)}",
        f"  first divergence: {where(al)}",
    ]
    for name, other in al.others.items():
        label = {"before_fault": "before the planted fault", "without_replay": "without replay (own routing)"}
        lines.append(
            f"  {label.get(name, name)}: expert sets differ for {_pct(other['tokens_differing_any_layer'])} of "
            f"tokens in at least one layer; first divergence: {_where(other)}"
        )
    lines += [f"  note: {n}" for n in al.notes]
    return "\n".join(lines)


def _where(d: dict) -> str:
    f = d["first_divergence"]
    if f is None:
        return f"none: every layer within {d['tolerance']:g}"
    return f"{'layer ' + str(f['layer']) if f['layer'] is not None else 'after the last layer'}, {f['component']}"


def plot(al: Alignment, path: Path) -> Path:
    """The judged difference against layer, one line per component (max |diff| / max(1, max |value|); log scale,
    exact zeros drawn at 1e-12), the tolerance dashed; the final norm and the head (|dlogp| / max(1, max |logp|)) as
    points after the last layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [ld.layer for ld in al.layers]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    series = {
        "attention": [ld.attention.scaled for ld in al.layers],
        "router logits": [ld.router_logits.scaled if ld.router_logits else math.nan for ld in al.layers],
        "experts / mlp": [ld.block.scaled for ld in al.layers],
    }
    for name, ys in series.items():
        ax.plot(xs, [max(y, FLOOR) if not math.isnan(y) else y for y in ys], marker="o", label=name)
    end = len(xs)
    ax.scatter([end], [max(al.final_norm.scaled, FLOOR)], marker="s", color="tab:purple", label="final norm")
    ax.scatter([end + 1], [max(al.head.scaled, FLOOR)], marker="^", color="tab:red", label="head (logprobs)")
    ax.set_xticks([*xs, end, end + 1], [*map(str, xs), "norm", "head"])
    ax.axhline(al.tolerance, linestyle="--", color="grey", linewidth=1, label=f"tolerance {al.tolerance:g}")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("max |diff| / max(1, max |value|)", fontsize=8)
    ax.set_title(f"{al.sides[0]} vs {al.sides[1]}: first divergence {where(al)}", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    try:
        save_figure(fig, path, root=path.parent, dpi=110)
    finally:
        plt.close(fig)
    return path


def _finite(x):
    """JSON has no NaN or infinity: such figures are written as strings ("nan", "inf")."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return json_number(x) if isinstance(x, float) else x


def check_out(out: Path) -> Path:
    """``out`` as a folder ``tim align`` can write its files in: created if missing, never a link, a file or a
    special file; a file is created and removed in it to prove it (a mode check misses read-only mounts, and root).
    Raises ``ValueError`` naming ``--out``, what it is and what is allowed."""
    import tempfile

    out = Path(out)
    allowed = "allowed: a folder this user can write in (created if missing), not a link"
    try:
        kind = describe(out)
    except OSError as e:  # a parent that is a file
        raise ValueError(f"--out {out}: cannot be created ({e.strerror or e}); {allowed}") from None
    if kind not in ("missing", "a folder"):
        raise ValueError(f"--out {out} is {kind}; {allowed}")
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".tim-align-probe.", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write in it ({e.strerror or e}); {allowed}") from None
    if describe(out) != "a folder":  # swapped for a link meanwhile
        raise ValueError(f"--out {out} is {describe(out)}; {allowed}")
    return out


def write(al: Alignment, out: Path, *, sequences: int, meta: dict) -> dict[str, Path]:
    """``align.json``, ``align.txt`` and ``align.png`` in ``out`` (:func:`check_out`); each written whole, then
    renamed over whatever was there."""
    out = check_out(out)
    body = _finite(
        {"schema": "tim-align/1", **meta, "sequences": sequences, **al.as_dict(), "where": where(al)}
    )
    files = {"json": out / "align.json", "text": out / "align.txt", "plot": out / "align.png"}
    write_atomic(files["json"], json.dumps(body, indent=1), root=out, what="align.json")
    write_atomic(files["text"], text(al, sequences=sequences) + "\n", root=out, what="align.txt")
    plot(al, files["plot"])
    return files
