"""Run folders: ``<output_dir>/<run name>/<timestamp>/`` holding everything a run writes.

This module is the one owner of a run folder's ``run.json`` status. Every transition goes through it:

    created / submitted -> running -> completed
                                   -> preempted   (checkpoint written in this attempt; requeue allowed or not)
                                   -> failed      (any error, start-up included, with its reason)

A Slurm job requeues itself only when ``run.json`` carries ``requeue_attempt`` equal to the attempt that
is ending (``<job id>.<restart count>``, see :func:`attempt_id`). Only :func:`mark_finished` writes it, for
a run that checkpointed after a SIGTERM in this very attempt and still has requeues left
(``cluster.max_requeues``). A resume that fails before its first checkpoint therefore ends the loop.

It also guards what a run folder records: :func:`adopt_recipe` compares a recipe given for an existing
folder with the recorded one, :func:`check_target` keeps ``tim train --run-dir`` out of folders that are not
run folders, and ``run.lock`` (:mod:`tim_megatron.run_lock`) keeps a second process out.

A run folder can come from elsewhere (a copied run, a shared file system), so nothing here writes through a
link or outside the folder: files are replaced by an atomic rename (:func:`tim_megatron.safe_files.write_atomic`:
a link planted at ``run.json``, a temporary name or ``summary.txt`` is replaced, its target untouched), appended
and lock files are opened without following links, and ``run.json`` and ``recipe.yaml`` are read only as regular
files. At the start of an attempt :func:`unsafe_entries` refuses, by name, a link where a run writes a folder or
appends, and a FIFO, socket or device anywhere a run reads or writes (a FIFO would block it forever).

A folder that cannot be written is found when it happens: at the start of an attempt (``run.json`` and the
subfolders a run writes), and at every step (rank 0 records the step reached in ``run.json``). The run then
stops with :class:`RunDirNotWritable`, and ``failed`` is recorded when ``run.json`` can still be written;
the message says when it could not.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import tempfile
import time
from pathlib import Path

from tim_megatron import clock
from tim_megatron.code_record import code_record
from tim_megatron.logging.untrusted import shown
from tim_megatron.recipe import LoadedRecipe, recipe_to_yaml
from tim_megatron.recipe.loader import clip, load_recipe
from tim_megatron.run_lock import LOCK_FILE
from tim_megatron.safe_files import (
    UnsafePathError,
    describe,
    open_append,
    read_text,
    regular_file,
    write_atomic,
)
from tim_megatron.stop import EXIT_PREEMPTED, StopDuringStartup

RECIPE_FILE = "recipe.yaml"
META_FILE = "run.json"
RESERVE_FILE = ".run.json.reserve"
"""Space set aside at the start of an attempt, given back when ``run.json`` cannot be written (full disk)."""
RESERVE_BYTES = 64 * 1024
BEFORE_RUN_FILES = frozenset(
    {LOCK_FILE, f".{META_FILE}.lock", RESERVE_FILE, "lab.json", "slot.json", "train.log"}
)
"""What a folder may hold before ``tim train`` first writes its run there: a lock from an earlier try, and
what ``tim lab`` puts there for the run it starts (its spec, core slot and log)."""
WRITTEN_SUBFOLDERS = ("checkpoints", "dumps", "wandb")
"""Subfolders a run writes into, checked at the start of an attempt when they exist."""
REAL_SUBFOLDERS = (*WRITTEN_SUBFOLDERS, "logs", "preflight")
"""Subfolders a run writes into that must be real folders, not links out of the run folder."""
REPLACED_FILES = (RESERVE_FILE, "summary.txt", "curves.png", "events.json")
"""Files a run replaces by an atomic rename: a link there is replaced (never followed), a special file refused."""
UNLINKED_FILES = ("metrics.jsonl", f".{META_FILE}.lock", LOCK_FILE, META_FILE, RECIPE_FILE)
"""Files a run appends to, locks or reads back: regular files only, a link refused (it would be followed)."""
MAX_META_BYTES = 16 * 2**20
"""Largest ``run.json`` read (the project writes a few kB)."""
DENIED_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS)

IGNORED_CHANGES = ("run.output_dir",)
"""Recipe keys that say where run folders live, not what a run computes: never a recipe change."""
FIXED_KEYS = ("model.dims.", "parallel.")
"""Prefixes of keys a checkpoint cannot continue across (tensor shapes, the rank layout of its files)."""


class RunDirError(RuntimeError):
    """A run folder that cannot be used as asked; the message names the folder, the cause and the fix."""


class RecipeChangeError(RunDirError):
    pass


class StatusTransitionError(RunDirError):
    """A ``run.json`` status change that :data:`ALLOWED_FROM` does not allow."""


class DiskFullError(RunDirError):
    pass


class SharedMemoryError(RunDirError):
    """Shared memory (/dev/shm) full or refusing writes: not the run folder's disk, which a full one looks like."""


class RunDirNotWritable(RunDirError):
    """A run folder (or a subfolder the run writes) that refuses writes: read-only, immutable, no permission."""


# ---------------------------------------------------------------------------------------------- folders


def new_run_dir(loaded: LoadedRecipe, *, root: str | Path | None = None) -> Path:
    """Create a fresh run folder; the name is validated by the recipe schema, so it cannot leave ``root``."""
    base = Path(root or loaded.recipe.run.output_dir).resolve()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    parent = base / loaded.name
    d = parent / stamp
    i = 1
    while d.exists():
        d = parent / f"{stamp}-{i}"
        i += 1
    if base not in d.resolve().parents:
        raise ValueError(f"run folder {d} would be outside {base}")
    d.mkdir(parents=True)
    write_resolved(loaded, d)
    return d


def check_target(d: Path) -> None:
    """Refuse ``tim train --run-dir d`` into a folder that is not a run folder, before anything is written.

    Allowed: a path that does not exist yet, an empty folder, a run folder (``run.json`` and ``recipe.yaml``)
    and a folder prepared for a run (:data:`BEFORE_RUN_FILES` only). Anything else holds someone's files, which
    a run would mix its own among (and ``run.json`` would be replaced)."""
    d = Path(d)
    if not d.exists() and not d.is_symlink():
        return
    if not d.is_dir():
        raise RunDirError(f"--run-dir {d}: exists and is not a folder; give a new path or a run folder")
    if (d / RECIPE_FILE).is_file() and read_meta(d).get("status"):
        return
    foreign = sorted(p.name for p in d.iterdir() if p.name not in BEFORE_RUN_FILES)
    if foreign:
        shown = ", ".join(repr(n) for n in foreign[:5]) + (
            f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        )
        raise RunDirError(
            f"--run-dir {d}: the folder exists and is not a run folder (it has no {META_FILE} with a status and "
            f"{RECIPE_FILE}; it holds {shown}). tim train writes only into a new or empty folder or a run "
            f"folder; nothing was written. Give a new path, or leave out --run-dir for a fresh folder under "
            f"run.output_dir."
        )


def write_resolved(loaded: LoadedRecipe, d: Path) -> None:
    _write_recipe(loaded, d)
    meta = {
        "name": loaded.name,
        "recipe_path": str(loaded.path),
        "overrides": loaded.overrides,
        "sweep_id": loaded.recipe.run.sweep_id,
        "created": _now(),
        "status": "created",
    }
    write_atomic(d / META_FILE, json.dumps(meta, indent=1), root=d, what="run record")


def _write_recipe(loaded: LoadedRecipe, d: Path) -> None:
    text = f"# resolved from {loaded.path} with overrides {loaded.overrides}\n" + recipe_to_yaml(
        loaded.recipe
    )
    write_atomic(d / RECIPE_FILE, text, root=d, what="run recipe")


def _recipe_file(d: Path) -> Path:
    """``d``'s recipe.yaml; :class:`RunDirError` unless it is a regular file (a link would read another file)."""
    p = d / RECIPE_FILE
    if not regular_file(p):
        raise RunDirError(f"{d}: its {RECIPE_FILE} is {describe(p)}; a run folder's recipe is a regular file")
    return p


def load_run(d: str | Path) -> LoadedRecipe:
    """The recipe a run folder was started with (for ``tim train --resume``)."""
    d = Path(d)
    if not os.path.lexists(d / RECIPE_FILE):
        raise FileNotFoundError(f"{d} is not a run folder (no {RECIPE_FILE})")
    loaded = load_recipe(_recipe_file(d))
    meta = read_meta(d)
    loaded.name = meta.get("name", loaded.name)
    return loaded


def read_meta(d: Path) -> dict:
    """``run.json`` (empty when missing or not JSON); :class:`UnsafePathError` when it is a link or special file,
    or larger than :data:`MAX_META_BYTES`."""
    p = Path(d) / META_FILE
    try:
        meta = json.loads(read_text(p, max_bytes=MAX_META_BYTES, what="run record"))
    except (FileNotFoundError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _meta_if_readable(d: Path) -> dict:
    with contextlib.suppress(OSError):
        return read_meta(d)
    return {}


# ------------------------------------------------------------------------------------- recipe changes


def _flat(data, prefix: str = "") -> dict:
    if isinstance(data, dict) and data:
        out = {}
        for k, v in data.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: data}


def recipe_changes(old, new) -> dict[str, tuple]:
    """``{dotted key: (recorded value, new value)}`` for every key where two recipes differ."""
    a, b = _flat(old.model_dump(mode="json")), _flat(new.model_dump(mode="json"))
    return {
        k: (a.get(k), b.get(k))
        for k in sorted(a.keys() | b.keys())
        if a.get(k) != b.get(k) and k not in IGNORED_CHANGES
    }


def _show(v) -> str:
    s = json.dumps(v)
    return s if len(s) <= 60 else s[:57] + "..."


def has_checkpoint(d: Path) -> bool:
    return any((Path(d) / "checkpoints").glob("step_*/state.json"))


def adopt_recipe(
    d: Path, loaded: LoadedRecipe, *, allow_change: bool = False, retry: bool = False
) -> dict[str, tuple]:
    """Make ``loaded`` the recipe of run folder ``d``; return the changes accepted (empty: none).

    A folder without a recipe gets this one. An identical recipe continues. A different one is refused
    with the differing keys listed, unless ``allow_change``, or ``retry`` (``tim train`` again on a folder where
    no step ever ran: a corrected start after one that failed): then it replaces ``recipe.yaml`` and the
    change (keys, old and new values, the step it applies from) is appended to ``run.json``'s
    ``recipe_changes``. Shapes and the rank layout cannot change under a checkpoint, flag or not.
    """
    d = Path(d)
    if not os.path.lexists(d / RECIPE_FILE):
        write_resolved(loaded, d)
        return {}
    recorded = load_recipe(_recipe_file(d)).recipe
    changes = recipe_changes(recorded, loaded.recipe)
    if not changes:
        return {}
    lines = "\n".join(f"  {k}: {_show(old)} -> {_show(new)}" for k, (old, new) in changes.items())
    fixed = [k for k in changes if k.startswith(FIXED_KEYS)]
    if fixed and has_checkpoint(d):
        raise RecipeChangeError(
            f"{d} holds checkpoints of another model shape or rank layout; these keys cannot change under a "
            f"checkpoint: {', '.join(fixed)}\n{lines}\n"
            f"Start a new run folder for the new values (give no --run-dir), or resume as recorded "
            f"(tim train --resume {d})."
        )
    fresh = retry and _never_stepped(
        d
    )  # a start that failed or stopped before its first step: nothing to mix
    if not allow_change and not fresh:
        raise RecipeChangeError(
            f"{d} was started with another recipe; {len(changes)} key(s) differ (recorded -> given):\n{lines}\n"
            f"Resume as recorded (tim train --resume {d}), or pass --allow-recipe-change to continue with "
            f"the new values (the change is recorded in {d / META_FILE})."
        )
    from_step = _checkpoint_step(d)
    _write_recipe(loaded, d)
    entry = {
        "at": _now(),
        "from_step": from_step + 1 if from_step is not None else 1,
        "changes": {k: [old, new] for k, (old, new) in changes.items()},
        "overrides": loaded.overrides,
    }
    if fresh and not allow_change:
        entry["note"] = "no step had run in this folder"

    def record(meta):
        meta.setdefault("recipe_changes", []).append(entry)
        if fresh:  # the folder's record describes the recipe its first step will run
            meta.update(name=loaded.name, recipe_path=str(loaded.path), overrides=loaded.overrides)

    update_meta(d, record)
    return changes


def _never_stepped(d: Path) -> bool:
    """No step ever ran in ``d`` (no checkpoint, no metrics row) and no Slurm job waits to run in it."""
    metrics = d / "metrics.jsonl"
    return (
        _checkpoint_step(d) is None
        and not (metrics.is_file() and metrics.stat().st_size)
        and read_meta(d).get("status") != "submitted"
    )


def _checkpoint_step(d: Path) -> int | None:
    steps = []
    for p in (Path(d) / "checkpoints").glob("step_*"):
        with contextlib.suppress(ValueError):
            steps.append(int(p.name.split("_", 1)[1]))
    return max(steps) if steps else None


# -------------------------------------------------------------------------------------------- status


EARLIER_ATTEMPTS_KEPT = 100
"""How many earlier attempts ``run.json`` lists under ``earlier_attempts`` (the oldest are dropped)."""

NO_RECORD = (
    "ended without a record: its processes were killed (a lost node, the out-of-memory killer or SIGKILL)"
)
"""How an attempt ended that left ``run.json`` ``running``: nothing of it could write its end."""


def _record_earlier_attempt(meta: dict) -> None:
    """Before a new attempt overwrites ``attempt``: the attempt that held the folder, how it ended and the step it
    reached, appended to ``earlier_attempts``. An attempt whose processes were killed (a whole node lost in a
    Slurm job, which Slurm then requeues) left the status ``running``; this is where that is written down."""
    old = meta.get("attempt")
    if not old or old == attempt_id():
        return
    status = meta.get("status")
    entry = {"attempt": old, "status": status, "step": meta.get("step"), "start_step": meta.get("start_step")}
    if isinstance(meta.get("code"), dict):
        entry["code"] = meta["code"]
    if status == "running":
        entry["reason"] = NO_RECORD
    elif meta.get("reason"):
        entry["reason"] = meta["reason"]
    earlier = meta.get("earlier_attempts")
    earlier = earlier if isinstance(earlier, list) else []
    meta["earlier_attempts"] = [*earlier, entry][-EARLIER_ATTEMPTS_KEPT:]


def resume_note(meta: dict, *, start_step: int) -> str | None:
    """The console's line on a resume: which checkpoint, which attempt came before, how it ended, and which of
    its steps run again (those after the checkpoint; their rows were dropped from ``metrics.jsonl``)."""
    earlier = meta.get("earlier_attempts")
    if start_step <= 1 or not isinstance(earlier, list) or not earlier or not isinstance(earlier[-1], dict):
        return None
    last = earlier[-1]
    status, reason = last.get("status"), last.get("reason")
    reason = reason if isinstance(reason, str) else "" if reason is None else shown(reason, 200)
    if status == "running":  # its reason is NO_RECORD, written by _record_earlier_attempt
        how = clip(reason, 200) or NO_RECORD
    else:
        known = {"preempted": "was preempted", "failed": "failed"}
        how = known[status] if isinstance(status, str) and status in known else f"ended {_field(status)}"
        first = next(iter(reason.strip().splitlines()), "")  # an error's first line
        if first:
            how += f" ({clip(first, 200)})"
    reached = last.get("step")
    again = ""
    if type(reached) is int and start_step <= reached < 10**12:
        again = f"step {start_step}" if reached == start_step else f"steps {start_step}..{reached}"
        again = f"; {again} {'runs' if reached == start_step else 'run'} again"
    return (
        f"attempt {_field(meta.get('attempt'))} resumes from the checkpoint of step {start_step - 1}: attempt "
        f"{_field(last.get('attempt'))} reached step {_field(reached)} and {how}{again}"
    )


def _field(value: object, limit: int = 80) -> str:
    """A short field of ``run.json`` in the resume note: a string clipped, anything else as ``repr`` shows it (a
    megabyte-long id or step costs a line, not a screen). The console escapes what it prints
    (:func:`tim_megatron.logging.untrusted.recorded`)."""
    if isinstance(value, str):
        return clip(value, limit)
    if value is None or (type(value) is int and abs(value) < 10**12):
        return str(value)
    return shown(value, limit)


def _now() -> str:
    """A time for ``run.json``: UTC with its offset (:func:`tim_megatron.clock.stamp`)."""
    return clock.stamp()


def attempt_id() -> str:
    """This attempt: ``<Slurm job id>.<restart count>`` in a job, else ``local.<host>.<pid>``."""
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        return f"{job}.{os.environ.get('SLURM_RESTART_COUNT') or 0}"
    return f"local.{socket.gethostname()}.{os.getpid()}"


def update_meta(d: Path, change, *, use_reserve: bool = True) -> dict:
    """Read-modify-write ``run.json`` under a short lock (a submit and a running job may both write it).

    Atomic (temporary file, then rename). On a full disk the space reserved by :func:`attempt` is given
    back and the write tried once more (unless not ``use_reserve``), so that a failure can still be recorded.
    """
    d = Path(d)
    p = d / META_FILE
    with open_append(d / f".{META_FILE}.lock", what="run record lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        meta = read_meta(d)
        change(meta)
        text = json.dumps(meta, indent=1)
        try:
            write_atomic(p, text, root=d, what="run record")
        except OSError as e:
            if e.errno != errno.ENOSPC or not use_reserve or not os.path.lexists(d / RESERVE_FILE):
                raise
            (d / RESERVE_FILE).unlink()
            write_atomic(p, text, root=d, what="run record")
    return meta


STATUSES = ("created", "submitted", "running", "completed", "preempted", "failed")
"""Every status ``run.json`` can hold."""
_ANY = frozenset({None, *STATUSES})
ALLOWED_FROM: dict[str, frozenset] = {
    "created": frozenset({None}),  # a new folder (write_resolved)
    "submitted": _ANY - {None},  # a resubmission continues any recorded run (a crashed one is left "running")
    "running": _ANY,  # an attempt starts, or start-up ends
    "completed": frozenset({"running"}),  # only the loop that ran the last step completes a run
    "preempted": _ANY,  # a stop during start-up (any earlier record), or the loop's SIGTERM checkpoint
    "failed": _ANY,  # any failure, start-up included
}
"""The statuses each status may follow (None: no status recorded yet)."""


def _transition(meta: dict, status: str, d: Path) -> None:
    old = meta.get("status")
    if old is not None and (not isinstance(old, str) or old not in STATUSES):
        raise StatusTransitionError(
            f"{d / META_FILE}: its status is {shown(old, 80)}, which no run writes (allowed: {', '.join(STATUSES)}); "
            f'the record was changed by hand or damaged: set "status" to one of those ("failed" if unsure)'
        )
    allowed = ALLOWED_FROM.get(status)
    if allowed is None:
        raise StatusTransitionError(f"{d / META_FILE}: status = {status!r}; allowed: {', '.join(STATUSES)}")
    if old not in allowed:
        raise StatusTransitionError(
            f"{d / META_FILE}: status {old!r} -> {status!r} is not a transition a run makes; {status!r} follows "
            f"only {', '.join(sorted(repr(a) for a in allowed))}"
        )


def set_status(d: Path, status: str, **extra) -> dict:
    """The one writer of ``run.json``'s status after the folder is created (:data:`ALLOWED_FROM` says which
    changes are allowed; :class:`StatusTransitionError` otherwise). Returns ``run.json`` as written."""

    def change(meta):
        _transition(meta, status, d)
        meta.update(status=status, updated=_now(), **extra)

    return update_meta(d, change)


def record_step(d: Path, step: int) -> None:
    """Rank 0, after each logged step: the step reached. It also proves, every step, that the folder still
    takes writes (the reserve is kept for the failure record)."""

    def change(meta):
        meta.update(step=step, updated=_now())

    update_meta(d, change, use_reserve=False)


def mark_running(d: Path, *, start_step: int, resumed_from: str | None) -> dict:
    """Start-up is over: steps ``start_step``.. begin. Records the cores this process may run on (a run's numbers
    depend on its thread count: float sums in another order). Returns ``run.json`` as written."""
    cores = sorted(os.sched_getaffinity(0))
    return set_status(d, "running", start_step=start_step, resumed_from=resumed_from, cpu_affinity=cores)


def mark_finished(
    d: Path, status: str, *, step: int, wall_seconds: float, max_requeues: int | None = None
) -> None:
    """``completed``, or ``preempted`` right after the loop's SIGTERM checkpoint of ``step``.

    Preempted in a Slurm job: ``requeue_attempt`` is set to this attempt while the job has been
    restarted fewer than ``max_requeues`` times; the job script requeues only on that mark.
    """
    extra: dict = {"step": step, "wall_seconds": round(wall_seconds, 2)}
    if status == "preempted":
        restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        extra["checkpoint_step"] = step
        if max_requeues is not None and restarts >= max_requeues:
            extra["requeue"] = (
                f"refused: the job was requeued {restarts} time(s), cluster.max_requeues = {max_requeues}; "
                f"continue with tim submit --resume {d}"
            )
            extra["requeue_attempt"] = None
        else:
            extra["requeue"] = "allowed"
            extra["requeue_attempt"] = attempt_id()
    set_status(d, status, **extra)


def failure_reason(err: BaseException) -> str:
    text = str(err).strip()
    reason = f"{type(err).__name__}: {text}" if text else type(err).__name__
    return reason if len(reason) <= 2000 else reason[:1997] + "..."


def mark_failed(d: Path, err: BaseException | str, **extra) -> None:
    reason = err if isinstance(err, str) else failure_reason(err)
    set_status(d, "failed", reason=reason, requeue_attempt=None, **extra)


def mark_stopped(d: Path, signame: str) -> None:
    """``preempted`` by a signal before the first step. No checkpoint was written in this attempt, so a
    Slurm job is not requeued for it; resuming continues from the folder's last checkpoint, if any."""
    set_status(
        d,
        "preempted",
        reason=f"stopped by {signame} during start-up, before any step of this attempt",
        requeue=f"refused: no checkpoint written in this attempt; continue with tim train --resume {d}",
        requeue_attempt=None,
    )


FULL_DISK_BYTES = 64 * 2**20
"""Free space below which a failure is reported as a full disk (writers such as torch's checkpoint writer
do not always pass ENOSPC on: a full disk can surface as "unexpected pos 704 vs 598")."""


def _chain(err: BaseException):
    seen = set()
    e = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


SHARED_MEMORY = Path("/dev/shm")
"""Where torch's shared-memory tensors live (the weights an engine process receives cross it)."""


def _free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _in_shared_memory(e: BaseException) -> bool:
    """``e`` names shared memory: a file under /dev/shm, or torch's shared-memory allocation (``</torch_...>``)."""
    name = getattr(e, "filename", None)
    if isinstance(name, str | bytes) and _inside(name, SHARED_MEMORY):
        return True
    text = str(e)
    return str(SHARED_MEMORY) in text or "</torch_" in text or "shared memory" in text.lower()


def shared_memory_fault(err: BaseException, d: Path) -> str | None:
    """Why ``err`` is shared memory (/dev/shm) being full or refusing writes rather than the run folder's disk (None:
    it is not). A full /dev/shm raises the same ENOSPC as a full disk (Docker's default is 64 MiB)."""
    for e in _chain(err):
        full = (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e)
        denied = isinstance(e, OSError) and e.errno in DENIED_ERRNOS
        if not (full or denied):
            continue
        shm_free, run_free = _free_bytes(SHARED_MEMORY), _free_bytes(d)
        if not _in_shared_memory(e) and not (
            full and shm_free is not None and shm_free < FULL_DISK_BYTES <= (run_free or 0)
        ):
            continue
        if denied:
            return f"shared memory ({SHARED_MEMORY}) refuses writes ({e.strerror or e})"
        size = _total_bytes(SHARED_MEMORY)
        return (
            f"shared memory ({SHARED_MEMORY}) is full ({shm_free} of {size} bytes free)"
            if shm_free is not None
            else f"shared memory ({SHARED_MEMORY}) is full"
        )
    return None


def _total_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def _disk_full(err: BaseException, d: Path) -> str | None:
    """Why ``err`` looks like a full disk under ``d`` (None: it does not)."""
    for e in _chain(err):
        if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e):
            return "No space left on device"
    free = _free_bytes(d)
    return f"{free} bytes free" if free is not None and free < FULL_DISK_BYTES else None


def _inside(path, d: Path) -> bool:
    try:
        return Path(os.fsdecode(path)).resolve().is_relative_to(d.resolve())
    except (OSError, TypeError, ValueError):
        return False


def unwritable_part(d: Path) -> str | None:
    """``"<folder>: <reason>"`` for the first of ``d`` and its existing :data:`WRITTEN_SUBFOLDERS` that refuses
    a new file (None: all take one). A probe, not the mode bits: root writes through those, not through a
    read-only mount or an immutable folder."""
    for folder in (d, *(d / s for s in WRITTEN_SUBFOLDERS)):
        if folder is not d and (folder.is_symlink() or not folder.is_dir()):
            continue  # a link is refused by name (unsafe_entries): nothing is probed through it
        try:
            fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-probe-")
        except OSError as e:
            if e.errno in DENIED_ERRNOS:
                return f"{folder}: {e.strerror}"
            continue
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(probe)
    return None


def unsafe_entries(d: Path) -> list[str]:
    """``"<path> is <what>"`` for each place in run folder ``d`` a run would write or read through a link, or where
    a special file would block or never end: a link at a subfolder it writes (:data:`REAL_SUBFOLDERS`), at a file
    it appends to or reads back (:data:`UNLINKED_FILES`, ``logs/engine*.log``), a special file at a file it
    replaces (:data:`REPLACED_FILES`), and anything but regular files and real folders under ``checkpoints/``.
    Found without opening anything."""
    bad = []

    def kind(p: Path, allowed: tuple[str, ...]) -> None:
        what = describe(p)
        if what != "missing" and not what.startswith(allowed):
            bad.append(f"{p} is {what}")

    for name in REAL_SUBFOLDERS:
        kind(d / name, ("a folder",))
    for name in UNLINKED_FILES:
        kind(d / name, ("a regular file",))
    for name in REPLACED_FILES:
        kind(d / name, ("a regular file", "a symbolic link"))
    logs = d / "logs"
    if logs.is_dir() and not logs.is_symlink():
        for p in sorted([*logs.glob("engine*.log"), logs / "errors.log"]):
            kind(p, ("a regular file",))
    ckpts = d / "checkpoints"
    if ckpts.is_dir() and not ckpts.is_symlink():
        from tim_megatron.trainer.checkpoint_scan import special_entries

        bad += [f"{ckpts}/{e.replace(': ', ' is ', 1)}" for e in special_entries(ckpts)]
    return bad


def _refused(d: Path, bad: list[str]) -> RunDirError:
    shown = "; ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
    return RunDirError(
        f"run folder {d} refused: {shown}. A run writes and reads only regular files and real folders inside its "
        "folder (a link would write or read another file, a FIFO would block); remove or replace these, then "
        "start again"
    )


def _write_denied(err: BaseException, d: Path) -> str | None:
    """Why ``err`` looks like a run folder that refuses writes (None: it does not)."""
    for e in _chain(err):
        if isinstance(e, OSError) and e.errno in DENIED_ERRNOS and e.filename and _inside(e.filename, d):
            return f"{os.fsdecode(e.filename)}: {e.strerror}"
    return unwritable_part(d)  # writers that do not pass the OSError on (torch's checkpoint writer)


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[-1][:300]}"


@contextlib.contextmanager
def attempt(d: Path, *, writer: bool = True):
    """One attempt at a run (a process start, a Slurm job or a requeue of it), start-up included.

    Records the attempt in ``run.json`` (and clears an earlier attempt's requeue mark) and checks that the
    folders the run writes take files; any exception inside sets ``failed`` with its reason before it
    propagates, a stop signal during start-up ``preempted``. A full disk becomes :class:`DiskFullError`, a
    folder that refuses writes :class:`RunDirNotWritable`; both say whether ``run.json`` holds the record.
    ``writer``: this process writes ``run.json`` (rank 0); the others only pass exceptions through.
    """
    d = Path(d)
    if writer:
        _reserve(d)
        code = (
            code_record()
        )  # the commit and versions this attempt runs (outside run.json's lock: git is slow)

        def start(meta):
            _transition(meta, "running", d)
            _record_earlier_attempt(meta)
            meta.update(
                status="running",
                updated=_now(),
                attempt=attempt_id(),
                host=socket.gethostname(),
                pid=os.getpid(),
                requeue_attempt=None,
                code=code,
            )
            meta.pop("reason", None)

        try:
            update_meta(d, start)
        except UnsafePathError as e:
            raise RunDirError(f"{e}; nothing ran (run.json could not record this)") from e
        except OSError as e:
            if e.errno not in DENIED_ERRNOS:
                raise
            raise RunDirNotWritable(
                f"cannot write {d / META_FILE} ({e.strerror}): the run folder refuses writes; nothing ran. "
                f"Make {d} writable (or give another folder), then start again."
            ) from e
    try:
        if writer and (unsafe := unsafe_entries(d)):
            raise _refused(d, unsafe)
        if writer and (bad := unwritable_part(d)):
            raise RunDirNotWritable(f"cannot write in {bad}: a run writes there; nothing ran")
        yield
    except BaseException as e:
        if isinstance(e, SystemExit) and e.code in (0, None):
            raise
        if isinstance(e, StopDuringStartup):
            if writer:
                with contextlib.suppress(OSError):
                    mark_stopped(d, str(e))
            raise
        shm = shared_memory_fault(e, d)
        full = None if shm else _disk_full(e, d)
        denied = None if full or shm else _write_denied(e, d)
        unrecorded = None  # why run.json could not record the failure
        if writer:
            why = shm or (f"disk full ({full})" if full else f"cannot write {denied}" if denied else None)
            if isinstance(e, RunDirNotWritable):  # its message names the folder already
                why = None
            try:
                mark_failed(d, f"{why}: {failure_reason(e)}" if why else e)
            except OSError as w:  # the original error matters more than the record
                meta = _meta_if_readable(d)  # the loop may have recorded it already (with the space reserved)
                if meta.get("status") != "failed" or meta.get("attempt") != attempt_id():
                    unrecorded = w.strerror or str(w)
        if not writer:
            record = ""  # rank 0 says what run.json holds
        elif unrecorded is None:
            record = "run.json records the failure. "
        else:
            status = _meta_if_readable(d).get("status")
            record = (
                f"run.json could not be written either ({unrecorded}): its status ({status}) is out of date. "
            )
        if shm:
            raise SharedMemoryError(
                f"{shm}; the error was {_first_line(e)}\n{record}The weights an engine process receives "
                "(rollout.engine_process = true) and torch's shared tensors cross it: give it room (a container's "
                "--shm-size; Docker's default is 64 MiB) or set rollout.engine_process = false, then resume from the "
                f"last checkpoint: tim train --resume {d}"
            ) from e
        if full:
            raise DiskFullError(
                f"the disk holding {d} is full ({full}); the error was {_first_line(e)}\n{record}"
                f"Free space, then resume from the last checkpoint: tim train --resume {d}"
            ) from e
        if denied or unrecorded is not None:
            if isinstance(e, RunDirNotWritable):
                cause = str(e)
            elif denied:
                cause = f"cannot write {denied}" + ("" if isinstance(e, OSError) else f" ({_first_line(e)})")
            else:
                cause = f"the run stopped on {_first_line(e)}"
            raise RunDirNotWritable(
                f"{cause}\n{record}Make {d} and its subfolders writable, then resume from the last "
                f"checkpoint: tim train --resume {d}"
            ) from e
        if isinstance(e, UnsafePathError):  # a link or special file met while the run wrote or read
            raise RunDirError(
                f"{e}\n{record}Remove or replace it, then resume: tim train --resume {d}"
            ) from e
        raise
    finally:
        if writer:
            with contextlib.suppress(OSError):
                (d / RESERVE_FILE).unlink(missing_ok=True)


def settle_launcher_exit(d: Path, code: int, *, attempt_before: str | None, stopped_by: str | None) -> int:
    """After a local launcher (torchrun) exits: the exit code that agrees with ``run.json``.

    The ranks' record decides: ``completed`` 0, ``preempted`` 75, ``failed`` non-zero (torchrun exits 1 for
    any rank's non-zero exit, and the ranks exit 0 when they stop as asked). Ranks that recorded no attempt
    of their own (``attempt_before`` unchanged: stopped or failed before it) or left it ``running`` leave
    the record to us: ``preempted`` when we passed them a stop signal (``stopped_by``), else ``failed``.
    """
    meta = _meta_if_readable(d)
    status = meta.get("status") if meta.get("attempt") != attempt_before else None
    if status == "completed":
        return 0
    if status == "preempted":
        return EXIT_PREEMPTED
    if status == "failed":
        return code if code not in (0, EXIT_PREEMPTED) else 1
    if stopped_by is not None:  # ranks stopped before they recorded anything (they exit 0 or die of it)
        with contextlib.suppress(OSError):  # a folder that refuses writes: the ranks' errors said so
            mark_stopped(d, stopped_by)
        return EXIT_PREEMPTED
    if code == 0:
        return 0
    with contextlib.suppress(OSError):
        mark_failed(d, f"the ranks' launcher exited with code {code} (a rank died; see the output above)")
    return code if code != EXIT_PREEMPTED else 1


def _reserve(d: Path) -> None:
    p = d / RESERVE_FILE
    with contextlib.suppress(OSError):  # a link there is replaced, not written through
        if not regular_file(p) or p.stat().st_size < RESERVE_BYTES:
            write_atomic(p, b"\0" * RESERVE_BYTES, root=d)
