"""Reading files from run folders, which anyone may have written or copied in.

Only regular files are opened, never through a link (a link to ``/dev/zero`` or a FIFO is refused, and a FIFO
cannot block the open; :mod:`tim_megatron.safe_files` holds the rule), and reads are bounded by the bytes actually read, since ``st_size`` says 0 for a device. Text read
from such a file is shown on a terminal only through :func:`printable` or :func:`shown`, so an escape
sequence in a path or a name cannot reach the terminal.

**One way to print what was recorded.** Everything a rich console prints that came from outside the code (run.json,
a recipe, a log, an archive, a path or a value the user typed, an exception's message quoting any of them) goes
through :func:`recorded`: control characters escaped, rich markup escaped (``[/data]`` is text, never a tag), and
clipped at a length that says how much was left out. ``tests/test_console_text.py`` walks every console call of the
package and fails on an interpolated value that reaches rich any other way.
"""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import BinaryIO

RECORDED_LIMIT = 300
"""Characters of one recorded value a console line shows (the rest is counted, not printed)."""


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


def clip(text: str, limit: int) -> str:
    """``text`` cut at ``limit`` characters, saying how many were left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


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


def terminal(**options):
    """The project's rich console: no wrapping (paths and ids in the output are copied and parsed) and no emoji codes
    (``:smile:`` in a recorded text stays text; markup has no escape for them). ``options`` go to ``Console``."""
    from rich.console import Console

    return Console(**{"soft_wrap": True, "emoji": False, **options})


def recorded(value: object, limit: int = RECORDED_LIMIT, *, lines: bool = False) -> str:
    """``value`` as console text: controls escaped (:func:`printable`; newlines and tabs kept when ``lines``),
    clipped to ``limit`` characters with the count of the rest, and rich markup escaped, so the console prints it as
    itself (but a trailing backslash, which rich's escape doubles so that it cannot escape a tag after it). Any
    value: a non-string is shown by ``str`` (a huge integer by its size)."""
    from rich.markup import escape

    if isinstance(value, str):
        text = value
    else:
        try:
            text = str(value)
        except ValueError:  # an int past Python's digit limit for str()
            text = f"<an integer of {value.bit_length()} bits>"  # type: ignore[attr-defined]
    cut = len(text) - limit
    text = text[:limit]
    if lines:
        text = "\n".join("\t".join(printable(p) for p in row.split("\t")) for row in text.split("\n"))
    else:
        text = printable(text)
    if cut > 0:
        text += f"... ({cut} more characters)"
    return escape(text)
