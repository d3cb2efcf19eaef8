"""One attempt at a run: recorded in ``run.json`` as it starts, the folder checked, and any failure inside it
recorded and named for what it means (:func:`attempt`)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from tim_megatron.code_record import code_record
from tim_megatron.run_dir.errors import RunDirError, RunDirNotWritable
from tim_megatron.run_dir.guard import DENIED_ERRNOS, _refused, failure_of, unsafe_entries, unwritable_part
from tim_megatron.run_dir.record import META_FILE, RESERVE_FILE, begin_attempt, mark_stopped, reserve
from tim_megatron.safe_files import UnsafePathError
from tim_megatron.stop import StopDuringStartup


@contextlib.contextmanager
def attempt(d: Path, *, writer: bool = True):
    """One attempt at a run (a process start, a Slurm job or a requeue of it), start-up included.

    Records the attempt in ``run.json`` (:func:`~tim_megatron.run_dir.record.begin_attempt`, which also clears an
    earlier attempt's requeue mark) and checks that the folders the run writes take files; any exception inside
    sets ``failed`` with its reason before it propagates, a stop signal during start-up ``preempted``. A full disk
    becomes :class:`DiskFullError`, a folder that refuses writes :class:`RunDirNotWritable`
    (:func:`~tim_megatron.run_dir.guard.failure_of`); both say whether ``run.json`` holds the record.
    ``writer``: this process writes ``run.json`` (rank 0); the others only pass exceptions through.
    """
    d = Path(d)
    if writer:
        _start(d)
    try:
        if writer and (unsafe := unsafe_entries(d)):
            raise _refused(d, unsafe)
        if writer and (bad := unwritable_part(d)):
            raise RunDirNotWritable(f"cannot write in {bad}: a run writes there; nothing ran")
        yield
    except BaseException as e:
        if isinstance(e, SystemExit) and e.code in (0, None):
            raise
        if isinstance(e, StopDuringStartup):
            if writer:
                with contextlib.suppress(OSError):
                    mark_stopped(d, str(e))
            raise
        named = failure_of(e, d, writer=writer)
        if named is not None:
            raise named from e
        raise
    finally:
        if writer:
            with contextlib.suppress(OSError):
                (d / RESERVE_FILE).unlink(missing_ok=True)


def _start(d: Path) -> None:
    """The attempt in ``run.json``, with space set aside for its failure record; a folder that cannot record it is
    named (nothing ran)."""
    reserve(d)
    code = code_record()  # the commit and versions this attempt runs (outside run.json's lock: git is slow)
    try:
        begin_attempt(d, code=code)
    except UnsafePathError as e:
        raise RunDirError(f"{e}; nothing ran (run.json could not record this)") from e
    except OSError as e:
        if e.errno not in DENIED_ERRNOS:
            raise
        raise RunDirNotWritable(
            f"cannot write {d / META_FILE} ({e.strerror}): the run folder refuses writes; nothing ran. "
            f"Make {d} writable (or give another folder), then start again."
        ) from e
