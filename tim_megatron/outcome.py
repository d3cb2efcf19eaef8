"""One result type for every tool that checks or measures something: ``tim doctor``, ``tim preflight``,
``make gpu-check`` and ``make bench`` each report a list of :class:`Outcome`.

An outcome says what was looked at (``name``, within a ``group``), whether it is fine (``status``), what was
found (``detail``, and the figure with its unit and the rule that judged it), and what to do when it is not fine
(``fix``). Each tool keeps its own layout on screen and its own JSON keys (:func:`as_record` maps them), so files
written before the type was shared still read the same.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import KW_ONLY, dataclass
from typing import Literal

Status = Literal["ok", "warn", "fail", "info", "skip"]
STATUSES: tuple[Status, ...] = ("ok", "warn", "fail", "info", "skip")


@dataclass(frozen=True)
class Outcome:
    """One thing a tool checked or measured, and its verdict."""

    name: str
    """What was checked or measured (``python``, ``megatron fp32 vs HF fp32, max |dlogp|``, ``ratio ours / bare``)."""
    status: Status
    """``ok`` (met), ``warn`` (works, but look), ``fail`` (not met: the tool's exit code says so), ``info`` (a figure
    reported, not judged), ``skip`` (not measured here; ``rule`` says why)."""
    detail: str = ""
    """What was found, in words."""
    fix: str = ""
    """What to do about a warn or a fail."""
    _: KW_ONLY
    value: float | None = None
    """The measured figure, when there is one."""
    unit: str = ""
    """The figure's unit (``s``, ``GiB``, ``x``, ``nats``)."""
    rule: str = ""
    """The rule the status applies (``<= 1.1x``), or why nothing was measured."""
    group: str = ""
    """The part of the tool it belongs to (a gpu-check section, a bench, a preflight topic)."""
    more: tuple[str, ...] = ()
    """Further lines shown indented under this one (the plan's table in ``tim doctor``)."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"Outcome.status = {self.status!r}: allowed {', '.join(STATUSES)}")


def judged(
    name: str, *, value: float, met: bool, rule: str, unit: str = "", group: str = "", fix: str = ""
) -> Outcome:
    """A figure against its target: ``ok`` when ``met``, else ``fail``."""
    return Outcome(
        name, "ok" if met else "fail", value=value, unit=unit, rule=rule, group=group, fix="" if met else fix
    )


def failed(outcomes: Iterable[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if o.status == "fail"]


def exit_code(outcomes: Iterable[Outcome]) -> int:
    """1 when anything failed, else 0: the exit code of every tool that reports outcomes."""
    return 1 if failed(outcomes) else 0


def counts(outcomes: Iterable[Outcome]) -> dict[str, int]:
    """How many of each status, every status present (zero where none)."""
    out = dict.fromkeys(STATUSES, 0)
    for o in outcomes:
        out[o.status] += 1
    return out


def format_value(value: float | None, unit: str) -> str:
    """A figure for a table: ``-`` when absent, a few significant digits, the unit after it."""
    if value is None:
        return "-"
    if unit in ("GiB", "s", "x"):
        text = f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    elif value == 0 or 1e-3 <= abs(value) < 1e4:
        text = f"{value:.4g}"
    else:
        text = f"{value:.2e}"
    return f"{text} {unit}".strip()


def target_line(o: Outcome) -> str:
    """A bench's line for a figure and its target: ``ratio ours / bare = 1.02x  (target <= 1.10x: met)``."""
    shown = format_value(o.value, o.unit)
    if o.unit in ("x", "%") or o.unit.startswith("% "):
        shown = shown.replace(f" {o.unit[0]}", o.unit[0], 1)  # 1.02x, 0.41%
    met = {"ok": "met", "fail": "MISSED"}.get(o.status, o.status)
    target = f"  (target {o.rule}: {met})" if o.rule else ""
    return f"{o.name} = {shown}{target}"


def json_number(v: float | None):
    """A figure as JSON: NaN and infinities become strings (JSON has no such numbers)."""
    if v is None or math.isfinite(v):
        return v
    return str(v)
