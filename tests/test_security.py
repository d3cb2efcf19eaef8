"""Attacks on tim-megatron's inputs (issue 14, findings 1, 2, 7 and the bad inputs of 8), each tried for real.

Every test below failed on main before the fix (checked by running this file against main's code) and passes
now. The attacks and what happens now:

Finding 1, shell injection in the rendered job script (``tim_megatron/slurm/render.py``, ``launch/tim.sbatch``)
  * Every ``@PLACEHOLDER@`` of the template, and an unknown ``@NOPE@``, inside every free-text value that
    reaches the script at once: ``cluster.env`` values, ``cluster.container_image``, ``cluster.container_mounts``,
    ``cluster.hf_home``, ``cluster.venv`` and the run folder (``run.output_dir``); the values also hold quotes,
    ``$(touch CANARY)``, backticks, ``;``, ``|``, ``&``, redirections and ``$HOME``. Result: the script passes
    ``bash -n``; run in a real bash (``srun``/``scontrol`` replaced by stubs that record what they get), no canary
    file appears and every value arrives byte for byte (as an environment variable, or as one ``srun``
    argument). On main, ``cluster.env.PROBE='x @SRUN_CONTAINER@'`` beside an image holding ``$(...)`` ran it.
  * A recipe file named ``x$(touch CANARY)@SRUN_CONTAINER@.yaml``, whose derived run name used to skip the
    ``run.name`` pattern: refused when loaded (the error names the file, the derived name, the pattern and the
    fix); ``tim submit --dry-run`` exits 2 without a traceback and nothing runs.
  * The same payload as ``run.name`` (schema pattern), ``cluster.job_name`` (directive pattern) and in the run
    folder path (``%``, ``$``, ``(``, spaces are not allowed in ``--output``): refused, nothing rendered.
  * A hostile ``cluster.env`` value, ``cluster.hf_home`` and container image submitted through the real local
    Slurm (``tests/local_slurm.py``): the job script runs (and fails at srun: no pyxis there); no canary. On
    main the canary appeared.
  * Secret names in ``cluster.env``: ``GITHUB_PAT``, ``AWS_CREDENTIALS``, ``GOOGLE_APPLICATION_CREDENTIALS``,
    ``PROXY_AUTH``, ``SSH_PRIVATE_KEY_FILE``, ``SESSION_COOKIE``, ``MY_SESSION`` are refused (on main the
    first six were rendered into the script); ``PATH``, ``PYTHONPATH``, ``LD_LIBRARY_PATH`` still work.

Finding 2, path traversal and code planting in ``tim report --sweep latest`` (``tim_megatron/report/*``)
  * ``run.json`` with ``sweep_id = "../../escaped-20990101-000000"``: on main the report was written two levels
    above ``report/``. Now the id is ignored (a warning names the file), ``--sweep latest`` finds no sweep and
    exits 2 with a named error; nothing is written outside ``report/``.
  * ``--name ../x``: refused (exit 2), nothing written.
  * A report folder (hence title) named ``p"); __import__("os").system("touch pwned"); x=dict(a="``: on main
    the generated ``wandb_report.py`` ran the payload. Now the title is a ``repr`` literal: the script
    compiles, runs (against a stub ``wandb_workspaces``) without creating the canary, and passes the title
    through unchanged. A crafted ``run.json`` name, sweep id and status are dropped with notices.

Finding 7, unbounded or unchecked input (``tim_megatron/recipe/loader.py``, ``schema.py``)
  * A 600-byte billion-laughs YAML (10^9 values once expanded): refused in well under a second with < 50 MB
    of memory growth (test bound: 5 s, 200 MB); on main 23 s and 2 GB, then 350 MB of error text.
  * A 2 MiB recipe, and ``/dev/zero`` as a recipe: refused before parsing (1 MiB cap, regular files only).
  * A recursive alias (``&a [*a]``) and 100-level nesting: refused by name, no RecursionError.
  * ``run.steps=true``, ``run.steps=0x10``, ``run.steps=1e29``, ``steps: 1e29`` in a file,
    ``run.steps=99999999999``, ``rollout.temperature=.inf``, ``rollout.sync_tolerance=.nan``,
    ``remedies.fp16=yes``: each refused with the key, the value and how to write it (on main: 1, 16,
    accepted, accepted, accepted, accepted, accepted, True).
  * 5,000 unknown keys and a 300 kB bad value: the error stays under 4,100 characters.

Finding 8, named errors instead of tracebacks (the cases owned here)
  * A folder and a binary file given as a recipe: named errors; ``tim recipe check DIR`` marks both FAIL and
    goes on to the valid one (on main: a traceback at the first).
  * ``tim report`` on an empty and a non-parquet dump, and on runs named ``$\\frac{$`` (folder) and with a
    ``$...$`` metric bucket: the report is built, with notices (on main: pyarrow and mathtext tracebacks).
  * A run named ``..`` or ``...`` (from a file ``...yaml``/``....yaml``): a named error.
  * ``cluster.env.X.Y=1``, an override that makes a value a mapping: blamed on the command line, not on
    "defaults".
  * ``tim logs JOB`` with a run folder whose ``run.json`` is a JSON list: skipped (on main: AttributeError).
  * ``run.name="[/bold]"``: on main rich read the quoted value as markup and crashed (MarkupError traceback);
    now the value is printed as it is.

Issue 21 (hardening, round 3): the attacks on data, code and the console. Each was tried against the code
before the fix and failed there; the test named with it passes now. Tests in other files are named with their
file.

Item 1, ``tim export-hf RUN OUT`` deleted OUT (``tim_megatron/export.py``)
  * OUT = the run folder, the folder that holds it (``runs/``, ``.``, ``/``), a folder of someone's files, the
    run's ``checkpoints/``, a file; each with and without ``--overwrite``. Before: ``shutil.rmtree(OUT)`` (for
    ``.``, a ValueError traceback after the model loaded). Now: refused before the run or the model is read,
    nothing deleted (``test_export_hf_refuses_an_out_it_did_not_create_before_loading_anything``).
  * An earlier export as OUT: refused without ``--overwrite``; with it replaced whole (a stray file gone), the
    export written into a fresh sibling and renamed, no temporary folder left, mode from the umask
    (``test_export_hf_replaces_only_an_earlier_export_and_only_with_overwrite``).

Item 2, a checkpoint that runs code when loaded (``trainer/checkpoint.py``, ``trainer/checkpoint_scan.py``)
  * A pickle that calls ``os.system`` planted in the RNG file (the format the code wrote before), in the
    torch.distributed.checkpoint ``.metadata`` index, in one of the index's byte items (non-tensor objects that
    torch reads with ``weights_only=False``) and in megatron's ``common.pt``, with ``checksums.json`` recomputed.
    Before: ``tim export-hf`` and ``tim train --resume`` ran the first three (canary file created). Now every
    pickle in the folder is read first by a loader that admits only plain data; the load is refused naming the
    file and the callable, no canary (``test_no_pickle_in_a_checkpoint_can_run_code``).
  * The RNG state is written as safetensors + JSON; an older checkpoint's ``rank<N>.pt`` is read with
    ``weights_only=True`` plus numpy's array types
    (``test_rng_state_is_tensors_and_json_and_an_older_pt_file_still_loads``). What stays trusted: the
    installed libraries, and a folder that does not change mid-load.

Item 9, files that are not files (``untrusted.py``; tests in ``test_report_safety.py``)
  * ``metrics.jsonl`` / ``run.json`` / a dump as a link to ``/dev/zero`` or a FIFO. Before: read without limit
    (the 1 MiB cap checked ``st_size``, 0) or a hang. Now: only regular files are opened (O_NONBLOCK, fstat
    after open) and reads are bounded by bytes read (``test_links_to_dev_zero_and_fifos_are_not_read``,
    ``test_reads_are_bounded_by_bytes_read_not_by_st_size``,
    ``test_the_lab_aggregate_passes_over_fifos_and_device_links``). A ``config.json`` FIFO or ``/dev/zero``
    link for ``tim new-recipe``: refused
    (``test_new_recipe_safety.py::test_a_config_json_that_is_not_a_file_is_a_named_error``).

Item 14, ``sweep_id: "latest"`` or a far-future stamp took over ``tim report --sweep latest``
  * Now a reserved id is refused with a notice, and "latest" is the newest stamp not ahead of the clock or of its
    run folders' files (``test_report_safety.py::test_a_planted_sweep_id_cannot_take_over_latest``,
    ``test_latest_with_only_planted_sweeps_is_a_named_error``).

Item 15, names with a trailing newline (``re.match(...$)``)
  * Lab arms ``baseline`` / ``"baseline\n"``, grid, sweep and variant names: refused with ``fullmatch``
    (``test_lab_safety.py::test_names_with_a_trailing_newline_are_refused``; recipe and run names:
    ``test_recipe_slurm_safety.py::test_names_with_a_trailing_newline_are_refused``).

Item 18, a newline in the HF path passed to ``tim new-recipe`` injected recipe keys through the header comment
  * Newline, CRLF and U+2028 are written as escapes in comments; ``model.path`` keeps the exact path, quoted
    (``test_new_recipe_safety.py::test_a_line_break_in_the_hf_path_stays_inside_the_header_comment``).

Item 19, ``tim report`` followed ``base:`` in a run folder's ``recipe.yaml`` to any absolute path
  * Now a run's recipe is read without inheritance; an existing and a missing base give the same notice
    (``test_report_safety.py::test_base_in_a_run_folders_recipe_is_not_followed``).

Item 20, terminal escape sequences in run-folder paths reached the terminal through notices
  * Control, C1 and bidi characters are escaped in every notice, and each notice is printed once (it was
    printed twice: once as a warning)
    (``test_report_safety.py::test_notices_escape_control_characters_and_are_printed_once``).

Item 21, ``make new-recipe NAME='x; touch CANARY #'`` ran the command
  * Every Makefile target passes each user value as one single-quoted argument; no canary for any target
    (``test_new_recipe_safety.py::test_make_passes_each_user_value_as_one_argument``,
    ``test_make_new_recipe_with_a_hostile_name_is_refused_by_tim``).

Item 22, ``tim cancel -- --me`` cancelled every job of the user
  * A job id must be a Slurm id and goes to scancel after ``--``
    (``test_recipe_slurm_safety.py::test_tim_cancel_dash_dash_me_never_reaches_scancel`` and two more).

Item 23, ``DB_PASS``, ``MYSQL_PWD`` and ``DATABASE_URL=postgres://u:pw@...`` were rendered in clear text
  * Credentials are refused by name and by value (URL userinfo, ``password=`` queries, known token formats,
    private keys, Bearer tokens), and the value is never printed
    (``test_recipe_slurm_safety.py::test_credentials_are_refused_by_name_or_value_and_never_printed``).

The rest of issue 21 (lab, run folders, data, checkpoints' checksums, wrong results, tracebacks) is listed in
``tests/test_integrity.py``'s header.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from tests.tim_cli import run_tim
from tim_megatron.recipe import RecipeError, load_recipe
from tim_megatron.slurm.render import TEMPLATE, RenderError, render

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny-moe" / "grpo.yaml"
PLACEHOLDERS = [*sorted(set(re.findall(r"@[A-Z][A-Z_]*@", TEMPLATE.read_text()))), "@NOPE@"]


tim = run_tim


def no_traceback(res) -> None:
    assert "Traceback" not in res.stdout + res.stderr, res.stderr[-3000:]


# ================================================================================ finding 1: job script


def payload(canary: Path, placeholder: str) -> str:
    """Quotes, command substitution, backticks, separators, redirections, a variable, and a placeholder."""
    return (
        f"x'\"$(touch {canary})`touch {canary}`;touch {canary}|true&&touch {canary}>/dev/null "
        f"{placeholder} $HOME !# *?~ \\ end"
    )


def run_job_script(script: str, tmp: Path) -> tuple[list[str], dict[str, str]]:
    """``bash -n``, then run the script in a real bash with ``srun``/``scontrol`` stubs; returns what the
    stub ``srun`` received: its arguments and its environment."""
    stubs = tmp / "stub-bin"
    stubs.mkdir()
    (stubs / "srun").write_text(
        '#!/bin/bash\nprintf "%s\\0" "$@" > "$STUB_OUT/args"\nenv -0 > "$STUB_OUT/env"\n'
    )
    (stubs / "scontrol").write_text('#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && echo localhost\nexit 0\n')
    for f in stubs.iterdir():
        f.chmod(0o755)
    path = tmp / "job.sbatch"
    path.write_text(script)
    syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    env = {
        "PATH": f"{stubs}:/usr/bin:/bin",
        "HOME": str(tmp),
        "STUB_OUT": str(tmp),
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NNODES": "1",
    }
    subprocess.run(["bash", str(path)], env=env, cwd=tmp, capture_output=True, text=True, timeout=60)
    assert (tmp / "args").exists(), "the srun line never ran"
    args = (tmp / "args").read_bytes().decode().split("\0")[:-1]
    got = dict(e.split("=", 1) for e in (tmp / "env").read_bytes().decode().split("\0") if "=" in e)
    return args, got


@pytest.mark.parametrize("placeholder", PLACEHOLDERS)
def test_placeholders_in_every_free_text_field_are_inert(placeholder, tmp_path):
    canary = tmp_path / f"pwned-{uuid.uuid4().hex}"
    p = payload(canary, placeholder)
    mount = f"{p}:/mnt"
    loaded = load_recipe(
        TINY,
        [
            f"cluster.env={{PROBE: {json.dumps(p)}, OTHER: {json.dumps('y ' + placeholder)}}}",
            f"cluster.container_image={json.dumps(p)}",
            f"cluster.container_mounts=[{json.dumps(mount)}]",
            f"cluster.hf_home={json.dumps(p)}",
            f"cluster.venv={json.dumps(p)}",
        ],
    )
    run = tmp_path / f"out{placeholder}" / "name" / "20260101-000000"  # @ is allowed in a run folder path
    script = render(loaded.recipe, run_dir=run, job_name="job")
    args, env = run_job_script(script, tmp_path)
    assert not canary.exists()
    assert env["PROBE"] == p and env["OTHER"] == "y " + placeholder and env["HF_HOME"] == p
    assert env["PATH"].startswith(f"{p}/bin:")
    assert f"--container-image={p}" in args
    assert f"--container-mounts={mount},{run}:{run}" in args
    assert f"--container-workdir={run}" in args
    assert args[-3:] == ["bash", f"{run}/job.sbatch", "__node"]
    assert f"#SBATCH --output={run}/logs/slurm-%j.out" in script.splitlines()


def test_a_hostile_recipe_file_name_is_refused(tmp_path):
    canary = tmp_path / f"pwned-{uuid.uuid4().hex}"
    folder = tmp_path / "recipes"
    folder.mkdir()
    f = folder / f"x$(touch {canary.name})@SRUN_CONTAINER@.yaml"
    f.write_text(f"base: {TINY}\ncluster:\n  container_image: 'i$(touch {canary})'\n  job_name: ok\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(f)
    msg = str(e.value)
    assert (
        "derived" in msg and "x$(touch" in msg and "rename the file (or its folder), or set run.name" in msg
    )
    res = tim("submit", str(f), "--dry-run", cwd=tmp_path)
    assert res.returncode == 2 and "rename the file" in res.stderr, res.stderr[-2000:]
    no_traceback(res)
    assert not canary.exists() and not (tmp_path / canary.name).exists()


def test_hostile_names_and_run_folders_are_refused(tmp_path):
    bad = "x$(touch pwned)@SRUN_CONTAINER@"
    with pytest.raises(RecipeError, match="run.name"):
        load_recipe(TINY, [f"run.name={json.dumps(bad)}"])
    r = load_recipe(TINY, [f"cluster.job_name={json.dumps(bad)}"]).recipe
    with pytest.raises(RenderError, match=r"cluster.job_name = .*must match"):
        render(r, run_dir=tmp_path, job_name="ok")
    r = load_recipe(TINY).recipe
    for folder in ("a b", "x$(id)", "o%j", "semi;colon", "new\nline", "a,b"):
        with pytest.raises(RenderError, match=r"run folder = .*set run.output_dir"):
            render(r, run_dir=tmp_path / folder, job_name="ok")


def test_control_characters_are_refused_in_shell_values(tmp_path):
    r = load_recipe(TINY, ['cluster.env={PROBE: "a\\rb"}']).recipe
    with pytest.raises(RenderError, match=r"cluster.env.PROBE = .*control character"):
        render(r, run_dir=tmp_path, job_name="ok")


@pytest.mark.parametrize(
    "name",
    [
        "GITHUB_PAT",
        "AWS_CREDENTIALS",
        "GOOGLE_APPLICATION_CREDENTIALS",
        "PROXY_AUTH",
        "SSH_PRIVATE_KEY_FILE",
        "SESSION_COOKIE",
        "MY_SESSION",
        "HF_TOKEN",
    ],
)
def test_secret_names_are_refused(name, tmp_path):
    r = load_recipe(TINY, [f"cluster.env={{{name}: v}}"]).recipe
    with pytest.raises(RenderError, match=rf"cluster.env.{name}: secrets must not be written.*export {name}"):
        render(r, run_dir=tmp_path, job_name="ok")


def test_path_like_names_are_not_secrets(tmp_path):
    r = load_recipe(TINY, ["cluster.env={PATH: /x, PYTHONPATH: /y, LD_LIBRARY_PATH: /z, NCCL_DEBUG: WARN}"])
    script = render(r.recipe, run_dir=tmp_path, job_name="ok")
    assert "export PYTHONPATH=/y" in script and "export LD_LIBRARY_PATH=/z" in script


@pytest.mark.slurm
def test_hostile_values_through_the_real_local_slurm(slurm, tmp_path):
    """The job script runs for real under sbatch. The local Slurm has no pyxis, so srun refuses the container
    options and the job fails there; the environment lines, where main ran the payload, run before that."""
    canary = tmp_path / f"pwned-{uuid.uuid4().hex}"
    p = payload(canary, "@SRUN_CONTAINER@ @RUN_DIR@ @ENVIRONMENT@")
    res = tim(
        "submit",
        str(TINY),
        f"run.output_dir={tmp_path / 'runs'}",
        f"model.path={tmp_path / 'no-model'}",
        "logging.wandb.mode=disabled",
        f"cluster.env={{PROBE: {json.dumps(p)}}}",
        f"cluster.hf_home={json.dumps(p)}",
        f"cluster.container_image={json.dumps(f'img$(touch {canary})')}",
        env={**slurm.env, "OMP_NUM_THREADS": "2"},
    )
    assert res.returncode == 0, res.stdout + res.stderr
    job = re.search(r"submitted job (\d+)", res.stdout).group(1)
    run = Path(re.search(r"run folder: (\S+)", res.stdout).group(1))
    assert slurm.wait(job, timeout=300) in ("COMPLETED", "FAILED")
    log = (run / "logs" / f"slurm-{job}.out").read_text()
    assert "tim-megatron job" in log, log[-3000:]
    assert not canary.exists()


# ================================================================================ finding 2: the report


def fake_run(root: Path, name: str, meta, *, rows: int = 3) -> Path:
    d = root / name / "20260101-000000"
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": t, "reward/mean": 0.1 * t, "mismatch/old_vs_rollout/rho_std": 1e-3 * t})
            + "\n"
            for t in range(1, rows + 1)
        )
    )
    (d / "run.json").write_text(json.dumps(meta))
    return d


def test_sweep_latest_cannot_write_outside_report(tmp_path):
    work = tmp_path / "work"
    fake_run(
        work / "runs", "a", {"name": "a", "sweep_id": "../../escaped-20990101-000000", "status": "completed"}
    )
    res = tim("report", "--sweep", "latest", cwd=work)
    assert res.returncode == 2 and "invalid sweep_id were ignored" in res.stderr, res.stdout + res.stderr
    no_traceback(res)
    assert not (tmp_path / "escaped-20990101-000000").exists()
    assert [p for p in tmp_path.rglob("*") if "report" not in p.parts and p.suffix in (".html", ".csv")] == []
    res = tim("report", str(work / "runs" / "a" / "20260101-000000"), "--name", "../x", cwd=work)
    assert res.returncode == 2 and "--name '../x'" in res.stderr
    no_traceback(res)
    assert not (tmp_path / "x").exists() and not (work / "report").exists()


STUB_WANDB_WORKSPACES = """
import json, os
class _Rec:
    def __init__(self, **kw):
        self.kw = kw
class Runset(_Rec): pass
class LinePlot(_Rec): pass
class PanelGrid(_Rec): pass
class Report(_Rec):
    url = "stub://report"
    def save(self):
        with open(os.environ["STUB_OUT"], "w") as f:
            json.dump({"title": self.kw["title"]}, f)
"""


def test_generated_wandb_report_cannot_run_planted_code(tmp_path):
    from tim_megatron.report.build import build_report

    run = fake_run(tmp_path / "runs", "a", {"name": "a", "status": "completed"})
    planted = 'p"); __import__("os").system("touch pwned"); x=dict(a="'
    out = tmp_path / "report" / planted
    build_report([run], out)
    script = out / "wandb_report.py"
    compile(script.read_text(), str(script), "exec")
    stub = tmp_path / "stub" / "wandb_workspaces" / "reports"
    stub.mkdir(parents=True)
    (stub.parent / "__init__.py").write_text("")
    (stub / "__init__.py").write_text("")
    (stub / "v2.py").write_text(STUB_WANDB_WORKSPACES)
    res = subprocess.run(
        [sys.executable, str(script), "entity", "project"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path / "stub"), "STUB_OUT": str(tmp_path / "saved.json")},
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert not (tmp_path / "pwned").exists()
    assert json.loads((tmp_path / "saved.json").read_text())["title"] == "tim-megatron: " + planted


def test_identifiers_read_back_from_run_folders_are_validated(tmp_path):
    from tim_megatron.report.build import build_report

    run = fake_run(
        tmp_path / "runs",
        "a",
        {"name": "../../x<script>", "sweep_id": "s/../../y", "status": '=HYPERLINK("http://e")'},
    )
    res = build_report([run], tmp_path / "report")
    notices = "\n".join(res["notices"])
    for key in ("name", "sweep_id", "status"):
        assert f"{key} = " in notices and f"is not a valid {key}; ignored" in notices
    assert res["rows"][0]["variant"] == "a" and res["rows"][0]["status"] == "unknown"
    assert "HYPERLINK" not in (tmp_path / "report" / "summary.csv").read_text()
    assert sorted(p.name for p in tmp_path.rglob("*.png")) == sorted(
        p.name for p in (tmp_path / "report").glob("*.png")
    )


# ============================================================================== finding 7: input limits


BILLION_LAUGHS = textwrap.dedent(
    """\
    # 10^9 strings once the aliases are expanded, all under a real recipe key.
    rollout:
      stop:
        - &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]
        - &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a]
        - &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b]
        - &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]
        - &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]
        - &f [*e,*e,*e,*e,*e,*e,*e,*e,*e,*e]
        - &g [*f,*f,*f,*f,*f,*f,*f,*f,*f,*f]
        - &h [*g,*g,*g,*g,*g,*g,*g,*g,*g,*g]
        - &i [*h,*h,*h,*h,*h,*h,*h,*h,*h,*h]
    """
)

MEASURE = """
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # whatever happens, not more than 4 GiB here
from tim_megatron.recipe import RecipeError, load_recipe
kb = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
before = kb()
t = time.perf_counter()
try:
    load_recipe(sys.argv[1])
    err = None
except RecipeError as e:
    err = str(e)
print(json.dumps({"seconds": time.perf_counter() - t, "rss_growth_mb": (kb() - before) / 1024, "error": err}))
"""


def test_billion_laughs_fails_fast_in_bounded_memory(tmp_path):
    f = tmp_path / "laughs.yaml"
    f.write_text(BILLION_LAUGHS)
    assert len(BILLION_LAUGHS.encode()) < 700
    res = subprocess.run(
        [sys.executable, "-c", MEASURE, str(f)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert res.returncode == 0, res.stderr[-2000:]
    m = json.loads(res.stdout.splitlines()[-1])
    # Safety bounds, not speed targets (the machine is shared): main took 23 s and 2 GB here.
    assert m["seconds"] < 5 and m["rss_growth_mb"] < 200, m
    assert "aliases" in m["error"] and "at most 100000" in m["error"] and len(m["error"]) < 500


def test_oversized_special_recursive_and_deep_yaml_are_refused(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("# padding\n" * (2 * 1024 * 1024 // 10))
    with pytest.raises(RecipeError, match=r"big.yaml: \d+ bytes; a recipe file may have at most 1048576"):
        load_recipe(big)
    with pytest.raises(RecipeError, match="not a regular file"):
        load_recipe("/dev/zero")
    rec = tmp_path / "rec.yaml"
    rec.write_text("a: &a [1, *a]\n")
    with pytest.raises(RecipeError, match="recursive YAML is not allowed"):
        load_recipe(rec)
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 100 + "]" * 100 + "\n")
    with pytest.raises(RecipeError, match="nested more than 64 levels"):
        load_recipe(deep)


@pytest.mark.parametrize(
    "override, key, hint",
    [
        ("run.steps=true", "run.steps = True", "a boolean is not a number"),
        ("run.steps=0x10", "run.steps = '0x10'", "hex, octal and digit separators"),
        ("run.steps=1e29", "run.steps = 1e+29", "whole number"),
        ("run.steps=99999999999", "run.steps = 99999999999", "within +-2147483647"),
        ("rollout.temperature=.inf", "rollout.temperature = inf", "NaN and infinity are not allowed"),
        ("rollout.sync_tolerance=.nan", "rollout.sync_tolerance = nan", "NaN and infinity are not allowed"),
        ("remedies.fp16=yes", "remedies.fp16 = 'yes'", "write true or false"),
        ("run.seed=-1", "run.seed = -1", "greater than or equal to 0"),
    ],
)
def test_loose_types_are_refused(override, key, hint):
    with pytest.raises(RecipeError) as e:
        load_recipe(TINY, [override])
    msg = str(e.value)
    assert msg.startswith("command line: " + key) and hint in msg, msg


def test_loose_types_in_a_file_name_the_file(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text(f"base: {TINY}\nrun:\n  steps: 1e29\n")
    with pytest.raises(
        RecipeError, match=rf"{re.escape(str(f))}: run.steps = 1e\+29: Input should be a valid integer"
    ):
        load_recipe(f)


def test_error_text_is_bounded(tmp_path):
    many = tmp_path / "many.yaml"
    many.write_text("rl:\n" + "".join(f"  k{i}: 1\n" for i in range(5000)))
    with pytest.raises(RecipeError) as e:
        load_recipe(many)
    assert len(str(e.value)) < 4100 and "more problems" in str(e.value)
    huge = tmp_path / "huge.yaml"
    huge.write_text("run:\n  steps: '" + "9" * 300_000 + "'\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(huge)
    assert len(str(e.value)) < 1000 and "more characters" in str(e.value)


# ============================================================================= finding 8: named errors


def test_folder_and_binary_recipes_are_named_errors_and_check_goes_on(tmp_path):
    d = tmp_path / "recipes"
    (d / "dir.yaml").mkdir(parents=True)
    (d / "bin.yaml").write_bytes(bytes(range(256)) * 4)
    (d / "good.yaml").write_text(f"base: {TINY}\n")
    with pytest.raises(RecipeError, match="is a folder, not a recipe file"):
        load_recipe(d / "dir.yaml")
    with pytest.raises(RecipeError, match=r"not a text file \(byte 0 is not UTF-8 text\)"):
        load_recipe(d / "bin.yaml")
    res = tim("recipe", "check", str(d))
    no_traceback(res)
    assert res.returncode == 1
    out = res.stdout
    assert re.search(r"FAIL .*bin.yaml", out) and re.search(r"FAIL .*dir.yaml", out)
    assert re.search(r"ok +.*good.yaml", out) and "1/3 recipes valid" in out
    res = tim("recipe", "show", str(d / "bin.yaml"))
    assert res.returncode == 2 and "not a text file" in res.stderr
    no_traceback(res)


def test_report_survives_bad_dumps_and_mathtext_names(tmp_path):
    from tim_megatron.report.build import build_report

    runs = tmp_path / "runs"
    a = fake_run(runs, "a$\\frac{$b", {"status": "completed"}, rows=3)
    with open(a / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 4, "mismatch/old_vs_rollout/bucket/$\\frac{$/rho_mean": 1.0}) + "\n")
    (a / "dumps").mkdir()
    (a / "dumps" / "step_00000001.parquet").write_bytes(b"")
    (a / "dumps" / "step_00000002.parquet").write_text("not parquet at all")
    res = build_report([a], tmp_path / "report")
    notices = "\n".join(res["notices"])
    assert notices.count("not a readable parquet token dump") == 2
    assert "the folder name is not a valid run name" in notices
    assert res["rows"][0]["variant"] == "a-frac-b"
    assert (tmp_path / "report" / "buckets_a-frac-b.png").stat().st_size > 1000


@pytest.mark.parametrize("stem", ["..", "..."])
def test_dot_run_names_are_named_errors(stem, tmp_path):
    (tmp_path / "recipes").mkdir()
    f = tmp_path / "recipes" / f"{stem}.yaml"
    f.write_text(f"base: {TINY}\n")
    with pytest.raises(RecipeError, match=rf"derived .* is '{re.escape(stem)}', which is not allowed"):
        load_recipe(f)
    res = tim("submit", str(f), "--dry-run", cwd=tmp_path)
    assert res.returncode == 2 and "rename the file (or its folder), or set run.name" in res.stderr
    no_traceback(res)


def test_tim_logs_skips_run_json_that_is_not_an_object(tmp_path):
    from tim_megatron.slurm.submit import find_run

    fake_run(tmp_path, "a", [1, 2])
    good = fake_run(tmp_path, "b", {"job_ids": ["42"]})
    assert find_run("42", tmp_path) == good and find_run("7", tmp_path) is None


def test_rich_markup_in_a_value_is_printed_not_parsed():
    res = tim("recipe", "show", str(TINY), 'run.name="[/bold]"')
    assert res.returncode == 2 and "run.name = '[/bold]'" in res.stderr and "letters, digits" in res.stderr
    no_traceback(res)


def test_override_that_nests_a_value_blames_the_command_line(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text(f"base: {TINY}\ncluster:\n  env: {{A: b}}\n")
    with pytest.raises(
        RecipeError, match=r"^command line: cluster.env.X = \{'Y': 1\}: Input should be a valid string"
    ):
        load_recipe(f, ["cluster.env.X.Y=1"])


# ============================================================= issue 21, items 1 and 2: export-hf and pickles


def _copy_run(trained: Path, tmp: Path) -> Path:
    import shutil

    d = tmp / "runs" / "run"
    shutil.copytree(trained, d)
    return d


def test_export_hf_refuses_an_out_it_did_not_create_before_loading_anything(tmp_path, monkeypatch):
    """Item 1: on main each of these OUT folders was ``shutil.rmtree``d (for '.', a ValueError traceback after
    the model loaded). Now each is refused, with or without ``--overwrite``, and nothing is deleted."""
    from tim_megatron.export import ExportError, check_out

    d = tmp_path / "runs" / "run"
    (d / "checkpoints" / "step_00000001").mkdir(parents=True)
    (d / "run.json").write_text("{}")
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"not a checkpoint")
    (tmp_path / "notes.txt").write_text("mine")
    monkeypatch.chdir(d.parent)
    cases = {
        "the run folder": (d, "is the run folder"),
        "the folder that holds it": (d.parent, "holds the run folder"),
        ". (holds the run)": (Path("."), "holds the run folder"),
        "the file system root": (Path("/"), "holds the run folder"),
        "a foreign folder": (foreign, "not an earlier export"),
        "its checkpoints": (d / "checkpoints", "inside the run's checkpoints"),
        "a file": (tmp_path / "notes.txt", "is a file"),
    }
    before = sorted(tmp_path.rglob("*"))
    for out, why in cases.values():
        for overwrite in (False, True):
            with pytest.raises(ExportError, match=re.escape(why)):
                check_out(d, out, overwrite=overwrite)
    assert check_out(d, d / "hf", overwrite=False) == (d / "hf").resolve()  # a new folder in the run is fine
    assert sorted(tmp_path.rglob("*")) == before
    # The command line refuses before the run or the model is read: nothing to load in this fake run folder.
    res = tim("export-hf", str(d), ".", "--overwrite", cwd=d.parent)
    assert res.returncode == 2 and "holds the run folder" in res.stderr, res.stderr[-2000:]
    no_traceback(res)
    assert sorted(tmp_path.rglob("*")) == before


def test_export_hf_replaces_only_an_earlier_export_and_only_with_overwrite(trained, tmp_path):
    """Item 1: a real export, then the same OUT again: refused, then replaced whole with ``--overwrite``."""
    import torch
    from safetensors.torch import load_file

    d = _copy_run(trained, tmp_path)
    out = tmp_path / "exports" / "hf"  # the parent is created
    first = tim("export-hf", str(d), str(out), timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads((out / "tim_export.json").read_text())["step"] == 3
    from transformers import AutoModelForCausalLM

    from tim_megatron.recipe import load_recipe
    from tim_megatron.run_setup import model_path_for

    assert AutoModelForCausalLM.from_pretrained(out).config.num_experts == 8  # loads in transformers
    init = load_file(str(model_path_for(load_recipe(d / "recipe.yaml").recipe) / "model.safetensors"))
    trained_weights = load_file(str(out / "model.safetensors"))
    assert trained_weights.keys() == init.keys()
    assert any(not torch.equal(trained_weights[k].float(), init[k].float()) for k in init)  # not the start
    (out / "stale.txt").write_text("left by hand")
    again = tim("export-hf", str(d), str(out), timeout=300)
    assert again.returncode == 2 and "--overwrite" in again.stderr, again.stderr[-2000:]
    assert (out / "stale.txt").exists()
    weights = load_file(str(out / "model.safetensors"))
    res = tim("export-hf", str(d), str(out), "--overwrite", "--dtype", "bfloat16", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not (out / "stale.txt").exists()  # replaced whole, not merged
    new = load_file(str(out / "model.safetensors"))
    assert new.keys() == weights.keys() and all(t.dtype == torch.bfloat16 for t in new.values())
    assert sorted(p.name for p in out.parent.iterdir()) == ["hf"]  # no temporary sibling left behind
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class _Canary:
    """Pickles as a call to ``os.system``: unpickling it creates the canary file."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _plant(step: Path, where: str, canary: Path) -> str:
    """Put a code-running pickle in one file of checkpoint ``step``, then recompute its checksums (an attacker
    who can write the folder can). Returns the file's name."""
    import io
    import pickle

    import torch

    from tim_megatron.trainer.checkpoint import write_checksums
    from tim_megatron.trainer.checkpoint_scan import read_metadata

    if where == "rng":  # the format main wrote, under the name main read
        for f in (step / "rng").iterdir():
            f.unlink()
        torch.save({"python": _Canary(canary)}, step / "rng" / "rank00000.pt")
        name = "rng/rank00000.pt"
    elif where == "common.pt":
        torch.save({"optimizer": _Canary(canary)}, step / "common.pt")
        name = "common.pt"
    elif where == ".metadata":
        (step / ".metadata").write_bytes(pickle.dumps(_Canary(canary)))
        name = ".metadata"
    else:  # a byte item of the index, pointed at a planted data file
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        md = read_metadata(step / ".metadata")
        key = next(
            k for k in md.storage_data if isinstance(md.state_dict_metadata[k.fqn], BytesStorageMetadata)
        )
        blob = io.BytesIO()
        torch.save(_Canary(canary), blob)
        (step / "__9_9.distcp").write_bytes(blob.getvalue())
        md.storage_data[key] = _StorageInfo(
            relative_path="__9_9.distcp", offset=0, length=len(blob.getvalue())
        )
        (step / ".metadata").write_bytes(pickle.dumps(md))
        name = key.fqn
    (step / "checksums.json").unlink()
    write_checksums(step)
    return name


@pytest.mark.parametrize("where", ["rng", ".metadata", "byte item", "common.pt"])
def test_no_pickle_in_a_checkpoint_can_run_code(trained, tmp_path, where):
    """Item 2: each file a load unpickles, planted with a pickle that calls ``os.system``, checksums recomputed.

    The scan refuses it by name; on main ``tim export-hf`` ran the rng, .metadata and byte-item payloads
    (``weights_only=False`` and torch's plain ``pickle.load`` of the index)."""
    from tim_megatron.trainer.checkpoint import verify_checkpoint
    from tim_megatron.trainer.checkpoint_scan import scan_checkpoint

    d = _copy_run(trained, tmp_path)
    step = d / "checkpoints" / "step_00000003"
    assert scan_checkpoint(step) == []
    canary = tmp_path / "pwned"
    name = _plant(step, where, canary)
    assert verify_checkpoint(step) == []  # the checksums cannot tell
    problems = scan_checkpoint(step)
    assert problems and any(name in p for p in problems), problems
    assert any("posix.system" in p or "os.system" in p for p in problems), problems
    if where in ("rng", "byte item"):  # the two paths a user runs: export and resume
        res = tim("export-hf", str(d), str(tmp_path / "hf"), timeout=300)
        assert res.returncode == 2 and "could run code" in res.stderr, res.stderr[-3000:]
        no_traceback(res)
        assert not (tmp_path / "hf").exists()
    if where == "rng":
        res = tim("train", "--resume", str(d), timeout=600)
        assert res.returncode == 2 and "could run code" in res.stderr, res.stderr[-3000:]
        meta = json.loads((d / "run.json").read_text())
        assert meta["status"] == "failed" and "could run code" in meta["reason"], meta
    assert not canary.exists()


def test_rng_state_is_tensors_and_json_and_an_older_pt_file_still_loads(tmp_path):
    """Item 2: the RNG state round-trips through safetensors + JSON; an older checkpoint's ``rank00000.pt``
    (python, numpy, torch and tracker states) is read as plain data (numpy arrays allowed) and restores."""
    import random

    import numpy as np
    import torch

    from tim_megatron.trainer.checkpoint import load_rng_state, save_rng_state

    (tmp_path / "new" / "rng").mkdir(parents=True)
    (tmp_path / "old" / "rng").mkdir(parents=True)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.normal()  # numpy caches the second gaussian: that is state too
    save_rng_state(tmp_path / "new" / "rng" / "rank00000.safetensors")
    torch.save(
        {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "tracker": {},
        },
        tmp_path / "old" / "rng" / "rank00000.pt",
    )
    want = (random.random(), np.random.rand(), np.random.normal(), torch.rand(3))
    for folder in ("new", "old"):
        random.seed(9)
        np.random.seed(9)
        torch.manual_seed(9)
        load_rng_state(tmp_path / folder, 0)
        got = (random.random(), np.random.rand(), np.random.normal(), torch.rand(3))
        assert got[:3] == want[:3] and torch.equal(got[3], want[3]), folder
