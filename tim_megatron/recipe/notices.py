"""Recipe values that are allowed but do nothing in this run: said at start, not refused.

A value that cannot take effect and that a user sets on purpose is refused by name (:mod:`tim_megatron.recipe.
rules`). Some come along from a recipe the user builds on, where they did act: the tiny model's own settings in a
recipe copied for a real checkpoint, or ``model.path`` given on the command line to a tiny recipe. Those are
named once at the start of ``tim train`` and by ``tim plan`` (:func:`notices`), so that nobody reads them as in
force.
"""

from __future__ import annotations


def notices(recipe) -> list[str]:
    """One sentence per value of ``recipe`` that is set and does nothing in this run."""
    m = recipe.model
    out = []
    defaults = type(m).model_fields
    tiny = {
        k: getattr(m, k) for k in ("tiny_seed", "tiny_warmup_steps") if getattr(m, k) != defaults[k].default
    }
    if m.path != "tiny" and tiny:
        given = ", ".join(f"model.{k} = {v}" for k, v in tiny.items())
        out.append(
            f"{given} with model.path = {m.path}: these build the built-in tiny model and do nothing to a checkpoint"
        )
    return out
