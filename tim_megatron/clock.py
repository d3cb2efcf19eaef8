"""Wall-clock times as the project records them: UTC with its offset, read back as absolute instants.

Every time written into a run folder (``run.json``'s ``created``, ``updated``, ``at``; ``lab.json``; ``run.lock``)
is :func:`stamp`: ISO 8601 in UTC with the offset spelled out (``2026-12-03T10:16:25+00:00``), so that it means
the same instant wherever it is read. :func:`epoch_of` reads it back, and also reads the older zone-less form
(``2026-11-28T04:14:03``, written before times carried their zone) **as UTC**: the machines those folders were
written on ran in UTC, and the reader's own time zone never enters. :func:`shown` prints an instant in UTC, named.
"""

from __future__ import annotations

from datetime import UTC, datetime

LEGACY_FORMAT = "%Y-%m-%dT%H:%M:%S"
"""The zone-less form older run folders hold; read as UTC (see the module docstring)."""


def stamp(epoch: float | None = None) -> str:
    """Now (or ``epoch``) in UTC with its offset, to the second: ``2026-12-03T10:16:25+00:00``."""
    when = datetime.now(UTC) if epoch is None else datetime.fromtimestamp(epoch, UTC)
    return when.isoformat(timespec="seconds")


def epoch_of(value: object) -> float | None:
    """A recorded time as epoch seconds: an ISO 8601 time with an offset as written, a zone-less one as UTC;
    None for anything else (not a string, not a time, outside years 1970-9999)."""
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    try:
        epoch = when.timestamp()
    except (OverflowError, OSError, ValueError):
        return None
    return epoch if epoch >= 0 else None


def shown(epoch: float) -> str:
    """``epoch`` as ``2026-11-28 04:14 UTC``, whatever the reader's time zone."""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M UTC")
