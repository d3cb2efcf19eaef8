"""Version-guarded runtime patches to megatron-core and vLLM, one module per patch.

Every patch module defines ``SPEC`` (what it patches, why, and the library versions it was verified on;
built by :mod:`patches.specs`, which states each library's distributions and verified versions once)
and an ``apply(...)`` that first calls :func:`patches.guard.check_version` and fails loudly on any other
version. Patches return a handle with ``revert()``; none keeps module-level mutable state.
"""
