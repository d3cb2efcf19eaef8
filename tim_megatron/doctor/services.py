"""Checks of what a run talks to: Slurm, wandb, and the HF cache with its free disk."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tim_megatron.doctor.base import GIB, Context, Outcome, dist_version, recipe_of
from tim_megatron.slurm.plan import param_count

LOW_DISK_GIB = 20
"""Below this much free disk at the HF cache, a warning."""


def check_slurm(ctx: Context) -> list[Outcome]:
    exe = shutil.which("sinfo", path=ctx.environ.get("PATH"))
    if exe is None:
        return [
            Outcome(
                "slurm",
                "warn",
                "sinfo not found: Slurm is not installed here",
                "fine for `tim train`; `tim submit` needs a Slurm login node",
            )
        ]
    try:
        res = subprocess.run(
            [exe, "--noheader", "--format=%R %a %D %G"],
            capture_output=True,
            text=True,
            timeout=ctx.timeout_s,
            env=dict(ctx.environ),
        )
    except subprocess.TimeoutExpired:
        res = None
    if res is None or res.returncode != 0:
        why = (
            "timed out"
            if res is None
            else (res.stderr.strip().splitlines() or ["no output"])[-1].removeprefix("sinfo: ")
        )
        return [
            Outcome(
                "slurm",
                "warn",
                f"not answering (sinfo: {why})",
                "fine on a laptop; for `tim submit`, run where slurmctld answers (SLURM_CONF)",
            )
        ]
    parts = {}
    for line in res.stdout.splitlines():
        f = line.split()
        if len(f) >= 3:
            parts[f[0]] = (
                f"{f[0]} ({f[1]}, {f[2]} node(s){', ' + f[3] if len(f) > 3 and f[3] != '(null)' else ''})"
            )
    out = [Outcome("slurm", "ok", "answers; partitions: " + ("; ".join(parts.values()) or "none"))]
    r = recipe_of(ctx)
    if r is not None and r.cluster.partition and r.cluster.partition not in parts:
        out.append(
            Outcome(
                "slurm partition",
                "fail",
                f"cluster.partition = {r.cluster.partition} is not a partition here (have: {', '.join(parts) or 'none'})",
                "set cluster.partition to one of them",
            )
        )
    return out


def check_wandb(ctx: Context) -> list[Outcome]:
    r = recipe_of(ctx)
    mode = r.logging.wandb.mode if r is not None else "auto"
    has_key = bool(ctx.environ.get("WANDB_API_KEY"))
    resolved = ("online" if has_key else "offline") if mode == "auto" else mode
    source = "logging.wandb.mode" if r is not None else "default"
    detail = f"{source} = {mode} -> {resolved}"
    if mode == "auto":
        detail += " (WANDB_API_KEY is " + ("set)" if has_key else "not set)")
    if ctx.environ.get("WANDB_MODE"):
        detail += f"; this shell also sets WANDB_MODE={ctx.environ['WANDB_MODE']}"
    if resolved == "disabled":
        return [Outcome("wandb", "ok", detail)]
    found = dist_version("wandb")
    if found is None:
        return [
            Outcome("wandb", "fail", f"{detail}, but wandb is not installed", "make setup, or mode disabled")
        ]
    detail += f", wandb {found[1]}"
    if resolved == "online" and not has_key:
        return [
            Outcome(
                "wandb",
                "warn",
                detail + "; WANDB_API_KEY is not set",
                "export WANDB_API_KEY in the submitting shell (or `wandb login`), or use mode offline",
            )
        ]
    return [Outcome("wandb", "ok", detail)]


def _existing_parent(path: Path) -> Path:
    p = path.resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def hf_cache_dir(ctx: Context) -> tuple[Path, str]:
    """The HF hub cache a run here would use, and where that choice came from."""
    r = recipe_of(ctx)
    if r is not None and r.cluster.hf_home:
        return Path(r.cluster.hf_home) / "hub", "cluster.hf_home"
    env = ctx.environ
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]), "HF_HUB_CACHE"
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]) / "hub", "HF_HOME"
    xdg = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME", str(Path.home()))) / ".cache")
    return Path(xdg) / "huggingface" / "hub", "default"


def hub_model(ctx: Context) -> str | None:
    r = recipe_of(ctx)
    if r is None or r.model.path == "tiny" or Path(r.model.path).exists():
        return None
    p = r.model.path
    return p if "/" in p and not p.startswith((".", "/")) else None


def check_hf_cache(ctx: Context) -> list[Outcome]:
    folder, source = hf_cache_dir(ctx)
    base = _existing_parent(folder)
    free = shutil.disk_usage(base).free
    writable = os.access(base, os.W_OK)
    where = "" if base == folder.resolve() else f" at {base}"
    detail = f"{folder} ({source}{'' if folder.exists() else ', not created yet'}), {free / GIB:.1f} GiB free{where}"
    detail += "" if writable else f", {base} not writable"
    repo = hub_model(ctx)
    if repo is not None:
        r = recipe_of(ctx)
        need = param_count(r.model.dims).total * 2  # bf16 safetensors
        cached = (folder / f"models--{repo.replace('/', '--')}").exists()
        if not cached and (free < need or not writable):
            return [
                Outcome(
                    "hf cache",
                    "fail",
                    f"{detail}; model.path = {repo} is not cached and needs about {need / GIB:.0f} GiB",
                    "free disk or point cluster.hf_home / HF_HOME at a larger, writable folder",
                )
            ]
        detail += f"; {repo} " + ("cached" if cached else f"downloads at start (about {need / GIB:.0f} GiB)")
    if not writable:
        return [Outcome("hf cache", "warn", detail, "make the folder writable or set HF_HOME")]
    if free < LOW_DISK_GIB * GIB:
        return [
            Outcome(
                "hf cache", "warn", detail, f"less than {LOW_DISK_GIB} GiB free; free disk or move HF_HOME"
            )
        ]
    return [Outcome("hf cache", "ok", detail)]
