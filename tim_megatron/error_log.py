"""Named errors on the console as one sentence; their tracebacks in the run's log.

An error the project raises by name (:class:`~tim_megatron.rollout.faults.EngineLost`,
:class:`~tim_megatron.rl.offpolicy.StalenessError`, :class:`~tim_megatron.rollout.exact_sampler.ExactMismatchError`,
...: any exception class defined in ``tim_megatron`` or ``patches``) already says what failed and where; its
traceback is for a developer. ``tim train`` prints such an error as its message and what to do, and appends the
traceback to ``<run folder>/logs/errors.log`` (:func:`write_traceback`). With ``TIM_DEBUG=1`` (or ``tim train
--debug``) the traceback is printed as well. Any other exception (a bug, a library's error) keeps its traceback on
the console.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

from tim_megatron import clock
from tim_megatron.safe_files import open_append

DEBUG_ENV = "TIM_DEBUG"
"""Set to 1: named errors print their traceback on the console too."""
ERRORS_LOG = Path("logs") / "errors.log"
"""Where, inside a run folder, the tracebacks of named errors are appended."""
OWN_PACKAGES = ("tim_megatron", "patches")


def is_named(err: BaseException) -> bool:
    """``err``'s class is one of the project's own (its message names what failed)."""
    module = type(err).__module__ or ""
    return module.split(".", 1)[0] in OWN_PACKAGES


def debug() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes")


def write_traceback(run_dir: Path, err: BaseException, *, attempt: str) -> Path | None:
    """Append ``err``'s traceback to the run's ``logs/errors.log`` under a header naming the attempt, the rank and
    the time (UTC); the path written, or None when the folder takes no write (the console then keeps it)."""
    path = Path(run_dir) / ERRORS_LOG
    rank = os.environ.get("RANK", "0")
    text = "".join(traceback.format_exception(err))
    try:
        path.parent.mkdir(exist_ok=True)
        with open_append(path, what="error log") as f:
            f.write(f"== {clock.stamp()} attempt {attempt} rank {rank}: {type(err).__name__}\n{text}\n")
    except OSError:
        return None
    return path
