"""Child processes that never outlive the run that started them.

* :func:`die_with_parent`: the kernel kills this process when its parent dies (Linux ``PR_SET_PDEATHSIG``).
  Ranks started by a launcher (torchrun) call it first thing, so a launcher killed with SIGKILL takes its
  ranks with it, like a dead node; they do not train on with nobody to collect their exit.
* :func:`run_launcher`: start a launcher command in its own session, bound to us the same way, pass our
  SIGTERM/SIGINT on to its ranks (so they checkpoint), wait, and return its exit code.
* :func:`bound_to_parent`: a command line that runs ``cmd`` bound to us the same way, for a caller that starts
  it from a thread (``tim lab``), where ``preexec_fn`` is unsafe: a small Python step binds itself, then
  ``exec``s ``cmd`` (the binding survives ``exec``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

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


def _children(pid: int) -> set[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    out = set()
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.add(int(p.name))
    return out


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``sig`` (Linux /proc: ``SigCgt``)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def run_launcher(
    cmd: list[str], *, stop_signal: Callable[[], int | None], env: dict[str, str] | None = None
) -> int:
    """Run ``cmd`` (torchrun) in environment ``env`` until it exits, and return its exit code; it dies with us.

    ``stop_signal()``: the SIGTERM/SIGINT our own handler received so far (None: none). It goes to the
    launcher's ranks (its child processes, also those it starts later), not to torchrun itself: torchrun answers
    a signal by killing its ranks 30 s later and exiting 1, while a rank that gets it finishes its step,
    checkpoints and exits 75 (or, still starting, stops at once). A rank gets it once its handler is in
    place: a Python process that has just started would die of it without a word."""
    bind = None
    if sys.platform.startswith("linux"):
        prctl = ctypes.CDLL(None).prctl  # looked up before the fork: the child only calls it

        def bind():
            prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)

    # Its own session: a terminal's Ctrl-C reaches us alone, and we pass it on once per rank.
    proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=bind, env=env)
    told: set[int] = set()
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return proc.wait(timeout=0.2)
        sig = stop_signal()
        if sig is None:
            continue
        # Without /proc its ranks cannot be found: torchrun then gets the signal and passes it on itself.
        if not Path("/proc").is_dir():
            ranks = {proc.pid}
        else:
            ranks = {pid for pid in _children(proc.pid) if _catches(pid, sig)}
        for pid in ranks - told:
            told.add(pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


def bound_to_parent(cmd: list[str], sig: int = signal.SIGKILL) -> list[str]:
    """``cmd`` prefixed so that the kernel sends it ``sig`` when this process (the thread that starts it) dies."""
    return [sys.executable, "-m", "tim_megatron.procs", str(os.getpid()), str(int(sig)), "--", *cmd]


def _exec_bound(argv: list[str]) -> None:
    """``PARENT SIG -- CMD...``: bind to PARENT with SIG, then become CMD."""
    parent, sig, sep, *cmd = argv
    if sep != "--" or not cmd:
        raise SystemExit("usage: python -m tim_megatron.procs PARENT_PID SIGNAL -- CMD ...")
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != int(parent):  # the parent died before the binding took effect
        os.kill(os.getpid(), int(sig))
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    _exec_bound(sys.argv[1:])
