"""SIGTERM and SIGINT during ``tim train``: how a run stops when it is asked to.

* During start-up (imports, the run folder, model, trainer and engine set-up) there is nothing to checkpoint:
  the signal stops it at once, by raising :class:`StopDuringStartup` wherever start-up is. A job's time
  limit or ``tim lab --timeout-minutes`` then ends the run within seconds, not after a whole first step.
* Once steps run, the signal only sets a flag: the loop finishes its step, checkpoints and exits with
  :data:`EXIT_PREEMPTED`.

This module imports nothing heavy, so ``tim train`` installs the handler before its slow imports.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

EXIT_PREEMPTED = 75
"""EX_TEMPFAIL: stopped by a signal, resumable (``tim train --resume``); the status is ``preempted``."""

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopDuringStartup(BaseException):
    """A stop signal before the first step. A BaseException, like KeyboardInterrupt: library code that
    catches ``Exception`` while starting up must not swallow it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class StopRequest:
    """Set by SIGTERM/SIGINT; while ``at_once`` (start-up) the signal also raises :class:`StopDuringStartup`."""

    requested: bool = False
    """A stop signal arrived."""
    signal: int | None = None
    """The last one that did."""
    at_once: bool = False
    """Start-up: stop now. False once steps run (the loop then stops after its step's checkpoint)."""

    def install(self) -> None:
        def handler(signum, _frame):
            self.requested, self.signal = True, signum
            if self.at_once:
                self.at_once = False  # one exception: a second signal must not interrupt its handling
                raise StopDuringStartup(signum)

        for s in SIGNALS:
            signal.signal(s, handler)

    def steps_begin(self) -> None:
        """From now on a signal waits for the end of the step."""
        self.at_once = False

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal else "a stop signal"
