"""What ``make gpu-check`` found: one :class:`~tim_megatron.outcome.Outcome` per measured figure (its ``group``
is the section), gathered in a :class:`Report` that prints as a table and saves as JSON (with the date, the
device and every library version).

The saved JSON keeps the layout reports had before the outcome type was shared (``docs/gpu-results/*.json``):
each finding is ``{"section", "name", "value", "unit", "verdict", "rule"}``, with the verdict ``pass`` where
the outcome is ``ok`` (:func:`record`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tim_megatron import outcome
from tim_megatron.outcome import Outcome, Status

_VERDICT = {"ok": "pass"}
"""The word the table and the JSON show for a status, where it differs from the status itself."""


def finding(
    section: str,
    name: str,
    value: float | None = None,
    unit: str = "",
    status: Status = "info",
    rule: str = "",
) -> Outcome:
    """One gpu-check figure: an :class:`Outcome` in ``section`` (its ``group``)."""
    return Outcome(name, status, value=value, unit=unit, rule=rule, group=section)


def verdict(o: Outcome) -> str:
    """What the verdict column and the JSON say: ``pass`` for ``ok``, else the status."""
    return _VERDICT.get(o.status, o.status)


def record(o: Outcome) -> dict:
    """One finding as it is saved: the keys and values of the reports written before :class:`Outcome`."""
    return {
        "section": o.group,
        "name": o.name,
        "value": outcome.json_number(o.value),
        "unit": o.unit,
        "verdict": verdict(o),
        "rule": o.rule,
    }


def row(o: Outcome) -> str:
    """One finding as a line of the table (without the rule)."""
    return f"  {o.group:<18} {o.name:<52} {outcome.format_value(o.value, o.unit):>12}  {verdict(o)}"


@dataclass
class Report:
    date: str
    device: str
    """The GPU model and memory, or ``cpu`` for a run of the code path on CPU (not GPU figures)."""
    versions: dict[str, str]
    findings: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0
    limit_seconds: float = 600.0

    @property
    def failed(self) -> list[Outcome]:
        return outcome.failed(self.findings)

    @property
    def exit_code(self) -> int:
        return outcome.exit_code(self.findings)

    def text(self) -> str:
        lines = [
            f"make gpu-check, {self.date}: {self.device}",
            "  " + ", ".join(f"{k} {v}" for k, v in self.versions.items()),
            f"  {'section':<18} {'measurement':<52} {'value':>12}  verdict",
        ]
        for f in self.findings:
            lines.append(row(f) + (f" ({f.rule})" if f.rule else ""))
        n = outcome.counts(self.findings)
        warn = f", {n['warn']} warn" if n["warn"] else ""
        within = "within" if self.seconds <= self.limit_seconds else "OVER"
        lines.append(
            f"  {n['ok']} pass, {n['fail']} fail{warn}, {n['info']} info, {n['skip']} skipped; "
            f"{self.seconds:.0f} s ({within} the {self.limit_seconds:.0f} s budget)"
        )
        return "\n".join(lines)

    def to_json(self) -> dict:
        d = asdict(self)
        d["findings"] = [record(f) for f in self.findings]
        return d

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(path)
        return path


NO_GPU = (
    "make gpu-check: no CUDA GPU here (torch.cuda.is_available() is False), so nothing was measured.\n"
    "Run it on a machine with one NVIDIA GPU (make setup EXTRA=gpu first); the CPU path is covered by make test."
)
