"""The ``tim`` command line."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import typer

from tim_megatron.report.settings import WarningSettings
from tim_megatron.untrusted import recorded, terminal

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="tim-megatron: MoE RL with a view on training-inference mismatch.",
)
recipe_app = typer.Typer(no_args_is_help=True, help="Resolve and validate recipes.")
simulate_app = typer.Typer(no_args_is_help=True, help="Numerical simulations.")
app.add_typer(recipe_app, name="recipe")
app.add_typer(simulate_app, name="simulate")

console = terminal()
err = terminal(stderr=True)


def _fail(msg: str, code: int = 2) -> None:
    import os

    from tim_megatron.recipe.loader import MAX_ERROR_CHARS

    # Each rank of a launcher prints its own error: say which one (torchrun's own prefix is "[rankN]:").
    who = (
        f"[rank{os.environ['RANK']}] "
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ
        else ""
    )
    # The message quotes user input (values, paths): "[/x]" in it is text, not rich markup.
    err.print(
        f"{recorded(who)}[bold red]error:[/] {recorded(msg, MAX_ERROR_CHARS, lines=True)}",
        highlight=False,
        markup=True,
        soft_wrap=True,
    )
    raise typer.Exit(code)


@recipe_app.command("show")
def recipe_show(
    recipe: Path, overrides: list[str] = typer.Argument(None, help="dotted key=value overrides")
) -> None:
    """Print the fully resolved recipe (inheritance and overrides applied, defaults filled in)."""
    from tim_megatron.recipe import RecipeError, load_recipe, recipe_to_yaml

    try:
        loaded = load_recipe(recipe, overrides or [])
    except RecipeError as e:
        _fail(str(e))
    sys.stdout.write(
        f"# run name: {loaded.name}\n# files: {' <- '.join(str(p) for p in reversed(loaded.chain))}\n"
    )
    sys.stdout.write(recipe_to_yaml(loaded.recipe))


@recipe_app.command("check")
def recipe_check(
    root: Path = typer.Argument(Path("recipes"), help="folder (or one file) to validate"),
) -> None:
    """Validate every recipe and sweep file under a folder, offline."""
    from tim_megatron.recipe.loader import MAX_ERROR_CHARS
    from tim_megatron.recipe_check import check_dir

    results = check_dir(root) if root.is_dir() else check_dir_single(root)
    bad = [(p, e) for p, e in results if e]
    for p, e in results:
        console.print(f"{'[green]ok[/]  ' if not e else '[red]FAIL[/]'} {recorded(p)}", highlight=False)
        if e:
            console.print(
                "      " + recorded(e, MAX_ERROR_CHARS, lines=True).replace("\n", "\n      "), highlight=False
            )
    console.print(f"{len(results) - len(bad):d}/{len(results):d} recipes valid", highlight=False)
    if not results:
        _fail(f"no recipes found under {root}")
    if bad:
        raise typer.Exit(1)


def check_dir_single(path: Path):
    from tim_megatron.recipe_check import check_file

    return [(path, check_file(path))]


@simulate_app.command("precision")
def simulate_precision_cmd(
    vocab: int = typer.Option(2048, help="vocabulary size"),
    samples: int = typer.Option(50_000, help="sampled tokens"),
    logit_std: float = typer.Option(1.5, help="std of the float32 logits"),
    seed: int = typer.Option(1234, help="random seed"),
    dtype: str = typer.Option("bfloat16", help="the quantizer's format: bfloat16 or float16 (real casts)"),
) -> None:
    """The BF16-softmax experiment of the objective-level-hacking paper (its Table 2), via our injection code."""
    from tim_megatron.simulate import simulate_precision

    if vocab < 2 or samples < 1 or logit_std <= 0:
        _fail(f"need vocab >= 2, samples >= 1, logit_std > 0 (got {vocab}, {samples}, {logit_std})")
    if dtype not in ("bfloat16", "float16"):
        _fail(f"--dtype {dtype}: allowed bfloat16, float16")
    r = simulate_precision(vocab=vocab, samples=samples, logit_std=logit_std, seed=seed, dtype=dtype)
    console.print(
        f"ratio p_fp32/mu_{recorded(dtype)} over {r.samples:d} sampled tokens (vocab {vocab:d}, logit std "
        f"{logit_std:g}, seed {seed:d})",
        highlight=False,
    )
    print("seed\tmean\tstd\tmax\tmin\tKL(mu||fp32)")
    print(f"{seed}\t{r.mean:.4f}\t{r.std:.4f}\t{r.max:.4f}\t{r.min:.4f}\t{r.kl:.3e}")


@app.command("train")
def train_cmd(
    recipe: Path = typer.Argument(None, help="recipe YAML (omit with --resume)"),
    overrides: list[str] = typer.Argument(None, help="dotted key=value overrides"),
    resume: Path = typer.Option(None, "--resume", help="continue this run folder from its latest checkpoint"),
    run_dir: Path = typer.Option(
        None, "--run-dir", help="use this run folder (resumes if it holds a checkpoint)"
    ),
    nproc: int = typer.Option(
        1, "--nproc", help="processes on this machine (torchrun); parallel.dp follows if unset"
    ),
    allow_recipe_change: bool = typer.Option(
        False,
        "--allow-recipe-change",
        help="continue --run-dir with a different recipe (recorded in run.json)",
    ),
    trust_unverified: bool = typer.Option(
        False,
        "--trust-unverified",
        help="resume from a checkpoint written before checksums were recorded (only if you trust its source)",
    ),
    debug: bool = typer.Option(
        False,
        "--debug",
        help="print the traceback of a named error too (as TIM_DEBUG=1); it is always in logs/",
    ),
) -> None:
    """Run GRPO/GSPO with vLLM rollouts and a megatron-core trainer."""
    import os

    from tim_megatron.error_log import DEBUG_ENV
    from tim_megatron.logging.library_log import quiet_torch_cpp_log

    if debug:
        os.environ[DEBUG_ENV] = "1"  # the ranks of --nproc N inherit it
    from tim_megatron.stop import EXIT_PREEMPTED, StopDuringStartup, StopRequest

    quiet_torch_cpp_log()  # before torch loads; its C++ warnings (a NUMA notice) are start-up noise

    stop = StopRequest(at_once=True)  # first of all: a SIGTERM while starting stops the start at once
    stop.install()
    held: list[Path] = []  # the run folder, once this process holds it
    try:
        _train(
            recipe=recipe,
            overrides=overrides,
            resume=resume,
            run_dir=run_dir,
            nproc=nproc,
            allow_recipe_change=allow_recipe_change,
            trust_unverified=trust_unverified,
            stop=stop,
            held=held,
        )
    except StopDuringStartup as e:
        if held:
            import contextlib

            from tim_megatron.run_dir import mark_stopped  # imported already: the folder is held

            with contextlib.suppress(OSError):
                mark_stopped(held[0], str(e))
            what = f": run.json says preempted; continue with tim train --resume {held[0]}"
        else:
            import os

            rank = os.environ.get("RANK", "0")
            what = f" (rank {rank})" if rank != "0" else ": no run was started"
        err.print(
            f"stopped by {recorded(e)} during start-up, before the first step{recorded(what)}",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(_rank_exit(EXIT_PREEMPTED)) from None


LOCAL_RANKS_ENV = "TIM_LOCAL_RANKS"
"""Set for the ranks of ``tim train --nproc N``: their launcher takes the exit code from run.json."""


def _rank_exit(code: int) -> int:
    """A rank of ``tim train --nproc N`` that stopped as asked (75) exits 0: torchrun reports any other code as a
    failure, with a traceback, and stops the other ranks at once; the launcher exits 75 from run.json."""
    import os

    from tim_megatron.stop import EXIT_PREEMPTED

    return 0 if code == EXIT_PREEMPTED and os.environ.get(LOCAL_RANKS_ENV) == "1" else code


def _train(
    *,
    recipe: Path | None,
    overrides: list[str] | None,
    resume: Path | None,
    run_dir: Path | None,
    nproc: int,
    allow_recipe_change: bool,
    trust_unverified: bool,
    stop,
    held: list[Path],
) -> None:
    """``tim train`` once its stop handler is in place: check everything, set up the run folder, run.

    ``held`` receives the run folder when this process takes its lock (the caller then records a stop)."""
    if nproc < 1:
        _fail(f"--nproc {nproc}: the number of processes to start on this machine; allowed 1 or more")
    where = _Where.here(nproc)
    loaded, rd = _prepare_folder(
        where,
        recipe=recipe,
        overrides=overrides,
        resume=resume,
        run_dir=run_dir,
        allow_recipe_change=allow_recipe_change,
        held=held,
    )
    if nproc > 1 and not where.under_launcher:
        raise typer.Exit(_launch_ranks(nproc, rd, stop=stop, trust_unverified=trust_unverified))
    code = _run_here(
        loaded, rd, where, resumed=resume is not None, stop=stop, trust_unverified=trust_unverified
    )
    raise typer.Exit(_rank_exit(code))


@dataclass(frozen=True)
class _Where:
    """This process's place in the run: under a launcher (torchrun, srun) or not, the world size, and whether it
    writes the run folder's record (rank 0, or the launcher of local ranks)."""

    under_launcher: bool
    world: int
    writer: bool

    @classmethod
    def here(cls, nproc: int) -> _Where:
        import os

        under = "RANK" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) > 1
        if "RANK" in os.environ:  # a rank of torchrun: it dies with its launcher
            from tim_megatron.procs import die_with_parent

            die_with_parent()
        world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1"))) if under else nproc
        return cls(under_launcher=under, world=world, writer=os.environ.get("RANK", "0") == "0")


def _prepare_folder(
    where: _Where,
    *,
    recipe: Path | None,
    overrides: list[str] | None,
    resume: Path | None,
    run_dir: Path | None,
    allow_recipe_change: bool,
    held: list[Path],
):
    """The recipe and the run folder: every check first, then the folder created, held and its recipe recorded.
    Returns (the loaded recipe, the folder)."""
    from tim_megatron import run_dir as run_folder
    from tim_megatron.recipe import RecipeError
    from tim_megatron.run_dir import RunDirError, load_run, new_run_dir
    from tim_megatron.run_lock import RunFolderBusy, hold

    rd = None
    try:
        if resume is not None:
            if recipe is not None or overrides:
                _fail("--resume takes the recipe from the run folder; give no recipe or overrides")
            loaded, rd = load_run(resume), resume
        elif recipe is None and run_dir is not None and (run_dir / "recipe.yaml").exists():
            loaded, rd = load_run(run_dir), run_dir  # a prepared run folder (tim submit writes one per job)
        else:
            if recipe is None:
                _fail("give a recipe (or --resume RUN_DIR, or --run-dir of a prepared run folder)")
            loaded = _load_for_world(recipe, list(overrides or []), where.world)
            if run_dir is not None:
                run_folder.check_target(run_dir)  # never into a folder of other files
            elif where.under_launcher:
                _fail("under torchrun/srun every rank needs the same --run-dir")
            rd = run_dir
        _check_world(
            loaded.recipe.parallel, where.world, nproc=where.world, under_launcher=where.under_launcher
        )
        from tim_megatron.modes import modes_of

        if modes_of(loaded.recipe).exact:  # before any GEMM of this process or of its ranks
            from tim_megatron.exact.kernels import pin_cpu_reductions

            pin_cpu_reductions()
        # Everything that can be checked was: only now is a folder created or written.
        if rd is None:
            rd = new_run_dir(loaded)
        if where.writer:
            rd.mkdir(parents=True, exist_ok=True)
            hold(rd)  # held until this process exits; a second run in the folder stops here
            held.append(rd)
            run_folder.adopt_recipe(rd, loaded, allow_change=allow_recipe_change, retry=True)
    except RecipeError as e:
        _fail(str(e))
    except (RunFolderBusy, RunDirError) as e:
        _fail(str(e))
    except FileNotFoundError as e:
        _fail(str(e))
    except OSError as e:  # a folder that cannot be created or written
        _fail(f"cannot set up the run folder {rd}: {e}")
    return loaded, rd


def _launch_ranks(nproc: int, rd: Path, *, stop, trust_unverified: bool) -> int:
    """Start ``nproc`` local ranks under torchrun on the prepared folder; the exit code that agrees with the
    ranks' ``run.json`` record."""
    import signal

    from tim_megatron import run_dir as run_folder

    before = run_folder.read_meta(rd).get("attempt")
    stop.steps_begin()  # from here a signal is recorded, and passed on to the ranks
    torchrun_code = _launch_local(
        nproc, rd, stop_signal=lambda: stop.signal, trust_unverified=trust_unverified
    )
    sig = signal.Signals(stop.signal).name if stop.signal else None
    code = run_folder.settle_launcher_exit(rd, torchrun_code, attempt_before=before, stopped_by=sig)
    status = run_folder.read_meta(rd).get("status")
    console.print(f"ranks done: run.json status {recorded(status)}, exit code {code:d}", highlight=False)
    return code


def _run_here(loaded, rd: Path, where: _Where, *, resumed: bool, stop, trust_unverified: bool) -> int:
    """Run the steps in this process, inside one attempt (failures set ``failed``, a stop while starting
    ``preempted``); user errors become a one-line exit."""
    from tim_megatron import run_dir as run_folder
    from tim_megatron.trainer.checkpoint import latest_checkpoint

    resuming = resumed or latest_checkpoint(rd / "checkpoints") is not None
    try:
        with run_folder.attempt(rd, writer=where.writer):
            from tim_megatron.loop import train  # its imports are start-up too

            return train(
                loaded,
                rd,
                resume=resuming,
                console=console,
                stop=stop,
                trust_unverified=trust_unverified,
                close=False,
            )
    except _user_errors() as e:
        _fail(f"{type(e).__name__}: {e}" + _align_hint(e, rd, world=where.world))
    except Exception as e:
        from tim_megatron import error_log
        from tim_megatron.rollout.base import EngineStartError

        if isinstance(e, EngineStartError) and e.kind == "fit":
            _fail(f"the rollout engine does not fit in the memory it was given: {e}\n{ENGINE_FIT_FIX}")
        if not error_log.is_named(e) or error_log.debug():
            raise  # a bug or a library's error keeps its traceback (and TIM_DEBUG=1 shows every one)
        _fail_named(e, rd, writer=where.writer)


def _fail_named(e: Exception, rd: Path, *, writer: bool) -> None:
    """A named error (:mod:`tim_megatron.error_log`) as its sentence and what to do; its traceback in the run's log."""
    from tim_megatron import error_log
    from tim_megatron.run_dir import attempt_id

    log = error_log.write_traceback(rd, e, attempt=attempt_id())
    where = (
        f"its traceback is in {log}"
        if log is not None
        else "its traceback could not be written to the run folder"
    )
    record = "run.json records the failure; " if writer else ""
    _fail(
        f"{type(e).__name__}: {e}\n{record}{where} ({error_log.DEBUG_ENV}=1 or tim train --debug prints it here). "
        f"Once the cause is fixed, continue from the last checkpoint: tim train --resume {rd}",
        code=1,
    )


ENGINE_FIT_FIX = (
    "fix: on a GPU raise rollout.gpu_memory_utilization (the engine's share of each GPU) or "
    "rollout.tensor_parallel_size, or lower rollout.max_model_len; on CPU set rollout.cpu_kvcache_gib within the "
    "machine's free memory (tim plan shows the budget)"
)


def _align_hint(e: Exception, rd: Path | None, *, world: int) -> str:
    """For a failed weight-sync check: the command that shows where the engine and the trainer part ways."""
    from tim_megatron.rollout.sync import WeightSyncError

    if not isinstance(e, WeightSyncError) or rd is None:
        return ""
    return (
        f"\nto see which layer and component differ, run: tim align {rd / 'recipe.yaml'} --out {rd / 'align'}"
        + (f" --nproc {world}" if world > 1 else "")
        + " "
        "(the same dtypes and layout; tim report on this run folder then shows it; --fault-layer N checks the "
        "tool on a planted fault)"
    )


def _load_for_world(recipe: Path, overrides: list[str], world: int):
    """The recipe with ``parallel.dp`` following the number of processes, unless the recipe or the command line
    sets it (then :func:`_check_world` holds them to it)."""
    from tim_megatron.recipe import load_recipe
    from tim_megatron.recipe.loader import layout_of

    p, _, given = layout_of(recipe, overrides)  # before the rules that read the world size
    if p is not None and world != p.world_size and "parallel.dp" not in given and world % (p.tp * p.pp) == 0:
        overrides = [*overrides, f"parallel.dp={world // (p.tp * p.pp)}"]
    return load_recipe(recipe, overrides)


def _check_world(p, world: int, *, nproc: int, under_launcher: bool) -> None:
    """The processes this run will have must be the recipe's layout (checked before any folder is written)."""
    if world == p.world_size:
        return
    layout = f"parallel.tp x pp x dp = {p.tp} x {p.pp} x {p.dp} = {p.world_size} process(es)"
    if under_launcher:
        _fail(f"the launcher started {world} process(es), but the recipe's layout needs {layout}")
    _fail(f"--nproc {nproc}: the recipe's layout needs {layout}; give --nproc {p.world_size}")


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors caused by the inputs (named in their messages), shown without a traceback."""
    from tim_megatron.data.sources import DataError
    from tim_megatron.rollout.sync import WeightSyncError
    from tim_megatron.rollout.vllm_engine import RolloutInputError
    from tim_megatron.run_dir import RunDirError
    from tim_megatron.trainer.checkpoint import CheckpointError
    from tim_megatron.trainer.hf_config import CheckpointMismatchError, UnsupportedModelError
    from tim_megatron.trainer.megatron_trainer import NonFiniteAbort
    from tim_megatron.trainer.weights import WeightLoadError

    return (
        CheckpointError,
        NonFiniteAbort,
        RunDirError,
        DataError,
        RolloutInputError,
        CheckpointMismatchError,
        UnsupportedModelError,
        WeightLoadError,
        WeightSyncError,
        FileNotFoundError,
    )


@app.command("export-hf")
def export_hf_cmd(
    run_dir: Path = typer.Argument(..., help="a run folder with checkpoints"),
    out: Path = typer.Argument(..., help="output folder (an HF checkpoint)"),
    dtype: str = typer.Option(None, help="cast tensors: float32, bfloat16 or float16 (default: as trained)"),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="replace OUT if it holds an earlier export (never any other folder)"
    ),
    trust_unverified: bool = typer.Option(
        False,
        "--trust-unverified",
        help="load a checkpoint written before checksums were recorded (only if you trust its source)",
    ),
) -> None:
    """Write a run's latest checkpoint as an HF checkpoint (per-expert tensors, config, tokenizer)."""
    from tim_megatron.export import ExportError, export_run
    from tim_megatron.recipe import RecipeError
    from tim_megatron.run_dir import RunDirError
    from tim_megatron.safe_files import UnsafePathError
    from tim_megatron.trainer.checkpoint import CheckpointError
    from tim_megatron.trainer.weights import WeightLoadError

    if dtype not in (None, "float32", "bfloat16", "float16"):
        _fail(f"--dtype {dtype!r}: allowed float32, bfloat16, float16")
    try:
        path = export_run(run_dir, out, dtype=dtype, overwrite=overwrite, trust_unverified=trust_unverified)
    except (
        FileNotFoundError,
        CheckpointError,
        ExportError,
        RunDirError,
        RecipeError,
        UnsafePathError,
        WeightLoadError,
    ) as e:
        _fail(str(e))
    console.print(f"exported {recorded(run_dir)} -> {recorded(path)}", highlight=False)


# ------------------------------------------------------------------------------------------------ Slurm


def _loaded_or_fail(recipe: Path, overrides: list[str] | None, nodes: int | None = None):
    from tim_megatron.recipe import RecipeError
    from tim_megatron.slurm.submit import with_nodes

    try:
        return with_nodes(recipe, list(overrides or []), nodes)
    except RecipeError as e:
        _fail(str(e))


@app.command("submit")
def submit_cmd(
    recipe: Path = typer.Argument(None, help="recipe YAML"),
    overrides: list[str] = typer.Argument(None, help="dotted key=value overrides"),
    nodes: int = typer.Option(None, "--nodes", help="cluster.nodes (parallel.dp grows with it unless set)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the job script; submit nothing"),
    resume: Path = typer.Option(
        None, "--resume", help="submit this run folder's job again (continues from its checkpoint)"
    ),
    allow_recipe_change: bool = typer.Option(
        False,
        "--allow-recipe-change",
        help="with --resume and a recipe: continue the folder with this recipe (recorded in run.json)",
    ),
) -> None:
    """Validate a recipe, write its Slurm job into a new run folder and sbatch it."""
    from tim_megatron.run_dir import RunDirError
    from tim_megatron.run_lock import RunFolderBusy
    from tim_megatron.slurm.render import RenderError
    from tim_megatron.slurm.submit import SlurmError, adopt_recipe_for_job, resubmit, submit
    from tim_megatron.slurm.submit import dry_run as render_only

    try:
        if resume is not None:
            if recipe is not None:  # compared with the folder's recipe; a change needs the flag
                loaded = _loaded_or_fail(recipe, overrides, nodes)
                adopt_recipe_for_job(resume, loaded, allow_change=allow_recipe_change)
            sub = resubmit(resume)
        else:
            if recipe is None:
                _fail("give a recipe (or --resume RUN_DIR)")
            loaded = _loaded_or_fail(recipe, overrides, nodes)
            if dry_run:
                sys.stdout.write(render_only(loaded))
                return
            sub = submit(loaded)
    except (RenderError, SlurmError, RunDirError, RunFolderBusy) as e:
        _fail(str(e))
    console.print(
        f"submitted job {recorded(sub.job_id)}\n  run folder: {recorded(sub.run_dir)}\n  log:        "
        f"{recorded(sub.log)}\n  wandb run:  {recorded(sub.wandb_name)}",
        highlight=False,
    )


@app.command("sweep")
def sweep_cmd(
    sweep: Path = typer.Argument(..., help="sweep YAML (base_recipe + variants)"),
    overrides: list[str] = typer.Argument(None, help="overrides applied to every variant"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the job scripts; submit nothing"),
) -> None:
    """Submit every variant of a sweep as its own job, all tagged with one sweep id."""
    from tim_megatron.recipe import RecipeError
    from tim_megatron.slurm.render import RenderError
    from tim_megatron.slurm.submit import SlurmError, submit_sweep

    try:
        sweep_id, subs = submit_sweep(sweep, extra=list(overrides or []), dry=dry_run)
    except (RecipeError, RenderError, SlurmError) as e:
        _fail(str(e))
    if dry_run:
        for text in subs:
            sys.stdout.write(text + "\n")
        return
    console.print(f"sweep {recorded(sweep_id)}: {len(subs):d} job(s)", highlight=False)
    for s in subs:
        console.print(f"  job {recorded(s.job_id)}  {recorded(s.run_dir)}", highlight=False)


@app.command("jobs")
def jobs_cmd() -> None:
    """The project's queued and running Slurm jobs."""
    from tim_megatron.slurm.submit import SlurmError, active_jobs

    try:
        rows = active_jobs()
    except (SlurmError, FileNotFoundError) as e:
        _fail(str(e))
    if not rows:
        console.print("no tim-megatron jobs in the queue", highlight=False)
    for r in rows:
        console.print(
            f"{recorded(r['job']):>8}  {recorded(r['state']):<10} {recorded(r['elapsed']):>10}  {recorded(r['name'])}",
            highlight=False,
        )


@app.command("logs")
def logs_cmd(
    job: str = typer.Argument(..., help="Slurm job id"),
    lines: int = typer.Option(40, help="lines from the end (a whole number >= 1)"),
    root: Path = typer.Option(Path("runs"), "--root", help="where run folders live (run.output_dir)"),
) -> None:
    """The end of a job's log (found through the run folders' run.json), control characters escaped."""
    from tim_megatron.slurm.joblog import JobLogError, job_log_tail, write_text

    try:
        text, notes = job_log_tail(job, lines=lines, root=root)
    except JobLogError as e:
        _fail(str(e))
    write_text(text)
    for note in notes:
        err.print(f"note: {recorded(note)}", highlight=False)


@app.command("cancel")
def cancel_cmd(job: str = typer.Argument(..., help="Slurm job id")) -> None:
    """Cancel a job (the run checkpoints on the SIGTERM; `tim submit --resume RUN_DIR` continues it)."""
    from tim_megatron.slurm.submit import SlurmError, cancel

    try:
        cancel(job)
    except SlurmError as e:
        _fail(str(e))
    console.print(f"cancelled {recorded(job)}", highlight=False)


@app.command("align")
def align_cmd(
    recipe: Path,
    overrides: list[str] = typer.Argument(None),
    tokens: Path | None = typer.Option(
        None, "--tokens", help="JSON list of token-id lists to compare on (default: the engine samples them)"
    ),
    prompts: int = typer.Option(8, "--prompts", help="prompts of step 1 the engine samples one response for"),
    out: Path | None = typer.Option(
        None, "--out", help="where align.json/.txt/.png go (default runs/align/NAME)"
    ),
    tolerance: float | None = typer.Option(
        None,
        "--tolerance",
        help="judged difference above which a component diverged (default: 1e-5 when every side computes in "
        "float32, else 4 x the half-precision floor measured on this machine)",
    ),
    fault_layer: int | None = typer.Option(
        None,
        "--fault-layer",
        help="plant a fault: scale the engine's experts of this layer (the report must find it)",
    ),
    fault_scale: float = typer.Option(0.01, "--fault-scale", help="--fault-layer multiplies by 1 + this"),
    nproc: int = typer.Option(
        1, "--nproc", help="processes on this machine (torchrun), for the recipe's layout"
    ),
    sides: str = typer.Option(
        "engine,trainer",
        "--sides",
        help="the two sides compared, from engine, trainer, hf (HF transformers in float32, the reference)",
    ),
) -> None:
    """Where do the engine and the trainer part ways? Both record the same tokens layer by layer (residual stream
    after attention and after the MLP/MoE, router logits, experts and gates, final norm, logprobs); the report names
    the first layer and component above the tolerance."""
    import os

    from tim_megatron.align.run import AlignOptions, align, check_inputs, parse_sides
    from tim_megatron.recipe import RecipeError

    if nproc < 1 or prompts < 1 or (tolerance is not None and not tolerance > 0):
        _fail(f"--nproc {nproc}, --prompts {prompts}, --tolerance {tolerance}: each must be positive")
    try:  # every option checked before anything loads
        options = AlignOptions(
            tokens=tokens,
            prompts=prompts,
            tolerance=tolerance,
            fault_layer=fault_layer,
            fault_scale=fault_scale,
            sides=parse_sides(sides),
        )
    except ValueError as e:
        _fail(str(e))
    under_launcher = "RANK" in os.environ
    if under_launcher:  # a rank of torchrun: it dies with its launcher
        from tim_megatron.procs import die_with_parent

        die_with_parent()
    world = int(os.environ.get("WORLD_SIZE", "1")) if under_launcher else nproc
    try:  # loaded once, with parallel.dp following the processes
        loaded = _load_for_world(recipe, list(overrides or []), world)
    except (RecipeError, FileNotFoundError) as e:
        _fail(str(e))
    _check_world(loaded.recipe.parallel, world, nproc=nproc, under_launcher=under_launcher)
    where = out or Path("runs") / "align" / loaded.name
    try:  # the tokens and the output folder, before the launcher, the trainer or the engine starts
        check_inputs(loaded.recipe, options, where)
    except ValueError as e:
        _fail(str(e))
    if nproc > 1 and not under_launcher:
        raise typer.Exit(
            _relaunch(nproc, ["align", *_without_nproc(sys.argv[sys.argv.index("align") + 1 :])])
        )
    try:
        align(loaded, options, out=where, console=console)
    except ValueError as e:
        _fail(str(e))
    if os.environ.get("RANK", "0") == "0":
        console.print(f"wrote {recorded(where)}/align.json, align.txt and align.png", highlight=False)


def _without_nproc(args: list[str]) -> list[str]:
    """The arguments less ``--nproc N`` (the ranks take the world from the launcher; torchrun would also read an
    abbreviated ``--nproc`` after the module as its own option)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def _relaunch(nproc: int, args: list[str]) -> int:
    """Run ``tim ARGS`` under torchrun with ``nproc`` ranks on this machine; its exit code."""
    from tim_megatron.procs import run_launcher

    return run_launcher(_torchrun(nproc, args), stop_signal=lambda: None)


def _torchrun(nproc: int, args: list[str]) -> list[str]:
    """The torchrun command for ``tim ARGS`` with ``nproc`` ranks on this machine, on a free local port."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)),
        *("--master_port", str(port), "-m", "tim_megatron.cli", *args),
    ]


@app.command("plan")
def plan_cmd(recipe: Path, overrides: list[str] = typer.Argument(None)) -> None:
    """Per-GPU memory estimate (parameters, gradients, optimizer state, activations, vLLM weights and KV cache),
    the rollout with each offload level, and the whole step's time (exit 1 when it does not fit, or when the
    recipe's ranks do not fill its nodes)."""
    from tim_megatron.slurm.fleet_plan import fleet_plan, format_fleet
    from tim_megatron.slurm.plan import estimate, format_plan
    from tim_megatron.slurm.step_plan import format_rollout_options, format_step

    loaded = _loaded_or_fail(recipe, overrides)
    plan = estimate(loaded.recipe)
    print(format_plan(loaded.recipe, plan, loaded.name))
    print(format_fleet(loaded.recipe, fleet_plan(loaded.recipe, plan)))
    if loaded.recipe.cluster.gpus_per_node:
        print(format_rollout_options(loaded.recipe, plan))
    print(format_step(loaded.recipe, plan))
    from tim_megatron.recipe.notices import notices

    for n in notices(loaded.recipe):
        console.print(f"[yellow]notice[/]: {recorded(n, 1000)}", highlight=False)
    if not plan.fits:  # the reasons are printed above; exit 1 like `tim doctor` does for a plan that fails
        raise typer.Exit(1)


@app.command("doctor")
def doctor_cmd(
    recipe: Path = typer.Argument(None, help="recipe YAML to resolve and plan (optional)"),
    overrides: list[str] = typer.Argument(None, help="dotted key=value overrides"),
    nodes: int = typer.Option(None, "--nodes", help="cluster.nodes (parallel.dp grows with it unless set)"),
    deps: str = typer.Option(
        None, "--deps", help="instead: resolve this extra (gpu) with pip, install nothing, check the versions"
    ),
) -> None:
    """Check this machine (and a recipe) before a long job: one line per check, ok / warn / fail with the fix."""
    from tim_megatron.doctor import CHECKS, context_for, exit_code, format_result, run_checks, summary
    from tim_megatron.doctor.deps import EXTRAS, check_deps

    if deps is not None:
        if deps not in EXTRAS:
            _fail(f"--deps {deps!r}: allowed {', '.join(EXTRAS)}")
        if recipe is not None:
            _fail(f"--deps {deps} takes no recipe ({recipe}): it checks what an install would get, not a run")
        print(
            f"resolving tim-megatron[{deps}] with pip: metadata only, nothing is installed (minutes)",
            flush=True,
        )
        results = check_deps(deps)
        for r in results:
            print(format_result(r), flush=True)
        print(summary(results))
        raise typer.Exit(exit_code(results))
    results = run_checks(context_for(recipe, overrides, nodes=nodes), CHECKS)
    for r in results:
        print(format_result(r), flush=True)
    print(summary(results))
    raise typer.Exit(exit_code(results))


@app.command("preflight")
def preflight_cmd(
    recipe: Path = typer.Argument(..., help="recipe YAML"),
    overrides: list[str] = typer.Argument(None, help="dotted key=value overrides (they win over the shrink)"),
    nodes: int = typer.Option(None, "--nodes", help="cluster.nodes (parallel.dp grows with it unless set)"),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="print the shrink and the job script; submit nothing"
    ),
) -> None:
    """A short Slurm job with the recipe's real layout and a shrunk workload: go / no-go and preflight.json."""
    from tim_megatron.preflight import load_preflight
    from tim_megatron.preflight.report import summary
    from tim_megatron.preflight.submit import dry_run as render_only
    from tim_megatron.preflight.submit import submit, watch
    from tim_megatron.recipe import RecipeError
    from tim_megatron.slurm.render import RenderError
    from tim_megatron.slurm.submit import SlurmError

    try:
        pf = load_preflight(recipe, list(overrides or []), nodes)
        if dry_run:
            sys.stdout.write(render_only(pf))
            return
        sub = submit(pf)
    except (RecipeError, RenderError, SlurmError) as e:
        _fail(str(e))
    console.print(
        f"submitted preflight job {recorded(sub.job_id)}\n  run folder: {recorded(sub.run_dir)}\n  log:        "
        f"{recorded(sub.log)}",
        highlight=False,
    )
    try:
        report = watch(
            sub.run_dir,
            sub.job_id,
            say=lambda s: console.print(recorded(s, 2000, lines=True), highlight=False),
        )
    except KeyboardInterrupt:
        _fail(
            f"stopped waiting; job {sub.job_id} goes on (scancel {sub.job_id} stops it); its verdict will be in "
            f"{sub.run_dir / 'preflight.json'} unless it dies without one",
            code=130,
        )
    print(summary(report), flush=True)
    raise typer.Exit(0 if report["verdict"]["go"] else 1)


@app.command("preflight-job", hidden=True)
def preflight_job_cmd(
    run_dir: Path = typer.Option(
        ..., "--run-dir", help="the preflight's run folder (written by tim preflight)"
    ),
) -> None:
    """Inside a preflight job, on every rank: the phases, then the verdict (exit 0 go, 1 no-go)."""
    from tim_megatron.preflight.job import run

    raise typer.Exit(run(run_dir, console=console))


@app.command("new-recipe")
def new_recipe_cmd(
    src: Path = typer.Argument(..., help="recipe folder to copy (FROM)"),
    name: str = typer.Argument(..., help="new folder name under recipes/ (NAME)"),
    hf: Path = typer.Argument(..., help="HF checkpoint folder or its config.json (HF)"),
    recipes_root: Path = typer.Option(
        Path("recipes"), "--recipes-root", help="folder the new recipe folder goes into"
    ),
    min_nodes: int = typer.Option(
        None, "--min-nodes", help="smallest cluster the layout search tries (default: FROM's node count)"
    ),
) -> None:
    """Copy a model's recipe folder for another HF MoE model; dimensions come from its config.json."""
    from tim_megatron.recipe import RecipeError, load_recipe
    from tim_megatron.slurm.new_recipe import new_recipe
    from tim_megatron.slurm.plan import estimate, format_plan
    from tim_megatron.trainer.hf_config import UnsupportedModelError

    try:
        dest, files = new_recipe(src, name, hf, recipes_root=recipes_root, min_nodes=min_nodes)
    except (RecipeError, UnsupportedModelError, FileNotFoundError) as e:
        _fail(str(e))
    console.print(f"wrote {recorded(dest)}: {recorded(', '.join(files), 2000)}", highlight=False)
    loaded = load_recipe(dest / "base.yaml")
    print(format_plan(loaded.recipe, estimate(loaded.recipe), loaded.name))


@app.command("dequantize")
def dequantize_cmd(
    src: Path = typer.Argument(
        ..., help="block-FP8 (DeepSeek-V3, Kimi-K2) or MXFP4 (gpt-oss) HF checkpoint folder"
    ),
    dst: Path = typer.Argument(..., help="new folder for the bfloat16 copy (must not exist)"),
) -> None:
    """Write a bfloat16 copy of a block-FP8 or MXFP4 checkpoint: the weights vLLM serves and the trainer trains."""
    from tim_megatron.safe_files import UnsafePathError
    from tim_megatron.trainer.hf_config import UnsupportedModelError
    from tim_megatron.trainer.weights import HFCheckpoint, WeightLoadError, fp8_checkpoint, mxfp4_checkpoint

    try:
        fmt = mxfp4_checkpoint if HFCheckpoint(src).mxfp4 else fp8_checkpoint
        n = fmt.convert_checkpoint(src, dst, to="bfloat16")
    except (
        ValueError,
        FileExistsError,
        FileNotFoundError,
        UnsafePathError,
        UnsupportedModelError,
        WeightLoadError,
    ) as e:
        _fail(str(e))
    console.print(f"wrote {recorded(dst)}: {n:d} tensors in bfloat16 (set model.path to it)", highlight=False)


@app.command("report")
def report_cmd(
    runs: list[Path] = typer.Argument(None, help="run folders to compare"),
    sweep: str = typer.Option(
        None,
        "--sweep",
        help="every run of a sweep (under --root): its id, its YAML file (newest submission), or 'latest'",
    ),
    root: Path = typer.Option(Path("runs"), "--root", help="where run folders live"),
    name: str = typer.Option(None, "--name", help="report name (default: the sweep id, or 'comparison')"),
    out: Path = typer.Option(None, "--out", help="output folder (default: report/<name>)"),
    baseline_steps: int = typer.Option(
        WarningSettings.baseline_steps, help="early warning: steps whose median is the baseline"
    ),
    window: int = typer.Option(
        WarningSettings.window, help="early warning: recent steps whose median is compared"
    ),
    threshold: float = typer.Option(
        WarningSettings.threshold, help="early warning: fires at this multiple of the baseline"
    ),
    collapse_drop: float = typer.Option(
        WarningSettings.collapse_drop, help="collapse: fraction below the best validation (or reward)"
    ),
) -> None:
    """Build report/<name>/index.html: curves, scatter, bucket drift, surrogate J, warnings, ranked table."""
    from tim_megatron.report.build import build_report, table_text
    from tim_megatron.report.runs import printable, resolve_sweep, shown, valid_id

    paths = list(runs or [])
    found_notices: list[str] = []  # skipped run folders while finding the sweep: on the page, printed once
    if sweep:
        try:
            sweep, found = resolve_sweep(sweep, root, found_notices)
        except ValueError as e:
            for n in found_notices:
                console.print(f"[yellow]notice[/]: {recorded(n, 2000)}", highlight=False)
            _fail(printable(str(e)))
        paths += found
    if not paths:
        _fail("give run folders, or --sweep SWEEP_ID | SWEEP_FILE | latest")
    name = name or sweep or "comparison"
    if not valid_id(name):  # it names the folder under report/ and titles the page
        _fail(
            f"--name {shown(name)}: a report name uses letters, digits, '.', '_' and '-', starts with a letter "
            "or digit and has at most 100 characters; pick such a name"
        )
    try:
        res = build_report(
            paths,
            out or Path("report") / name,
            title=name,
            settings=WarningSettings(
                baseline_steps=baseline_steps, window=window, threshold=threshold, collapse_drop=collapse_drop
            ),
            notices=found_notices,
        )
    except ValueError as e:  # a report file that would land outside its folder
        _fail(printable(str(e)))
    print(table_text(res["rows"]))
    for n in res["notices"]:
        console.print(f"[yellow]notice[/]: {recorded(n, 2000)}", highlight=False)  # notices quote run folders
    console.print(
        f"report: {recorded(res['out'] / 'index.html')}  (summary.csv beside it; {res['seconds']:.1f} s)",
        highlight=False,
    )


@app.command("lab")
def lab_cmd(
    grid: str = typer.Argument(..., help="grid file, or a preset under lab/ (quick, full, long)"),
    only: str = typer.Option(
        None, "--only", help="comma-separated arms to run (the report covers every arm)"
    ),
    out: Path = typer.Option(None, "--out", help="report folder (default: report/<grid name>)"),
    root: Path = typer.Option(None, "--root", help="run folders (default: runs/lab/<grid name>)"),
    aggregate_only: bool = typer.Option(
        False, "--aggregate-only", help="run nothing; rebuild the report from the runs on disk"
    ),
    from_archive: Path = typer.Option(
        None,
        "--from-archive",
        help="with --aggregate-only: rebuild the report from this archive of the grid's runs (lab/data/<grid>.tar.xz) "
        "instead of --root",
    ),
    write_archive: Path = typer.Option(
        None,
        "--write-archive",
        help="after the report, write the grid's completed runs (the files the report reads) to this .tar.xz "
        "(checked before any run: an existing file needs --overwrite-archive)",
    ),
    overwrite_archive: bool = typer.Option(
        False, "--overwrite-archive", help="with --write-archive: replace the file if it exists"
    ),
    allow_dirty: bool = typer.Option(
        False,
        "--allow-dirty",
        help="run a pre-registered grid (docs/prereg/<grid>.md) from a tree with uncommitted changes",
    ),
    timeout_minutes: float = typer.Option(None, "--timeout-minutes", help="stop any one run after this long"),
    jobs: int = typer.Option(
        1,
        "--jobs",
        help="runs at a time, each pinned to its own share of the cores (default 1: one at a time)",
    ),
    docs: Path = typer.Option(
        None,
        "--docs",
        help="also put the generated tables into this Markdown file, between <!-- tables:NAME --> and "
        "<!-- /tables:NAME --> (NAME: the grid's name)",
    ),
) -> None:
    """Run a TIM lab grid (arms x seeds, `--jobs` `tim train` at a time), then write verdicts.csv and index.html."""
    from tim_megatron.lab.grid import GridError
    from tim_megatron.lab.main import run_lab
    from tim_megatron.lab.runner import LabStopped, core_slots
    from tim_megatron.recipe import RecipeError

    try:
        core_slots(jobs)  # before anything runs
    except ValueError as e:
        _fail(f"--jobs {jobs}: {e}")
    arms = {a.strip() for a in only.split(",") if a.strip()} if only is not None else None
    argv = " ".join(
        ["tim lab", grid, *(["--only", only] if only else []), *(["--jobs", str(jobs)] if jobs > 1 else [])]
    )
    try:
        res = run_lab(
            grid,
            out=out,
            root=root,
            only=arms,
            aggregate_only=aggregate_only,
            from_archive=from_archive,
            write_archive_to=write_archive,
            overwrite_archive=overwrite_archive,
            allow_dirty=allow_dirty,
            timeout_s=timeout_minutes * 60 if timeout_minutes else None,
            jobs=jobs,
            command=argv,
            log=lambda m: console.print(recorded(m, 4000, lines=True), highlight=False),
        )
        if docs is not None:
            from tim_megatron.lab.docs import include_tables

            include_tables(docs, res["grid"].name, (res["page"].parent / "tables.md").read_text())
    except (GridError, RecipeError) as e:
        _fail(str(e))
    except LabStopped as e:
        _fail(
            f"tim lab {e}: the runs in flight were stopped; run the same command again to finish the grid",
            code=128 + e.signum,
        )
    for v in res["verdicts"]:
        ci = f"[{v.ci_low:.3g}, {v.ci_high:.3g}]" if v.n_seeds >= 2 else "(no CI)"
        console.print(
            f"{recorded(v.claim)}  {recorded(v.verdict):<15} effect {v.effect:.3g} {recorded(ci)}  "
            f"{recorded(v.detail, 2000)}",
            highlight=False,
        )
    wall = f" (runs: {res['wall_seconds']:.0f} s)" if res["wall_seconds"] else ""
    console.print(
        f"report: {recorded(res['page'])}  (verdicts.csv beside it){recorded(wall)}", highlight=False
    )
    bad = [r for r in res["records"] if r.status.startswith(("failed", "timeout", "busy"))]
    if bad:
        _fail(
            f"{len(bad)} run(s) did not complete: "
            + "; ".join(f"{r.arm} seed {r.seed}: {r.status}" for r in bad)
            + ". Their claims count the seeds that did; run the same command again to retry them.",
            code=1,
        )


def _launch_local(nproc: int, rd: Path, *, stop_signal, trust_unverified: bool = False) -> int:
    """Re-run ``tim train`` under torchrun with ``nproc`` ranks on this machine, all on run folder ``rd``;
    ``stop_signal()`` is the stop signal received so far, passed on to the ranks."""
    import os

    cmd = _torchrun(
        nproc, ["train", "--resume", str(rd), *(["--trust-unverified"] if trust_unverified else [])]
    )
    console.print(f"launching {nproc:d} ranks: {recorded(' '.join(cmd), 2000)}", highlight=False)
    from tim_megatron.procs import run_launcher

    env = {**os.environ, LOCAL_RANKS_ENV: "1"}
    return run_launcher(cmd, stop_signal=stop_signal, env=env)  # its ranks die with it, and it with us


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
