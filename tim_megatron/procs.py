"""Child processes that never outlive the run that started them.

* :func:`die_with_parent`: the kernel kills this process when its parent dies (Linux ``PR_SET_PDEATHSIG``).
  Ranks started by a launcher (torchrun) call it first thing, so a launcher killed with SIGKILL takes its
  ranks with it, like a dead node; they do not train on with nobody to collect their exit.
* :func:`run_launcher`: start a launcher command in its own session, bound to us the same way, forward
  SIGTERM/SIGINT to it (so the ranks checkpoint), wait, and return its exit code.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent exits (no-op off Linux)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), sig)


def run_launcher(cmd: list[str]) -> int:
    """Run ``cmd`` (torchrun) until it exits; it dies with us, and receives our SIGTERM/SIGINT."""
    bind = None
    if sys.platform.startswith("linux"):
        prctl = ctypes.CDLL(None).prctl  # looked up before the fork: the child only calls it

        def bind():
            prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)

    # Its own session: a terminal's Ctrl-C reaches us alone, and we forward it once.
    proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=bind)

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
