"""Model families, one module each, found by HF architecture name.

Every module in this package except ``base`` defines ``FAMILY`` (whose name is the module's name), a :class:`~.base.Family`: how to read the
model's config.json, its megatron-core config and layer specs, its HF <-> Megatron weight table, its tiny test
model and its parameter count. The registry imports them all; adding a family means adding one module (see the
docs/families.md, "Adding a model family").
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from tim_megatron.family_names import FAMILIES
from tim_megatron.trainer.families.base import Family, HFConfigError, UnsupportedModelError, shown

__all__ = [
    "Family",
    "HFConfigError",
    "UnsupportedModelError",
    "families",
    "family_for_hf",
    "family_names",
    "get_family",
]


def family_names() -> list[str]:
    """Registry names: the family modules' names (known without importing them; the recipe schema allows the
    same list, :data:`tim_megatron.family_names.FAMILIES`)."""
    return list(FAMILIES)


@functools.cache
def families() -> dict[str, Family]:
    """Every family, by registry name (built once per process, never changed afterwards)."""
    found: dict[str, Family] = {}
    for name in family_names():
        mod = importlib.import_module(f"{__name__}.{name}")
        fam = getattr(mod, "FAMILY", None)
        if not isinstance(fam, Family):
            raise TypeError(f"{mod.__name__} defines no FAMILY (a tim_megatron.trainer.families.base.Family)")
        if fam.name != name:
            raise TypeError(f"{mod.__name__}: FAMILY.name = {fam.name!r} must be the module's name {name!r}")
        found[name] = fam
    return found


def architectures() -> list[str]:
    return [a for f in families().values() for a in f.architectures]


def get_family(name: str) -> Family:
    fam = families().get(name)
    if fam is None:
        raise UnsupportedModelError(f"model family {name!r} is unknown; known: {', '.join(families())}")
    return fam


def family_for_hf(cfg: dict[str, Any]) -> Family:
    """The family of an HF config.json, by ``architectures`` (else ``model_type``)."""
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise HFConfigError(
            f"config.json: architectures = {shown(archs)}: allowed: a list of class names (strings), "
            'e.g. ["Qwen3MoeForCausalLM"]'
        )
    for fam in families().values():
        if any(a in fam.architectures for a in archs):
            return fam
    from tim_megatron.trainer.families._unsupported import REFUSED

    for a in archs:
        if a in REFUSED:
            raise UnsupportedModelError(REFUSED[a])
    mt = cfg.get("model_type")
    if not archs:
        for fam in families().values():
            if mt == fam.model_type:
                return fam
    raise UnsupportedModelError(
        f"architecture {shown(archs or mt)} is not supported; supported: {', '.join(architectures())} "
        "(to support another family, add a module under tim_megatron/trainer/families/: docs/families.md, "
        "'Adding a model family')"
    )
