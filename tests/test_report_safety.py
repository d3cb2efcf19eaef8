"""`tim report` (and the shared metrics reader behind `tim lab --aggregate-only`) on hostile run folders.

Issue 21's report items, each tried for real. Every test failed on the code before the fix (checked by
running this file against a clean export of that code) and passes now, except
``test_a_resolved_run_recipe_is_still_read``, which guards that the fix for item 19 keeps reading the recipe
a run folder really holds.

Item 8, an integer no float can hold (``tim_megatron/logging/tracker.py`` ``read_metrics``)
  * One ``metrics.jsonl`` row with a 400-digit value, a 400-digit step, a 400-digit integer nested in
    ``events``, and a row nested 100,000 levels deep. Before: ``OverflowError`` in ``tim report`` for every
    run, and in the lab's per-run statistics (``RecursionError`` for the deep row). Now: the value is left
    out of its row (the bad step and the deep row are skipped), each with a notice naming the file and line;
    the report and the lab statistics are computed from the rest.

Item 9, a link to ``/dev/zero`` and a FIFO (``tim_megatron/untrusted.py``)
  * ``metrics.jsonl`` and ``run.json`` as links to ``/dev/zero``; ``metrics.jsonl``, ``run.json`` and a token
    dump as FIFOs. Before: ``/dev/zero`` was read without limit (the 1 MiB check read ``st_size``, which is 0)
    until memory ran out, and a FIFO hung ``tim report`` forever. Now: only regular files are opened (checked
    before and after an ``O_NONBLOCK`` open), reads are bounded by the bytes actually read, and each such file
    is a notice; ``tim report`` finishes at once with the other runs.

Item 14, a planted sweep id taking over ``tim report --sweep latest`` (``tim_megatron/report/runs.py``)
  * ``run.json`` with ``sweep_id: latest``, with a far-future stamp (``99991231-235959``), with a stamp a day
    ahead, and one planted two days ago whose stamp is an hour old. Before: ``--sweep latest`` reported the
    ``latest`` run (and without it, the far-future one). Now: ``latest`` is a reserved word (refused with a
    notice), and only stamps that are neither ahead of the clock nor later than their run folders were last
    written count; the real newest sweep is found, and each one passed over is a notice.

Item 19, ``base:`` in a run folder's ``recipe.yaml`` (``tim_megatron/report/runs.py`` ``read_recipe``)
  * ``base:`` to an absolute path holding a schema key with a secret value, and to a missing file. Before: the
    file was read (its value reached the page through the validation error) and a missing one said "file not
    found", telling which files exist. Now: ``base:`` is never followed; both give the same notice.

Item 20, terminal escapes in run-folder paths (``printable``/``shown``)
  * A run folder whose path holds ``ESC[31m`` and a C1 CSI, with a corrupt metrics line. Before: the escape
    reached the terminal in the notice. Now: every notice is printed with control characters escaped
    (``\\x1b``), on the terminal, the page and ``report.json``.

Tracebacks list: a 1 GB ``metrics.jsonl`` took 2.4 GB of memory
  * Before: the whole file was read as text and split into lines (two copies) before parsing. Now: it is
    streamed line by line (an 8 MB file of rewritten steps is read with under 2 MB of peak memory), metric
    names are shared between rows, and a file over ``MAX_METRICS_BYTES`` (512 MiB) is refused with a named
    error before it is read; the report leaves that run out with a notice.

Tracebacks list: every report notice was printed twice
  * Before: each notice was both a Python ``UserWarning`` (on stderr, with a source line) and a notice line.
    Now: notices are the one channel; each is printed once.
"""

from __future__ import annotations

import json
import os
import resource
import time
import tracemalloc
from pathlib import Path

import pytest

from tests.tim_cli import run_tim

ROOT = Path(__file__).resolve().parents[1]
HUGE = int("9" * 400)


def make_run(
    root: Path, name: str, *, meta: dict | None = None, rows: int = 6, folder: str = "20260101-000000"
):
    d = root / name / folder
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": t, "reward/mean": 0.1 * t, "mismatch/old_vs_rollout/rho_std": 1e-3 * 1.1**t})
            + "\n"
            for t in range(1, rows + 1)
        )
    )
    (d / "run.json").write_text(json.dumps({"name": name, "status": "completed", **(meta or {})}))
    return d


def tim(*args: str, cwd: Path, timeout: int = 120):
    """The CLI in a child process; a read that blocks (a FIFO) fails the test at ``timeout``."""

    def limit_memory():  # a reader without a bound fails here, not by taking the machine's memory
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    return run_tim(*args, cwd=cwd, timeout=timeout, preexec_fn=limit_memory)


# ====================================================================================== item 8: huge integers


def test_a_value_no_float_holds_costs_only_that_value(tmp_path):
    from tim_megatron.lab.runstats import run_stats
    from tim_megatron.logging.tracker import read_metrics
    from tim_megatron.report.build import build_report

    good = make_run(tmp_path / "runs", "good")
    bad = make_run(tmp_path / "runs", "bad")
    with open(bad / "metrics.jsonl", "a") as f:
        f.write(f'{{"step": 7, "reward/mean": 0.9, "mismatch/old_vs_rollout/rho_std": {HUGE}}}\n')
        f.write(f'{{"step": {HUGE}, "reward/mean": 0.1}}\n')
        f.write(f'{{"step": 8, "reward/mean": 0.95, "events": [{{"step": {HUGE}}}]}}\n')
        f.write('{"step": 10, "reward/mean": 1.0}\n')
    res = build_report([good, bad], tmp_path / "report")
    assert {r["variant"]: r["steps"] for r in res["rows"]} == {"good": 6, "bad": 10}
    where = f"{bad / 'metrics.jsonl'}"
    assert f"{where}:7: left out 'mismatch/old_vs_rollout/rho_std'" in "\n".join(res["notices"])
    stats = run_stats(bad, arm="a", seed=0)  # what `tim lab --aggregate-only` computes per run
    assert stats.steps == 10 and stats.reward_end == pytest.approx(1.0)

    with open(bad / "metrics.jsonl", "a") as f:  # nested deeper than Python parses: a RecursionError
        f.write('{"step": 11, "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    problems: list[str] = []
    rows = read_metrics(bad / "metrics.jsonl", problems)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7, 8, 10]
    assert rows[6] == {"step": 7, "reward/mean": 0.9} and rows[7] == {"step": 8, "reward/mean": 0.95}
    text = "\n".join(problems)
    assert f"{where}:7: left out 'mismatch/old_vs_rollout/rho_std'" in text
    assert f"{where}:8: skipped a corrupt line (step = 9999" in text
    assert f"{where}:9: left out 'events'" in text
    assert f"{where}:11: skipped a corrupt line (maximum recursion depth" in text
    assert len(problems) == 4


# ====================================================================================== item 9: devices, FIFOs


def test_links_to_dev_zero_and_fifos_are_not_read(tmp_path):
    runs = tmp_path / "runs"
    zero_metrics = make_run(runs, "zero-metrics")
    (zero_metrics / "metrics.jsonl").unlink()
    (zero_metrics / "metrics.jsonl").symlink_to("/dev/zero")
    zero_meta = make_run(runs, "zero-meta")
    (zero_meta / "run.json").unlink()
    (zero_meta / "run.json").symlink_to("/dev/zero")
    fifo_metrics = make_run(runs, "fifo-metrics")
    (fifo_metrics / "metrics.jsonl").unlink()
    os.mkfifo(fifo_metrics / "metrics.jsonl")
    fifo_meta = make_run(runs, "fifo-meta")
    (fifo_meta / "run.json").unlink()
    os.mkfifo(fifo_meta / "run.json")
    (fifo_meta / "dumps").mkdir()
    os.mkfifo(fifo_meta / "dumps" / "step_00000001.parquet")
    res = tim(
        "report",
        *(str(d) for d in (zero_metrics, zero_meta, fifo_metrics, fifo_meta)),
        "--out",
        "rep",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    out = res.stdout
    for f in (
        zero_metrics / "metrics.jsonl",
        zero_meta / "run.json",
        fifo_metrics / "metrics.jsonl",
        fifo_meta / "run.json",
        fifo_meta / "dumps" / "step_00000001.parquet",
    ):
        assert f"notice: {f}: not a regular file" in out, out
    rows = json.loads((tmp_path / "rep" / "report.json").read_text())["summary"]
    assert sorted(r["variant"] for r in rows) == ["fifo-meta", "zero-meta"]  # their metrics are plain files


def test_the_lab_aggregate_passes_over_fifos_and_device_links(tmp_path):
    """Item 9, lab side: ``tim lab --aggregate-only`` computes :func:`run_stats` per run and judges reuse with
    ``is_complete``; on main a FIFO run.json hung both and a FIFO metrics.jsonl raised. Now such a run counts
    as having no steps and no status, whatever the other runs hold."""
    import threading

    from tim_megatron.lab.runner import is_complete
    from tim_megatron.lab.runstats import run_stats

    runs = tmp_path / "runs"
    done = {}
    for name, target in (("metrics.jsonl", "fifo"), ("run.json", "fifo"), ("metrics.jsonl", "zero")):
        d = make_run(runs, f"{target}-{name}")
        (d / name).unlink()
        os.mkfifo(d / name) if target == "fifo" else (d / name).symlink_to("/dev/zero")

        def judge(d=d, key=f"{target}-{name}"):
            done[key] = (run_stats(d, arm="a", seed=0), is_complete(d, {"recipe_sha256": "x"}))

        t = threading.Thread(target=judge, daemon=True)  # a hang must fail the test, not stall the suite
        t.start()
        t.join(timeout=20)
        assert not t.is_alive(), f"{d / name}: still reading after 20 s"
    for key, (stats, complete) in done.items():
        assert not complete, key
        if key.endswith("metrics.jsonl"):
            assert stats.steps == 0, (key, stats)


def test_reads_are_bounded_by_bytes_read_not_by_st_size(tmp_path):
    from tim_megatron.untrusted import UnreadableFile, open_regular, read_bounded

    f = tmp_path / "big.json"
    f.write_bytes(b"x" * 1000)
    assert read_bounded(f, 1000) == b"x" * 1000
    with pytest.raises(UnreadableFile, match=r"big.json: more than 999 bytes"):
        read_bounded(f, 999)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "zero").symlink_to("/dev/zero")
    for name in ("fifo", "zero"):
        with pytest.raises(UnreadableFile, match=rf"{name}: not a regular file"):
            open_regular(tmp_path / name)


# ====================================================================================== item 14: --sweep latest


def test_a_planted_sweep_id_cannot_take_over_latest(tmp_path):
    from tim_megatron.report.runs import resolve_sweep

    runs = tmp_path / "runs"
    hour_ago = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() - 3600))
    real = [make_run(runs, f"real-{v}", meta={"sweep_id": f"clip-{hour_ago}"}) for v in "ab"]
    make_run(runs, "older", meta={"sweep_id": "clip-20200101-000000"})
    make_run(runs, "reserved", meta={"sweep_id": "latest"})
    make_run(runs, "future", meta={"sweep_id": "evil-99991231-235959"})
    tomorrow = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() + 86400))
    make_run(runs, "tomorrow", meta={"sweep_id": f"evil-{tomorrow}"})
    # Planted two days ago with a stamp that was then in the future and is now an hour old.
    planted = make_run(runs, "planted", meta={"sweep_id": f"evil-{hour_ago[:-1]}9"})
    two_days_ago = time.time() - 2 * 86400
    os.utime(planted / "run.json", (two_days_ago, two_days_ago))

    assert resolve_sweep("latest", runs) == (f"clip-{hour_ago}", sorted(real))
    notices: list[str] = []
    resolve_sweep("latest", runs, notices)
    text = "\n".join(notices)
    assert "sweep_id = 'latest' is a reserved word" in text
    assert (
        "sweep evil-99991231-235959: not taken as the newest sweep: its submission time 9999-12-31 23:59:59 is in the future"
        in text
    )
    assert f"sweep evil-{tomorrow}: not taken as the newest sweep: its submission time" in text
    assert (
        f"sweep evil-{hour_ago[:-1]}9: not taken as the newest sweep: its submission time is later than"
        in text
    )
    # Named explicitly, a sweep is still found whatever its stamp.
    assert resolve_sweep("evil-99991231-235959", runs)[0] == "evil-99991231-235959"
    with pytest.raises(ValueError, match="no run folder under .* belongs to sweep id 'latest-x'"):
        resolve_sweep("latest-x", runs)


def test_latest_with_only_planted_sweeps_is_a_named_error(tmp_path):
    from tim_megatron.report.runs import resolve_sweep

    runs = tmp_path / "runs"
    make_run(runs, "reserved", meta={"sweep_id": "latest"})
    make_run(runs, "future", meta={"sweep_id": "evil-99991231-235959"})
    with pytest.raises(ValueError, match=r"belongs to any sweep; .* 1 passed over as the newest"):
        resolve_sweep("latest", runs)
    notices: list[str] = []
    with pytest.raises(ValueError):
        resolve_sweep("latest", runs, notices)
    assert len(notices) == 2


# ====================================================================================== item 19: base: in a run


def test_base_in_a_run_folders_recipe_is_not_followed(tmp_path):
    from tim_megatron.report.build import build_report

    secret = tmp_path / "elsewhere" / "secret.yaml"
    secret.parent.mkdir()
    secret.write_text('run:\n  name: "SECRET value 42 !"\n')
    runs = []
    for name, base in (("exists", secret), ("missing", tmp_path / "elsewhere" / "nope.yaml")):
        d = make_run(tmp_path / "runs", name)
        (d / "recipe.yaml").write_text(f"base: {base}\nrun:\n  steps: 3\n")
        runs.append(d)
    res = build_report(runs, tmp_path / "report")
    notices = [n for n in res["notices"] if "recipe.yaml" in n]
    assert len(notices) == 2
    for n, d in zip(notices, runs, strict=True):
        assert n.startswith(f"{d / 'recipe.yaml'}: base = ")
        assert "base: is not followed; the recipe is left out" in n
        assert "not found" not in n
    page = (tmp_path / "report" / "index.html").read_text()
    assert "SECRET" not in page and "SECRET" not in (tmp_path / "report" / "report.json").read_text()
    assert len(res["rows"]) == 2


def test_a_resolved_run_recipe_is_still_read(tmp_path):
    from tim_megatron.recipe import load_recipe, recipe_to_yaml
    from tim_megatron.report.runs import load_run

    d = make_run(tmp_path / "runs", "ok")
    (d / "recipe.yaml").write_text(
        recipe_to_yaml(load_recipe(ROOT / "recipes" / "tiny-moe" / "grpo.yaml").recipe)
    )
    notices: list[str] = []
    run = load_run(d, notices)
    assert run.recipe is not None and notices == []


# ====================================================================================== item 20 + printed twice


def test_notices_escape_control_characters_and_are_printed_once(tmp_path):
    d = tmp_path / "runs" / "a\x1b[31mRED\x9bb" / "20260101-000000"
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\nnot json\n')
    res = tim("report", str(d), "--out", "rep", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    both = res.stdout + res.stderr
    assert "\x1b" not in both and "\x9b" not in both
    shown_dir = str(d).replace("\x1b", "\\x1b").replace("\x9b", "\\x9b")
    line = f"{shown_dir}/metrics.jsonl:2: skipped a corrupt line"
    assert both.count(line) == 1, both
    assert "UserWarning" not in both
    notices = json.loads((tmp_path / "rep" / "report.json").read_text())["notices"]
    assert line in notices[0] and not any("\x1b" in n or "\x9b" in n for n in notices)

    from tim_megatron.report.runs import printable, shown

    assert printable("a\x1b[31mb\x9b2J\u202ec é") == "a\\x1b[31mb\\x9b2J\\u202ec é"
    assert shown("\x1b]0;x\x07") == "'\\x1b]0;x\\x07'"


# ====================================================================================== a 1 GB metrics.jsonl


def test_metrics_are_streamed_not_read_whole(tmp_path):
    """Peak memory while reading 8 MB of rows that rewrite one step stays near one row, not the file."""
    from tim_megatron.logging.tracker import read_metrics

    row = json.dumps({"step": 1, **{f"metric/{i}": 0.5 for i in range(100)}}) + "\n"
    f = tmp_path / "metrics.jsonl"
    with open(f, "w") as out:
        out.write(row * (8_000_000 // len(row)))
    tracemalloc.start()
    try:
        rows = read_metrics(f)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(rows) == 1 and len(rows[0]) == 101
    assert peak < 2_000_000, f"peak {peak} bytes for a {f.stat().st_size}-byte file"


def test_a_metrics_file_over_the_cap_is_a_named_error_and_the_run_is_left_out(tmp_path, monkeypatch):
    from tim_megatron.logging import tracker
    from tim_megatron.logging.tracker import MetricsError, read_metrics
    from tim_megatron.report.build import build_report

    small = make_run(tmp_path / "runs", "small", rows=3)
    big = make_run(tmp_path / "runs", "big", rows=2000)
    size = (big / "metrics.jsonl").stat().st_size
    with pytest.raises(
        MetricsError, match=rf"metrics.jsonl: {size} bytes; a metrics.jsonl of at most 10000 bytes"
    ):
        read_metrics(big / "metrics.jsonl", max_bytes=10_000)
    monkeypatch.setattr(tracker, "MAX_METRICS_BYTES", 10_000)
    res = build_report([small, big], tmp_path / "report")
    assert [r["variant"] for r in res["rows"]] == ["small"]
    assert any(
        n.startswith(f"{big / 'metrics.jsonl'}: {size} bytes") and n.endswith("run left out")
        for n in res["notices"]
    )


def test_a_line_over_the_line_limit_is_skipped_without_being_held(tmp_path, monkeypatch):
    from tim_megatron.logging import tracker
    from tim_megatron.logging.tracker import read_metrics

    monkeypatch.setattr(tracker, "MAX_METRICS_LINE_BYTES", 1000)
    f = tmp_path / "metrics.jsonl"
    long_line = '{"step": 2, "pad": "' + "x" * 5000 + '"}\n'
    f.write_text('{"step": 1}\n' + long_line + '{"step": 3}\n')
    problems: list[str] = []
    assert [r["step"] for r in read_metrics(f, problems)] == [1, 3]
    assert problems == [f"{f}:2: skipped a line of {len(long_line)} bytes (at most 1000)"]


# ====================================================================================== tim align's files in a run


def _aligned(folder: Path, *, where: str | None = None) -> Path:
    """A real ``tim align`` report (align.json, align.txt, align.png) in ``folder``; ``where`` replaces the first
    divergence's words in align.json and is appended to align.txt (a marker the page must or must not show)."""
    from tests.test_align import _capture, _changed
    from tim_megatron.align.compare import compare
    from tim_megatron.align.report import write

    a = _capture("engine")
    files = write(
        compare(a, _changed(a, ("mlp", 1), a.get("mlp", 1) + 1), tolerance=1e-5), folder, sequences=2, meta={}
    )
    if where is not None:
        body = json.loads(files["json"].read_text())
        files["json"].write_text(json.dumps({**body, "where": where}))
        files["text"].write_text(files["text"].read_text() + where + "\n")
    return folder


def test_links_in_a_runs_align_folder_are_not_followed(tmp_path):
    """``RUN/align/align.json``, ``align.txt`` and ``align.png`` as links to another report's files, and a run whose
    ``align`` folder is a link: before, their text reached index.html and the linked PNG was copied as
    ``align-N.png``. Now: none is read; each is a notice, and the run with real files keeps its section."""
    from tim_megatron.report.build import build_report

    secret = _aligned(tmp_path / "secret", where="SECRET-FROM-ELSEWHERE")
    runs = tmp_path / "runs"
    files = make_run(runs, "files-linked")
    (files / "align").mkdir()
    for name in ("align.json", "align.txt", "align.png"):
        (files / "align" / name).symlink_to(secret / name)
    folder = make_run(runs, "folder-linked")
    (folder / "align").symlink_to(secret)
    real = make_run(runs, "real")
    _aligned(real / "align")
    res = build_report([files, folder, real], tmp_path / "rep")
    page = (tmp_path / "rep" / "index.html").read_text()
    assert "SECRET-FROM-ELSEWHERE" not in page
    assert (
        "<h3>real: engine vs b</h3>" in page and "files-linked:" not in page and "folder-linked:" not in page
    )
    copied = sorted(p.name for p in (tmp_path / "rep").glob("align-*.png"))
    assert (
        len(copied) == 1
        and (tmp_path / "rep" / copied[0]).read_bytes() == (real / "align" / "align.png").read_bytes()
    )
    text = "\n".join(res["notices"])
    assert f"{files / 'align' / 'align.json'} is a symbolic link" in text, text
    assert f"{folder / 'align'} is a symbolic link" in text, text


@pytest.mark.parametrize(
    "content",
    [
        "[]",
        '"a string"',
        '{"tokens_differing_any_layer": "abc"}',
        '{"sides": [1, 2], "tolerance": [0]}',
        "[" * 100_000,
        f'{{"where": "x", "sides": ["engine", "trainer"], "tokens": 3, "tolerance": {HUGE}}}',
    ],
    ids=["list", "string", "share-not-a-number", "tolerance-a-list", "deep", "huge-integer"],
)
def test_a_malformed_align_json_costs_only_its_section(tmp_path, content):
    """Before: one run's malformed ``align/align.json`` (a list, a string, a share that is not a number, nesting
    deeper than Python parses) stopped ``tim report`` for every run. Now: that section is left out with a notice
    naming the file; both runs are in the report and the other run's alignment is shown."""
    from tim_megatron.report.build import build_report

    good = make_run(tmp_path / "runs", "good")
    _aligned(good / "align")
    bad = make_run(tmp_path / "runs", "bad")
    (bad / "align").mkdir()
    (bad / "align" / "align.json").write_text(content)
    res = build_report([good, bad], tmp_path / "rep")
    assert sorted(r["variant"] for r in res["rows"]) == ["bad", "good"]
    page = (tmp_path / "rep" / "index.html").read_text()
    assert "<h3>good: engine vs b</h3>" in page and "<h3>bad" not in page
    named = [n for n in res["notices"] if str(bad / "align" / "align.json") in n]
    assert len(named) == 1 and "left out of the report" in named[0], res["notices"]
