"""Keep megatron-core's checkpoint-writer helper process alive through the job's SIGTERM.

megatron-core 0.16's distributed checkpointing collects its file writers' results through a module-global
``multiprocessing.Manager().Queue()`` (``filesystem_async._get_write_results_queue``), whose server process is
started on the first save and reused by every later one. Slurm delivers a preemption or ``scancel`` SIGTERM to
every process of the job step, that server included, so it dies; the final checkpoint the run then writes in
answer to the signal fails with ``BrokenPipeError`` on the rank whose server died, and the other ranks wait in a
barrier for it. Seen on the two-node test cluster: a periodic checkpoint at step 2, ``scancel`` at step 4, run
"failed" instead of "preempted".

The fix: create that queue ourselves, once, with SIGTERM and SIGINT ignored while its server process starts
(an ignored disposition survives the server's exec), then restore our handlers. No megatron code is replaced.
"""

from __future__ import annotations

import signal

from patches.guard import PatchSpec, check_version

SPEC = PatchSpec(
    name="megatron-checkpoint-writer-signals",
    library="megatron.core",
    distributions=("megatron-core",),
    verified="==0.16.*",
    reason="the checkpoint writers' results-queue server dies on the job's SIGTERM, so the final checkpoint fails.",
    targets=("megatron.core.dist_checkpointing.strategies.filesystem_async._get_write_results_queue",),
)


def shield() -> None:
    """Start megatron's writer results queue now, immune to SIGTERM/SIGINT (idempotent)."""
    check_version(SPEC)
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is not None:
        return
    if not hasattr(filesystem_async, "_get_write_results_queue"):
        raise RuntimeError(
            "megatron-core no longer has filesystem_async._get_write_results_queue: re-verify "
            "patches/megatron/checkpoint_writer_signals.py"
        )
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for s in saved:
            signal.signal(s, signal.SIG_IGN)
        filesystem_async._get_write_results_queue()
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
