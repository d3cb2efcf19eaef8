"""Files in folders that may come from elsewhere: written only inside the folder, read only as regular files.

A run folder, a lab root, an ``tim align`` output or a model folder can be copied from another machine or
prepared by someone else. Whatever it holds, a command of this project

* writes, truncates and deletes only what lies inside the folder it owns, never through a symbolic link: a
  file is replaced by an atomic rename of a fresh temporary file (:func:`write_atomic`), or opened with
  ``O_NOFOLLOW`` (:func:`open_append`); a folder is removed only when it carries its owner's marker
  (:func:`remove_owned_tree`);
* reads only regular files, and none through a link out of the folder (:func:`open_regular`,
  :func:`regular_file`): a FIFO would block the reader forever, a device would never end, and a link would let
  the folder's author choose which of the reader's files gets read (and copied into a report or an export).

Every refusal is an :class:`UnsafePathError` naming the path, what it is, and what is allowed.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "UnsafePathError",
    "check_inside",
    "copy_regular",
    "describe",
    "open_append",
    "open_regular",
    "read_bytes",
    "read_text",
    "regular_file",
    "remove_owned_tree",
    "save_figure",
    "write_atomic",
]


class UnsafePathError(OSError):
    """A path this project refuses to read or write: a link, a special file, or a place outside its folder."""


_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISREG, "a regular file"),
)


def describe(path: str | os.PathLike) -> str:
    """What ``path`` is, without following a link: 'a symbolic link (to '...')', 'a FIFO (named pipe)', 'missing'.
    A link's target is shown quoted with control characters escaped: its author chose that text."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return "missing"
    for test, name in _KINDS:
        if test(mode):
            if name == "a symbolic link":
                with contextlib.suppress(OSError):
                    return f"{name} (to {os.readlink(path)!r})"
            return name
    return "a special file"


def _new_file_mode() -> int:
    """The mode ``open()`` gives a new file (0o666 less the umask), read without changing the umask."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o644


def check_inside(root: str | os.PathLike, path: str | os.PathLike, *, what: str = "file") -> Path:
    """``path`` (absolute, or relative to the working folder, like ``root``) as an absolute path, if it lies inside
    ``root`` by name (``..`` cannot leave it) and no folder between ``root`` and it is a symbolic link; the last part
    may be anything (the caller decides)."""
    root = Path(os.path.normpath(os.path.abspath(root)))
    target = Path(os.path.normpath(os.path.abspath(path)))
    if target == root or not target.is_relative_to(root):
        raise UnsafePathError(f"{what} {os.fspath(path)!r} lies outside {root}; allowed: a path inside it")
    here = root
    for part in target.relative_to(root).parts[:-1]:
        here = here / part
        if here.is_symlink():
            raise UnsafePathError(
                f"{what} {target}: {here} is {describe(here)}; allowed: real folders inside {root}"
            )
    return target


def _refuse_special(path: Path, *, what: str, allowed: str = "a regular file") -> None:
    kind = describe(path)
    if kind not in ("missing", "a regular file") and not path.is_symlink():
        raise UnsafePathError(f"{what} {path} is {kind}; allowed: {allowed}")


def write_atomic(
    path: str | os.PathLike,
    data: bytes | str | Iterable[bytes],
    *,
    root: str | os.PathLike | None = None,
    what: str = "file",
) -> Path:
    """Replace ``path`` with ``data`` (text is UTF-8; an iterable of byte chunks is streamed): a fresh temporary
    file beside it (random name, created
    exclusively), synced, then renamed over it. A link at ``path`` is replaced, never written through; a folder,
    FIFO or device there is refused. The new file gets the mode ``open()`` would give (0o666 less the umask).
    With ``root``, ``path`` must lie inside it (:func:`check_inside`)."""
    path = check_inside(root, path, what=what) if root is not None else Path(path)
    _refuse_special(path, what=what, allowed="a regular file or a symbolic link (replaced, not followed)")
    chunks = (
        [data.encode()] if isinstance(data, str) else [data] if isinstance(data, bytes | bytearray) else data
    )
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, _new_file_mode())  # mkstemp's 0o600 would hide run files from the rest of a team
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def open_append(path: str | os.PathLike, *, what: str = "file"):
    """``path`` opened for appending text, created if missing; a link or special file there is refused."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    except OSError as e:  # a link or special file is named; a denied or missing folder stays what it is
        kind = describe(path)
        if kind not in ("missing", "a regular file"):
            raise UnsafePathError(f"{what} {path} is {kind}; allowed: a regular file") from e
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafePathError(f"{what} {path} is {describe(path)}; allowed: a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "a")


def open_regular(
    path: str | os.PathLike,
    *,
    root: str | os.PathLike | None = None,
    what: str = "file",
    max_bytes: int | None = None,
):
    """``path`` opened for binary reading when it is a regular file (not a link, FIFO or device), inside ``root``
    when one is given, and (with ``max_bytes``) no larger than that. Checked before the open, opened with
    ``O_NOFOLLOW | O_NONBLOCK``, then checked on the open descriptor, so a FIFO never blocks and a file swapped
    after the check is still refused."""
    path = check_inside(root, path, what=what) if root is not None else Path(path)
    kind = describe(path)  # before the open too: opening a device can have effects of its own
    if kind not in ("missing", "a regular file"):
        raise UnsafePathError(f"{what} {path} is {kind}; allowed: a regular file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        kind = describe(path)
        if kind not in ("missing", "a regular file"):
            raise UnsafePathError(f"{what} {path} is {kind}; allowed: a regular file") from e
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafePathError(f"{what} {path} is {describe(path)}; allowed: a regular file")
    if max_bytes is not None and st.st_size > max_bytes:
        os.close(fd)
        raise UnsafePathError(f"{what} {path} has {st.st_size} bytes; allowed: at most {max_bytes}")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_bytes(path, *, root=None, what: str = "file", max_bytes: int | None = None) -> bytes:
    with open_regular(path, root=root, what=what, max_bytes=max_bytes) as f:
        return f.read()


def read_text(path, *, root=None, what: str = "file", max_bytes: int | None = None) -> str:
    return read_bytes(path, root=root, what=what, max_bytes=max_bytes).decode()


def regular_file(path: str | os.PathLike, *, root: str | os.PathLike | None = None) -> bool:
    """Whether ``path`` is a regular file (not through a link), inside ``root`` when one is given."""
    try:
        p = check_inside(root, path) if root is not None else Path(path)
        return stat.S_ISREG(os.lstat(p).st_mode)
    except (OSError, ValueError):
        return False


def copy_regular(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    src_root: str | os.PathLike,
    dst_root: str | os.PathLike | None = None,
    what: str = "file",
    max_bytes: int | None = None,
) -> Path:
    """Copy ``src``, a regular file inside ``src_root``, to ``dst`` (:func:`write_atomic`)."""
    return write_atomic(
        dst, read_bytes(src, root=src_root, what=what, max_bytes=max_bytes), root=dst_root, what=what
    )


def save_figure(fig, path: str | os.PathLike, *, root: str | os.PathLike | None = None, **kwargs) -> Path:
    """A matplotlib figure saved through :func:`write_atomic` (``savefig`` on a path would follow a link there);
    the format comes from the suffix unless ``format=`` is given."""
    buf = io.BytesIO()
    kwargs.setdefault("format", Path(path).suffix.lstrip(".") or "png")
    fig.savefig(buf, **kwargs)
    return write_atomic(path, buf.getvalue(), root=root, what="figure")


def remove_owned_tree(
    path: str | os.PathLike, *, root: str | os.PathLike, marker: str, what: str = "folder"
) -> None:
    """Delete folder ``path`` inside ``root`` only when it is a real folder (not a link) holding the regular file
    ``marker`` that its owner wrote there; ``shutil.rmtree`` then removes links inside it without following
    them."""
    import shutil

    path = check_inside(root, path, what=what)
    if path.is_symlink() or not path.is_dir():
        raise UnsafePathError(f"{what} {path} is {describe(path)}; allowed: a real folder inside {root}")
    if not regular_file(path / marker):
        raise UnsafePathError(
            f"{what} {path} has no {marker} (it is {describe(path / marker)} there); only folders this "
            "command made are removed, and this one was not"
        )
    shutil.rmtree(path)
