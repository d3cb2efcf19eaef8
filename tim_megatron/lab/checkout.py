"""The checkout a lab runs from: git's answers (or its refusal), whether the tree is clean, which grids are
pre-registered, and the code each run recorded (``run.json``'s ``code``).

* :func:`git` runs one git command in the project's root and returns its output, or git's own refusal
  ("fatal: detected dubious ownership ...", "fatal: not a git repository ...") as the reason;
* a grid is **pre-registered** when ``docs/prereg/<grid name>.md`` exists (:func:`registration`); ``tim lab``
  runs such a grid only from a clean tree (``git status --porcelain`` empty, untracked files included, the notion
  ``run.json``'s ``code.clean`` records), unless told ``--allow-dirty`` (:func:`require_clean`);
* :func:`run_code` reads the ``code`` record of a run (its commit, whether its tree was clean, the diff's sha256,
  the project version) for the report's list of the commits its runs came from; older runs have none.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tim_megatron.lab.grid import Grid, GridError
from tim_megatron.safe_files import regular_file
from tim_megatron.untrusted import printable, shown

GIT_TIMEOUT_S = 30.0
COMMIT = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
"""A full commit id (SHA-1 or SHA-256 repositories); used with ``fullmatch``."""
DIRTY_SHOWN = 12
"""Dirty files named in the refusal (the rest are counted)."""


@dataclass(frozen=True)
class GitAnswer:
    ok: bool
    out: bytes
    """stdout (bytes: a blob is read as it is)."""
    why: str
    """git's refusal (its first ``fatal:``/``error:`` line, or why git could not run); empty when ``ok``."""

    @property
    def text(self) -> str:
        return self.out.decode("utf-8", errors="replace").strip()


def git(repo: Path, *args: str) -> GitAnswer:
    """``git -C repo ARGS``; never raises (a missing git, a timeout and a refusal come back as ``why``)."""
    try:
        p = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, timeout=GIT_TIMEOUT_S)
    except OSError as e:
        return GitAnswer(False, b"", f"git cannot be run ({e.strerror or e})")
    except subprocess.TimeoutExpired:
        return GitAnswer(False, b"", f"git {' '.join(args[:2])} took over {GIT_TIMEOUT_S:.0f} s")
    if p.returncode == 0:
        return GitAnswer(True, p.stdout, "")
    lines = [x.strip() for x in p.stderr.decode("utf-8", errors="replace").splitlines() if x.strip()]
    first = next((x for x in lines if x.startswith(("fatal:", "error:"))), lines[0] if lines else "")
    return GitAnswer(False, p.stdout, printable(first[:300]) or f"git exited with {p.returncode}")


def dirty_files(repo: Path) -> tuple[list[str] | None, str]:
    """(``git status --porcelain`` lines, "") for the checkout at ``repo``; (None, git's refusal) if git cannot
    say."""
    a = git(repo, "status", "--porcelain", "--untracked-files=all")
    if not a.ok:
        return None, a.why
    return [printable(x) for x in a.out.decode("utf-8", errors="replace").splitlines() if x.strip()], ""


def registration(grid: Grid, repo: Path) -> Path | None:
    """The grid's pre-registration, ``docs/prereg/<grid name>.md`` in the project; None if it has none."""
    p = repo / "docs" / "prereg" / f"{grid.name}.md"
    return p if regular_file(p) else None


def require_clean(grid: Grid, repo: Path, *, allow_dirty: bool) -> None:
    """Before a pre-registered grid runs: a :class:`GridError` naming the dirty files (or git's refusal), unless
    ``allow_dirty``. A grid without a pre-registration runs from any tree."""
    prereg = registration(grid, repo)
    if prereg is None or allow_dirty:
        return
    dirty, why = dirty_files(repo)
    rel = prereg.relative_to(repo) if prereg.is_relative_to(repo) else prereg
    if dirty is None:
        raise GridError(
            f"grid {grid.name!r} is pre-registered ({rel}), so its runs come from a clean, committed checkout; "
            f"whether {repo} is clean cannot be told ({why}). Pass --allow-dirty to run it anyway"
        )
    if dirty:
        named = ", ".join(dirty[:DIRTY_SHOWN]) + (
            f" and {len(dirty) - DIRTY_SHOWN} more" if len(dirty) > DIRTY_SHOWN else ""
        )
        raise GridError(
            f"grid {grid.name!r} is pre-registered ({rel}), so its runs come from a clean, committed checkout, and "
            f"{repo} has uncommitted changes (git status --porcelain): {named}. Commit them (or move them away), or "
            "pass --allow-dirty to run anyway (each run's run.json then records the tree as not clean)"
        )


@dataclass(frozen=True)
class RunCode:
    """The code one run recorded at an attempt's start (``run.json``'s ``code``), as read."""

    commit: str | None
    """A full commit id, or None (not recorded, or not a commit id)."""
    clean: bool | None
    """Whether that checkout's tree was clean; None when unknown."""
    diff_sha256: str | None
    version: str | None

    def tree(self) -> str:
        return {True: "clean", False: "uncommitted changes"}.get(self.clean, "clean or not: not recorded")


def _code(value: object) -> RunCode | None:
    if not isinstance(value, dict):
        return None
    commit, clean, diff, version = (value.get(k) for k in ("commit", "clean", "diff_sha256", "version"))
    return RunCode(
        commit=commit if isinstance(commit, str) and COMMIT.fullmatch(commit) else None,
        clean=clean if isinstance(clean, bool) else None,
        diff_sha256=diff if isinstance(diff, str) and re.fullmatch(r"[0-9a-f]{64}", diff) else None,
        version=version if isinstance(version, str) and len(version) <= 64 else None,
    )


def run_code(meta: dict) -> list[RunCode]:
    """The code records of a run's attempts (``run.json``'s ``code``, and an earlier attempt's where recorded),
    first attempt first; empty when the run recorded none (runs from before the record)."""
    out = []
    earlier = meta.get("earlier_attempts")
    for e in earlier if isinstance(earlier, list) else []:
        c = _code(e.get("code")) if isinstance(e, dict) else None
        if c is not None:
            out.append(c)
    c = _code(meta.get("code"))
    if c is not None:
        out.append(c)
    return out


def code_rows(runs: list[tuple[str, list[RunCode]]]) -> list[dict]:
    """The commits the runs came from, for the report: one row per (commit, tree, version), with the runs from it;
    runs that recorded none are one row, "not recorded"."""
    groups: dict[tuple, list[str]] = {}
    for name, codes in runs:
        for c in codes or [None]:
            key = (
                ("not recorded", "", "")
                if c is None
                else (c.commit or "not recorded", c.tree(), c.version or "")
            )
            groups.setdefault(key, [])
            if name not in groups[key]:
                groups[key].append(name)
    return [
        {"commit": k[0], "tree": k[1], "version": k[2], "runs": len(v), "which": _listed(v)}
        for k, v in sorted(groups.items(), key=lambda kv: (kv[0][0] == "not recorded", kv[0]))
    ]


def code_text(rows: list[dict]) -> str:
    """One sentence for tables.md: the commits the runs came from."""
    if not rows:
        return "Code the runs came from (run.json's code): no run."
    if len(rows) == 1 and rows[0]["commit"] == "not recorded":
        return (
            f"Code the runs came from (run.json's code): not recorded by any of the {rows[0]['runs']} runs "
            "(their run.json has no code record)."
        )
    parts = []
    for r in rows:
        if r["commit"] == "not recorded":
            parts.append(f"not recorded for {r['runs']} run(s) ({r['which']})")
        else:
            version = f", version {shown(r['version'], 40)}" if r["version"] else ""
            parts.append(f"{r['commit'][:12]} ({r['tree']}{version}) for {r['runs']} run(s) ({r['which']})")
    return "Code the runs came from (run.json's code): " + "; ".join(parts) + "."


def _listed(names: list[str], limit: int = 8) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
