"""tim_megatron.safe_files: nothing is written through a link, and nothing but a regular file inside the folder
is read."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from tim_megatron import safe_files as sf


def test_write_atomic_replaces_a_planted_link_and_leaves_its_target(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").symlink_to(victim)
    sf.write_atomic(run / "run.json", "{}", root=run)
    assert victim.read_text() == "keep"
    assert not (run / "run.json").is_symlink() and (run / "run.json").read_text() == "{}"
    assert sorted(p.name for p in run.iterdir()) == ["run.json"]  # no temporary file left


def test_write_atomic_refuses_paths_outside_the_root_and_through_linked_folders(tmp_path):
    run, other = tmp_path / "run", tmp_path / "other"
    run.mkdir()
    other.mkdir()
    (run / "logs").symlink_to(other)
    with pytest.raises(sf.UnsafePathError, match="symbolic link"):
        sf.write_atomic(run / "logs" / "engine.log", "x", root=run)
    with pytest.raises(sf.UnsafePathError, match="outside"):
        sf.write_atomic(run / ".." / "other" / "x", "x", root=run)
    assert list(other.iterdir()) == []


def test_write_atomic_refuses_a_fifo(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(sf.UnsafePathError, match="FIFO"):
        sf.write_atomic(tmp_path / "pipe", "x")


def test_open_append_refuses_a_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(sf.UnsafePathError, match="symbolic link"):
        sf.open_append(tmp_path / "metrics.jsonl")
    assert victim.read_text() == "keep"
    with sf.open_append(tmp_path / "new.jsonl") as f:
        f.write("a\n")
    assert (tmp_path / "new.jsonl").read_text() == "a\n"


def test_open_regular_refuses_links_fifos_and_oversized_files_without_blocking(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("key")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "README.md").symlink_to(secret)
    os.mkfifo(folder / "pipe")
    (folder / "big").write_bytes(b"x" * 100)
    with pytest.raises(sf.UnsafePathError, match="symbolic link"):
        sf.read_text(folder / "README.md", root=folder)
    result = {}

    def read_fifo():
        try:
            sf.read_bytes(folder / "pipe", root=folder)
        except sf.UnsafePathError as e:
            result["error"] = str(e)

    t = threading.Thread(target=read_fifo, daemon=True)
    t.start()
    t.join(5)
    assert "FIFO" in result.get("error", ""), "reading a FIFO blocked or was not refused"
    with pytest.raises(sf.UnsafePathError, match="100 bytes; allowed: at most 10"):
        sf.read_bytes(folder / "big", max_bytes=10)
    with pytest.raises(sf.UnsafePathError, match="outside"):
        sf.read_bytes(folder / ".." / "secret", root=folder)
    assert not sf.regular_file(folder / "README.md") and sf.regular_file(folder / "big", root=folder)


def test_remove_owned_tree_needs_the_marker_and_a_real_folder(tmp_path):
    root = tmp_path / "lab"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    (root / "linked").symlink_to(outside)
    (root / "theirs").mkdir()
    (root / "mine").mkdir()
    (root / "mine" / ".owner").write_text("")
    (root / "mine" / "link").symlink_to(outside)
    with pytest.raises(sf.UnsafePathError, match="symbolic link"):
        sf.remove_owned_tree(root / "linked", root=root, marker=".owner")
    with pytest.raises(sf.UnsafePathError, match="has no .owner"):
        sf.remove_owned_tree(root / "theirs", root=root, marker=".owner")
    sf.remove_owned_tree(root / "mine", root=root, marker=".owner")
    assert not (root / "mine").exists() and (root / "theirs").is_dir()
    assert (outside / "precious").read_text() == "keep"


def test_write_atomic_gives_the_mode_open_would_and_escapes_link_targets(tmp_path):
    old = os.umask(0o022)
    try:
        sf.write_atomic(tmp_path / "run.json", "{}")
        (tmp_path / "plain.json").write_text("{}")
    finally:
        os.umask(old)
    assert (
        os.stat(tmp_path / "run.json").st_mode & 0o777
        == os.stat(tmp_path / "plain.json").st_mode & 0o777
        == 0o644
    )
    (tmp_path / "evil").symlink_to("/tmp/\x1b[2Jx")
    assert "\\x1b[2J" in sf.describe(tmp_path / "evil") and "\x1b" not in sf.describe(tmp_path / "evil")


def test_relative_folders_work_as_absolute_ones(tmp_path, monkeypatch):
    """``tim train --resume runs/x`` and the lab's default root ``runs/lab/<grid>`` are relative paths."""
    monkeypatch.chdir(tmp_path)
    run = Path("runs") / "x"
    run.mkdir(parents=True)
    assert sf.check_inside(run, run / "run.json") == tmp_path / "runs" / "x" / "run.json"
    sf.write_atomic(run / "run.json", "{}", root=run)
    assert (tmp_path / "runs" / "x" / "run.json").read_text() == "{}"
    with sf.open_append(run / "metrics.jsonl") as f:
        f.write("a\n")
    assert sf.read_text(run / "metrics.jsonl", root=run) == "a\n"
    (tmp_path / "elsewhere").mkdir()
    (run / "linked").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(sf.UnsafePathError, match="symbolic link"):
        sf.write_atomic(run / "linked" / "f", "x", root=run)
    with pytest.raises(sf.UnsafePathError, match="outside"):
        sf.check_inside(run, Path("runs") / "y" / "f")


def test_open_append_creates_with_the_mode_open_would_and_names_a_denied_folder_as_such(tmp_path):
    old = os.umask(0o027)
    try:
        with sf.open_append(tmp_path / "metrics.jsonl") as f:
            f.write("a\n")
        sf.write_atomic(tmp_path / "run.json", "{}")
        with open(tmp_path / "plain", "a") as f:
            f.write("a\n")
    finally:
        os.umask(old)
    modes = {n: os.stat(tmp_path / n).st_mode & 0o777 for n in ("metrics.jsonl", "run.json", "plain")}
    assert modes == {"metrics.jsonl": 0o640, "run.json": 0o640, "plain": 0o640}
    with pytest.raises(FileNotFoundError) as e:  # a missing folder is not called unsafe
        sf.open_append(tmp_path / "no-such-folder" / "metrics.jsonl")
    assert not isinstance(e.value, sf.UnsafePathError)
