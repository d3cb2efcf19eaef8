"""The libraries' own output goes to the run folder's ``logs/engine.log``, the console keeps the project's lines.

Issue 21, Console ("`make demo`'s console shows one line per step and no engine warnings"):
- Tried: ``make demo``. Before: about 40 lines of library output came before step 1: vLLM WARNING lines (its seed,
  enforce-eager, Triton, LD_PRELOAD advice, 15 "Attempted to load weight ... float32 into ... bfloat16", 5
  "torch.set_num_threads"), the unprefixed "Triton is installed, but doesn't include CPU backend" (vLLM's logger
  before vLLM had set up its handler), megatron-core's "Apex is not installed" and "full scope is deprecated"
  UserWarnings, vLLM FutureWarnings, torch's C++ "[W... utils.cpp:68] Warning: NUMA binding" and tqdm bars
  "Loading safetensors checkpoint shards". Now: the console names ``logs/engine.log`` first, then shows the
  run header, one line per step, the summary and a count of the warnings the file received. vLLM's log (at
  ``logging.engine_level``), other libraries' log records and Python warnings raised from library code are in
  the file; vLLM errors and the project's own warnings (e.g. IntegrityWarning) still reach stderr. torch's C++
  log shows errors only (``TORCH_CPP_LOG_LEVEL``, a user's value wins), vLLM's load bars are off. Tests:
  test_library_output_goes_to_the_file_and_the_projects_to_the_console (the routing, in process),
  test_vllm_keeps_off_its_logger_only_while_the_run_routes_it, test_torch_cpp_log_is_quieted_unless_the_user_chose,
  and the console of a real ``tim train`` in
  tests/test_loop.py::test_run_folder_holds_recipe_metrics_dumps_png_summary_and_wandb.
"""

from __future__ import annotations

import io
import logging
import warnings
from pathlib import Path

from rich.console import Console

from tests.conftest import importable, require
from tim_megatron.integrity import IntegrityWarning
from tim_megatron.logging import library_log

SITE = "/usr/lib/python3/site-packages/megatron/core/models/backends.py"
"""A library file a warning is raised from (it need not exist)."""
OURS = str(Path(library_log.__file__))
"""A project file."""


def test_library_output_goes_to_the_file_and_the_projects_to_the_console(tmp_path, capsys):
    shown = []  # what the hook in place before the run shows (on stderr, in a real run)
    console = Console(file=io.StringIO(), width=200)
    engine, root = logging.getLogger("vllm"), logging.getLogger()
    before = (list(engine.handlers), engine.level, engine.propagate, list(root.handlers))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, category, *_: shown.append(f"{category.__name__}: {message}")
        hook = warnings.showwarning
        with library_log.routed(tmp_path, level="warning", console=console, rank=0) as log:
            assert library_log.routes_engine_log()
            warnings.warn_explicit("Apex is not installed", UserWarning, SITE, 21)
            warnings.warn_explicit(
                "checkpoint step 3 is corrupt", IntegrityWarning, SITE, 1
            )  # the category is ours
            warnings.warn_explicit("wandb stopped working", UserWarning, OURS, 1)  # raised from our code
            logging.getLogger("vllm.model_executor.models.utils").warning("Attempted to load weight %s", "w")
            logging.getLogger("vllm.model_executor.models.utils").info("not at engine_level")
            logging.getLogger("vllm.v1.engine.core").error("EngineCore failed")
            logging.getLogger("megatron.core.utils").warning("a megatron notice")
        assert warnings.showwarning is hook  # put back
    assert not library_log.routes_engine_log()
    assert (list(engine.handlers), engine.level, engine.propagate, list(root.handlers)) == before

    text = (tmp_path / "logs" / "engine.log").read_text()
    assert log.path == tmp_path / "logs" / "engine.log"
    assert f"{SITE}:21 UserWarning: Apex is not installed" in text
    assert "WARNING vllm.model_executor.models.utils:" in text and "Attempted to load weight w" in text
    assert "ERROR vllm.v1.engine.core:" in text and "megatron.core.utils" in text
    assert "corrupt" not in text and "wandb" not in text and "not at engine_level" not in text
    assert shown == ["IntegrityWarning: checkpoint step 3 is corrupt", "UserWarning: wandb stopped working"]
    err = capsys.readouterr().err
    assert "EngineCore failed" in err and "Attempted" not in err and "megatron notice" not in err
    assert console.file.getvalue().splitlines() == [
        f"engine log: {log.path}",
        f"engine log: 3 warnings in {log.path}",  # the library warning, vLLM's and megatron's (not the error)
    ]


def test_other_ranks_write_their_own_file_and_print_nothing(tmp_path):
    console = Console(file=io.StringIO())
    with library_log.routed(tmp_path, level="warning", console=console, rank=3):
        logging.getLogger("vllm.config").warning("rank 3's notice")
    assert "rank 3's notice" in (tmp_path / "logs" / "engine.rank3.log").read_text()
    assert not (tmp_path / "logs" / "engine.log").exists() and console.file.getvalue() == ""


def test_vllm_keeps_off_its_logger_only_while_the_run_routes_it(tmp_path):
    require(importable("vllm"), "vLLM")
    from tim_megatron.rollout.engine_log import engine_logging_config

    assert engine_logging_config({}) is None  # not routed: vLLM sets up its console handler as by default
    with library_log.routed(tmp_path, level="warning", rank=0):
        config = engine_logging_config({})
        assert config is not None and config.configure_logging is False
        assert (
            engine_logging_config({"VLLM_LOGGING_CONFIG_PATH": "/etc/mine.json"}) is None
        )  # the user's wins


def test_torch_cpp_log_is_quieted_unless_the_user_chose():
    env: dict[str, str] = {}
    library_log.quiet_torch_cpp_log(env)
    assert env == {"TORCH_CPP_LOG_LEVEL": "ERROR"}
    env = {"TORCH_CPP_LOG_LEVEL": "INFO"}
    library_log.quiet_torch_cpp_log(env)
    assert env == {"TORCH_CPP_LOG_LEVEL": "INFO"}
