"""Issue 21, the recipe loader, Slurm and doctor items: each attack tried for real, what it did before, what now.

Item 15 (recipe part), a trailing newline in a checked name (``recipe/loader.py``, ``recipe/schema.py``)
  * ``run.name: "baseline\\n"``, ``run.sweep_id: "s\\n"`` and a recipe file whose derived run name ends in a
    newline. Before and now: refused. The schema's patterns run on pydantic's Rust regex, where ``$`` is the end
    of the text, and the loader checks the derived name with ``re.fullmatch``; nothing in these two files
    validates with ``re.match(...$)``. The test guards against a regression; it did not fail before.

Item 16, duplicate YAML keys (``recipe/loader.py``, every file read through ``read_yaml_file``/``yaml_load``)
  * A recipe with two ``run:`` blocks, a nested ``rl.clip.high`` set twice, a sweep file with two ``variants:``,
    a lab grid with two ``seeds:``, and an override ``run={steps: 1, steps: 2}``. Before: loaded, the last one
    won silently. Now: refused, naming the file, the dotted key and the line of both keys. Anchors and aliases,
    and the same key in different mappings, still load.

Item 22, ``tim cancel -- --me`` (``slurm/submit.py``)
  * ``--me``, ``--user=root``, ``-u``, ``123 456``, ``123;x``, Arabic-Indic digits, ``123\\n`` and more as the
    job id. Before: passed to ``scancel`` as they were (``--me`` cancels every job of the user). Now: a named
    error listing the allowed forms (``123``, ``123_4``, ``123_[1-3,7]``), scancel never runs; a valid id is
    passed after ``--``. The CLI test puts a recording ``scancel`` first on PATH, so that even unfixed code
    could not cancel real jobs.

Item 23, credentials in ``cluster.env`` (``slurm/render.py``)
  * ``DB_PASS``, ``MYSQL_PWD``, ``PGPASS``, ``SMTP_PASSPHRASE`` by name; ``DATABASE_URL=postgres://u:pw@db``,
    ``HTTPS_PROXY=http://alice:pw@proxy``, a ``?password=`` query, an ``hf_`` token and a private key by value;
    a ``cluster.container_image`` with ``user:password@``. Before: rendered in clear text into ``job.sbatch``.
    Now: refused, naming the key and the kind of credential, never printing the value. ``PATH``,
    ``PYTHONPATH``, ``LD_LIBRARY_PATH``, ``PWD``, a URL with a user but no password and ``host:port/p@x``
    still render.

Tracebacks and unclear messages (the cases owned here), one table
  * ``tim recipe check`` on a symbolic link loop, on a folder of two links to each other, and on a recipe
    whose ``base:`` is a loop. Before: a ``RuntimeError: Symlink loop`` traceback. Now: FAIL naming the file
    and "a symbolic link loop"; the check goes on.
  * ``tim doctor --nodes 0`` / ``tim preflight --nodes -1``. Before: "command line: parallel.dp = 0 ...", a key
    the user never typed. Now: "--nodes = 0: the number of Slurm nodes must be a whole number >= 1". A node
    count that makes the derived ``parallel.dp`` invalid says that ``--nodes`` set it.
  * ``tim plan qwen3-30b-a3b/grpo.yaml cluster.nodes=1000000``. Before: "63.22 GiB of 80 GiB: fits" for 32
    ranks on a million nodes (a job script the renderer refuses), exit 0. Now: "DOES NOT RUN", the layout
    reason naming ``cluster.nodes``, exit 1; ``tim doctor``'s plan line fails the same way (on CPU recipes too).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tim_megatron.cli import app
from tim_megatron.recipe import RecipeError, load_recipe
from tim_megatron.recipe.loader import parse_override
from tim_megatron.slurm import submit as slurm_submit
from tim_megatron.slurm.render import RenderError, render
from tim_megatron.slurm.submit import SlurmError, cancel

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny-moe" / "grpo.yaml"
BIG = ROOT / "recipes" / "qwen3-30b-a3b" / "grpo.yaml"  # 4 nodes x 8 GPUs, tp 2 x dp 16 = 32 ranks


def cli(*args: str):
    res = CliRunner().invoke(app, [str(a) for a in args])
    assert not isinstance(res.exception, Exception) or isinstance(res.exception, SystemExit), res.exception
    return res


# ===================================================================================== item 15 (recipe part)


def test_names_with_a_trailing_newline_are_refused(tmp_path):
    for override in ('run.name="baseline\\n"', 'run.sweep_id="s\\n"', 'run.name="a\\r"'):
        with pytest.raises(RecipeError, match=r"run\.(name|sweep_id) = .*letters, digits"):
            load_recipe(TINY, [override])
    odd = tmp_path / "x\n.yaml"
    odd.write_text(f"base: {TINY}\n")
    with pytest.raises(RecipeError, match=r"the run name derived from this file.*not allowed"):
        load_recipe(odd)


# ======================================================================================= item 16: duplicates


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


DUPLICATES = [
    ("recipe", "base: {tiny}\nrun:\n  steps: 3\nrl:\n  clip:\n    low: 0.2\nrun:\n  steps: 5\n", "run", 7, 2),
    ("nested", "base: {tiny}\nrl:\n  clip:\n    high: 0.2\n    high: 0.3\n", "rl.clip.high", 5, 4),
    (
        "sweep",
        "name: s\nbase_recipe: {tiny}\nvariants:\n  - name: a\n    overrides: [run.steps=1]\n"
        "variants:\n  - name: b\n    overrides: [run.steps=2]\n",
        "variants",
        6,
        3,
    ),
    (
        "grid",
        "name: g\nbase_recipe: {tiny}\nseeds: [1, 2]\narms:\n  - name: a\nseeds: [3]\n",
        "seeds",
        6,
        3,
    ),
]


@pytest.mark.parametrize("kind, text, key, line, first", DUPLICATES, ids=[d[0] for d in DUPLICATES])
def test_duplicate_yaml_keys_are_refused_naming_file_key_and_both_lines(
    kind, text, key, line, first, tmp_path
):
    path = _write(tmp_path / f"{kind}.yaml", text.format(tiny=TINY))
    if kind == "grid":
        from tim_megatron.lab.grid import GridError, load_grid

        with pytest.raises(GridError) as e:
            load_grid(path)
    elif kind == "sweep":
        from tim_megatron.recipe.sweep import load_sweep

        with pytest.raises(RecipeError) as e:
            load_sweep(path)
    else:
        with pytest.raises(RecipeError) as e:
            load_recipe(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: line {line}: duplicate key {key!r} (first set at line {first})"), msg
    res = cli("recipe", "check", path)  # the checker shows the same named error, no traceback
    assert res.exit_code == 1 and f"duplicate key {key!r}" in res.output, res.output


def test_a_duplicate_key_in_an_override_is_refused():
    with pytest.raises(RecipeError, match=r"override run=\.\.\.: line 1: duplicate key 'steps'"):
        parse_override("run={steps: 1, steps: 2}")


def test_aliases_and_keys_repeated_in_other_mappings_still_load(tmp_path):
    text = (
        f"base: {TINY}\nrl:\n  clip: &c {{low: 0.2, high: 0.28}}\n  seq_clip: {{low: 0.0003, high: 0.0004}}\n"
        "run: {steps: 2}\n"
    )
    loaded = load_recipe(_write(tmp_path / "ok.yaml", text))
    assert loaded.recipe.rl.clip.high == 0.28 and loaded.recipe.run.steps == 2
    from tim_megatron.recipe.loader import yaml_load

    assert yaml_load("a: &x {b: 1}\nc: *x\nd: *x\n") == {"a": {"b": 1}, "c": {"b": 1}, "d": {"b": 1}}


# =========================================================================================== item 22: cancel


@pytest.mark.parametrize("job", ["123", "4567_8", "99_[1-3]", "99_[1-3,7,9-10]"])
def test_a_slurm_job_id_goes_to_scancel_after_the_end_of_options(job):
    assert slurm_submit.scancel_argv(job) == ["scancel", "--", job]


@pytest.mark.parametrize(
    "job",
    ["--me", "--user=root", "-u", "--signal=KILL", "", "0", "123 456", "123;x", "123\n", "123_", "12_[1-",
     "\u0661\u0662\u0663", "all", "123.0", "123,456"],
)  # fmt: skip
def test_anything_but_a_job_id_is_refused_before_scancel(job):
    with pytest.raises(SlurmError, match=r"job id .*: not a Slurm job id; allowed: digits \(123\)"):
        slurm_submit.scancel_argv(job)
    with pytest.raises(SlurmError, match="not a Slurm job id"):
        cancel(job)


def test_tim_cancel_dash_dash_me_never_reaches_scancel(tmp_path, monkeypatch):
    record = tmp_path / "scancel-args"
    stub = tmp_path / "bin" / "scancel"
    stub.parent.mkdir()
    stub.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" >> "{record}"\n')
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{stub.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    res = cli("cancel", "--", "--me")
    assert res.exit_code == 2, res.output
    assert "job id '--me': not a Slurm job id" in res.output
    assert not record.exists(), record.read_text()
    res = cli("cancel", "4242")
    assert res.exit_code == 0, res.output
    assert record.read_text().splitlines() == ["--", "4242"]


# ======================================================================================= item 23: secrets


CREDENTIALS = [
    ("cluster.env={DB_PASS: hunter2}", "cluster.env.DB_PASS: secrets must not be written", "hunter2"),
    ("cluster.env={MYSQL_PWD: hunter2}", "cluster.env.MYSQL_PWD: secrets must not be written", "hunter2"),
    ("cluster.env={PGPASS: hunter2}", "cluster.env.PGPASS: secrets must not be written", "hunter2"),
    ("cluster.env={SMTP_PASSPHRASE: hunter2}", "cluster.env.SMTP_PASSPHRASE: secrets", "hunter2"),
    (
        "cluster.env={DATABASE_URL: 'postgres://u:hunter2@db:5432/x'}",
        "cluster.env.DATABASE_URL: the value holds a password in a URL",
        "hunter2",
    ),
    (
        "cluster.env={HTTPS_PROXY: 'http://alice:hunter2@proxy:3128'}",
        "cluster.env.HTTPS_PROXY: the value holds a password in a URL",
        "hunter2",
    ),
    (
        "cluster.env={DATABASE_URL: 'postgres://db/x?sslmode=require&password=hunter2'}",
        "cluster.env.DATABASE_URL: the value holds a credential in a URL query",
        "hunter2",
    ),
    (
        f"cluster.env={{HUB: hf_{'Q' * 34}}}",
        "cluster.env.HUB: the value holds an access token",
        "Q" * 34,
    ),
    (
        "cluster.env={DEPLOY: '-----BEGIN OPENSSH PRIVATE KEY----- abc'}",
        "cluster.env.DEPLOY: the value holds a private key",
        "abc",
    ),
    (
        "cluster.container_image='docker://bob:hunter2@registry.example#img:1'",
        "cluster.container_image: the value holds a password in a URL",
        "hunter2",
    ),
]


@pytest.mark.parametrize(
    "override, message, secret", CREDENTIALS, ids=[c[1].split(":")[0] for c in CREDENTIALS]
)
def test_credentials_are_refused_by_name_or_value_and_never_printed(override, message, secret, tmp_path):
    r = load_recipe(TINY, [override]).recipe
    with pytest.raises(RenderError) as e:
        render(r, run_dir=tmp_path, job_name="ok")
    assert str(e.value).startswith(message), e.value
    assert "export" in str(e.value) or "container_image" in message
    assert secret not in str(e.value)


def test_paths_and_urls_without_a_password_still_render(tmp_path):
    env = (
        "cluster.env={PATH: /x, PYTHONPATH: /y, LD_LIBRARY_PATH: /z, PWD: /w, NCCL_DEBUG: WARN, "
        "DATABASE_URL: 'postgres://alice@db/x', MIRROR: 'http://host:8080/p@x', BYPASS_FLAG: '1x'}"
    )
    script = render(load_recipe(TINY, [env]).recipe, run_dir=tmp_path, job_name="ok")
    for line in (
        "export PYTHONPATH=/y",
        "export LD_LIBRARY_PATH=/z",
        "export PWD=/w",
        "export DATABASE_URL=postgres://alice@db/x",
        "export MIRROR=http://host:8080/p@x",
    ):
        assert line in script, line


# ==================================================================================== tracebacks, one table


def _loop(tmp: Path) -> tuple[Path, ...]:
    (tmp / "loop.yaml").symlink_to("loop.yaml")
    return (tmp / "loop.yaml",)


def _pair(tmp: Path) -> tuple[Path, ...]:
    d = tmp / "pair"
    d.mkdir()
    (d / "a.yaml").symlink_to("b.yaml")
    (d / "b.yaml").symlink_to("a.yaml")
    return (d,)


def _base_loop(tmp: Path) -> tuple[Path, ...]:
    _loop(tmp)
    return (_write(tmp / "child.yaml", "base: loop.yaml\n"),)


def _recipe_check(make):
    def case(tmp: Path) -> tuple[int, str]:
        res = cli("recipe", "check", *make(tmp))
        return res.exit_code, res.output

    return case


def _doctor(nodes: int):
    def case(tmp: Path) -> tuple[int, str]:
        from tim_megatron.doctor import context_for
        from tim_megatron.doctor.recipe_checks import check_recipe

        (r,) = check_recipe(context_for(TINY, [], nodes=nodes, environ={}))
        return (1 if r.status == "fail" else 0), "\n".join([r.detail, *r.more])

    return case


def _cli(*args):
    def case(tmp: Path) -> tuple[int, str]:
        res = cli(*args)
        return res.exit_code, res.output

    return case


def _doctor_plan(recipe: Path, *overrides: str):
    def case(tmp: Path) -> tuple[int, str]:
        from tim_megatron.doctor import context_for
        from tim_megatron.doctor.recipe_checks import check_plan

        (r,) = check_plan(context_for(recipe, list(overrides), environ={}))
        return (1 if r.status == "fail" else 0), f"{r.detail} -> {r.fix}"

    return case


TRACEBACKS = [
    ("check-symlink-loop", _recipe_check(_loop), 1, ["loop.yaml: cannot be read (a symbolic link loop)"], []),
    (
        "check-two-links",
        _recipe_check(_pair),
        1,
        ["a.yaml: cannot be read (a symbolic link loop)", "b.yaml: cannot be read (a symbolic", "0/2"],
        [],
    ),
    (
        "check-base-loop",
        _recipe_check(_base_loop),
        1,
        ["child.yaml: base = 'loop.yaml': cannot be read (a symbolic link loop)"],
        [],
    ),
    ("doctor-nodes-0", _doctor(0), 1, ["--nodes = 0: the number of Slurm nodes must be a whole number >= 1"], ["parallel.dp = "]),
    ("doctor-nodes-neg", _doctor(-3), 1, ["--nodes = -3: the number of Slurm nodes must be"], ["parallel.dp = "]),
    (
        "preflight-nodes-neg",
        _cli("preflight", TINY, "--nodes", "-1", "--dry-run"),
        2,
        ["error: --nodes = -1: the number of Slurm nodes must be a whole number >= 1"],
        ["parallel.dp = "],
    ),
    (
        "submit-nodes-dp-invalid",
        _cli("submit", BIG, "--nodes", "1000", "--dry-run"),
        2,
        ["--nodes = 1000 (sets cluster.nodes = 1000, hence parallel.dp = 1000 nodes x 8 ranks", "= 4000)"],
        [],
    ),
    (
        "plan-million-nodes-gpu",
        _cli("plan", BIG, "cluster.nodes=1000000"),
        1,
        ["DOES NOT RUN", "layout: parallel.tp x pp x dp = 32 ranks do not split evenly over cluster.nodes = 1000000"],
        [": fits"],
    ),
    (
        "plan-million-nodes-cpu",
        _cli("plan", TINY, "cluster.nodes=1000000"),
        1,
        ["DOES NOT RUN: layout: parallel.tp x pp x dp = 1 ranks do not split evenly over cluster.nodes = 1000000"],
        [],
    ),
    (
        "plan-too-few-nodes",
        _cli("plan", BIG, "cluster.nodes=2"),
        1,
        ["32 ranks over cluster.nodes = 2 is 16 per node, but cluster.gpus_per_node = 8"],
        [": fits"],
    ),
    (
        "doctor-plan-million-nodes",
        _doctor_plan(TINY, "cluster.nodes=1000000"),
        1,
        ["layout: parallel.tp x pp x dp = 1 ranks do not split evenly over cluster.nodes = 1000000", "-> set cluster.nodes"],
        [],
    ),
]  # fmt: skip


@pytest.mark.parametrize("name, case, code, wanted, unwanted", TRACEBACKS, ids=[t[0] for t in TRACEBACKS])
def test_bad_input_is_a_named_error(name, case, code, wanted, unwanted, tmp_path):
    got_code, out = case(tmp_path)
    assert "Traceback" not in out and "RuntimeError" not in out, out[-3000:]
    assert got_code == code, out[-3000:]
    for text in wanted:
        assert text in out, (text, out[-3000:])
    for text in unwanted:
        assert text not in out, (text, out[-3000:])


def test_a_plan_whose_ranks_fill_the_nodes_still_fits():
    """The shipped layout (4 nodes x 8 GPUs = tp 2 x dp 16) passes the layout check, and --nodes scales dp."""
    res = cli("plan", BIG)
    assert res.exit_code == 0 and "of 80 GiB: fits" in res.output, res.output
    res = cli("plan", BIG, "cluster.nodes=8", "parallel.dp=32")
    assert res.exit_code == 0 and "8 node(s)" in res.output and "fits" in res.output, res.output
