"""Let megatron-core build multi-head latent attention without transformer-engine.

megatron-core 0.16.1's ``multi_latent_attention`` imports ``TELinear`` from its transformer-engine extension inside
a ``try`` and sets ``HAVE_TE = True`` when that import succeeds. Without transformer-engine the extension still
imports, and binds its names to mock placeholders, so ``HAVE_TE`` is True and ``MLASelfAttention.__init__`` calls
``isinstance(self.linear_proj, TELinear)`` with a mock as the class: ``TypeError``. Setting the module's
``HAVE_TE`` to False (what it means: transformer-engine is absent) skips that transformer-engine-only branch; its
other references compare spec classes with ``in [TELinear]``, which a placeholder never equals. Needed wherever
transformer-engine is absent and a model uses MLA.
"""

from __future__ import annotations

import importlib.util

from patches.guard import Handle, check_version, set_attr
from patches.specs import megatron_core_patch

SPEC = megatron_core_patch(
    name="megatron-mla-without-te",
    reason="MLASelfAttention calls isinstance() with transformer-engine's placeholder class when it is missing.",
    targets=("megatron.core.transformer.multi_latent_attention.HAVE_TE",),
)


def needed() -> bool:
    """True when transformer-engine is not installed."""
    return importlib.util.find_spec("transformer_engine") is None


def apply() -> Handle:
    """Set ``multi_latent_attention.HAVE_TE = False``; call only when :func:`needed`."""
    check_version(SPEC)
    import megatron.core.transformer.multi_latent_attention as mla

    if isinstance(mla.TELinear, type):
        raise RuntimeError(f"{SPEC.name} must not be applied: TELinear is a real class ({mla.TELinear!r})")
    h = Handle(SPEC.name)
    set_attr(h, mla, "HAVE_TE", False)
    return h
