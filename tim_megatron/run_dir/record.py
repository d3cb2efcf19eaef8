"""``run.json``: the one writer of a run's record and status.

Every status change goes through :func:`set_status` (:data:`ALLOWED_FROM` says which it allows) or an attempt's
start (:func:`begin_attempt`); every write is a read-modify-write under ``run.json``'s lock (:func:`update_meta`),
atomic, with space set aside at an attempt's start for the failure record (:func:`reserve`). Nothing outside this
package reads ``run.json`` but through :func:`read_meta`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
from pathlib import Path

from tim_megatron import clock
from tim_megatron.run_dir.errors import StatusTransitionError
from tim_megatron.run_dir.meta import META_FILE, RecordError, read_record
from tim_megatron.safe_files import UnsafePathError, open_append, regular_file, write_atomic
from tim_megatron.stop import EXIT_PREEMPTED
from tim_megatron.untrusted import clip, shown

RESERVE_FILE = ".run.json.reserve"
"""Space set aside at the start of an attempt, given back when ``run.json`` cannot be written (full disk)."""
RESERVE_BYTES = 64 * 1024


def create_record(
    d: Path, *, name: str, recipe_path: str, overrides: list[str], sweep_id: str | None
) -> None:
    """A new folder's ``run.json``: its name, the recipe it was made from, the overrides, the sweep, when, and the
    status ``created``."""
    meta = {
        "name": name,
        "recipe_path": recipe_path,
        "overrides": overrides,
        "sweep_id": sweep_id,
        "created": now(),
        "status": "created",
    }
    write_atomic(Path(d) / META_FILE, json.dumps(meta, indent=1), root=d, what="run record")


def read_meta(d: Path) -> dict:
    """``run.json`` (empty when missing or not a JSON object: a folder whose record is damaged is started afresh);
    :class:`UnsafePathError` when it is a link or special file, or larger than :data:`MAX_META_BYTES`
    (:func:`~tim_megatron.run_dir.meta.read_record`, the one reader)."""
    p = Path(d) / META_FILE
    if not os.path.lexists(p):
        return {}
    try:
        return read_record(d)
    except RecordError as e:
        if e.unsafe:
            raise UnsafePathError(f"run record {e}") from None
        return {}


def _meta_if_readable(d: Path) -> dict:
    with contextlib.suppress(OSError):
        return read_meta(d)
    return {}


EARLIER_ATTEMPTS_KEPT = 100
"""How many earlier attempts ``run.json`` lists under ``earlier_attempts`` (the oldest are dropped)."""

NO_RECORD = (
    "ended without a record: its processes were killed (a lost node, the out-of-memory killer or SIGKILL)"
)
"""How an attempt ended that left ``run.json`` ``running``: nothing of it could write its end."""


def _record_earlier_attempt(meta: dict) -> None:
    """Before a new attempt overwrites ``attempt``: the attempt that held the folder, how it ended and the step it
    reached, appended to ``earlier_attempts``. An attempt whose processes were killed (a whole node lost in a
    Slurm job, which Slurm then requeues) left the status ``running``; this is where that is written down."""
    old = meta.get("attempt")
    if not old or old == attempt_id():
        return
    status = meta.get("status")
    entry = {"attempt": old, "status": status, "step": meta.get("step"), "start_step": meta.get("start_step")}
    if isinstance(meta.get("code"), dict):
        entry["code"] = meta["code"]
    if status == "running":
        entry["reason"] = NO_RECORD
    elif meta.get("reason"):
        entry["reason"] = meta["reason"]
    earlier = meta.get("earlier_attempts")
    earlier = earlier if isinstance(earlier, list) else []
    meta["earlier_attempts"] = [*earlier, entry][-EARLIER_ATTEMPTS_KEPT:]


def resume_note(meta: dict, *, start_step: int) -> str | None:
    """The console's line on a resume: which checkpoint, which attempt came before, how it ended, and which of
    its steps run again (those after the checkpoint; their rows were dropped from ``metrics.jsonl``)."""
    earlier = meta.get("earlier_attempts")
    if start_step <= 1 or not isinstance(earlier, list) or not earlier or not isinstance(earlier[-1], dict):
        return None
    last = earlier[-1]
    status, reason = last.get("status"), last.get("reason")
    reason = reason if isinstance(reason, str) else "" if reason is None else shown(reason, 200)
    if status == "running":  # its reason is NO_RECORD, written by _record_earlier_attempt
        how = clip(reason, 200) or NO_RECORD
    else:
        known = {"preempted": "was preempted", "failed": "failed"}
        how = known[status] if isinstance(status, str) and status in known else f"ended {_field(status)}"
        first = next(iter(reason.strip().splitlines()), "")  # an error's first line
        if first:
            how += f" ({clip(first, 200)})"
    reached = last.get("step")
    again = ""
    if type(reached) is int and start_step <= reached < 10**12:
        again = f"step {start_step}" if reached == start_step else f"steps {start_step}..{reached}"
        again = f"; {again} {'runs' if reached == start_step else 'run'} again"
    return (
        f"attempt {_field(meta.get('attempt'))} resumes from the checkpoint of step {start_step - 1}: attempt "
        f"{_field(last.get('attempt'))} reached step {_field(reached)} and {how}{again}"
    )


def _field(value: object, limit: int = 80) -> str:
    """A short field of ``run.json`` in the resume note: a string clipped, anything else as ``repr`` shows it (a
    megabyte-long id or step costs a line, not a screen). The console escapes what it prints
    (:func:`tim_megatron.untrusted.recorded`)."""
    if isinstance(value, str):
        return clip(value, limit)
    if value is None or (type(value) is int and abs(value) < 10**12):
        return str(value)
    return shown(value, limit)


def now() -> str:
    """A time for ``run.json``: UTC with its offset (:func:`tim_megatron.clock.stamp`)."""
    return clock.stamp()


def attempt_id() -> str:
    """This attempt: ``<Slurm job id>.<restart count>`` in a job, else ``local.<host>.<pid>``."""
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        return f"{job}.{os.environ.get('SLURM_RESTART_COUNT') or 0}"
    return f"local.{socket.gethostname()}.{os.getpid()}"


def update_meta(d: Path, change, *, use_reserve: bool = True) -> dict:
    """Read-modify-write ``run.json`` under a short lock (a submit and a running job may both write it).

    Atomic (temporary file, then rename). On a full disk the space reserved by :func:`attempt` is given
    back and the write tried once more (unless not ``use_reserve``), so that a failure can still be recorded.
    """
    d = Path(d)
    p = d / META_FILE
    with open_append(d / f".{META_FILE}.lock", what="run record lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        meta = read_meta(d)
        change(meta)
        text = json.dumps(meta, indent=1)
        try:
            write_atomic(p, text, root=d, what="run record")
        except OSError as e:
            if e.errno != errno.ENOSPC or not use_reserve or not os.path.lexists(d / RESERVE_FILE):
                raise
            (d / RESERVE_FILE).unlink()
            write_atomic(p, text, root=d, what="run record")
    return meta


STATUSES = ("created", "submitted", "running", "completed", "preempted", "failed")
"""Every status ``run.json`` can hold."""
_ANY = frozenset({None, *STATUSES})
ALLOWED_FROM: dict[str, frozenset] = {
    "created": frozenset({None}),  # a new folder (write_resolved)
    "submitted": _ANY - {None},  # a resubmission continues any recorded run (a crashed one is left "running")
    "running": _ANY,  # an attempt starts, or start-up ends
    "completed": frozenset({"running"}),  # only the loop that ran the last step completes a run
    "preempted": _ANY,  # a stop during start-up (any earlier record), or the loop's SIGTERM checkpoint
    "failed": _ANY,  # any failure, start-up included
}
"""The statuses each status may follow (None: no status recorded yet)."""


def _transition(meta: dict, status: str, d: Path) -> None:
    old = meta.get("status")
    if old is not None and (not isinstance(old, str) or old not in STATUSES):
        raise StatusTransitionError(
            f"{d / META_FILE}: its status is {shown(old, 80)}, which no run writes (allowed: {', '.join(STATUSES)}); "
            f'the record was changed by hand or damaged: set "status" to one of those ("failed" if unsure)'
        )
    allowed = ALLOWED_FROM.get(status)
    if allowed is None:
        raise StatusTransitionError(f"{d / META_FILE}: status = {status!r}; allowed: {', '.join(STATUSES)}")
    if old not in allowed:
        raise StatusTransitionError(
            f"{d / META_FILE}: status {old!r} -> {status!r} is not a transition a run makes; {status!r} follows "
            f"only {', '.join(sorted(repr(a) for a in allowed))}"
        )


def set_status(d: Path, status: str, **extra) -> dict:
    """The one writer of ``run.json``'s status after the folder is created (:data:`ALLOWED_FROM` says which
    changes are allowed; :class:`StatusTransitionError` otherwise). Returns ``run.json`` as written."""

    def change(meta):
        _transition(meta, status, d)
        meta.update(status=status, updated=now(), **extra)

    return update_meta(d, change)


def mark_submitted(d: Path, job: str) -> dict:
    """``submitted`` by Slurm job ``job``, appended to the jobs that ran the folder (``job_ids``), in one write under
    the lock. Returns ``run.json`` as written."""

    def change(meta):
        _transition(meta, "submitted", d)
        jobs = meta.get("job_ids")
        meta.update(
            status="submitted", updated=now(), job_ids=[*(jobs if isinstance(jobs, list) else []), job]
        )

    return update_meta(d, change)


def record_step(d: Path, step: int) -> None:
    """Rank 0, after each logged step: the step reached. It also proves, every step, that the folder still
    takes writes (the reserve is kept for the failure record)."""

    def change(meta):
        meta.update(step=step, updated=now())

    update_meta(d, change, use_reserve=False)


def mark_running(d: Path, *, start_step: int, resumed_from: str | None) -> dict:
    """Start-up is over: steps ``start_step``.. begin. Records the cores this process may run on (a run's numbers
    depend on its thread count: float sums in another order). Returns ``run.json`` as written."""
    cores = sorted(os.sched_getaffinity(0))
    return set_status(d, "running", start_step=start_step, resumed_from=resumed_from, cpu_affinity=cores)


def mark_finished(
    d: Path, status: str, *, step: int, wall_seconds: float, max_requeues: int | None = None
) -> None:
    """``completed``, or ``preempted`` right after the loop's SIGTERM checkpoint of ``step``.

    Preempted in a Slurm job: ``requeue_attempt`` is set to this attempt while the job has been
    restarted fewer than ``max_requeues`` times; the job script requeues only on that mark.
    """
    extra: dict = {"step": step, "wall_seconds": round(wall_seconds, 2)}
    if status == "preempted":
        restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        extra["checkpoint_step"] = step
        if max_requeues is not None and restarts >= max_requeues:
            extra["requeue"] = (
                f"refused: the job was requeued {restarts} time(s), cluster.max_requeues = {max_requeues}; "
                f"continue with tim submit --resume {d}"
            )
            extra["requeue_attempt"] = None
        else:
            extra["requeue"] = "allowed"
            extra["requeue_attempt"] = attempt_id()
    set_status(d, status, **extra)


def failure_reason(err: BaseException) -> str:
    text = str(err).strip()
    reason = f"{type(err).__name__}: {text}" if text else type(err).__name__
    return reason if len(reason) <= 2000 else reason[:1997] + "..."


def mark_failed(d: Path, err: BaseException | str, **extra) -> None:
    reason = err if isinstance(err, str) else failure_reason(err)
    set_status(d, "failed", reason=reason, requeue_attempt=None, **extra)


def mark_stopped(d: Path, signame: str) -> None:
    """``preempted`` by a signal before the first step. No checkpoint was written in this attempt, so a
    Slurm job is not requeued for it; resuming continues from the folder's last checkpoint, if any."""
    set_status(
        d,
        "preempted",
        reason=f"stopped by {signame} during start-up, before any step of this attempt",
        requeue=f"refused: no checkpoint written in this attempt; continue with tim train --resume {d}",
        requeue_attempt=None,
    )


def begin_attempt(d: Path, *, code: dict) -> dict:
    """An attempt starts: ``running``, the attempt that held the folder before written down in
    ``earlier_attempts``, this attempt's id, host, pid and code, and an earlier attempt's requeue mark and reason
    cleared. Returns ``run.json`` as written."""

    def start(meta):
        _transition(meta, "running", d)
        _record_earlier_attempt(meta)
        meta.update(
            status="running",
            updated=now(),
            attempt=attempt_id(),
            host=socket.gethostname(),
            pid=os.getpid(),
            requeue_attempt=None,
            code=code,
        )
        meta.pop("reason", None)

    return update_meta(d, start)


def settle_launcher_exit(d: Path, code: int, *, attempt_before: str | None, stopped_by: str | None) -> int:
    """After a local launcher (torchrun) exits: the exit code that agrees with ``run.json``.

    The ranks' record decides: ``completed`` 0, ``preempted`` 75, ``failed`` non-zero (torchrun exits 1 for
    any rank's non-zero exit, and the ranks exit 0 when they stop as asked). Ranks that recorded no attempt
    of their own (``attempt_before`` unchanged: stopped or failed before it) or left it ``running`` leave
    the record to us: ``preempted`` when we passed them a stop signal (``stopped_by``), else ``failed``.
    """
    meta = _meta_if_readable(d)
    status = meta.get("status") if meta.get("attempt") != attempt_before else None
    if status == "completed":
        return 0
    if status == "preempted":
        return EXIT_PREEMPTED
    if status == "failed":
        return code if code not in (0, EXIT_PREEMPTED) else 1
    if stopped_by is not None:  # ranks stopped before they recorded anything (they exit 0 or die of it)
        with contextlib.suppress(OSError):  # a folder that refuses writes: the ranks' errors said so
            mark_stopped(d, stopped_by)
        return EXIT_PREEMPTED
    if code == 0:
        return 0
    with contextlib.suppress(OSError):
        mark_failed(d, f"the ranks' launcher exited with code {code} (a rank died; see the output above)")
    return code if code != EXIT_PREEMPTED else 1


def reserve(d: Path) -> None:
    p = d / RESERVE_FILE
    with contextlib.suppress(OSError):  # a link there is replaced, not written through
        if not regular_file(p) or p.stat().st_size < RESERVE_BYTES:
            write_atomic(p, b"\0" * RESERVE_BYTES, root=d)
