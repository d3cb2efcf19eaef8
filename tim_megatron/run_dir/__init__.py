"""Run folders: ``<output_dir>/<run name>/<timestamp>/`` holding everything a run writes.

By job: :mod:`.folder` (a fresh folder, the refusal of one that is not a run folder, the recipe it records and the
changes allowed to it), :mod:`.record` (``run.json``: its one writer and its status machine), :mod:`.guard` (what a
folder must not be, and what a failure inside it means), :mod:`.attempts` (one attempt, recorded and checked), :mod:`.meta` (the one reader of ``run.json``),
and :mod:`.errors`. The names below are theirs, importable from the package.

This package is the one owner of a run folder's ``run.json`` status. Every transition goes through it:

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

import importlib

_WHERE = {
    "ALLOWED_FROM": "record",
    "BEFORE_RUN_FILES": "folder",
    "DENIED_ERRNOS": "guard",
    "DiskFullError": "errors",
    "EARLIER_ATTEMPTS_KEPT": "record",
    "FIXED_KEYS": "folder",
    "IGNORED_CHANGES": "folder",
    "MAX_META_BYTES": "meta",
    "META_FILE": "meta",
    "NO_RECORD": "record",
    "REAL_SUBFOLDERS": "guard",
    "RECIPE_FILE": "folder",
    "REPLACED_FILES": "guard",
    "RESERVE_BYTES": "record",
    "RESERVE_FILE": "record",
    "RecipeChangeError": "errors",
    "RecordError": "meta",
    "RunDirError": "errors",
    "RunDirNotWritable": "errors",
    "SHARED_MEMORY": "guard",
    "STATUSES": "record",
    "SharedMemoryError": "errors",
    "StatusTransitionError": "errors",
    "UNLINKED_FILES": "guard",
    "WRITTEN_SUBFOLDERS": "guard",
    "adopt_recipe": "folder",
    "attempt": "attempts",
    "attempt_id": "record",
    "check_target": "folder",
    "failure_reason": "record",
    "has_checkpoint": "folder",
    "load_run": "folder",
    "mark_failed": "record",
    "mark_finished": "record",
    "mark_running": "record",
    "mark_stopped": "record",
    "mark_submitted": "record",
    "new_run_dir": "folder",
    "read_meta": "record",
    "read_record": "meta",
    "recipe_changes": "folder",
    "record_step": "record",
    "resume_note": "record",
    "set_status": "record",
    "settle_launcher_exit": "record",
    "shared_memory_fault": "guard",
    "unsafe_entries": "guard",
    "unwritable_part": "guard",
    "update_meta": "record",
    "write_resolved": "folder",
}
"""Each public name and the module of this package that defines it: imported when first asked for (PEP 562), so
that the job script's reader (:mod:`.meta`) imports nothing heavy."""

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
