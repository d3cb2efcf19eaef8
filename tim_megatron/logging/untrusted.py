"""Reading files from run folders, which anyone may have written or copied in.

Only regular files are opened, never through a link (a link to ``/dev/zero`` or a FIFO is refused, and a FIFO
cannot block the open; :mod:`tim_megatron.safe_files` holds the rule), and reads are bounded by the bytes actually read, since ``st_size`` says 0 for a device. Text read
from such a file is shown on a terminal only through :func:`printable` or :func:`shown`, so an escape
sequence in a path or a name cannot reach the terminal.
"""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import BinaryIO


class UnreadableFile(ValueError):
    """A run-folder file that is not read at all; the message names the file and why."""


def open_regular(path: str | Path) -> BinaryIO:
    """``path`` opened for binary reading; :class:`UnreadableFile` unless it is a regular file, not a link
    (:func:`tim_megatron.safe_files.open_regular`, whose refusals this turns into the readers' error type)."""
    from tim_megatron.safe_files import UnsafePathError, describe
    from tim_megatron.safe_files import open_regular as open_safely

    try:
        return open_safely(path)
    except UnsafePathError:
        raise UnreadableFile(
            f"{path}: not a regular file ({describe(path)}); only plain files are read from a run folder"
        ) from None
    except OSError as e:
        raise UnreadableFile(f"{path}: cannot be read ({e.strerror or e})") from None


def read_bounded(path: str | Path, limit: int) -> bytes:
    """The bytes of the regular file ``path``; :class:`UnreadableFile` if it holds more than ``limit``."""
    try:
        with open_regular(path) as f:
            raw = f.read(limit + 1)
    except OSError as e:
        raise UnreadableFile(f"{path}: cannot be read ({e.strerror or e})") from None
    if len(raw) > limit:
        raise UnreadableFile(f"{path}: more than {limit} bytes; at most {limit} are read")
    return raw


def printable(text: str) -> str:
    """``text`` with every character a terminal could act on (controls, ESC, C1, bidi marks) escaped.

    Printable characters, non-ASCII letters included, stay as they are; the rest are written as ``repr``
    writes them (``\\x1b``, ``\\n``, ``\\u202e``).
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def shown(value: object, limit: int = 80) -> str:
    """A value from outside, quoted, short and printable (``repr`` escapes every control character). Nested
    containers are cut at a few levels and items, so a value megabytes long or nested thousands deep costs
    little."""
    short = reprlib.Repr()
    short.maxlevel, short.maxstring, short.maxother, short.maxlist, short.maxdict = 3, limit, limit, 6, 6
    try:
        text = short.repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        text = f"<an integer of {value.bit_length()} bits>"
    return text if len(text) <= limit else text[:limit] + "..."
