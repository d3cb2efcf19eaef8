"""The model families' registry names: the modules of ``tim_megatron/trainer/families/``, read from the folder
without importing anything, so that the recipe schema (which the families import) and the registry share one list."""

from __future__ import annotations

from pathlib import Path

FAMILIES_DIR = Path(__file__).resolve().parent / "trainer" / "families"
"""One module per family; ``base`` and names starting with ``_`` are not families."""


def family_names() -> tuple[str, ...]:
    """The registry names, sorted."""
    return tuple(
        sorted(p.stem for p in FAMILIES_DIR.glob("*.py") if not p.stem.startswith("_") and p.stem != "base")
    )


FAMILIES = family_names()
"""The model families, by registry name."""
