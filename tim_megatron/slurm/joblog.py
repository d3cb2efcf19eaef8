"""The end of a job's Slurm log, read back from its run folder for ``tim logs``, whatever it holds.

A job's log (``logs/slurm-JOB.out``) holds whatever the job's processes wrote: C libraries, crash dumps, progress
bars, and text quoted from recipes, data and run folders. It is read only when it is a regular file inside the
run folder, reached through no link (a FIFO, a device such as ``/dev/zero`` or a link there is refused by name, in
one line; :mod:`tim_megatron.safe_files` holds the rule); its tail is read from its end in chunks, at most
:data:`MAX_TAIL_BYTES` (a 3 GB log, sparse or not, costs a few MiB), and decoded as UTF-8 with every byte that is
not replaced by U+FFFD. The run folder is found through the run.json files that record the job
(:func:`tim_megatron.slurm.submit.find_run`, which reads them with :mod:`tim_megatron.slurm.run_record`).

What ``tim logs`` prints: the log is the job's own output, but a terminal acts on escape sequences in it (an OSC
title, a clear-screen, an OSC 8 link, U+202E, a C1 CSI), and they may come from any text the job printed. So every
control or otherwise unprintable character but newline and tab is written escaped, as ``repr`` writes it
(``\\x1b``, ``\\r``, ``\\u202e``), whether or not stdout is a terminal: a pipe into a file, ``less -R`` or a later
``cat`` reaches a terminal too, and one rule makes the output the same everywhere. A run of :data:`NUL_RUN` or more
NUL bytes is shown as ``[... N NUL bytes ...]`` and a line longer than :data:`MAX_LINE_CHARS` characters is clipped
with ``[... N more characters ...]``, so the output is a few times the bytes read at most. What was not read is
said on stderr. The raw bytes stay in the log file for whoever needs them.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from tim_megatron.untrusted import printable, shown

MAX_TAIL_BYTES = 4 * 2**20
"""Most bytes ``tim logs`` reads from the end of a log, whatever ``--lines`` asks."""
CHUNK_BYTES = 64 * 2**10
"""Bytes read per step back from a log's end."""
MAX_LINE_CHARS = 4096
"""Characters of one log line shown; the rest of the line is left out and counted."""
NUL_RUN = 16
"""A run of at least this many NUL characters is shown as one ``[... N NUL bytes ...]`` (a sparse file's hole,
a crash's zeroed buffer)."""

_NULS = re.compile(f"\x00{{{NUL_RUN},}}")


class JobLogError(ValueError):
    """A job log ``tim logs`` cannot show; the message names the job or the file and why, escaped."""


def check_lines(lines: object) -> int:
    """``lines`` if it is a whole number >= 1; :class:`JobLogError` naming the value and what is allowed."""
    if isinstance(lines, bool) or not isinstance(lines, int) or lines < 1:
        raise JobLogError(
            f"--lines = {shown(lines)}: the number of lines from the end of the log to show; allowed: a whole "
            f"number >= 1 (at most the last {MAX_TAIL_BYTES // 2**20} MiB of the log are read)"
        )
    return lines


@dataclass(frozen=True)
class Tail:
    """The end of a file, as read: ``data`` starts at byte ``start`` of a file of ``size`` bytes."""

    data: bytes
    """The bytes read, in file order."""
    start: int
    """Offset of ``data``'s first byte in the file (0: the file is read from its start)."""
    size: int
    """The file's size when it was opened."""
    whole_first_line: bool
    """Whether ``data`` begins at the start of a line (the file's start, or just after a newline)."""


def read_tail(
    path: str | Path,
    *,
    lines: int,
    root: str | Path | None = None,
    max_bytes: int = MAX_TAIL_BYTES,
    chunk: int = CHUNK_BYTES,
) -> Tail:
    """The end of the regular file ``path`` (inside ``root`` when given, no link on the way): chunks read back from
    its end until they hold ``lines`` whole lines, reach its start, or reach ``max_bytes``. A link or special
    file is refused (:class:`~tim_megatron.safe_files.UnsafePathError`) before anything is read."""
    from tim_megatron.safe_files import open_regular

    with open_regular(path, root=root, what="job log") as f:
        size = os.fstat(f.fileno()).st_size
        pos, parts, got, newlines = size, [], 0, 0
        while pos > 0 and got < max_bytes and newlines <= lines:
            n = min(chunk, pos, max_bytes - got)
            pos -= n
            f.seek(pos)
            part = f.read(n)  # shorter only when the file shrank meanwhile
            parts.append(part)
            got += n
            newlines += part.count(b"\n")
        whole = pos == 0
        if not whole:
            f.seek(pos - 1)
            whole = f.read(1) == b"\n"
    return Tail(b"".join(reversed(parts)), pos, size, whole)


def clean_line(text: str, *, limit: int = MAX_LINE_CHARS) -> str:
    """One log line (no newline) as shown: NUL runs counted, clipped at ``limit`` characters, every control
    character but tab escaped."""
    text = _NULS.sub(lambda m: f"[... {len(m.group())} NUL bytes ...]", text)
    more = ""
    if len(text) > limit:
        more = f" [... {len(text) - limit} more characters ...]"
        text = text[:limit]
    return "\t".join(printable(part) for part in text.split("\t")) + more


def tail_lines(tail: Tail, lines: int) -> tuple[str, list[str]]:
    """The last ``lines`` lines of ``tail`` as printable text (:func:`clean_line` each; the file's last newline
    kept as it is), and notes on what was left out."""
    pieces = tail.data.split(b"\n")
    ends_with_newline = pieces[-1] == b""
    if ends_with_newline:
        pieces.pop()
    notes = []
    partial = False
    if len(pieces) > lines:
        pieces = pieces[-lines:]
    elif not tail.whole_first_line and pieces:
        partial = True
    if tail.start > 0 and len(pieces) < lines:
        notes.append(
            f"the log has {tail.size} bytes and at most its last {len(tail.data)} are read: they hold "
            f"{len(pieces)} of the {lines} lines asked"
            + (", the first of them cut at its start" if partial else "")
        )
    shown_lines = [clean_line(p.decode("utf-8", "replace")) for p in pieces]
    if partial:
        shown_lines[0] = "[...] " + shown_lines[0]
    text = "\n".join(shown_lines) + ("\n" if ends_with_newline and shown_lines else "")
    return text, notes


def job_log_tail(job: str, *, lines: int, root: str | Path) -> tuple[str, list[str]]:
    """The last ``lines`` lines of job ``job``'s Slurm log, found through the run folders under ``root`` that
    record it, as printable text, and notes on what was left out; :class:`JobLogError` naming what is wrong."""
    from tim_megatron.safe_files import UnsafePathError
    from tim_megatron.slurm.submit import SlurmError, check_job_id, find_run

    check_lines(lines)
    try:
        check_job_id(job)
    except SlurmError as e:
        raise JobLogError(str(e)) from None
    run = find_run(job, root)
    if run is None:
        raise JobLogError(printable(f"no run folder under {root} records job {job}"))
    log = run / "logs" / f"slurm-{job}.out"
    try:
        tail = read_tail(log, lines=lines, root=run)
    except FileNotFoundError:
        raise JobLogError(printable(f"{log} does not exist yet (is the job still pending?)")) from None
    except UnsafePathError as e:
        raise JobLogError(printable(f"{e}; only plain files are read from a run folder")) from None
    except OSError as e:
        raise JobLogError(printable(f"{log}: cannot be read ({e.strerror or e})")) from None
    return tail_lines(tail, lines)


def write_text(text: str, out=None) -> None:
    """``text`` written to ``out`` (stdout), anything its encoding cannot hold written as ``\\u`` escapes."""
    out = out or sys.stdout
    enc = getattr(out, "encoding", None) or "utf-8"
    out.write(text.encode(enc, "backslashreplace").decode(enc))
    out.flush()
