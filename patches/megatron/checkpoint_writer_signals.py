"""Keep megatron-core's checkpoint-writer helper process alive through the job's SIGTERM.

megatron-core 0.16's distributed checkpointing collects its file writers' results through a module-global
``multiprocessing.Manager().Queue()`` (``filesystem_async._get_write_results_queue``), whose server process is
started on the first save and reused by every later one. Slurm delivers a preemption or ``scancel`` SIGTERM to
every process of the job step, that server included, so it dies; the final checkpoint the run then writes in
answer to the signal fails with ``BrokenPipeError`` on the rank whose server died, and the other ranks wait in a
barrier for it. Seen on the two-node test cluster: a periodic checkpoint at step 2, ``scancel`` at step 4, run
"failed" instead of "preempted".

The fix: create that queue ourselves, once, in a manager whose server process ignores SIGTERM and SIGINT and
asks the kernel to kill it when its parent (the rank) dies, so it neither dies before the final checkpoint nor
outlives a rank killed with SIGKILL. No megatron code is replaced: megatron finds the queue already made.
"""

from __future__ import annotations

import signal

from patches.guard import check_version
from patches.specs import megatron_core_patch

SPEC = megatron_core_patch(
    name="megatron-checkpoint-writer-signals",
    reason="the checkpoint writers' results-queue server dies on the job's SIGTERM, so the final checkpoint fails.",
    targets=("megatron.core.dist_checkpointing.strategies.filesystem_async._get_write_results_queue",),
)


def _server_init() -> None:
    """Runs first in the manager's server process."""
    from tim_megatron.procs import die_with_parent

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
    die_with_parent()


def shield() -> None:
    """Make megatron's writer results queue now, in a server immune to the job's signals (idempotent)."""
    check_version(SPEC)
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is not None:
        return
    if not hasattr(filesystem_async, "_get_write_results_queue"):
        raise RuntimeError(
            "megatron-core no longer has filesystem_async._get_write_results_queue: re-verify "
            "patches/megatron/checkpoint_writer_signals.py"
        )
    manager = SyncManager(ctx=mp.get_context("spawn"))  # the context megatron itself uses
    manager.start(initializer=_server_init)
    filesystem_async._results_queue = manager.Queue()
    filesystem_async._tim_results_manager = manager  # the queue lives as long as its manager object
