"""What ``make gpu-check`` found: one :class:`Finding` per measured figure, gathered in a :class:`Report`
that prints as a table and saves as JSON (with the date, the device and every library version)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

Verdict = Literal["pass", "fail", "info", "skip"]


@dataclass(frozen=True)
class Finding:
    section: str
    """Which part of the check (``parity tiny``, ``step time``, ``vllm sleep/wake``...)."""
    name: str
    """What was measured."""
    value: float | None
    """The figure (None when skipped or when the section failed before measuring)."""
    unit: str = ""
    verdict: Verdict = "info"
    rule: str = ""
    """The rule the verdict applies (``<= 1e-3``), or why the section was skipped or failed."""


@dataclass
class Report:
    date: str
    device: str
    """The GPU model and memory, or ``cpu`` for a run of the code path on CPU (not GPU figures)."""
    versions: dict[str, str]
    findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0
    limit_seconds: float = 600.0

    @property
    def failed(self) -> list[Finding]:
        return [f for f in self.findings if f.verdict == "fail"]

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    def text(self) -> str:
        lines = [
            f"make gpu-check, {self.date}: {self.device}",
            "  " + ", ".join(f"{k} {v}" for k, v in self.versions.items()),
            f"  {'section':<18} {'measurement':<52} {'value':>12}  verdict",
        ]
        for f in self.findings:
            lines.append(
                f"  {f.section:<18} {f.name:<52} {format_value(f.value, f.unit):>12}  {f.verdict}"
                + (f" ({f.rule})" if f.rule else "")
            )
        n = {v: sum(f.verdict == v for f in self.findings) for v in ("pass", "fail", "info", "skip")}
        within = "within" if self.seconds <= self.limit_seconds else "OVER"
        lines.append(
            f"  {n['pass']} pass, {n['fail']} fail, {n['info']} info, {n['skip']} skipped; "
            f"{self.seconds:.0f} s ({within} the {self.limit_seconds:.0f} s budget)"
        )
        return "\n".join(lines)

    def to_json(self) -> dict:
        d = asdict(self)
        d["findings"] = [{**asdict(f), "value": _json_number(f.value)} for f in self.findings]
        return d

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(path)
        return path


def format_value(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit in ("GiB", "s", "x"):
        text = f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    elif value == 0 or 1e-3 <= abs(value) < 1e4:
        text = f"{value:.4g}"
    else:
        text = f"{value:.2e}"
    return f"{text} {unit}".strip()


def _json_number(v: float | None):
    if v is None or math.isfinite(v):
        return v
    return str(v)


NO_GPU = (
    "make gpu-check: no CUDA GPU here (torch.cuda.is_available() is False), so nothing was measured.\n"
    "Run it on a machine with one NVIDIA GPU (make setup EXTRA=gpu first); the CPU path is covered by make test."
)
