"""Submit runs and sweeps to Slurm; list, tail and cancel the project's jobs.

A submission creates the run folder (resolved ``recipe.yaml``, ``run.json``, ``logs/``), renders the job
script into it (``job.sbatch``) and calls ``sbatch``. The job runs ``tim train --run-dir RUN_DIR``, which
resumes from the folder's latest checkpoint when there is one, so a requeued or resubmitted job continues
the same run.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tim_megatron.recipe import LoadedRecipe, RecipeError, load_recipe
from tim_megatron.recipe.loader import layout_of
from tim_megatron.recipe.sweep import load_sweep
from tim_megatron.run_dir import (
    META_FILE,
    RECIPE_FILE,
    RunDirError,
    adopt_recipe,
    mark_submitted,
    new_run_dir,
    read_meta,
)
from tim_megatron.slurm.render import RenderError, render

JOB_FILE = "job.sbatch"


class SlurmError(RuntimeError):
    pass


@dataclass
class Submission:
    job_id: str
    run_dir: Path
    script: Path

    @property
    def log(self) -> Path:
        return self.run_dir / "logs" / f"slurm-{self.job_id}.out"

    @property
    def wandb_name(self) -> str:
        return f"{self.run_dir.parent.name}/{self.run_dir.name}"


def with_nodes(recipe_path: str | Path, overrides: list[str], nodes: int | None) -> LoadedRecipe:
    """Load a recipe for ``nodes`` nodes: data parallelism grows with the node count unless set explicitly."""
    if nodes is not None and (isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1):
        raise RecipeError(
            f"--nodes = {nodes!r}: the number of Slurm nodes must be a whole number >= 1 (it sets cluster.nodes; "
            "parallel.dp grows with it unless set)"
        )
    p, c, given = layout_of(recipe_path, overrides)  # before the rules that read the world size
    if nodes is None or p is None or c is None or nodes == c.nodes:
        return load_recipe(recipe_path, overrides)
    extra = [f"cluster.nodes={nodes}"]
    per_node = c.gpus_per_node or (p.world_size // c.nodes)
    derived = ""
    if "parallel.dp" not in given or given["parallel.dp"] != "command line":
        world = nodes * per_node
        if world % (p.tp * p.pp) == 0:
            extra.append(f"parallel.dp={world // (p.tp * p.pp)}")
            derived = (
                f", hence parallel.dp = {nodes} nodes x {per_node} ranks / (tp {p.tp} x pp {p.pp}) = "
                f"{world // (p.tp * p.pp)}"
            )
    try:
        return load_recipe(recipe_path, [*overrides, *extra])
    except RecipeError as e:
        # The keys named below were set by --nodes, not typed by the user: say so.
        raise RecipeError(f"--nodes = {nodes} (sets cluster.nodes = {nodes}{derived}): {e}") from None


def _sbatch(script: Path, env: dict | None = None) -> str:
    try:
        res = subprocess.run(
            ["sbatch", "--parsable", str(script)],
            capture_output=True,
            text=True,
            env=env or os.environ.copy(),
            timeout=60,
        )
    except FileNotFoundError:
        raise SlurmError("sbatch not found: is Slurm installed, and SLURM_CONF set?") from None
    if res.returncode != 0:
        raise SlurmError(f"sbatch failed: {res.stderr.strip() or res.stdout.strip()}")
    return res.stdout.strip().split(";")[0]


def prepare(
    loaded: LoadedRecipe, *, output_dir: str | Path | None = None, command: str = "train"
) -> tuple[Path, str]:
    """A new run folder holding the job script (``command``: what its ranks run, see ``render.COMMANDS``)."""
    run_dir = new_run_dir(loaded, root=output_dir)
    (run_dir / "logs").mkdir()
    try:
        script = render(loaded.recipe, run_dir=run_dir, job_name=loaded.name, command=command)
    except RenderError:
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    (run_dir / JOB_FILE).write_text(script)
    return run_dir, script


def submit_prepared(run_dir: Path) -> Submission:
    """sbatch the job script of a folder made by :func:`prepare`, and record the job id in its run.json."""
    job = _sbatch(run_dir / JOB_FILE)
    _record_job(run_dir, job)
    return Submission(job, run_dir, run_dir / JOB_FILE)


def submit(loaded: LoadedRecipe, *, output_dir: str | Path | None = None) -> Submission:
    run_dir, _ = prepare(loaded, output_dir=output_dir)
    return submit_prepared(run_dir)


def resubmit(run_dir: str | Path) -> Submission:
    """Submit the run folder's job again; it resumes from the latest checkpoint."""
    run_dir = Path(run_dir).resolve()
    if not (run_dir / JOB_FILE).exists():
        raise SlurmError(f"{run_dir}: no {JOB_FILE} (was it created by tim submit?)")
    return submit_prepared(run_dir)


def dry_run(loaded: LoadedRecipe, *, output_dir: str | Path | None = None) -> str:
    """The script ``submit`` would write, for a run folder that is not created."""
    root = Path(output_dir or loaded.recipe.run.output_dir).resolve()
    return render(loaded.recipe, run_dir=root / loaded.name / "DRY-RUN", job_name=loaded.name)


def _record_job(run_dir: Path, job: str) -> None:
    mark_submitted(run_dir, job)


def submit_sweep(
    sweep_file: str | Path,
    *,
    extra: list[str] | None = None,
    output_dir: str | Path | None = None,
    dry: bool = False,
):
    """One job per variant, all tagged with the same sweep id; returns (sweep id, submissions or scripts)."""
    sweep = load_sweep(sweep_file)
    sweep_id = f"{sweep.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out = []
    for v in sweep.variants:
        loaded = sweep.load_variant(v, extra=extra, sweep_id=sweep_id)
        out.append(dry_run(loaded, output_dir=output_dir) if dry else submit(loaded, output_dir=output_dir))
    return sweep_id, out


# ------------------------------------------------------------------------------------------------ jobs


def job_state(job: str) -> str | None:
    res = subprocess.run(
        ["scontrol", "show", "job", "-o", str(job)], capture_output=True, text=True, timeout=30
    )
    m = re.search(r"JobState=(\S+)", res.stdout)
    return m.group(1) if m else None


def active_jobs() -> list[dict]:
    res = subprocess.run(["squeue", "-h", "-o", "%i|%j|%T|%M|%k"], capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise SlurmError(f"squeue failed: {res.stderr.strip()}")
    rows = []
    for line in res.stdout.splitlines():
        jid, name, state, elapsed, comment = (line.split("|") + [""] * 5)[:5]
        if comment == "tim-megatron":
            rows.append({"job": jid, "name": name, "state": state, "elapsed": elapsed})
    return rows


def find_run(job: str, root: str | Path = "runs") -> Path | None:
    """The run folder under ``root`` whose run.json records job ``job``. A run.json that is a link, a FIFO, a
    device, too large, not a JSON object or nested too deep is not read as one
    (:func:`tim_megatron.slurm.run_record.read_record`)."""
    from tim_megatron.slurm.run_record import RecordError, read_record

    for meta in Path(root).glob(f"*/*/{META_FILE}"):
        try:
            data = read_record(meta.parent)
        except RecordError:  # a corrupt or unreadable run.json is not the one we look for
            continue
        ids = data.get("job_ids")
        if isinstance(ids, list) and str(job) in ids:
            return meta.parent
    return None


JOB_ID = (
    r"[1-9][0-9]{0,11}(?:_(?:[0-9]{1,9}|\[[0-9]{1,9}(?:-[0-9]{1,9})?(?:,[0-9]{1,9}(?:-[0-9]{1,9})?)*\]))?"
)
"""A Slurm job id: ``123``, one array task ``123_4``, or array tasks ``123_[1-3,7]`` (ASCII digits only)."""


def check_job_id(job: str) -> str:
    """``job`` if it is a Slurm job id; else :class:`SlurmError` naming the value and the allowed forms (an
    option such as ``--me`` or ``--user=x`` would otherwise reach scancel and cancel every job it selects)."""
    if not isinstance(job, str) or not re.fullmatch(JOB_ID, job):
        raise SlurmError(
            f"job id {job!r}: not a Slurm job id; allowed: digits (123), one array task (123_4) or array "
            "tasks (123_[1-3,7]) (`tim jobs` lists this project's jobs)"
        )
    return job


def scancel_argv(job: str) -> list[str]:
    """The ``scancel`` command for one job: the id is checked, and ``--`` ends scancel's options before it."""
    return ["scancel", "--", check_job_id(job)]


def cancel(job: str) -> None:
    try:
        res = subprocess.run(scancel_argv(job), capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise SlurmError("scancel not found: is Slurm installed, and SLURM_CONF set?") from None
    if res.returncode != 0:
        raise SlurmError(f"scancel {job} failed: {res.stderr.strip()}")


def adopt_recipe_for_job(d: Path, loaded: LoadedRecipe, *, allow_change: bool = False) -> dict[str, tuple]:
    """:func:`tim_megatron.run_dir.adopt_recipe` for ``tim submit --resume``: under the folder's lock (no job may be running
    in it), and with the job script rendered again from the new recipe when it changed."""
    from tim_megatron.run_lock import hold

    d = Path(d).resolve()
    if not (d / RECIPE_FILE).exists():
        raise RunDirError(f"{d} is not a run folder (no {RECIPE_FILE})")
    lock = hold(d)
    try:
        changes = adopt_recipe(d, loaded, allow_change=allow_change)
        if changes:
            name = read_meta(d).get("name", loaded.name)
            (d / JOB_FILE).write_text(render(loaded.recipe, run_dir=d, job_name=name))
    finally:
        lock.release()
    return changes
