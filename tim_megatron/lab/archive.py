"""A lab's completed runs as one archive kept in the repository (``lab/data/<grid>.tar.xz``), and back.

The archive holds, for every completed run of the grid, the files the report reads (:data:`ARCHIVED`) under
``<grid>/<arm>/seed<N>/``. Members are sorted, with mtime 0, owner 0 and mode 0644, so the same runs always give the
same bytes. ``tim lab GRID --aggregate-only --from-archive FILE`` rebuilds the report from it alone: every run in the
archive must be a completed run of today's grid, or the command stops and names the run (a report silently missing
runs would be a different report; one the archive lacks is named in the report's notices).

Writing (``--write-archive``): the target is checked before any run (:func:`check_target`): its folder exists, it
is no folder, link, FIFO or device, it lies outside the run folders it reads and the report folder, and an existing
file is replaced only when told (``--overwrite-archive``). A run file over :data:`MAX_MEMBER_BYTES` is an error
naming the run.

Reading (:func:`unpacked`) streams the archive once: each member's header is checked before a byte of its data is
decompressed (the layout, exact names: an arm of the grid, ``seed`` and ASCII digits without a leading zero, one
of :data:`ARCHIVED`; a regular file; its size), its data is copied in chunks and counted, and the decompressed
stream itself is cut off once it runs past what the accepted members and their headers can take. A 10 MB archive
declaring a 64 GiB member is refused at that member's header.
"""

from __future__ import annotations

import contextlib
import io
import lzma
import os
import re
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tim_megatron.lab.grid import Grid, GridError
from tim_megatron.lab.runner import LAB_FILE, completed_runs
from tim_megatron.safe_files import describe, open_regular, write_atomic

ARCHIVED = (LAB_FILE, "metrics.jsonl", "recipe.yaml", "run.json")
"""The files of a run the report reads (statistics, traces, the recipe hash, the status and start time)."""

MAX_MEMBER_BYTES = 256 << 20
"""No file in an archive is larger (a metrics file of a 100-step run is well under 1 MiB)."""

MAX_TOTAL_BYTES = 2 << 30
"""The most an archive may unpack to."""

HEADER_ALLOWANCE = 64 << 10
"""Decompressed bytes allowed per member beyond its data (its headers, a long name's, the end blocks)."""

CHUNK = 1 << 20
SEED_DIR = re.compile(r"seed(0|[1-9][0-9]*)")
"""A run's seed folder, used with ``fullmatch``: ``seed`` and ASCII digits, no leading zero (``seed01``,
``seed١`` and ``seed²`` are not seed 1)."""


def _real(path: Path) -> Path:
    return Path(os.path.realpath(os.path.abspath(path)))


def check_target(
    path: Path, *, root: Path | None = None, out: Path | None = None, overwrite: bool = False
) -> None:
    """Refuse a ``--write-archive`` target before anything runs (see the module docstring); a :class:`GridError`
    names the path, what it is and what is allowed."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    pkind = describe(parent)
    if not parent.is_dir():
        raise GridError(
            f"--write-archive {path}: its folder {parent} is {'missing' if pkind == 'missing' else pkind}; "
            "allowed: a path in an existing folder (create the folder first)"
        )
    kind = describe(path)
    if kind not in ("missing", "a regular file"):
        raise GridError(
            f"--write-archive {path} is {kind}; allowed: a new file, or a regular file to replace"
        )
    for name, folder in (("the run folders (--root)", root), ("the report folder (--out)", out)):
        if folder is not None and _real(path).is_relative_to(_real(folder)):
            raise GridError(
                f"--write-archive {path} lies inside {name} {folder}, which this command reads or writes; "
                "allowed: a path outside it (lab/data/<grid>.tar.xz)"
            )
    if kind == "a regular file" and not overwrite:
        raise GridError(
            f"--write-archive {path} already exists; pass --overwrite-archive to replace it, or name a new file"
        )


def write_archive(
    grid: Grid, plans, root: Path, path: Path, *, out: Path | None = None, overwrite: bool = False
) -> int:
    """Write the completed runs of ``grid`` under ``root`` to ``path`` (xz-compressed tar), atomically; returns
    the number of runs. A run lacking one of :data:`ARCHIVED`, or with one over :data:`MAX_MEMBER_BYTES`, is an
    error naming it. ``path`` is checked as :func:`check_target` does (``overwrite``: an existing file may be
    replaced)."""
    check_target(path, root=root, out=out, overwrite=overwrite)
    buf = io.BytesIO()
    runs = completed_runs(grid, plans, root)
    if not runs:
        raise GridError(f"--write-archive {path}: no completed run of grid {grid.name!r} under {root}")
    total = 0
    with (
        lzma.open(buf, "wb", preset=9) as xz,
        tarfile.open(fileobj=xz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for arm, seed, d in runs:
            for name in ARCHIVED:
                f = d / name
                kind = describe(f)
                if kind != "a regular file":
                    raise GridError(
                        f"--write-archive {path}: run {arm}/seed{seed}'s {name} is {kind} (every run needs {name} "
                        "as a regular file)"
                    )
                size = os.lstat(f).st_size
                if size > MAX_MEMBER_BYTES:
                    raise GridError(
                        f"--write-archive {path}: run {arm}/seed{seed}'s {name} has {size} bytes, over the "
                        f"archive's limit of {MAX_MEMBER_BYTES} bytes per file"
                    )
                try:
                    with open_regular(f, what=f"run file {name}", max_bytes=MAX_MEMBER_BYTES) as src:
                        data = src.read(MAX_MEMBER_BYTES + 1)
                except OSError as e:
                    raise GridError(f"--write-archive {path}: run {arm}/seed{seed}'s {name}: {e}") from None
                if len(data) > MAX_MEMBER_BYTES:
                    raise GridError(
                        f"--write-archive {path}: run {arm}/seed{seed}'s {name} grew past the archive's limit of "
                        f"{MAX_MEMBER_BYTES} bytes per file while it was read"
                    )
                total += len(data)
                if total > MAX_TOTAL_BYTES:
                    raise GridError(
                        f"--write-archive {path}: the runs' files pass {MAX_TOTAL_BYTES} bytes in all at run "
                        f"{arm}/seed{seed} (the most an archive may unpack to)"
                    )
                info = tarfile.TarInfo(f"{grid.name}/{arm}/seed{seed}/{name}")
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                tar.addfile(info, io.BytesIO(data))
    try:
        write_atomic(path, buf.getvalue(), what="lab archive")
    except OSError as e:
        raise GridError(f"--write-archive {path}: {e.strerror or e}") from None
    return len(runs)


class _TooLarge(Exception):
    pass


class _Inflated(io.RawIOBase):
    """The decompressed bytes of an xz file, read in chunks, refused once past ``allowance`` (raised by the
    reader as members are accepted): the decompression never runs ahead of what the checks let through."""

    def __init__(self, f):
        self.f = f
        self.d = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
        self.count = 0
        self.allowance = HEADER_ALLOWANCE

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if not len(b):
            return 0
        out = b""
        while not out and not self.d.eof:
            data = self.f.read(CHUNK) if self.d.needs_input else b""
            if self.d.needs_input and not data:
                raise EOFError("the compressed data ends before its end-of-stream marker")
            out = self.d.decompress(data, max_length=min(len(b), CHUNK))
        self.count += len(out)
        if self.count > self.allowance:
            raise _TooLarge(self.count)
        b[: len(out)] = out
        return len(out)


def _member_error(path: Path, name: str, why: str) -> GridError:
    return GridError(f"--from-archive {path}: member {name!r} {why}")


def _check_header(m: tarfile.TarInfo, grid: Grid, path: Path, seen: set[str]) -> tuple[str, str, str]:
    """(arm, seed folder, file) of member ``m``, or a :class:`GridError` naming it and the rule it breaks."""
    parts = m.name.split("/")
    layout = (
        f"is not <grid>/<arm>/seed<N>/<file> for grid {grid.name!r} with file one of {', '.join(ARCHIVED)} "
        "(regular files only)"
    )
    if m.type not in (tarfile.REGTYPE, tarfile.AREGTYPE) or len(parts) != 4:
        raise _member_error(path, m.name, layout)
    g, arm, seed, name = parts
    if g != grid.name or name not in ARCHIVED:
        raise _member_error(path, m.name, layout)
    arms = [a.name for a in grid.arms]
    if arm not in arms:
        raise _member_error(
            path, m.name, f"names arm {arm!r}, not an arm of grid {grid.name!r} ({', '.join(arms)})"
        )
    if not SEED_DIR.fullmatch(seed):
        raise _member_error(
            path, m.name, f"has seed folder {seed!r}; allowed: 'seed' and ASCII digits without a leading zero"
        )
    if int(seed[4:]) not in grid.seeds:
        raise _member_error(
            path, m.name, f"names seed {seed[4:]}, not one of grid {grid.name!r}'s {grid.seeds}"
        )
    if m.name in seen:
        raise _member_error(path, m.name, "appears twice")
    if m.size > MAX_MEMBER_BYTES:
        raise _member_error(path, m.name, f"is {m.size} bytes (at most {MAX_MEMBER_BYTES})")
    return arm, seed, name


def _extract(f, grid: Grid, dest: Path, path: Path) -> set[tuple[str, int]]:
    """Check and copy every member of the archive read from ``f`` into ``dest``; the (arm, seed) runs it holds."""
    stream = _Inflated(f)
    seen: set[str] = set()
    runs: set[tuple[str, int]] = set()
    total = 0
    with tarfile.open(fileobj=stream, mode="r|") as tar:  # tarfile reads ahead at most one record
        for m in tar:
            arm, seed, name = _check_header(m, grid, path, seen)
            total += m.size
            if total > MAX_TOTAL_BYTES:
                raise GridError(f"--from-archive {path}: unpacks to more than {MAX_TOTAL_BYTES} bytes")
            seen.add(m.name)
            stream.allowance = total + HEADER_ALLOWANCE * (len(seen) + 1) + 512 * len(seen)
            target = dest / grid.name / arm / seed
            target.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(m)
            copied = 0
            with open(target / name, "xb") as out:
                while chunk := src.read(CHUNK):
                    copied += len(chunk)
                    if copied > min(m.size, MAX_MEMBER_BYTES):
                        raise _member_error(path, m.name, f"holds more than its {m.size} bytes")
                    out.write(chunk)
            runs.add((arm, int(seed[4:])))
    return runs


@contextlib.contextmanager
def unpacked(grid: Grid, plans, path: Path) -> Iterator[Path]:
    """The runs of the archive at ``path`` in a temporary folder, as a lab root for ``grid`` (removed on exit).
    Every run in it must be a completed run of today's grid: else an error names the first that is not."""
    kind = describe(path)
    if kind != "a regular file":
        what = "no such file" if kind == "missing" else f"is {kind}"
        raise GridError(
            f"--from-archive {path}: {what}; allowed: a regular file (an archive written by --write-archive)"
        )
    try:
        f = open_regular(path, what="archive")
    except OSError as e:
        raise GridError(f"--from-archive {path}: {e.strerror or e}") from None
    with f, tempfile.TemporaryDirectory(prefix="tim-lab-archive-") as tmp:
        try:
            held = _extract(f, grid, Path(tmp), path)
        except _TooLarge as e:
            raise GridError(
                f"--from-archive {path}: its decompressed stream runs past what its members declare (more than "
                f"{e.args[0]} bytes); refused"
            ) from None
        except (tarfile.TarError, lzma.LZMAError, EOFError) as e:
            raise GridError(f"--from-archive {path}: not a readable .tar.xz ({e})") from e
        root = Path(tmp) / grid.name
        accepted = {(arm, seed) for arm, seed, _ in completed_runs(grid, plans, root)}
        for arm, seed in sorted(held):
            if (arm, seed) not in accepted:
                raise GridError(
                    f"--from-archive {path}: run {arm}/seed{seed} is not a completed run of grid {grid.path} as it is "
                    "today (an arm or seed it does not have, or a recipe that resolves differently now)"
                )
        yield root
