"""Reading ``run.json``: the one reader, for the run folder's own code, the report, ``tim logs`` and the job script.

``run.json`` may have been edited or copied in by anyone. It is read only when it is a regular file (a link, a FIFO
or a device such as ``/dev/zero`` is refused by name; :mod:`tim_megatron.safe_files` holds the rule), whole only up
to :data:`MAX_META_BYTES`, and a record too deep for the JSON parser (``RecursionError``) is an unreadable record
like any other (:class:`RecordError`). This module imports nothing heavy: the job script runs it in the seconds
after a SIGTERM (:mod:`tim_megatron.slurm.run_record`).
"""

from __future__ import annotations

import json
from pathlib import Path

from tim_megatron.untrusted import UnreadableFile, printable, read_bounded

META_FILE = "run.json"
MAX_META_BYTES = 16 * 2**20
"""Largest ``run.json`` read (the project writes a few kB)."""


class RecordError(ValueError):
    """A ``run.json`` that is not read (a link, special file, too large, not UTF-8, not a JSON object, too deep);
    the message names the file and why, escaped."""

    def __init__(self, message: str, *, unsafe: bool = False):
        super().__init__(message)
        self.unsafe = unsafe
        """The file is a link or special file, or too large: not something a run wrote."""


def read_record(run_dir: str | Path) -> dict:
    """``RUN_DIR/run.json`` as a dict; :class:`RecordError` unless it is a regular file (not a link) of at most
    :data:`MAX_META_BYTES` holding a UTF-8 JSON object the parser can nest into."""
    path = Path(run_dir) / META_FILE
    try:
        data = json.loads(read_bounded(path, MAX_META_BYTES).decode("utf-8"))
    except UnreadableFile as e:
        raise RecordError(printable(str(e)), unsafe=path.exists() or path.is_symlink()) from None
    except UnicodeDecodeError as e:
        raise RecordError(printable(f"{path}: not UTF-8 (byte {e.start})")) from None
    except RecursionError:
        raise RecordError(printable(f"{path}: nested too deep to parse")) from None
    except ValueError as e:  # JSONDecodeError; an integer past Python's digit limit
        raise RecordError(printable(f"{path}: not JSON ({e})")[:300]) from None
    if not isinstance(data, dict):
        raise RecordError(printable(f"{path}: holds {type(data).__name__}, not a JSON object"))
    return data
