"""Open a dataset named by ``data.*.path``: a local parquet/JSON Lines file or folder, or a Hub dataset name.

Every row keeps a location for error messages: the file and line of a JSON Lines row, the file and row index
of a parquet row, the split and row index of a Hub row. JSON files are read line by line here first, because
the HF loader reports an undecodable byte, a broken line or an empty file without saying where.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tim_megatron.data.checks import bad_rows, json_type
from tim_megatron.data.errors import DataError

FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}
"""Local file suffixes read, and the HF ``datasets`` loader of each."""
# Suffixes that mark a value as a file path even when it has the owner/name shape of a Hub dataset.
PATH_SUFFIXES = {*FORMATS, ".csv", ".tsv", ".txt", ".arrow", ".gz", ".bz2", ".xz", ".zst", ".zip"}
HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
ALLOWED = (
    "allowed: a .parquet, .jsonl or .json file, a folder of .parquet or .jsonl files, or a Hub dataset name "
    "(owner/name)"
)


@dataclass(frozen=True)
class Span:
    """The rows of one file (or one Hub split) inside the loaded dataset."""

    name: str
    """How a message names the file or split."""
    start: int
    """Index of its first row in the dataset."""
    lines: tuple[int, ...] | None
    """Line number of each of its rows (JSON Lines), or None: rows are named by index."""


@dataclass(frozen=True)
class Rows:
    """A loaded HF dataset, and where each of its rows came from."""

    dataset: Any
    """The ``datasets.Dataset``."""
    head: str
    """The recipe key (and its value where a location does not show it), the start of every message."""
    spans: tuple[Span, ...]
    """Files in dataset order."""

    def locate(self, i: int) -> str:
        """``data/train.jsonl line 7``, ``part-0.parquet row index 3`` or ``split train row index 5``."""
        span = self.spans[bisect.bisect_right([s.start for s in self.spans], i) - 1]
        k = i - span.start
        at = f"line {span.lines[k]}" if span.lines is not None else f"row index {k}"
        return f"{span.name} {at}" if span.name else at


def is_hub_name(value: str) -> bool:
    """``owner/name`` with no file suffix, whose first part is not a local folder (``data/train`` with a
    ``data/`` folder here is a missing local path, not a Hub dataset)."""
    return (
        HUB_NAME.fullmatch(value) is not None
        and Path(value).suffix.lower() not in PATH_SUFFIXES
        and not Path(value.split("/")[0]).is_dir()
    )


def read_dataset(path: str, *, split: str, key: str, check: Callable[[dict], str | None]) -> Rows:
    """The dataset at ``path`` (the value of recipe key ``key``).

    ``check``: called on every JSON object read from a local JSON file; it returns a problem with the row
    or None. Problems are gathered and raised together, each with its file and line."""
    local = Path(path).expanduser()
    if local.exists():
        return _read_local(local, path=path, key=key, check=check)
    if not is_hub_name(path):
        raise DataError(f"{key} = {path}: no such file or folder (relative to {Path.cwd()}); {ALLOWED}")
    import datasets

    ds = _load(lambda: datasets.load_dataset(path, split=split), what=f"{key} = {path}")
    return Rows(ds, f"{key} = {path}", (Span(f"split {split}", 0, None),))


def _read_local(local: Path, *, path: str, key: str, check: Callable[[dict], str | None]) -> Rows:
    import datasets

    head = key if local.is_file() else f"{key} = {path}"  # a location names the file itself
    files = _local_files(local, head=head)
    spans, problems, start = [], [], 0
    for f in files:
        if FORMATS[f.suffix.lower()] == "json":
            lines, count = _scan_json(f, head=head, check=check, problems=problems)
        else:
            lines, count = None, _parquet_rows(f, head=head)
        spans.append(Span(str(f), start, lines))
        start += count
    if problems:
        raise bad_rows(head, problems)
    fmt = FORMATS[files[0].suffix.lower()]
    ds = _load(
        lambda: datasets.load_dataset(fmt, data_files=[str(f) for f in files], split="train"),
        what=f"{key} = {path}",
    )
    if len(ds) != start:  # the loader split the rows differently from the scan: name rows by index only
        return Rows(ds, f"{key} = {path}", (Span("", 0, None),))
    return Rows(ds, head, tuple(spans))


def _local_files(local: Path, *, head: str) -> list[Path]:
    if local.is_dir():
        files = sorted(local.glob("**/*.parquet")) + sorted(local.glob("**/*.jsonl"))
        if not files:
            raise DataError(f"{head}: no .parquet or .jsonl files in that folder; {ALLOWED}")
        if len({FORMATS[f.suffix.lower()] for f in files}) > 1:
            raise DataError(f"{head}: the folder holds both .parquet and .jsonl files; allowed: one format")
    else:
        files = [local]
    for f in files:
        if f.suffix.lower() not in FORMATS:
            raise DataError(f"{head}: {f} is not a dataset file (suffix {f.suffix!r}); {ALLOWED}")
        if not f.is_file():  # a FIFO or a device would block the reader or never end
            raise DataError(f"{head}: {f} is not a regular file; {ALLOWED}")
    return files


def _scan_json(
    file: Path, *, head: str, check: Callable[[dict], str | None], problems: list[str]
) -> tuple[list[int] | None, int]:
    """(line number of each row, row count) of a JSON Lines file; (None, row count) for a JSON array."""
    lines: list[int] = []
    with file.open("rb") as fh:
        for n, raw in enumerate(fh, 1):
            text = _utf8(raw, at=f"{head}: {file} line {n}")
            if not text.strip():
                continue
            if not lines and text.lstrip().startswith("["):
                return None, _scan_json_array(file, head=head, check=check, problems=problems)
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{head}: {file} line {n}: not valid JSON ({e.msg} at column {e.colno}); allowed: one JSON "
                    "object per line"
                ) from None
            _check_row(
                row,
                f"{file} line {n}",
                head=head,
                allowed='one JSON object per line, such as {"prompt": "...", "answer": "..."}',
                check=check,
                problems=problems,
            )
            lines.append(n)
    if not lines:
        raise DataError(f"{head}: {file} is empty (no JSON rows); allowed: one JSON object per line")
    return lines, len(lines)


def _scan_json_array(
    file: Path, *, head: str, check: Callable[[dict], str | None], problems: list[str]
) -> int:
    raw = file.read_bytes()
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        line, line_start = raw.count(b"\n", 0, e.start) + 1, raw.rfind(b"\n", 0, e.start) + 1
        _utf8(raw[line_start : e.end], at=f"{head}: {file} line {line}")
        raise  # unreachable: _utf8 raised on the same byte
    except json.JSONDecodeError as e:
        raise DataError(
            f"{head}: {file} line {e.lineno}: not valid JSON ({e.msg} at column {e.colno}); allowed: a JSON "
            "array of objects, or one JSON object per line"
        ) from None
    if not isinstance(doc, list) or not doc:
        raise DataError(f"{head}: {file} holds no rows; allowed: a non-empty JSON array of objects")
    for k, row in enumerate(doc):
        _check_row(
            row,
            f"{file} row index {k}",
            head=head,
            allowed="a JSON array of objects",
            check=check,
            problems=problems,
        )
    return len(doc)


def _check_row(
    row, where: str, *, head: str, allowed: str, check: Callable[[dict], str | None], problems: list[str]
) -> None:
    """One parsed row at ``where`` (file and line or index): not an object raises; ``check``'s problem is kept."""
    if not isinstance(row, dict):
        raise DataError(f"{head}: {where}: a JSON {json_type(row)}, not an object; allowed: {allowed}")
    problem = check(row)
    if problem:
        problems.append(f"{where}: {problem}")


def _utf8(raw: bytes, *, at: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{at}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line); allowed: "
            "UTF-8 (save the file as UTF-8)"
        ) from None


def _parquet_rows(file: Path, *, head: str) -> int:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(file).metadata.num_rows
    except Exception as e:  # pyarrow raises several types for a file that is not parquet
        raise DataError(f"{head}: {file} is not a readable parquet file ({type(e).__name__}: {e})") from None


def _load(load: Callable[[], Any], *, what: str) -> Any:
    try:
        return load()
    except Exception as e:  # network, format or schema errors from datasets
        cause = e.__cause__ or e  # DatasetGenerationError wraps the reader's own message
        raise DataError(
            f"{what}: could not load the dataset ({type(cause).__name__}: {cause}); {ALLOWED}"
        ) from None
