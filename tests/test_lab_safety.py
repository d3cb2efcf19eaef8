"""The lab is safe to run twice, to interrupt and to kill; it reruns what changed; its names and options are checked.

Attacks and faults (issue 21), each with what was tried, what happened before, and what happens now:

- Item 3 (a second ``tim lab`` on a live grid). Tried: a second lab on the run folders of a lab whose run is
  training; a lab on a grid one of whose run folders a hand-started ``tim train --run-dir`` holds. Before: the
  second lab printed "removing the incomplete or outdated .../seed1" and deleted the live run's folder. Now: a
  lab holds ``<root>/lab.lock``, so the second lab stops at once with an error naming the first (pid, command);
  every run folder is claimed with its ``run.lock`` before it is looked at, a folder held by a live process is
  skipped as "busy" with its holder named, and left untouched; the claim passes to the run's ``tim train`` as
  an inherited descriptor (its own ``hold`` passes through the ancestor rule), so the folder is never free
  between the claim and the run's end, and free again once the run is gone.
  Tests: ``test_a_second_lab_stops_and_a_killed_lab_takes_its_tim_train_along``,
  ``test_a_folder_a_live_process_holds_is_skipped_and_kept``.
- Item 4 (killing ``tim lab``). Tried: SIGKILL to ``tim lab`` while its ``tim train`` starts; SIGTERM to the lab's
  runner while its run (a stand-in that starts at once) runs. Before: the runs (each in its own session) went on
  training with nobody to collect them. Now: a run is bound to the lab by
  the kernel's parent-death signal (a SIGKILLed lab leaves no run behind), and on SIGTERM or SIGINT the lab
  sends SIGTERM to every run's process group (SIGKILL after a grace period) and exits.
  Tests: ``test_a_second_lab_stops_and_a_killed_lab_takes_its_tim_train_along``,
  ``test_sigterm_on_the_lab_stops_its_runs_cleanly``.
- Item 5 (a changed recipe reused). Tried: complete a lab run, then edit the ``base:`` parent of the grid's
  recipe and run the grid again. Before: the old run was reused (``lab.json`` held only the recipe's path and the
  overrides). Now: ``lab.json`` holds the sha256 of the resolved recipe, and a run is reused only under the
  same hash, or (a run from a lab that recorded no hash, or from before the schema gained a key) when the
  recipe the run itself recorded in ``recipe.yaml`` resolves to the same hash today; the changed arm runs again.
  Tests: ``test_a_run_is_reused_only_under_the_same_resolved_recipe``,
  ``test_a_run_an_older_lab_made_is_judged_by_the_recipe_it_recorded``.
- Item 15 (names with a trailing newline). Tried: lab arms ``baseline`` and ``"baseline\\n"``, a grid named
  ``"g\\n"``, sweep variants ``a`` and ``"a\\n"``, a sweep named ``"s\\n"``. Before: ``re.match`` with ``$``
  passed them, so two arms (or variants) got the same run name and folder. Now: names are checked with
  ``fullmatch``; the error names the key and the value. Test: ``test_names_with_a_trailing_newline_are_refused``.
- Tracebacks list, lab ``dose``. Tried: ``dose: .nan``, ``.inf``, ``-.inf``, ``1.0e+400`` and a 400-digit integer.
  Before: accepted silently. Now: a named error (``arms[0].dose``, the
  value, "a finite number"). Test: ``test_a_dose_must_be_a_finite_number``.
- A lab root from elsewhere. Tried: a seed folder that is a link to a folder outside the
  root holding files, an arm folder that is a link to an empty folder outside, and a seed folder holding someone's
  files (no ``lab.json``). Before: the lab took the lock in and emptied the outside folder, made its run folders
  (and ran) in the other, and emptied the foreign folder. Now: a run folder that is, or lies under, a link is
  refused by name before anything is made or read there, and a folder is emptied only when it holds the
  ``lab.json`` only the lab writes; each refused seed counts as failed, its folder left as it was; the report's
  collection does not read a run through a link. Tests: ``test_linked_and_foreign_run_folders_are_left_alone``,
  ``test_the_report_reads_no_run_through_a_link``.
- Tracebacks list, ``--only ' , '``. Tried: ``tim lab GRID --only ' , '`` and ``--only ''``. Before: ran
  nothing and said nothing (exit 0). Now: exit 2 with an error that lists the grid's arms.
  Test: ``test_only_naming_no_arm_is_an_error_listing_the_arms``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COUNTDOWN = ROOT / "recipes/tiny-moe/countdown.yaml"

# Stands in for `python` in the runner's `python -m tim_megatron.cli train ... --run-dir D`: it takes the run
# folder's lock as `tim train` does, records its pid, then finishes a run (FAKE_TRAIN=complete) or trains on
# until stopped (FAKE_TRAIN=sleep), noting a SIGTERM.
FAKE_TRAIN = f"""#!{sys.executable}
import json, os, signal, sys, time
from pathlib import Path
from tim_megatron.run_lock import hold

d = Path(sys.argv[sys.argv.index("--run-dir") + 1])
hold(d)


def term(signum, frame):
    (d / "got-sigterm").write_text("")
    sys.exit(143)


signal.signal(signal.SIGTERM, term)
(d / "child.pid").write_text(str(os.getpid()))
if os.environ.get("FAKE_TRAIN", "complete") == "sleep":
    time.sleep(600)
(d / "metrics.jsonl").write_text(json.dumps({{"step": 1}}) + "\\n")
(d / "run.json").write_text(json.dumps({{"status": "completed"}}))
"""

# A `tim lab` reduced to its runner: run_grid on the grid, with the fake `python`.
LAB_DRIVER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from tim_megatron.lab.grid import load_grid, plan
    from tim_megatron.lab.runner import run_grid

    grid = load_grid(sys.argv[1])
    run_grid(grid, plan(grid), Path(sys.argv[2]), python=sys.argv[3])
    """
)


def _grid(tmp_path: Path, body: str, *, base: Path = COUNTDOWN, seeds: str = "[1]") -> Path:
    p = tmp_path / "g.yaml"
    p.write_text(f"name: g\nbase_recipe: {base}\nseeds: {seeds}\n" + body)
    return p


def _fake(tmp_path: Path) -> str:
    p = tmp_path / "fake-python"
    p.write_text(FAKE_TRAIN)
    p.chmod(0o755)
    return str(p)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    t0 = time.monotonic()
    while not path.exists():
        if proc.poll() is not None or time.monotonic() - t0 > timeout:
            log = path.parent / "train.log"
            proc.kill()
            out = proc.communicate()[0]
            pytest.fail(f"no {path}: lab {out!r}; run {log.read_text() if log.exists() else '-'}")
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    """A process that exists and is no zombie (an orphan's zombie waits on a reaper that may never come)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _gone(pid: int, timeout: float = 30.0) -> bool:
    t0 = time.monotonic()
    while _alive(pid):
        if time.monotonic() - t0 > timeout:
            return False
        time.sleep(0.1)
    return True


def _kill_leftovers(lab: subprocess.Popen, pids: list[int]) -> None:
    """After a failure: the lab, and runs that outlived it, so no test leaves a process behind."""
    if lab.poll() is None:
        lab.kill()
        lab.wait()
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _claim_soon(folder: Path, timeout: float = 10.0):
    """The folder's lock, once free: a killed process's leader shows as a zombie while its other threads still
    exit and hold its files."""
    from tim_megatron.run_lock import RunFolderBusy, claim

    t0 = time.monotonic()
    while True:
        try:
            return claim(folder)
        except RunFolderBusy:
            if time.monotonic() - t0 > timeout:
                raise
            time.sleep(0.1)


def _start_lab(tmp_path: Path, grid: Path, root: Path) -> subprocess.Popen:
    env = {**os.environ, "FAKE_TRAIN": "sleep"}
    cmd = [sys.executable, "-c", LAB_DRIVER, str(grid), str(root), _fake(tmp_path)]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT
    )


# ------------------------------------------------------------------------------------------ items 3 and 4


def _children(pid: int) -> list[tuple[int, str]]:
    """``(pid, command line)`` of every live child of ``pid``."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append((int(stat.parent.name), cmdline))
    return out


def test_a_second_lab_stops_and_a_killed_lab_takes_its_tim_train_along(tmp_path):
    """The real `tim lab` and `tim train`: the run passes the lab's claim (it writes its recipe.yaml only once it
    holds the folder), a second `tim lab` on the grid stops at once naming the first, and SIGKILL on the lab
    leaves no `tim train` behind (killed during its start-up: what it would do next is beside the point)."""
    from tim_megatron.run_lock import RunFolderBusy, claim

    grid = _grid(tmp_path, "arms: [{name: a}]\n")
    root = tmp_path / "runs"
    run = root / "a" / "seed1"
    cmd = [sys.executable, "-m", "tim_megatron.cli", "lab", str(grid), "--root", str(root)]
    cmd += ["--out", str(tmp_path / "report")]
    lab = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    pids: list[int] = []
    try:
        _wait_for(run / "recipe.yaml", lab)
        kids = _children(lab.pid)
        pids += [pid for pid, _ in kids]
        (child, line), *more = [c for c in kids if "tim_megatron.cli train" in c[1]]
        assert not more and f"--run-dir {run}" in line
        second = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"another tim lab is running on the run folders {root}: pid {lab.pid} " in second.stderr
        assert (run / "recipe.yaml").exists() and _alive(child)  # nothing of the live run was removed
        with pytest.raises(RunFolderBusy, match=f"pid {lab.pid}"):
            claim(run)
        lab.kill()  # SIGKILL: no handler runs; the kernel's parent-death signal takes the run along
        lab.wait(timeout=30)
        assert _gone(child), f"tim train (pid {child}) still runs after its lab was killed"
    finally:
        _kill_leftovers(lab, pids)
    _claim_soon(run).release()  # the run's share of the lock went with it: no stale lock


def test_sigterm_on_the_lab_stops_its_runs_cleanly(tmp_path):
    root = tmp_path / "runs"
    run = root / "a" / "seed1"
    lab = _start_lab(tmp_path, _grid(tmp_path, "arms: [{name: a}]\n"), root)
    pids: list[int] = []
    try:
        _wait_for(run / "child.pid", lab)
        pids.append(child := int((run / "child.pid").read_text()))
        lab.send_signal(signal.SIGTERM)
        out = lab.communicate(timeout=60)[0]
        assert "LabStopped: stopped by SIGTERM" in out, out
        assert "a seed 1: stopped with the lab (exit 143)" in out, out  # it got SIGTERM: a clean stop
        assert (run / "got-sigterm").exists() and _gone(child)
    finally:
        _kill_leftovers(lab, pids)


def test_a_folder_a_live_process_holds_is_skipped_and_kept(tmp_path):
    from tim_megatron.lab.grid import load_grid, plan
    from tim_megatron.lab.runner import run_grid

    grid = load_grid(_grid(tmp_path, "arms: [{name: a}]\n", seeds="[1, 2]"))
    root = tmp_path / "runs"
    held = root / "a" / "seed1"
    (held / "checkpoints").mkdir(parents=True)
    (held / "checkpoints" / "step_3").write_text("weights")
    (held / "run.json").write_text(json.dumps({"status": "running"}))
    hold = "import sys, time; from tim_megatron.run_lock import hold; hold(sys.argv[1]); print('held', flush=True)"
    holder = subprocess.Popen(  # a `tim train --run-dir runs/a/seed1` started by hand
        [sys.executable, "-c", hold + "; time.sleep(600)", str(held)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        lines: list[str] = []
        records = run_grid(grid, plan(grid), root, python=_fake(tmp_path), log=lines.append)
    finally:
        holder.kill()
        holder.wait()
    status = {r.seed: r.status for r in records}
    assert status[2] == "completed"
    assert status[1].startswith(f"busy (in use by pid {holder.pid} ")
    assert any("seed 1: busy, skipped" in x and f"pid {holder.pid}" in x for x in lines), lines
    assert (held / "checkpoints" / "step_3").read_text() == "weights"  # left as it was
    assert not any("removing" in x for x in lines)


# ---------------------------------------------------------------------------------------------- item 5


def test_a_run_is_reused_only_under_the_same_resolved_recipe(tmp_path):
    from tim_megatron.lab.grid import load_grid, plan
    from tim_megatron.lab.runner import LAB_FILE, run_grid

    parent = tmp_path / "parent.yaml"
    parent.write_text(f"base: {COUNTDOWN}\noptim: {{lr: 1.0e-6}}\n")
    (tmp_path / "child.yaml").write_text("base: parent.yaml\n")
    grid_path = _grid(tmp_path, "arms: [{name: a}]\n", base=tmp_path / "child.yaml")
    root, fake = tmp_path / "runs", _fake(tmp_path)
    lab_json = root / "a" / "seed1" / LAB_FILE

    def status() -> str:
        grid = load_grid(grid_path)
        return run_grid(grid, plan(grid), root, python=fake, log=lambda m: None)[0].status

    assert status() == "completed"
    first = json.loads(lab_json.read_text()).get("recipe_sha256")
    from tim_megatron.lab.provenance import RULE_FILES, rule_hashes

    recorded = json.loads(lab_json.read_text())["rules"]  # the rule files' content as the run started
    assert recorded == rule_hashes() and set(recorded) == set(RULE_FILES) and all(recorded.values())
    assert status() == "reused"
    parent.write_text(f"base: {COUNTDOWN}\noptim: {{lr: 2.0e-6}}\n")  # the grid and its recipe file unchanged
    assert status() == "completed"
    assert first and json.loads(lab_json.read_text())["recipe_sha256"] != first


def test_a_run_an_older_lab_made_is_judged_by_the_recipe_it_recorded(tmp_path):
    """A completed run whose lab.json has no hash (made before hashes were recorded) is neither rerun nor removed
    while the recipe it recorded resolves to the grid's; once the grid's recipe changes, it is outdated."""
    from tim_megatron.lab.grid import load_grid, plan
    from tim_megatron.lab.runner import LAB_FILE, is_complete, run_dir, run_spec
    from tim_megatron.recipe import load_recipe
    from tim_megatron.run_dir import write_resolved

    parent = tmp_path / "parent.yaml"
    parent.write_text(f"base: {COUNTDOWN}\noptim: {{lr: 1.0e-6}}\n")
    grid = load_grid(_grid(tmp_path, "arms: [{name: a}]\n", base=parent))
    (p,) = plan(grid)
    d = run_dir(tmp_path / "runs", "a", 1)
    d.mkdir(parents=True)
    write_resolved(load_recipe(grid.base, grid.run_overrides(p.arm, 1)), d)  # recipe.yaml, as tim train does
    (d / "run.json").write_text(json.dumps({"status": "completed"}))
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    (d / LAB_FILE).write_text(json.dumps({"base": str(grid.base), "overrides": grid.run_overrides(p.arm, 1)}))
    assert is_complete(d, run_spec(grid, p, 1))
    parent.write_text(f"base: {COUNTDOWN}\noptim: {{lr: 2.0e-6}}\n")
    assert not is_complete(d, run_spec(grid, p, 1))


# -------------------------------------------------------------------------- item 15 and the tracebacks list


NAMES = [  # (grid or sweep, file body after base_recipe, the error)
    (
        "grid",
        'seeds: [1]\narms: [{name: baseline}, {name: "baseline\\n"}]\n',
        r"arms\[1\]\.name = 'baseline\\n'",
    ),
    ("grid", 'name: "g\\n"\nseeds: [1]\narms: [{name: a}]\n', r"name = 'g\\n'"),
    ("sweep", 'variants: [{name: a}, {name: "a\\n"}]\n', r"variants\[1\]\.name = 'a\\n'"),
    ("sweep", 'name: "s\\n"\nvariants: [{name: a}]\n', r"name = 's\\n'"),
]


@pytest.mark.parametrize(("kind", "body", "match"), NAMES)
def test_names_with_a_trailing_newline_are_refused(tmp_path, kind, body, match):
    from tim_megatron.lab.grid import GridError, load_grid
    from tim_megatron.recipe import RecipeError
    from tim_megatron.recipe.sweep import load_sweep

    path = tmp_path / "f.yaml"
    path.write_text(f"base_recipe: {COUNTDOWN}\n" + body)
    load, error = (load_sweep, RecipeError) if kind == "sweep" else (load_grid, GridError)
    with pytest.raises(error, match=match):
        load(path)


@pytest.mark.parametrize("dose", [".nan", ".inf", "-.inf", "1.0e+400", "1" + "0" * 400])
def test_a_dose_must_be_a_finite_number(tmp_path, dose):
    from tim_megatron.lab.grid import GridError, load_grid

    with pytest.raises(GridError, match=r"arms\[0\]\.dose = .*: expected a finite number"):
        load_grid(_grid(tmp_path, f"arms: [{{name: a, group: g, dose: {dose}}}]\n"))


@pytest.mark.parametrize("only", [" , ", ""])
def test_only_naming_no_arm_is_an_error_listing_the_arms(tmp_path, only):
    from typer.testing import CliRunner

    from tim_megatron.cli import app

    grid = _grid(tmp_path, "arms: [{name: a}, {name: b}]\n")
    res = CliRunner().invoke(app, ["lab", str(grid), "--only", only, "--root", str(tmp_path / "runs")])
    assert res.exit_code == 2, res.output
    assert "--only names no arm" in res.output and "its arms: a, b" in res.output
    assert not (tmp_path / "runs").exists()  # nothing ran


# ------------------------------------------------------------------------------- a lab root from elsewhere


def test_linked_and_foreign_run_folders_are_left_alone(tmp_path):
    from tim_megatron.lab.grid import load_grid, plan
    from tim_megatron.lab.runner import run_grid

    grid = load_grid(_grid(tmp_path, "arms: [{name: a}, {name: b}]\n", seeds="[1, 2, 3]"))
    root = tmp_path / "runs"
    outside = tmp_path / "outside"  # a folder of someone's, outside the root
    outside.mkdir()
    (outside / "notes.txt").write_text("mine")
    (outside / "run.json").write_text(json.dumps({"status": "failed"}))  # looks like an unfinished run
    (root / "a").mkdir(parents=True)
    (root / "a" / "seed1").symlink_to(outside, target_is_directory=True)
    foreign = root / "a" / "seed2"  # under the root, never a run of the lab's
    (foreign / "data").mkdir(parents=True)
    (foreign / "data" / "table.csv").write_text("1,2\n")
    elsewhere = tmp_path / "elsewhere"  # an arm folder that leads out of the root
    elsewhere.mkdir()
    (root / "b").symlink_to(elsewhere, target_is_directory=True)
    lines: list[str] = []
    records = run_grid(grid, plan(grid), root, python=_fake(tmp_path), log=lines.append)
    status = {(r.arm, r.seed): r.status for r in records}
    assert sorted(p.name for p in outside.iterdir()) == ["notes.txt", "run.json"]  # not even a lock file
    assert (outside / "notes.txt").read_text() == "mine"
    assert (foreign / "data" / "table.csv").read_text() == "1,2\n"
    assert sorted(p.name for p in foreign.iterdir()) == ["data"]  # no lock file made there either
    assert list(elsewhere.iterdir()) == []
    assert status[("a", 1)].startswith("failed (refused: ") and "symbolic link" in status[("a", 1)], status
    assert status[("a", 2)].startswith("failed (refused: ") and "no lab.json" in status[("a", 2)], status
    for seed in (1, 2, 3):
        assert status[("b", seed)].startswith("failed (refused: ") and "symbolic link" in status[("b", seed)]
    assert status[("a", 3)] == "completed"  # the lab's own run folder beside them
    assert not any("removing" in x for x in lines), lines


def test_the_report_reads_no_run_through_a_link(tmp_path):
    from tim_megatron.lab.grid import load_grid, plan
    from tim_megatron.lab.main import collect
    from tim_megatron.lab.runner import run_grid

    grid = load_grid(_grid(tmp_path, "arms: [{name: a}]\n"))
    made = tmp_path / "elsewhere"  # a completed lab run of the same grid, outside the root
    assert (
        run_grid(grid, plan(grid), made, python=_fake(tmp_path), log=lambda m: None)[0].status == "completed"
    )
    assert collect(grid, plan(grid), made).runs  # read where it is
    root = tmp_path / "runs"
    (root / "a").mkdir(parents=True)
    (root / "a" / "seed1").symlink_to(made / "a" / "seed1", target_is_directory=True)
    assert collect(grid, plan(grid), root).runs == {}


def test_tim_lab_refuses_to_replace_an_archive_unless_told(tmp_path):
    """``--write-archive`` onto an existing file stops before anything else (exit 2, the file kept);
    ``--overwrite-archive`` lets the command go on (here to the report of an empty root, then the named error that
    there is no completed run to archive)."""
    from typer.testing import CliRunner

    from tim_megatron.cli import app

    grid = _grid(tmp_path, "arms: [{name: a}]\n")
    target = tmp_path / "a.tar.xz"
    target.write_bytes(b"kept")
    cmd = [
        "lab",
        str(grid),
        "--aggregate-only",
        "--root",
        str(tmp_path / "runs"),
        "--out",
        str(tmp_path / "r"),
    ]
    res = CliRunner().invoke(app, [*cmd, "--write-archive", str(target)])
    assert res.exit_code == 2 and "already exists; pass --overwrite-archive" in res.output, res.output
    assert target.read_bytes() == b"kept" and not (tmp_path / "r").exists()
    res = CliRunner().invoke(app, [*cmd, "--write-archive", str(target), "--overwrite-archive"])
    assert res.exit_code == 2 and "no completed run of grid 'g'" in res.output, res.output
    assert (tmp_path / "r" / "index.html").exists() and target.read_bytes() == b"kept"
