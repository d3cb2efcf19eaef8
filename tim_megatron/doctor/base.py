"""The doctor's machinery: the :class:`Context` every check reads, running the checks (each reports
:class:`~tim_megatron.outcome.Outcome`, the type every checking tool shares), and the helpers several checks share (import probes in a child process, installed versions, the
project's declared version ranges)."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tim_megatron.outcome import Outcome, counts

if TYPE_CHECKING:
    from tim_megatron.recipe import LoadedRecipe, Recipe

GIB = 2**30
PROJECT = "tim-megatron"


@dataclass(frozen=True)
class Context:
    """What every check may read. Checks share nothing else."""

    environ: Mapping[str, str]
    """The environment (subprocesses such as ``sinfo`` get this one)."""
    recipe: LoadedRecipe | None = None
    """The :class:`~tim_megatron.recipe.LoadedRecipe` given, when it resolved."""
    recipe_arg: str | None = None
    """The recipe path given on the command line, if any."""
    recipe_error: str | None = None
    """Why the recipe given did not resolve."""
    timeout_s: float = 120.0
    """Limit for each child process (import probes, ``sinfo``, ``nvidia-smi``)."""

    @property
    def in_job(self) -> bool:
        """Inside a Slurm allocation, where the job's GPUs must be visible."""
        return "SLURM_JOB_ID" in self.environ


Check = Callable[[Context], list[Outcome]]


# ------------------------------------------------------------------------------------------ helpers


@dataclass(frozen=True)
class Probe:
    """The outcome of importing a module in a child process."""

    ok: bool
    version: str | None = None
    error: str = ""
    extra: dict = field(default_factory=dict)


_PROBE = r"""
import importlib, json, sys
out = {"ok": False}
try:
    m = importlib.import_module(sys.argv[1])
    out["ok"] = True
    out["version"] = getattr(m, "__version__", None)
    for name in sys.argv[2:]:
        try:
            importlib.import_module(name)
            out.setdefault("extra", {})[name] = True
        except Exception as e:
            out.setdefault("extra", {})[name] = f"{type(e).__name__}: {e}"
except BaseException as e:
    out["error"] = f"{type(e).__name__}: {e}"
print("\n@@probe@@" + json.dumps(out))
"""


def probe_import(ctx: Context, module: str, *also: str) -> Probe:
    """Import ``module`` (then each of ``also``) in a fresh interpreter; never raises."""
    try:
        res = subprocess.run(
            [sys.executable, "-c", _PROBE, module, *also],
            capture_output=True,
            text=True,
            timeout=ctx.timeout_s,
            env=dict(ctx.environ),
        )
    except subprocess.TimeoutExpired:
        return Probe(False, error=f"import {module} did not finish within {ctx.timeout_s:.0f} s")
    _, found, marker = res.stdout.rpartition("@@probe@@")
    if not found:
        tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
        return Probe(False, error=f"the interpreter died importing {module} (exit {res.returncode}): {tail}")
    d = json.loads(marker.strip())
    return Probe(d["ok"], d.get("version"), d.get("error", ""), d.get("extra", {}))


def dist_version(*names: str) -> tuple[str, str] | None:
    """(distribution, version) of the first of ``names`` that is installed."""
    for name in names:
        try:
            return name, md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def project_requirement(dist: str, extra: str | None = None) -> SpecifierSet | None:
    """The version range this project declares for ``dist`` here (markers evaluated), or None."""
    try:
        reqs = md.requires(PROJECT) or []
    except md.PackageNotFoundError:
        return None
    env = {"extra": extra or ""}
    spec = None
    for text in reqs:
        r = Requirement(text)
        if r.name.lower() != dist.lower():
            continue
        if r.marker is not None and not r.marker.evaluate(env):
            continue
        spec = r.specifier if spec is None else spec & r.specifier
    return spec


def in_range(version: str, spec: SpecifierSet | None) -> bool:
    return spec is None or Version(version) in spec


def range_text(spec: SpecifierSet | None) -> str:
    return f"{PROJECT} needs {spec}" if spec else "no range declared"


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def nvidia_smi(ctx: Context, *query: str) -> list[str] | None:
    """Rows of ``nvidia-smi --query-gpu=...`` (None when it is missing or fails)."""
    exe = shutil.which("nvidia-smi", path=ctx.environ.get("PATH"))
    if exe is None:
        return None
    try:
        res = subprocess.run(
            [exe, f"--query-gpu={','.join(query)}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=ctx.timeout_s,
            env=dict(ctx.environ),
        )
    except (subprocess.TimeoutExpired, OSError):
        return None
    if res.returncode != 0:
        return None
    return [line.strip() for line in res.stdout.splitlines() if line.strip()]


def recipe_of(ctx: Context) -> Recipe | None:
    return ctx.recipe.recipe if ctx.recipe is not None else None


def not_checked(ctx: Context, check: str) -> list[Outcome]:
    why = "the recipe does not resolve" if ctx.recipe_error else "no recipe given"
    return [Outcome(check, "ok" if ctx.recipe_error is None else "warn", f"not checked: {why}")]


def gpus_wanted(ctx: Context) -> int:
    r = recipe_of(ctx)
    return r.cluster.gpus_per_node if r is not None else 0


# --------------------------------------------------------------------------------------------- run


def run_checks(ctx: Context, checks: tuple[Check, ...]) -> list[Outcome]:
    """Every check's results, in order; a check that raises becomes a fail naming the exception."""
    out = []
    for check in checks:
        try:
            out.extend(check(ctx))
        except Exception as e:
            name = check.__name__.removeprefix("check_").replace("_", "-")
            out.append(
                Outcome(name, "fail", f"the check itself failed: {type(e).__name__}: {e}", "see the error")
            )
    return out


def format_result(r: Outcome, width: int = 40) -> str:
    """One check's line: status, the check's name padded to ``width`` (always two spaces after), the detail."""
    line = f"{r.status:<4}  {r.name:<{width}}  {r.detail}"
    if r.fix:
        line += f"  -> fix: {r.fix}"
    return "\n".join([line, *(f"{'':6}{m}" for m in r.more)])


def summary(results: list[Outcome]) -> str:
    n = counts(results)
    verdict = "not ready: fix the fails above" if n["fail"] else "ready"
    return f"{n['ok']} ok, {n['warn']} warn, {n['fail']} fail: {verdict}"


def as_record(r: Outcome) -> dict:
    """A check's result as ``preflight.json`` keeps it (the keys it always had: check, status, detail, fix, more)."""
    return {"check": r.name, "status": r.status, "detail": r.detail, "fix": r.fix, "more": list(r.more)}


def context_for(
    recipe: str | Path | None,
    overrides: list[str] | None = None,
    *,
    nodes: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> Context:
    """The context for ``tim doctor [RECIPE] [key=value ...]``: a recipe that does not resolve is a result."""
    env = dict(os.environ if environ is None else environ)
    if recipe is None:
        return Context(environ=env)
    from tim_megatron.recipe import RecipeError
    from tim_megatron.slurm.submit import with_nodes

    try:
        loaded = with_nodes(recipe, list(overrides or []), nodes)
    except (RecipeError, FileNotFoundError) as e:
        return Context(environ=env, recipe_arg=str(recipe), recipe_error=str(e))
    return Context(environ=env, recipe=loaded, recipe_arg=str(recipe))
