"""The lab's committed run archives (lab/data/<grid>.tar.xz): written reproducibly, read back only when every run in
them is a completed run of today's grid, and enough to rebuild a report without the run folders."""

from __future__ import annotations

import io
import lzma
import re
import tarfile
from pathlib import Path

import pytest

from tim_megatron.lab.archive import unpacked, write_archive
from tim_megatron.lab.grid import GridError, load_grid, plan
from tim_megatron.lab.main import run_lab

REPO = Path(__file__).resolve().parents[1]
PILOT = REPO / "lab" / "data" / "D-pilot.tar.xz"
PILOT_GRID = REPO / "lab" / "D-pilot.yaml"


def _pilot():
    grid = load_grid(PILOT_GRID)
    return grid, plan(grid)


def _members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path, "r:xz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def _archive(path: Path, members: dict[str, bytes]) -> Path:
    buf = io.BytesIO()
    with lzma.open(buf, "wb") as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(buf.getvalue())
    return path


def test_the_pilot_archive_unpacks_and_writes_back_to_the_same_bytes(tmp_path):
    grid, plans = _pilot()
    with unpacked(grid, plans, PILOT) as root:
        n = write_archive(grid, plans, root, tmp_path / "again.tar.xz")
        assert sorted(p.parent.name for p in root.glob("*/seed*/run.json")) == ["seed1"] * 3 + ["seed2"] * 3
    assert n == 6  # 3 arms x 2 seeds, every one a completed run of today's grid
    # the tar stream byte for byte (xz's own bytes could change with the liblzma version)
    assert lzma.decompress((tmp_path / "again.tar.xz").read_bytes()) == lzma.decompress(PILOT.read_bytes())


def test_a_report_from_the_archive_equals_the_report_from_the_run_folders(tmp_path):
    grid, plans = _pilot()
    with unpacked(grid, plans, PILOT) as root:
        folders = tmp_path / "runs"
        for f in root.rglob("*"):
            if f.is_file():
                (folders / f.relative_to(root)).parent.mkdir(parents=True, exist_ok=True)
                (folders / f.relative_to(root)).write_bytes(f.read_bytes())
    quiet = dict(aggregate_only=True, log=lambda m: None, command="tim lab lab/D-pilot.yaml")
    a = run_lab(str(PILOT_GRID), root=folders, out=tmp_path / "a", **quiet)
    b = run_lab(str(PILOT_GRID), from_archive=PILOT, out=tmp_path / "b", **quiet)
    assert sum(len(s) for s in a["lab"].runs.values()) == sum(len(s) for s in b["lab"].runs.values()) == 6
    for name in ("tables.md", "verdicts.csv", "deficits.csv", "arms.csv", "detectors.csv"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert {a: sorted(s) for a, s in b["lab"].runs.items()} == {
        "exact": [1, 2],
        "inject-noise-1": [1, 2],
        "inject-noise-3": [1, 2],
    }


def test_an_archive_run_whose_recipe_no_longer_matches_the_grid_is_named(tmp_path):
    grid, plans = _pilot()
    members = _members(PILOT)
    key = "D-pilot/inject-noise-3/seed2/recipe.yaml"
    members[key] = members[key].replace(b"lr: 0.0003", b"lr: 0.0005")
    members["D-pilot/inject-noise-3/seed2/lab.json"] = b"{}"
    bad = _archive(tmp_path / "bad.tar.xz", members)
    with (
        pytest.raises(GridError, match="run inject-noise-3/seed2 is not a completed run of grid"),
        unpacked(grid, plans, bad),
    ):
        pass


@pytest.mark.parametrize(
    "name, why",
    [
        ("../escape/exact/seed1/run.json", "is not <grid>/<arm>/seed<N>/<file>"),
        ("D-pilot/exact/seed1/notes.txt", "is not <grid>/<arm>/seed<N>/<file>"),
        ("other-grid/exact/seed1/run.json", "for grid 'D-pilot'"),
    ],
)
def test_an_archive_member_outside_the_layout_is_refused_before_anything_is_unpacked(tmp_path, name, why):
    grid, plans = _pilot()
    members = _members(PILOT)
    members[name] = b"{}"
    bad = _archive(tmp_path / "x.tar.xz", members)
    with pytest.raises(GridError, match=why.replace("<", ".").replace(">", ".")), unpacked(grid, plans, bad):
        pass
    assert not (tmp_path / "escape").exists()


def test_from_archive_runs_nothing_and_says_what_it_needs(tmp_path):
    with pytest.raises(GridError, match="needs --aggregate-only"):
        run_lab(str(PILOT_GRID), from_archive=PILOT, out=tmp_path / "r", log=lambda m: None)
    with pytest.raises(GridError, match="no such file"):
        run_lab(
            str(PILOT_GRID), aggregate_only=True, from_archive=tmp_path / "none.tar.xz", log=lambda m: None
        )
    (tmp_path / "junk.tar.xz").write_bytes(b"not xz")
    with pytest.raises(GridError, match="not a readable .tar.xz"):
        run_lab(
            str(PILOT_GRID), aggregate_only=True, from_archive=tmp_path / "junk.tar.xz", log=lambda m: None
        )


GENERATED_BLOCKS = {
    "D": (range(3, 16), ("exact", "inject-noise-1", "inject-noise-3")),
    "E": (range(16, 24), ("exact", "noise-2", "bias", "engine")),
}
"""The experiments whose docs block regenerates from a committed archive: their seeds and arms."""


@pytest.mark.parametrize("name", sorted(GENERATED_BLOCKS))
def test_the_docs_tables_regenerate_byte_for_byte_from_the_committed_runs(tmp_path, name):
    """docs/lab-results.md's generated block for experiment ``name`` is the tables.md of a report rebuilt from
    lab/data/<name>.tar.xz alone (D: 39 runs, 3 arms x seeds 3-15; E: 32 runs, 4 arms x seeds 16-23), byte for
    byte."""
    from tim_megatron.lab.docs import include_tables

    seeds, arms = GENERATED_BLOCKS[name]
    res = run_lab(
        str(REPO / "lab" / f"{name}.yaml"),
        aggregate_only=True,
        from_archive=REPO / "lab" / "data" / f"{name}.tar.xz",
        out=tmp_path / "report",
        log=lambda m: None,
    )
    assert {a: sorted(s) for a, s in res["lab"].runs.items()} == {a: list(seeds) for a in arms}
    committed = (REPO / "docs" / "lab-results.md").read_bytes()
    doc = tmp_path / "lab-results.md"
    doc.write_bytes(committed)
    include_tables(doc, name, (tmp_path / "report" / "tables.md").read_text())
    assert doc.read_bytes() == committed


# ------------------------------------------------------------------------- hostile archives and targets (issue 56)


def _runs_of(root: Path):
    """The runs of an unpacked archive, as the report's rules_text reads them."""
    from types import SimpleNamespace

    runs: dict[str, dict] = {}
    for d in sorted(root.glob("*/seed*")):
        seed = int(d.name[4:])
        runs.setdefault(d.parent.name, {})[seed] = SimpleNamespace(arm=d.parent.name, seed=seed, path=str(d))
    return SimpleNamespace(runs=runs)


def test_ds_rules_sentence_is_the_same_in_every_time_zone(monkeypatch):
    """D's runs wrote their start without a zone (UTC); the sentence read it in the reader's zone, so Berlin said
    the rules changed after the first run and UTC before. Now the same sentence, in UTC, everywhere."""
    import time

    from tim_megatron.lab.report import rules_text

    grid = load_grid(REPO / "lab" / "D.yaml")
    said = {}
    with unpacked(grid, plan(grid), REPO / "lab" / "data" / "D.tar.xz") as root:
        lab = _runs_of(root)
        try:
            for tz in ("UTC", "Europe/Berlin", "America/Los_Angeles"):
                monkeypatch.setenv("TZ", tz)
                time.tzset()
                said[tz] = rules_text(lab)
        finally:
            monkeypatch.undo()
            time.tzset()
    assert len(set(said.values())) == 1, said
    assert "2026-11-28 04:14 UTC" in said["UTC"]


@pytest.mark.parametrize(
    "name, why",
    [
        ("D-pilot/exact/seed01/run.json", "has seed folder 'seed01'"),
        ("D-pilot/exact/seed\u0661/run.json", "has seed folder"),
        ("D-pilot/exact/seed\u00b2/run.json", "has seed folder"),
        ("D-pilot/exact/seed7/run.json", "names seed 7, not one of grid 'D-pilot'"),
        ("D-pilot/../x/run.json", "names arm '..', not an arm of grid 'D-pilot'"),
        ("D-pilot/exact/../run.json", "has seed folder '..'"),
        ("D-pilot/exact/seed1/run.json", "appears twice"),
    ],
)
def test_an_archive_member_must_name_an_arm_and_seed_of_the_grid_exactly(tmp_path, name, why):
    """``seed01`` and ``seed١`` passed as seed 1 and bypassed the completed-run check; ``D-pilot/../x`` passed the
    member check; ``seed²`` and ``exact/../run.json`` ended in tracebacks."""
    grid, plans = _pilot()
    members = [*_members(PILOT).items(), (name, b"{}")]
    buf = io.BytesIO()
    with lzma.open(buf, "wb", preset=0) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        for n, data in members:
            info = tarfile.TarInfo(n)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    bad = tmp_path / "x.tar.xz"
    bad.write_bytes(buf.getvalue())
    with pytest.raises(GridError, match=re.escape(why)), unpacked(grid, plans, bad):
        pass


def test_a_member_over_the_limit_is_refused_at_its_header_before_its_data_is_decompressed(
    tmp_path, monkeypatch
):
    """The header's size is checked before the data is read: data that would fail to decompress further on is
    never reached (before, every header was read first, which decompressed every byte: 152 s for a 10 MB archive
    declaring 64 GiB)."""
    import random

    from tim_megatron.lab import archive

    monkeypatch.setattr(archive, "MAX_MEMBER_BYTES", 1 << 20)
    grid, plans = _pilot()
    data = random.Random(0).randbytes(2 << 20)  # incompressible: the compressed stream is as long as the data
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("D-pilot/exact/seed1/metrics.jsonl")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    packed = bytearray(lzma.compress(raw.getvalue(), preset=0))
    packed[len(packed) // 2] ^= 0xFF  # corrupt in the middle of the member's data
    bad = tmp_path / "big.tar.xz"
    bad.write_bytes(bytes(packed))
    with pytest.raises(GridError, match=r"is 2097152 bytes \(at most 1048576\)"), unpacked(grid, plans, bad):
        pass


@pytest.mark.parametrize("kind", ["link", "folder", "fifo", "device"])
def test_from_archive_names_what_the_path_is(tmp_path, kind):
    import os

    grid, plans = _pilot()
    path = {"device": Path("/dev/zero")}.get(kind, tmp_path / "a.tar.xz")
    if kind == "link":
        path.symlink_to(PILOT)
    elif kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    what = {
        "link": "is a symbolic link",
        "folder": "is a folder",
        "fifo": "is a FIFO",
        "device": "is a character device",
    }
    with (
        pytest.raises(GridError, match=f"--from-archive {re.escape(str(path))}: {what[kind]}"),
        unpacked(grid, plans, path),
    ):
        pass


def test_an_archive_lacking_runs_of_the_grid_gives_a_report_that_names_them(tmp_path):
    members = {k: v for k, v in _members(PILOT).items() if not k.startswith("D-pilot/inject-noise-3/seed2/")}
    part = _archive(tmp_path / "part.tar.xz", members)
    res = run_lab(
        str(PILOT_GRID), aggregate_only=True, from_archive=part, out=tmp_path / "r", log=lambda m: None
    )
    (notice,) = [n for n in res["notices"] if "not in this report" in n]
    assert notice.startswith("1 of the grid's 6 runs are not in this report") and notice.endswith(
        "inject-noise-3/seed2"
    )
    assert f"Notice: {notice}" in (tmp_path / "r" / "tables.md").read_text()
    assert "inject-noise-3/seed2" in (tmp_path / "r" / "index.html").read_text()


@pytest.mark.parametrize(
    "case", ["no folder", "a folder", "a fifo", "exists", "inside root", "inside out", "a link"]
)
def test_write_archive_target_is_checked_before_anything_runs(tmp_path, case):
    """A missing folder, a folder, a FIFO, a link, an existing file (without --overwrite-archive) or a path inside
    the run folders or the report: refused with a named error before the first run (the grid's one arm would run
    if the check came later: its run folders are never made)."""
    import os

    grid = tmp_path / "g.yaml"
    grid.write_text(
        f"name: g\nbase_recipe: {REPO / 'recipes/tiny-moe/countdown.yaml'}\nseeds: [1]\n"
        "arms: [{name: a, requires: a future feature, overrides: [diagnostics.future=1]}]\n"
    )
    root, out = tmp_path / "runs", tmp_path / "report"
    target = {
        "no folder": tmp_path / "none" / "a.tar.xz",
        "inside root": root / "a" / "seed1" / "run.json",
        "inside out": out / "a.tar.xz",
    }.get(case, tmp_path / "a.tar.xz")
    if case == "a folder":
        target.mkdir()
    elif case == "a fifo":
        os.mkfifo(target)
    elif case == "exists":
        target.write_bytes(b"kept")
    elif case == "a link":
        target.symlink_to(tmp_path / "elsewhere")
    elif case == "inside root":
        target.parent.mkdir(parents=True)
        target.write_text("{}")
    elif case == "inside out":
        out.mkdir()
    why = {
        "no folder": "its folder .* is missing",
        "a folder": "is a folder",
        "a fifo": "is a FIFO",
        "exists": "already exists; pass --overwrite-archive",
        "inside root": "lies inside the run folders",
        "inside out": "lies inside the report folder",
        "a link": "is a symbolic link",
    }[case]
    with pytest.raises(GridError, match=why):
        run_lab(str(grid), root=root, out=out, write_archive_to=target, log=lambda m: None)
    assert not (root / "lab.lock").exists() and not (out / "index.html").exists()  # nothing ran, no report
    if case == "exists":
        assert target.read_bytes() == b"kept"


def test_a_run_file_over_the_archive_limit_is_one_error_naming_the_run(tmp_path, monkeypatch):
    from tim_megatron.lab import archive

    grid, plans = _pilot()
    with unpacked(grid, plans, PILOT) as root:
        monkeypatch.setattr(archive, "MAX_MEMBER_BYTES", 4096)
        with pytest.raises(
            GridError,
            match=r"run exact/seed1's metrics.jsonl has \d+ bytes, over the archive's limit of 4096",
        ):
            write_archive(grid, plans, root, tmp_path / "a.tar.xz")
    assert not (tmp_path / "a.tar.xz").exists()
