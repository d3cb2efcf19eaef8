"""The report's section for ``tim align`` results kept in run folders (``RUN/align/align.json``, as the command
that a failed weight-sync check prints writes them): per run, the sides, the first divergence, the share of tokens
whose expert set differs, the per-layer table and the plot."""

from __future__ import annotations

import html
import json
import shutil
from pathlib import Path

from tim_megatron.report.plots import inside


def found(runs) -> list[tuple[str, Path]]:
    """(run name, align folder) for each run whose folder holds ``align/align.json``."""
    return [(r.name, r.path / "align") for r in runs if (r.path / "align" / "align.json").is_file()]


def section(runs, out: Path, notices: list[str]) -> list[str]:
    """The section's HTML parts (empty when no run has an alignment); the plots are copied into ``out``."""
    e = html.escape
    parts: list[str] = []
    for i, (name, folder) in enumerate(found(runs)):
        try:
            rep = json.loads((folder / "align.json").read_text())
            where, sides = rep.get("where", "?"), " vs ".join(map(str, rep.get("sides", [])))
        except (OSError, ValueError, TypeError) as err:
            notices.append(f"{folder / 'align.json'}: not readable ({err}); left out of the report")
            continue
        differing = rep.get("tokens_differing_any_layer")
        share = "n/a (dense)" if differing is None else f"{100 * float(differing):.1f}%"
        parts.append(
            f"<h3>{e(name)}: {e(sides)}</h3><p>First divergence: <b>{e(str(where))}</b> "
            f"(tolerance {e(str(rep.get('tolerance')))}, {e(str(rep.get('tokens')))} tokens). "
            f"Tokens whose expert set differs in at least one layer: {e(share)}.</p>"
        )
        table = folder / "align.txt"
        if table.is_file():
            parts.append(f"<pre>{e(table.read_text())}</pre>")
        png = folder / "align.png"
        if png.is_file():
            copied = f"align-{i}.png"
            shutil.copyfile(png, inside(out, copied))
            parts.append(f'<figure><img src="{copied}" alt="{e(name)} alignment"></figure>')
    if parts:
        parts.insert(0, "<h2>Where the engine and the trainer part ways (tim align)</h2>")
    return parts
