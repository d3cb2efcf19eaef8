"""What a run folder must not be, and what a failure inside one is: links and special files where a run writes or
reads (:func:`unsafe_entries`), folders that refuse writes (:func:`unwritable_part`), and an error translated into
what it means for the folder (:func:`failure_of`: a full disk, a full or read-only shared memory, a folder that
refuses writes), with what ``run.json`` could record."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path

from tim_megatron.run_dir.errors import DiskFullError, RunDirError, RunDirNotWritable, SharedMemoryError
from tim_megatron.run_dir.folder import RECIPE_FILE
from tim_megatron.run_dir.record import (
    META_FILE,
    RESERVE_FILE,
    _meta_if_readable,
    attempt_id,
    failure_reason,
    mark_failed,
)
from tim_megatron.run_lock import LOCK_FILE
from tim_megatron.safe_files import UnsafePathError, describe

WRITTEN_SUBFOLDERS = ("checkpoints", "dumps", "wandb")
"""Subfolders a run writes into, checked at the start of an attempt when they exist."""
REAL_SUBFOLDERS = (*WRITTEN_SUBFOLDERS, "logs", "preflight")
"""Subfolders a run writes into that must be real folders, not links out of the run folder."""
REPLACED_FILES = (RESERVE_FILE, "summary.txt", "curves.png", "events.json")
"""Files a run replaces by an atomic rename: a link there is replaced (never followed), a special file refused."""
UNLINKED_FILES = ("metrics.jsonl", f".{META_FILE}.lock", LOCK_FILE, META_FILE, RECIPE_FILE)
"""Files a run appends to, locks or reads back: regular files only, a link refused (it would be followed)."""
DENIED_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS)


FULL_DISK_BYTES = 64 * 2**20
"""Free space below which a failure is reported as a full disk (writers such as torch's checkpoint writer
do not always pass ENOSPC on: a full disk can surface as "unexpected pos 704 vs 598")."""


def _chain(err: BaseException):
    seen = set()
    e = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


SHARED_MEMORY = Path("/dev/shm")
"""Where torch's shared-memory tensors live (the weights an engine process receives cross it)."""


def _free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _in_shared_memory(e: BaseException) -> bool:
    """``e`` names shared memory: a file under /dev/shm, or torch's shared-memory allocation (``</torch_...>``)."""
    name = getattr(e, "filename", None)
    if isinstance(name, str | bytes) and _inside(name, SHARED_MEMORY):
        return True
    text = str(e)
    return str(SHARED_MEMORY) in text or "</torch_" in text or "shared memory" in text.lower()


def shared_memory_fault(err: BaseException, d: Path) -> str | None:
    """Why ``err`` is shared memory (/dev/shm) being full or refusing writes rather than the run folder's disk (None:
    it is not). A full /dev/shm raises the same ENOSPC as a full disk (Docker's default is 64 MiB)."""
    for e in _chain(err):
        full = (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e)
        denied = isinstance(e, OSError) and e.errno in DENIED_ERRNOS
        if not (full or denied):
            continue
        shm_free, run_free = _free_bytes(SHARED_MEMORY), _free_bytes(d)
        if not _in_shared_memory(e) and not (
            full and shm_free is not None and shm_free < FULL_DISK_BYTES <= (run_free or 0)
        ):
            continue
        if denied:
            return f"shared memory ({SHARED_MEMORY}) refuses writes ({e.strerror or e})"
        size = _total_bytes(SHARED_MEMORY)
        return (
            f"shared memory ({SHARED_MEMORY}) is full ({shm_free} of {size} bytes free)"
            if shm_free is not None
            else f"shared memory ({SHARED_MEMORY}) is full"
        )
    return None


def _total_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def _disk_full(err: BaseException, d: Path) -> str | None:
    """Why ``err`` looks like a full disk under ``d`` (None: it does not)."""
    for e in _chain(err):
        if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e):
            return "No space left on device"
    free = _free_bytes(d)
    return f"{free} bytes free" if free is not None and free < FULL_DISK_BYTES else None


def _inside(path, d: Path) -> bool:
    try:
        return Path(os.fsdecode(path)).resolve().is_relative_to(d.resolve())
    except (OSError, TypeError, ValueError):
        return False


def unwritable_part(d: Path) -> str | None:
    """``"<folder>: <reason>"`` for the first of ``d`` and its existing :data:`WRITTEN_SUBFOLDERS` that refuses
    a new file (None: all take one). A probe, not the mode bits: root writes through those, not through a
    read-only mount or an immutable folder."""
    for folder in (d, *(d / s for s in WRITTEN_SUBFOLDERS)):
        if folder is not d and (folder.is_symlink() or not folder.is_dir()):
            continue  # a link is refused by name (unsafe_entries): nothing is probed through it
        try:
            fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-probe-")
        except OSError as e:
            if e.errno in DENIED_ERRNOS:
                return f"{folder}: {e.strerror}"
            continue
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(probe)
    return None


def unsafe_entries(d: Path) -> list[str]:
    """``"<path> is <what>"`` for each place in run folder ``d`` a run would write or read through a link, or where
    a special file would block or never end: a link at a subfolder it writes (:data:`REAL_SUBFOLDERS`), at a file
    it appends to or reads back (:data:`UNLINKED_FILES`, ``logs/engine*.log``), a special file at a file it
    replaces (:data:`REPLACED_FILES`), and anything but regular files and real folders under ``checkpoints/``.
    Found without opening anything."""
    bad = []

    def kind(p: Path, allowed: tuple[str, ...]) -> None:
        what = describe(p)
        if what != "missing" and not what.startswith(allowed):
            bad.append(f"{p} is {what}")

    for name in REAL_SUBFOLDERS:
        kind(d / name, ("a folder",))
    for name in UNLINKED_FILES:
        kind(d / name, ("a regular file",))
    for name in REPLACED_FILES:
        kind(d / name, ("a regular file", "a symbolic link"))
    logs = d / "logs"
    if logs.is_dir() and not logs.is_symlink():
        for p in sorted([*logs.glob("engine*.log"), logs / "errors.log"]):
            kind(p, ("a regular file",))
    ckpts = d / "checkpoints"
    if ckpts.is_dir() and not ckpts.is_symlink():
        from tim_megatron.trainer.checkpoint_scan import special_entries

        bad += [f"{ckpts}/{e.replace(': ', ' is ', 1)}" for e in special_entries(ckpts)]
    return bad


def _refused(d: Path, bad: list[str]) -> RunDirError:
    shown = "; ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
    return RunDirError(
        f"run folder {d} refused: {shown}. A run writes and reads only regular files and real folders inside its "
        "folder (a link would write or read another file, a FIFO would block); remove or replace these, then "
        "start again"
    )


def _write_denied(err: BaseException, d: Path) -> str | None:
    """Why ``err`` looks like a run folder that refuses writes (None: it does not)."""
    for e in _chain(err):
        if isinstance(e, OSError) and e.errno in DENIED_ERRNOS and e.filename and _inside(e.filename, d):
            return f"{os.fsdecode(e.filename)}: {e.strerror}"
    return unwritable_part(d)  # writers that do not pass the OSError on (torch's checkpoint writer)


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[-1][:300]}"


def failure_of(e: BaseException, d: Path, *, writer: bool) -> BaseException | None:
    """What a failure inside run folder ``d`` means for it, recorded (``writer``: this process writes ``run.json``,
    rank 0): the error to raise in its place (:class:`SharedMemoryError`, :class:`DiskFullError`,
    :class:`RunDirNotWritable`, :class:`RunDirError` for a link or special file met), each saying whether
    ``run.json`` holds the failure, or None when ``e`` is to be raised as it is (after ``failed`` was recorded)."""
    shm = shared_memory_fault(e, d)
    full = None if shm else _disk_full(e, d)
    denied = None if full or shm else _write_denied(e, d)
    unrecorded = None  # why run.json could not record the failure
    if writer:
        why = shm or (f"disk full ({full})" if full else f"cannot write {denied}" if denied else None)
        if isinstance(e, RunDirNotWritable):  # its message names the folder already
            why = None
        try:
            mark_failed(d, f"{why}: {failure_reason(e)}" if why else e)
        except OSError as w:  # the original error matters more than the record
            meta = _meta_if_readable(d)  # the loop may have recorded it already (with the space reserved)
            if meta.get("status") != "failed" or meta.get("attempt") != attempt_id():
                unrecorded = w.strerror or str(w)
    if not writer:
        record = ""  # rank 0 says what run.json holds
    elif unrecorded is None:
        record = "run.json records the failure. "
    else:
        status = _meta_if_readable(d).get("status")
        record = (
            f"run.json could not be written either ({unrecorded}): its status ({status}) is out of date. "
        )
    if shm:
        return SharedMemoryError(
            f"{shm}; the error was {_first_line(e)}\n{record}The weights an engine process receives "
            "(rollout.engine_process = true) and torch's shared tensors cross it: give it room (a container's "
            "--shm-size; Docker's default is 64 MiB) or set rollout.engine_process = false, then resume from the "
            f"last checkpoint: tim train --resume {d}"
        )
    if full:
        return DiskFullError(
            f"the disk holding {d} is full ({full}); the error was {_first_line(e)}\n{record}"
            f"Free space, then resume from the last checkpoint: tim train --resume {d}"
        )
    if denied or unrecorded is not None:
        if isinstance(e, RunDirNotWritable):
            cause = str(e)
        elif denied:
            cause = f"cannot write {denied}" + ("" if isinstance(e, OSError) else f" ({_first_line(e)})")
        else:
            cause = f"the run stopped on {_first_line(e)}"
        return RunDirNotWritable(
            f"{cause}\n{record}Make {d} and its subfolders writable, then resume from the last "
            f"checkpoint: tim train --resume {d}"
        )
    if isinstance(e, UnsafePathError):  # a link or special file met while the run wrote or read
        return RunDirError(f"{e}\n{record}Remove or replace it, then resume: tim train --resume {d}")
    return None
