"""A lab's completed runs as one archive kept in the repository (``lab/data/<grid>.tar.xz``), and back.

The archive holds, for every completed run of the grid, the files the report reads (:data:`ARCHIVED`) under
``<grid>/<arm>/seed<N>/``. Members are sorted, with mtime 0, owner 0 and mode 0644, so the same runs always give the
same bytes. ``tim lab GRID --aggregate-only --from-archive FILE`` rebuilds the report from it alone: every run in the
archive must be a completed run of today's grid, or the command stops and names the run (a report silently missing
runs would be a different report)."""

from __future__ import annotations

import contextlib
import io
import lzma
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tim_megatron.lab.grid import Grid, GridError
from tim_megatron.lab.runner import LAB_FILE, completed_runs
from tim_megatron.safe_files import read_bytes, regular_file, write_atomic

ARCHIVED = (LAB_FILE, "metrics.jsonl", "recipe.yaml", "run.json")
"""The files of a run the report reads (statistics, traces, the recipe hash, the status and start time)."""

MAX_MEMBER_BYTES = 256 << 20
"""No file in an archive is larger (a metrics file of a 100-step run is well under 1 MiB)."""

MAX_TOTAL_BYTES = 2 << 30
"""The most an archive may unpack to."""


def write_archive(grid: Grid, plans, root: Path, path: Path) -> int:
    """Write the completed runs of ``grid`` under ``root`` to ``path`` (xz-compressed tar), atomically; returns
    the number of runs. A run lacking one of :data:`ARCHIVED` is an error naming it."""
    buf = io.BytesIO()
    runs = completed_runs(grid, plans, root)
    if not runs:
        raise GridError(f"--write-archive {path}: no completed run of grid {grid.name!r} under {root}")
    with (
        lzma.open(buf, "wb", preset=9) as xz,
        tarfile.open(fileobj=xz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for arm, seed, d in runs:
            for name in ARCHIVED:
                f = d / name
                if not regular_file(f):
                    raise GridError(
                        f"--write-archive: {f} is missing or not a regular file (every run needs {name})"
                    )
                data = read_bytes(f, what=f"run file {name}", max_bytes=MAX_MEMBER_BYTES)
                info = tarfile.TarInfo(f"{grid.name}/{arm}/seed{seed}/{name}")
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                tar.addfile(info, io.BytesIO(data))
    write_atomic(path, buf.getvalue(), what="lab archive")
    return len(runs)


def _check_members(tar: tarfile.TarFile, grid: Grid, path: Path) -> None:
    total = 0
    for m in tar.getmembers():
        parts = Path(m.name).parts
        if not m.isfile() or len(parts) != 4 or parts[0] != grid.name or parts[3] not in ARCHIVED:
            raise GridError(
                f"--from-archive {path}: member {m.name!r} is not <grid>/<arm>/seed<N>/<file> for grid "
                f"{grid.name!r} with file one of {', '.join(ARCHIVED)} (regular files only)"
            )
        if m.size > MAX_MEMBER_BYTES:
            raise GridError(
                f"--from-archive {path}: member {m.name!r} is {m.size} bytes (at most {MAX_MEMBER_BYTES})"
            )
        total += m.size
    if total > MAX_TOTAL_BYTES:
        raise GridError(f"--from-archive {path}: unpacks to {total} bytes (at most {MAX_TOTAL_BYTES})")


@contextlib.contextmanager
def unpacked(grid: Grid, plans, path: Path) -> Iterator[Path]:
    """The runs of the archive at ``path`` in a temporary folder, as a lab root for ``grid`` (removed on exit).
    Every run in it must be a completed run of today's grid: else an error names the first that is not."""
    if not regular_file(path):
        raise GridError(f"--from-archive {path}: no such file (an archive written by --write-archive)")
    with tempfile.TemporaryDirectory(prefix="tim-lab-archive-") as tmp:
        try:
            with tarfile.open(path, mode="r:xz") as tar:
                _check_members(tar, grid, path)
                tar.extractall(tmp, filter="data")
        except (tarfile.TarError, lzma.LZMAError, EOFError) as e:
            raise GridError(f"--from-archive {path}: not a readable .tar.xz ({e})") from e
        root = Path(tmp) / grid.name
        accepted = {(arm, seed) for arm, seed, _ in completed_runs(grid, plans, root)}
        for arm_dir in sorted(root.iterdir()) if root.is_dir() else []:
            for seed_dir in sorted(arm_dir.iterdir()):
                seed = seed_dir.name.removeprefix("seed")
                if not seed.isdigit() or (arm_dir.name, int(seed)) not in accepted:
                    raise GridError(
                        f"--from-archive {path}: run {arm_dir.name}/{seed_dir.name} is not a completed run of grid "
                        f"{grid.path} as it is today (an arm or seed it does not have, or a recipe that resolves "
                        "differently now)"
                    )
        yield root
