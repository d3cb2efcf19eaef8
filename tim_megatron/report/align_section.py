"""The report's section for ``tim align`` results kept in run folders (``RUN/align/align.json``, as the command
that a failed weight-sync check prints writes them): per run, the sides, the first divergence, the share of tokens
whose expert set differs, the per-layer table and the plot.

A run folder may come from elsewhere, so its ``align`` folder and files are read only as regular files inside it
(:mod:`tim_megatron.safe_files`: no link is followed, no FIFO opened), each within a size limit, and
``align.json`` must have the shape ``tim align`` writes: anything else leaves that run's section out with a notice
naming the file, never the report.
"""

from __future__ import annotations

import html
import json
import math
import os
from pathlib import Path

from tim_megatron.safe_files import UnsafePathError, copy_regular, read_text
from tim_megatron.untrusted import shown

MAX_JSON_BYTES = 16 << 20
"""An ``align.json`` larger than this is not read (a 94-layer model's is a few hundred KiB)."""
MAX_TEXT_BYTES = 1 << 20
MAX_PNG_BYTES = 16 << 20


def found(runs) -> list[tuple[str, Path, Path]]:
    """(run name, run folder, align folder) for each run that has an ``align/align.json`` entry of any kind (what it
    is, is judged when it is read)."""
    return [
        (r.name, r.path, r.path / "align") for r in runs if os.path.lexists(r.path / "align" / "align.json")
    ]


class AlignFileError(ValueError):
    """An ``align.json`` that is not what ``tim align`` writes."""


def _number(rep: dict, key: str, *, optional: bool = False) -> float | None:
    v = rep.get(key)
    if v is None and optional:
        return None
    try:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ValueError
        return float(v)
    except (ValueError, OverflowError):  # OverflowError: an integer no float can hold
        raise AlignFileError(f"{key} = {shown(v, 40)} is not a finite number") from None


def summary(text: str) -> dict:
    """The figures the section shows, from ``align.json``'s text; :class:`AlignFileError` names what is wrong."""
    try:
        rep = json.loads(text)
    except (
        ValueError,
        RecursionError,
    ) as e:  # JSONDecodeError, a huge integer; nesting deeper than Python parses
        raise AlignFileError(f"not JSON ({str(e)[:120]})") from None
    if not isinstance(rep, dict):
        raise AlignFileError(f"a JSON {type(rep).__name__}, not an object")
    where, sides = rep.get("where"), rep.get("sides")
    if not isinstance(where, str):
        raise AlignFileError("where is not a string")
    if not (isinstance(sides, list) and len(sides) == 2 and all(isinstance(s, str) for s in sides)):
        raise AlignFileError("sides is not a list of two names")
    share = _number(rep, "tokens_differing_any_layer", optional=True)
    if share is not None and not 0 <= share <= 1:
        raise AlignFileError(f"tokens_differing_any_layer = {share} is not a share in [0, 1]")
    tokens = rep.get("tokens")
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise AlignFileError("tokens is not an integer")
    return {
        "where": where,
        "sides": " vs ".join(sides),
        "share": share,
        "tolerance": _number(rep, "tolerance"),
        "tokens": tokens,
    }


def section(runs, out: Path, notices: list[str]) -> list[str]:
    """The section's HTML parts (empty when no run has an alignment); the plots are copied into ``out``."""
    e = html.escape
    parts: list[str] = []
    for i, (name, run, folder) in enumerate(found(runs)):
        try:
            s = summary(
                read_text(folder / "align.json", root=run, what="align.json", max_bytes=MAX_JSON_BYTES)
            )
        except (OSError, UnicodeDecodeError, AlignFileError) as err:  # UnsafePathError is an OSError
            notices.append(_notice(folder / "align.json", err, "left out of the report"))
            continue
        share = "n/a (dense)" if s["share"] is None else f"{100 * s['share']:.1f}%"
        parts.append(
            f"<h3>{e(name)}: {e(s['sides'])}</h3><p>First divergence: <b>{e(s['where'])}</b> "
            f"(tolerance {s['tolerance']:g}, {s['tokens']} tokens). "
            f"Tokens whose expert set differs in at least one layer: {e(share)}.</p>"
        )
        table = folder / "align.txt"
        if os.path.lexists(table):
            try:
                parts.append(
                    f"<pre>{e(read_text(table, root=run, what='align.txt', max_bytes=MAX_TEXT_BYTES))}</pre>"
                )
            except (OSError, UnicodeDecodeError) as err:
                notices.append(_notice(table, err, "its table left out of the report"))
        png = folder / "align.png"
        if os.path.lexists(png):
            copied = f"align-{i}.png"
            try:
                copy_regular(
                    png, out / copied, src_root=run, dst_root=out, what="align.png", max_bytes=MAX_PNG_BYTES
                )
            except OSError as err:
                notices.append(_notice(png, err, "its plot left out of the report"))
            else:
                parts.append(f'<figure><img src="{copied}" alt="{e(name)} alignment"></figure>')
    if parts:
        parts.insert(0, "<h2>Where the engine and the trainer part ways (tim align)</h2>")
    return parts


def _notice(path: Path, err: Exception, what: str) -> str:
    """A notice naming the file (a refused path's error already names it and what it is)."""
    if isinstance(err, UnsafePathError):
        return f"{err}; {what}"
    return f"{path}: {str(err)[:200]}; {what}"
