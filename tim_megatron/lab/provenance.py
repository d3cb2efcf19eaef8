"""When the lab's rules were fixed, read from git: the last commit of the rule code against the first run's start.

A report that says its rules were "fixed before any run" must be able to show it. :func:`rules_fixed_text` writes
that sentence from the repository itself: the last commit that touched the rule code (:data:`RULE_FILES`) and the
earliest ``created`` time among the runs' ``run.json`` (local time, as the run folder writes it). It says
"before" or "after" as the two times fall, and says so plainly when it cannot tell (no git, uncommitted changes
to the rule code, no run).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RULE_FILES = (
    "tim_megatron/lab/claims.py",
    "tim_megatron/lab/runstats.py",
    "tim_megatron/lab/deficits.py",
    "tim_megatron/lab/stats.py",
    "tim_megatron/lab/grid.py",
)
"""The code that decides the verdicts: the claims' rules, the per-run numbers they read (collapse, growth, the
policy outcome), the per-arm deficits, the statistics and the grid's rule keys."""


def _git(repo: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def created_time(value: object) -> float | None:
    """A ``run.json`` ``created`` value (``%Y-%m-%dT%H:%M:%S``, local time) as epoch seconds; None if unreadable."""
    if not isinstance(value, str):
        return None
    try:
        return time.mktime(time.strptime(value, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def _when(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(epoch))


def rules_fixed_text(
    *, first_start: float | None, repo: Path = ROOT, files: tuple[str, ...] = RULE_FILES
) -> str:
    """One sentence: was the rule code's last commit before the first run's start? (see the module docstring)"""
    names = " and ".join(files)
    last = _git(repo, "log", "-1", "--format=%h %ct", "--", *files)
    if not last:
        return f"When the rules ({names}) were fixed cannot be stated: {repo} has no git history for them."
    if _git(repo, "status", "--porcelain", "--", *files):
        return (
            f"The rule code ({names}) has uncommitted changes in this checkout: no commit records the rules these "
            "verdicts were decided by."
        )
    commit, stamp = last.split()
    committed = float(stamp)
    where = f"The rules ({names}) were last changed in commit {commit} on {_when(committed)}"
    if first_start is None:
        return f"{where}; no run start is recorded to compare with."
    if committed < first_start:
        return f"{where}, before the first run of this grid started ({_when(first_start)})."
    return (
        f"{where}, after the first run of this grid started ({_when(first_start)}): these rules were not fixed "
        "before the runs."
    )
