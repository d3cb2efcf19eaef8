"""Generated tables in the docs: ``tim lab GRID --docs FILE`` puts the grid's ``tables.md`` into FILE.

FILE holds a block per grid, between ``<!-- tables:NAME -->`` and ``<!-- /tables:NAME -->`` (NAME the grid's
name). The block is replaced with the report's ``tables.md``, headings moved two levels down (``#`` becomes
``###``), and nothing else in the file changes, so no number in a generated block is typed by hand.
"""

from __future__ import annotations

import re
from pathlib import Path

from tim_megatron.lab.grid import GridError


def markers(name: str) -> tuple[str, str]:
    return f"<!-- tables:{name} -->", f"<!-- /tables:{name} -->"


def nested(tables_md: str, levels: int = 2) -> str:
    """The tables' Markdown with every heading ``levels`` deeper."""
    return re.sub(r"^(#+) ", lambda m: "#" * (len(m.group(1)) + levels) + " ", tables_md, flags=re.M)


def include_tables(doc: Path, name: str, tables_md: str) -> None:
    """Replace grid ``name``'s block in ``doc`` with ``tables_md``; the error names the markers it needs."""
    begin, end = markers(name)
    try:
        text = doc.read_text()
    except OSError as e:
        raise GridError(f"--docs {doc}: {e.strerror or e}") from None
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i or text.count(begin) != 1 or text.count(end) != 1:
        raise GridError(
            f"--docs {doc}: needs exactly one block for grid {name!r}, the lines {begin!r} and {end!r} in that "
            "order; the generated tables go between them"
        )
    from tim_megatron.safe_files import write_atomic

    body = nested(tables_md).strip()
    write_atomic(doc, text[: i + len(begin)] + "\n\n" + body + "\n\n" + text[j:])
