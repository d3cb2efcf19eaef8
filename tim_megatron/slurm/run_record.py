"""A run folder's ``run.json`` read back for the job script and for ``tim logs``, whatever it holds.

``run.json`` is read by the run folder's one reader (:func:`tim_megatron.run_dir.meta.read_record`: regular files
only, bounded, a record too deep to parse is unreadable like any other). Only its top-level keys are consulted, and
what is printed of it is quoted, escaped and clipped to one line.

The job script (``launch/tim.sbatch``) calls this module after the run's processes end, as
``python -m tim_megatron.slurm.run_record COMMAND`` (it imports nothing heavy: it runs in the seconds after a
SIGTERM):

* ``requeue-check RUN_DIR ATTEMPT``: exit 0 when the top-level ``requeue_attempt`` is ``ATTEMPT``, else 1 (a key
  of that name nested deeper, or an unreadable record, never requeues a job);
* ``completed RUN_DIR``: exit 0 when the top-level ``status`` is ``completed``, else 1;
* ``status-line RUN_DIR``: one line naming the record's ``status``, ``reason`` and ``requeue``
  (:func:`status_summary`), or why the record was not read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tim_megatron.run_dir.meta import MAX_META_BYTES, META_FILE, RecordError, read_record
from tim_megatron.untrusted import shown

RECORD_FILE = META_FILE
MAX_RECORD_BYTES = MAX_META_BYTES
STATUS_KEYS = {"status": 40, "reason": 600, "requeue": 300}
"""The run.json keys a status line names, with how many characters of each it shows at most."""
MAX_STATUS_CHARS = 1200
"""Longest status line (:func:`status_summary`)."""
TOOL_COMMANDS = ("requeue-check", "completed", "status-line")
"""The commands ``python -m tim_megatron.slurm.run_record`` runs (the job script calls each)."""


def requeue_marked(run_dir: str | Path, attempt: str) -> bool:
    """Whether ``run.json``'s top-level ``requeue_attempt`` is ``attempt`` (the run checkpointed after a SIGTERM
    in this very attempt and has requeues left); False for an unreadable record."""
    try:
        mark = read_record(run_dir).get("requeue_attempt")
    except RecordError:
        return False
    return isinstance(mark, str) and mark == attempt


def is_completed(run_dir: str | Path) -> bool:
    """Whether ``run.json``'s top-level ``status`` is ``completed``; False for an unreadable record."""
    try:
        return read_record(run_dir).get("status") == "completed"
    except RecordError:
        return False


def status_summary(record: dict) -> str:
    """One printable line naming the record's :data:`STATUS_KEYS` that it has (``status = 'failed'; reason =
    '...'``): each value quoted and escaped (:func:`~tim_megatron.untrusted.shown`) and clipped, the
    line at most :data:`MAX_STATUS_CHARS`."""
    parts = [f"{key} = {shown(record[key], limit)}" for key, limit in STATUS_KEYS.items() if key in record]
    line = "; ".join(parts) if parts else f"{RECORD_FILE} names no {', '.join(STATUS_KEYS)}"
    return line if len(line) <= MAX_STATUS_CHARS else line[: MAX_STATUS_CHARS - 3] + "..."


def status_line(run_dir: str | Path) -> str:
    """:func:`status_summary` of ``RUN_DIR/run.json``, or why it was not read (escaped, clipped)."""
    try:
        return status_summary(read_record(run_dir))
    except RecordError as e:
        return str(e)[:MAX_STATUS_CHARS]


def main(argv: list[str] | None = None) -> int:
    """``python -m tim_megatron.slurm.run_record``: the job script's reader of ``run.json`` (see the module
    docstring); exit status 0 or 1 answers a check, 2 is a usage error."""
    parser = argparse.ArgumentParser(
        prog="python -m tim_megatron.slurm.run_record",
        description="Read a run folder's run.json for the job script.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(TOOL_COMMANDS[0], help="exit 0 when the top-level requeue_attempt is ATTEMPT")
    check.add_argument("run_dir")
    check.add_argument("attempt")
    sub.add_parser(TOOL_COMMANDS[1], help="exit 0 when the top-level status is completed").add_argument(
        "run_dir"
    )
    sub.add_parser(TOOL_COMMANDS[2], help="print status, reason and requeue in one line").add_argument(
        "run_dir"
    )
    args = parser.parse_args(argv)
    if args.command == "requeue-check":
        return 0 if requeue_marked(args.run_dir, args.attempt) else 1
    if args.command == "completed":
        return 0 if is_completed(args.run_dir) else 1
    enc = sys.stdout.encoding or "utf-8"
    sys.stdout.write((status_line(args.run_dir) + "\n").encode(enc, "backslashreplace").decode(enc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
