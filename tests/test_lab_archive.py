"""The lab's committed run archives (lab/data/<grid>.tar.xz): written reproducibly, read back only when every run in
them is a completed run of today's grid, and enough to rebuild a report without the run folders."""

from __future__ import annotations

import io
import lzma
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


def test_ds_tables_in_the_docs_regenerate_byte_for_byte_from_its_committed_runs(tmp_path):
    """docs/lab-results.md's generated block for experiment D is the tables.md of a report rebuilt from
    lab/data/D.tar.xz alone (39 runs: 3 arms x seeds 3-15), byte for byte."""
    from tim_megatron.lab.docs import include_tables

    res = run_lab(
        str(REPO / "lab" / "D.yaml"),
        aggregate_only=True,
        from_archive=REPO / "lab" / "data" / "D.tar.xz",
        out=tmp_path / "report",
        log=lambda m: None,
    )
    assert {a: sorted(s) for a, s in res["lab"].runs.items()} == {
        a: list(range(3, 16)) for a in ("exact", "inject-noise-1", "inject-noise-3")
    }
    committed = (REPO / "docs" / "lab-results.md").read_bytes()
    doc = tmp_path / "lab-results.md"
    doc.write_bytes(committed)
    include_tables(doc, "D", (tmp_path / "report" / "tables.md").read_text())
    assert doc.read_bytes() == committed
