"""Run folders and checkpoints from elsewhere: nothing is written through a link, nothing special is read.

A run folder can be copied from another machine or prepared by someone else. Each test plants what such a folder
could hold and runs the real command (``tim train --resume``, ``tim export-hf``) or the writer itself:

- Links at the names a run writes by replacing them (``.run.json.tmp``, ``metrics.jsonl.tmp``,
  ``.run.json.reserve``, ``summary.txt``, ``curves.png``, ``events.json``), pointing at files outside. Before:
  ``tim train --resume`` wrote through every one (the reserve's target zeroed, ``run.json`` with every key it read
  and the summary written over the targets). Now: each is replaced by an atomic rename; the targets are
  unchanged.
  Test: ``test_a_resume_replaces_planted_links_and_leaves_their_targets``.
- Links where a run appends, locks or makes a folder (``run.lock``, ``.run.json.lock``, ``metrics.jsonl``,
  ``logs/engine.log``, ``logs``, ``checkpoints``). Before: the lock record was written over the target, a dangling
  lock link created its target, the engine log was appended to the target (or created in a linked folder), and a
  linked ``metrics.jsonl`` or ``checkpoints`` was read from outside. Now: ``tim train --resume`` refuses by name
  (exit 2, no traceback) before anything is written there. Test: ``test_links_where_a_run_appends_or_locks``.
- The same for the writers a resume of a finished run does not reach: the recipe of a new or changed run
  (``.recipe.yaml.tmp``), token dumps, the engine log of rank N, preflight heartbeats, the checkpoints' ``latest``
  marker. Before: each wrote through its temporary name (the engine log: appended through the link). Now: replaced,
  or refused by name. Test: ``test_each_writer_replaces_or_refuses_links``.
- A FIFO in a checkpoint folder (an extra ``*.pt``, ``checksums.json``, ``latest``). Before: ``tim train --resume``
  and ``tim export-hf`` blocked forever on it. Now: both refuse it by name within seconds.
  Test: ``test_a_fifo_in_the_checkpoints_is_refused_by_name``.
- A checkpoint index declaring a byte item of 10**15 bytes (or at an offset past the file). Before: the scan tried
  to read it (``MemoryError``). Now: a named problem, checked against the file's size first.
  Test: ``test_a_declared_length_past_the_file_is_refused_by_name``.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import importable, require
from tests.tim_cli import run_tim

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
GRPO = ROOT / "recipes/tiny-moe/grpo.yaml"
CANARY = '{"status": "$(touch /tmp/pwned)"}\nexport PS1=kept\n'


def tim(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    require(importable("megatron.core", "vllm"), "megatron-core and vLLM")
    return run_tim(*args, timeout=timeout, env={"OMP_NUM_THREADS": "2"})


def _copy_run(trained: Path, tmp: Path) -> Path:
    d = tmp / "runs" / "run"
    shutil.copytree(trained, d, symlinks=True)
    return d


def _outside(tmp: Path, name: str) -> Path:
    """A file outside the run folder, as a user's shell start-up file would be."""
    p = tmp / "home" / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(CANARY)
    return p


def _flat(err: str) -> str:
    return " ".join(err.split())


# ------------------------------------------------------------------------------ links a resume replaces

REPLACED = (".run.json.tmp", "metrics.jsonl.tmp", ".run.json.reserve")
"""Temporary and reserve names: the run's own files must not go through them."""
RESULTS = ("summary.txt", "curves.png", "events.json")
"""What a finished run writes last: a link there is replaced by the run's file."""


def test_a_resume_replaces_planted_links_and_leaves_their_targets(trained, tmp_path):
    d = _copy_run(trained, tmp_path)
    targets = {}
    for name in (*REPLACED, *RESULTS):
        (d / name).unlink(missing_ok=True)
        targets[name] = _outside(tmp_path, name.strip(".") + ".target")
        (d / name).symlink_to(targets[name])
    res = tim("train", "--resume", str(d))  # the run is complete: start-up, then its end-of-run files
    assert res.returncode == 0, res.stderr[-3000:]
    changed = [n for n, t in targets.items() if t.read_bytes() != CANARY.encode()]
    assert not changed, f"written through the links at {changed}"
    for name in RESULTS:
        assert not (d / name).is_symlink() and (d / name).stat().st_size > 0, name
    assert isinstance(json.loads((d / "events.json").read_text()), list)
    assert json.loads((d / "run.json").read_text())["status"] == "completed"


# ---------------------------------------------------------------------- links a resume refuses by name


def _plant_outside_folder(tmp: Path, d: Path, name: str) -> tuple[Path, Path]:
    """``d/name`` replaced by a link to a folder outside holding what ``d/name`` held."""
    outside = tmp / "elsewhere" / name
    outside.parent.mkdir(parents=True, exist_ok=True)
    if (d / name).exists():
        shutil.move(str(d / name), outside)
    else:
        outside.mkdir()
    (d / name).symlink_to(outside, target_is_directory=True)
    return d / name, outside


def _snapshot(p: Path) -> dict:
    """Every entry under ``p`` (or ``p`` itself) with its bytes; missing: {}."""
    if p.is_dir():
        return {str(q.relative_to(p)): q.read_bytes() if q.is_file() else None for q in sorted(p.rglob("*"))}
    return {"": p.read_bytes()} if p.exists() else {}


@pytest.mark.parametrize(
    "place", ["run.lock", ".run.json.lock", "metrics.jsonl", "logs/engine.log", "logs", "checkpoints"]
)
def test_links_where_a_run_appends_or_locks(trained, tmp_path, place):
    d = _copy_run(trained, tmp_path)
    if place in ("logs", "checkpoints"):
        link, target = _plant_outside_folder(tmp_path, d, place)
    else:
        link = d / place
        link.parent.mkdir(exist_ok=True)
        link.unlink(missing_ok=True)
        target = _outside(tmp_path, place.replace("/", "_") + ".target")
        if place == ".run.json.lock":
            target.unlink()  # a dangling link: opening it would create the target
        link.symlink_to(target)
    before = _snapshot(target)
    res = tim("train", "--resume", str(d))
    assert _snapshot(target) == before, f"{target} changed through the link at {place}"
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-3000:]
    err = _flat(res.stderr)
    assert str(link) in err and "symbolic link" in err, err[-2000:]
    assert "Traceback" not in res.stderr
    assert link.is_symlink()


# ----------------------------------------------------------------------- writers a resume does not reach


def test_each_writer_replaces_or_refuses_links(tmp_path):
    import torch

    from tim_megatron.logging.dumps import write_dump
    from tim_megatron.logging.library_log import routed
    from tim_megatron.preflight.heartbeat import Heartbeat
    from tim_megatron.recipe import load_recipe
    from tim_megatron.run_dir import adopt_recipe, write_resolved
    from tim_megatron.safe_files import UnsafePathError
    from tim_megatron.trainer.checkpoint import atomic_write_text

    d = tmp_path / "run"
    d.mkdir()
    targets = {}

    def plant(name: str) -> Path:
        targets[name] = _outside(tmp_path, name.replace("/", "_") + ".target")
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).symlink_to(targets[name])
        return d / name

    mask = torch.ones(2, 3, dtype=torch.bool)
    lp = torch.zeros(2, 3)
    dump = dict(step=1, mask=mask, input_ids=torch.zeros(2, 3, dtype=torch.long), train_lp=lp, infer_lp=lp)
    dump |= dict(old_lp=lp, advantages=torch.zeros(2), rewards=torch.zeros(2))

    # replaced: the recipe and run.json of a new run and of a changed one, a dump, a rank's heartbeat, the
    # checkpoints' latest marker
    plant(".recipe.yaml.tmp")
    plant(".run.json.tmp")
    write_resolved(load_recipe(GRPO), d)
    adopt_recipe(d, load_recipe(GRPO, ["optim.lr=5e-4"]), allow_change=True)
    write_dump(plant("dumps/step_00000001.parquet"), **dump)
    write_dump(plant("dumps/step_00000002.parquet.tmp").with_name("step_00000002.parquet"), **dump)
    plant("preflight/ranks/rank-00000.json")
    plant(f"preflight/ranks/.rank-00000.json.{os.getpid()}.tmp")
    Heartbeat(d, rank=0, host="h").begin("model")
    atomic_write_text(plant("checkpoints/latest"), "step_00000001")
    plant(f"checkpoints/.latest.tmp{os.getpid()}")
    atomic_write_text(d / "checkpoints" / "latest", "step_00000002")
    changed = [n for n, t in targets.items() if t.read_bytes() != CANARY.encode()]
    assert not changed, f"written through the links at {changed}"
    # refused: the engine log of rank 1 (appended to)
    plant("logs/engine.rank1.log")
    with (
        pytest.raises(UnsafePathError, match="engine.rank1.log is a symbolic link"),
        routed(d, level="info", rank=1),
    ):
        pass
    assert not (d / "dumps" / "step_00000001.parquet").is_symlink()
    assert json.loads((d / "preflight/ranks/rank-00000.json").read_text())["current"] == "model"
    assert (d / "checkpoints" / "latest").read_text() == "step_00000002"
    assert json.loads((d / "run.json").read_text())["recipe_changes"][0]["changes"]["optim.lr"][1] == 5e-4

    # a folder the writer would make its file in is a link out of the run folder: refused, nothing made there
    other = tmp_path / "other"
    e = tmp_path / "run2"
    for sub in ("dumps", "preflight", "logs"):
        (other / sub).mkdir(parents=True)
        (e / sub).parent.mkdir(parents=True, exist_ok=True)
        (e / sub).symlink_to(other / sub, target_is_directory=True)
    with pytest.raises(UnsafePathError, match="dumps is a symbolic link"):
        write_dump(e / "dumps" / "step_00000001.parquet", root=e, **dump)
    with pytest.raises(UnsafePathError, match="preflight is a symbolic link"):
        Heartbeat(e, rank=0, host="h")
    with pytest.raises(UnsafePathError, match="logs is a symbolic link"), routed(e, level="info", rank=0):
        pass
    assert [p for p in other.rglob("*") if p.is_file()] == []


# ------------------------------------------------------------------------------------ FIFOs, lengths


@pytest.mark.parametrize("place", ["step_00000003/extra.pt", "step_00000003/checksums.json", "latest"])
def test_a_fifo_in_the_checkpoints_is_refused_by_name(trained, tmp_path, place):
    d = _copy_run(trained, tmp_path)
    fifo = d / "checkpoints" / place
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo)
    for args in (["train", "--resume", str(d)], ["export-hf", str(d), str(tmp_path / "hf")]):
        try:
            res = tim(*args, timeout=180)
        except subprocess.TimeoutExpired:
            pytest.fail(f"tim {args[0]} blocked on the FIFO at {place}")
        assert res.returncode == 2, res.stderr[-3000:]
        err = _flat(res.stderr)
        assert place.rsplit("/", 1)[-1] in err and "FIFO" in err, err[-2000:]
        assert "Traceback" not in res.stderr
    assert not (tmp_path / "hf").exists()


def _bytes_item(step: Path):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from tim_megatron.trainer.checkpoint_scan import read_metadata

    md = read_metadata(step / ".metadata")
    key = next(k for k in md.storage_data if isinstance(md.state_dict_metadata[k.fqn], BytesStorageMetadata))
    return md, key


@pytest.mark.parametrize(("offset", "length"), [(0, 10**15), (10**15, 8), (-1, 8)])
def test_a_declared_length_past_the_file_is_refused_by_name(trained, tmp_path, offset, length):
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from tim_megatron.trainer.checkpoint import write_checksums
    from tim_megatron.trainer.checkpoint_scan import scan_checkpoint

    d = _copy_run(trained, tmp_path)
    step = d / "checkpoints" / "step_00000003"
    md, key = _bytes_item(step)
    info = md.storage_data[key]
    md.storage_data[key] = _StorageInfo(relative_path=info.relative_path, offset=offset, length=length)
    (step / ".metadata").write_bytes(pickle.dumps(md))
    (step / "checksums.json").unlink()
    write_checksums(step)  # whoever can write the folder can recompute them
    problems = scan_checkpoint(step)
    size = (step / info.relative_path).stat().st_size
    assert any(
        key.fqn in p and f"declares bytes {offset}..{offset + length}" in p and f"has {size} bytes" in p
        for p in problems
    ), problems
    if length == 10**15:  # the command a user runs on it
        res = tim("export-hf", str(d), str(tmp_path / "hf"))
        assert res.returncode == 2 and "declares bytes 0..1000000000000000" in _flat(res.stderr), res.stderr[
            -3000:
        ]
        assert "Traceback" not in res.stderr and "MemoryError" not in res.stderr


def test_a_checksum_entry_outside_the_checkpoint_is_not_read(trained, tmp_path):
    """``checksums.json`` names the files to hash; a name such as ``../../../outside.txt`` (with that file's true
    size and sha256) had verification read a file outside the checkpoint, and pass. Now it is a named problem."""
    import hashlib

    from tim_megatron.trainer.checkpoint import verify_checkpoint

    d = _copy_run(trained, tmp_path)
    step = d / "checkpoints" / "step_00000003"
    outside = _outside(tmp_path, "outside.txt")
    name = os.path.relpath(outside, step)
    table = json.loads((step / "checksums.json").read_text())
    blob = outside.read_bytes()
    table["files"][name] = {"sha256": hashlib.sha256(blob).hexdigest(), "size": len(blob)}
    (step / "checksums.json").write_text(json.dumps(table))
    problems = verify_checkpoint(step)
    assert any(name in p and "points outside it" in p for p in problems), problems
