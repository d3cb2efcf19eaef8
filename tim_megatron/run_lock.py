"""One process per run folder: an ``flock`` on ``<run folder>/run.lock``.

The lock is held for the life of the process that takes it; the kernel releases it when the last
descriptor closes, so a run killed with SIGKILL (or a dead node's) leaves no stale lock behind. The lock
file names its holder (host, pid, start time) for the error a second process gets.

One process of a run takes it: a single ``tim train``, the ``tim train --nproc N`` launcher before it
starts its ranks, or global rank 0 of a job whose ranks a launcher (torchrun under srun) started. A rank
whose launcher ancestor already holds the lock goes on without taking it.

:func:`claim` is for a process that removes or reuses folders it does not run itself (``tim lab``): it takes
the lock or names the holder, ancestors included, and hands the lock to the run it starts.

The lock file is opened without following a link (``O_NOFOLLOW``) and without waiting on a FIFO
(``O_NONBLOCK``), and used only when it is a regular file: a run folder from elsewhere could otherwise have the
holder's record written over any file a link there names.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from tim_megatron.clock import stamp
from tim_megatron.safe_files import UnsafePathError
from tim_megatron.safe_files import describe as describe_path

LOCK_FILE = "run.lock"


class RunFolderBusy(RuntimeError):
    """Another process holds the run folder."""

    def __init__(self, msg: str, *, holder: dict | None = None):
        super().__init__(msg)
        self.holder = holder or {}
        """The holder's record (host, pid, started, command); empty when it wrote none yet."""


@dataclass
class RunLock:
    path: Path
    fd: int | None
    """Our descriptor; None when an ancestor (our launcher) holds the lock for us."""

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _ancestors() -> set[int]:
    """Our parent, its parent, ... (Linux /proc)."""
    out, pid = set(), os.getppid()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state letter: ppid
    return out


def _holder(fd: int) -> dict:
    """The holder's record; it may still be writing it, so look a few times."""
    for _ in range(40):
        with contextlib.suppress(OSError, ValueError):
            data = os.pread(fd, 4096, 0)
            if data:
                rec = json.loads(data)
                if isinstance(rec, dict):
                    return rec
        time.sleep(0.05)
    return {}


def _not_a_lock(path: Path) -> UnsafePathError:
    return UnsafePathError(f"lock file {path} is {describe_path(path)}; allowed: a regular file")


def _lock(path: Path) -> tuple[int | None, dict]:
    """``(our descriptor, {})`` when we took ``path``'s lock, ``(None, the holder's record)`` when another has it;
    :class:`UnsafePathError` when ``path`` is a link or anything but a regular file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if describe_path(path) not in ("missing", "a regular file"):
            raise _not_a_lock(path) from e
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _not_a_lock(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        rec = _holder(fd)
        os.close(fd)
        return None, rec
    rec = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": stamp(),
        "command": " ".join(_argv())[:300],
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(rec).encode(), 0)
    return fd, {}


def describe(rec: dict) -> str:
    """A lock holder's record in words, for an error (control characters escaped: it reaches a terminal)."""
    if not rec:
        return "a process that has not written its name yet"
    text = f"pid {rec.get('pid')} on {rec.get('host')} since {rec.get('started')} ({rec.get('command', '?')})"
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def hold(run_dir: str | Path) -> RunLock:
    """Take ``run_dir``'s lock for this process (released at exit), or raise :class:`RunFolderBusy`."""
    path = Path(run_dir) / LOCK_FILE
    fd, rec = _lock(path)
    if fd is not None:
        return RunLock(path, fd)
    if rec.get("host") == socket.gethostname() and rec.get("pid") in _ancestors():
        return RunLock(path, None)
    raise RunFolderBusy(
        f"run folder {run_dir} is in use by {describe(rec)}; lock file {path}. Two runs in one folder would "
        f"interleave their metrics and checkpoints: wait for it to end, stop it, or use another folder.",
        holder=rec,
    )


def claim(folder: str | Path, *, lock_file: str = LOCK_FILE) -> RunLock:
    """Take ``folder/lock_file`` for this process, or raise :class:`RunFolderBusy` naming the holder.

    Unlike :func:`hold`, a lock an ancestor holds counts as busy: the caller means to remove or reuse the
    folder, which only the one process that holds it may do. A child started with the descriptor
    (``pass_fds``) shares the lock, and its own :func:`hold` passes through the ancestor rule."""
    path = Path(folder) / lock_file
    fd, rec = _lock(path)
    if fd is None:
        raise RunFolderBusy(f"{folder} is in use by {describe(rec)} (lock file {path})", holder=rec)
    return RunLock(path, fd)


def _argv() -> list[str]:
    try:
        return Path("/proc/self/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []
