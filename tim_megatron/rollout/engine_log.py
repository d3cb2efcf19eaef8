"""What the vLLM engine prints: its own log level (``logging.engine_level``), and one harmless warning dropped.

At vLLM's default level (info) every step adds three engine lines to the console around the weight reload. The
engine's log is kept at ``warning`` unless the recipe asks for more, and the one warning every reload prints,
``RotaryEmbedding: Failed to load weights``, is dropped. Why it is harmless, in vLLM 0.32.0's
``model_loader/reload/layerwise.py``: an in-place reload counts every parameter and buffer of a layer as loadable
and warns about any layer of which it loaded nothing. RotaryEmbedding's only tensor is ``cos_sin_cache``, a
non-persistent buffer vLLM computes from the model config (RoPE has no weights), so no checkpoint and no export
holds it. vLLM then puts the layer's existing tensors back (``_place_kernel_tensors``): the cache is unchanged. Only
that class name is dropped: another layer in that message did miss its weights (some rotary variants, FoPE's, have
learned ones). The filter is installed only on the vLLM version this was read in.

During ``tim train`` the engine's log goes to ``<run_dir>/logs/engine.log``, not the console
(:mod:`tim_megatron.logging.library_log`). vLLM 0.32 puts its own console handler on its logger when an engine
starts (``vllm.logger.configure_logging``); :func:`engine_logging_config` tells it not to while the log is routed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from tim_megatron import versions

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
"""The logger of vLLM's layerwise reload (its module name)."""
FAILED_TO_LOAD = "%s: Failed to load weights"
"""The message, as vLLM 0.32.0 formats it (``%s`` is the layer's class name)."""
HARMLESS_LAYERS = ("RotaryEmbedding",)
"""Layers whose "failed to load" holds nothing to load (see the module docstring)."""


class DropHarmlessReloadWarning(logging.Filter):
    """Drops "RotaryEmbedding: Failed to load weights" from vLLM's reload log; passes everything else."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (record.msg == FAILED_TO_LOAD and len(args) == 1 and args[0] in HARMLESS_LAYERS)


def configure_engine_log(level: str, *, vllm_version: str) -> str:
    """Drop the harmless reload warning (once per process; only when ``vllm_version`` is the verified one, whose
    source this was read in), and return the ``log_level`` to give ``vllm.LLM`` for ``logging.engine_level``."""
    if versions.accepts(versions.VLLM, vllm_version):
        logger = logging.getLogger(RELOAD_LOGGER)
        if not any(isinstance(f, DropHarmlessReloadWarning) for f in logger.filters):
            logger.addFilter(DropHarmlessReloadWarning())
    return level.upper()


def engine_logging_config(environ: Mapping[str, str]):
    """The ``logging_config`` to give ``vllm.LLM``, or None to let vLLM set up its logging as it does by default.

    While this process routes vLLM's log (:func:`tim_megatron.logging.library_log.routes_engine_log`), vLLM is
    told not to configure logging: that would replace the routing's handlers with its console handler. Not when
    the user gives vLLM a logging config file (``VLLM_LOGGING_CONFIG_PATH``: theirs wins), nor on a vLLM without
    ``LoggingConfig``."""
    from tim_megatron.logging.library_log import routes_engine_log

    if not routes_engine_log() or environ.get("VLLM_LOGGING_CONFIG_PATH"):
        return None
    try:
        from vllm.config.logging import LoggingConfig
    except ImportError:
        return None
    return LoggingConfig(configure_logging=False)
