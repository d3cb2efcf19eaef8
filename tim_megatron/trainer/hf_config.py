"""Read an HF ``config.json`` into :class:`ModelDims` through its model family, and check a recipe against it.

The per-family reading lives in :mod:`tim_megatron.trainer.families`; this module finds the file, parses it
with named errors, and compares a recipe's ``model.dims`` with the checkpoint's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tim_megatron.recipe.schema import ModelDims
from tim_megatron.trainer.families import HFConfigError, UnsupportedModelError, family_for_hf

__all__ = [
    "CheckpointMismatchError",
    "HFConfigError",
    "UnsupportedModelError",
    "check_dims_match",
    "dims_from_hf",
    "model_family",
    "read_hf_config",
]

MAX_CONFIG_BYTES = 4 << 20
"""A config.json is a few KB; anything larger is not one."""

MAX_INT_DIGITS = 100
"""A config.json's counts and token ids have a few digits; longer integers are refused while parsing, by key
(Python itself refuses more than 4300 digits with an error that names neither key nor line)."""


class _HugeInt(ValueError):
    def __init__(self, digits: str):
        self.digits = digits
        super().__init__(digits)


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _HugeInt(text)
    return int(text)


def _huge_int_error(f: Path, text: str, digits: str) -> HFConfigError:
    """Name the key and line of the first over-long integer in ``text``."""
    at = text.find(digits)
    before = text[max(at - 300, 0) : at]
    keys = re.findall(r'"((?:[^"\\]|\\.){1,100})"\s*:\s*\[?\s*$', before)
    key = f"key {keys[-1]!r}" if keys else "a value"
    line = text.count("\n", 0, at) + 1
    n = len(digits.lstrip("-"))
    return HFConfigError(
        f"{f}: line {line}: {key} is an integer of {n} digits; allowed: integers of at most {MAX_INT_DIGITS} "
        "digits (fix: use the model's published config.json)"
    )


class CheckpointMismatchError(ValueError):
    pass


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The config.json of a checkpoint folder (or the file itself), as a dict; named errors otherwise."""
    p = Path(path)
    f = p / "config.json" if p.is_dir() and p.name != "config.json" else p
    if not f.exists():
        raise FileNotFoundError(f"model checkpoint {path}: no config.json (expected {f})")
    if f.is_dir():
        raise HFConfigError(
            f"{f}: is a directory, not a config.json file (fix: point at the checkpoint folder or its config.json)"
        )
    if not f.is_file():  # a FIFO would block, a device (/dev/zero) never ends
        raise HFConfigError(f"{f}: not a regular file; allowed: a config.json file")
    try:
        with f.open("rb") as fh:
            data = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise HFConfigError(
            f"{f}: cannot be read ({e.strerror}); allowed: a readable config.json file"
        ) from None
    if len(data) > MAX_CONFIG_BYTES:
        raise HFConfigError(
            f"{f}: larger than {MAX_CONFIG_BYTES} bytes; allowed: a config.json of at most {MAX_CONFIG_BYTES} bytes"
        )
    try:
        text = data.decode("utf-8")
        cfg = json.loads(text, parse_int=_parse_int)
    except _HugeInt as e:
        raise _huge_int_error(f, text, e.digits) from None
    except RecursionError:
        raise HFConfigError(
            f"{f}: JSON nested too deeply to read; allowed: a JSON object of model settings, a few levels deep "
            "(fix: use the model's published config.json)"
        ) from None
    except UnicodeDecodeError as e:
        raise HFConfigError(
            f"{f}: not UTF-8 text ({e.reason} at byte {e.start}); a config.json is JSON text"
        ) from None
    except json.JSONDecodeError as e:
        raise HFConfigError(
            f"{f}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno} (fix: use the model's published config.json)"
        ) from None
    if not isinstance(cfg, dict):
        raise HFConfigError(
            f"{f}: top level is a JSON {type(cfg).__name__}; allowed: a JSON object of model settings "
            '(e.g. {"architectures": [...], "hidden_size": ...})'
        )
    return cfg


def model_family(cfg: dict[str, Any]) -> str:
    """Registry name of the checkpoint's family."""
    return family_for_hf(cfg).name


def dims_from_hf(cfg: dict[str, Any]) -> ModelDims:
    """The model's dims through its family; a ``quantization_config`` other than block FP8 or MXFP4 is refused by
    key."""
    from tim_megatron.trainer.weights.fp8 import QuantizationConfigError, block_fp8_of
    from tim_megatron.trainer.weights.mxfp4 import is_mxfp4

    family = family_for_hf(cfg)
    try:
        if not is_mxfp4(cfg):
            block_fp8_of(cfg, where=family.architectures[0])
    except QuantizationConfigError as e:
        raise UnsupportedModelError(str(e)) from None
    return family.read_dims(cfg)


def _unused_intermediate(d: ModelDims) -> bool:
    """An MoE model without dense layers never reads ``intermediate_size``."""
    return d.is_moe and d.first_k_dense_layers == 0


def check_dims_match(recipe_dims: ModelDims, hf_dims: ModelDims, *, where: str) -> None:
    """The recipe's ``model.dims`` must describe the checkpoint it points at."""
    diffs = []
    if recipe_dims.resolved_family != hf_dims.resolved_family:
        diffs.append(
            f"model.dims.family = {recipe_dims.resolved_family} but the checkpoint is {hf_dims.resolved_family}"
        )
    for name in ModelDims.model_fields:
        if name in ("max_position_embeddings", "family"):
            continue
        a, b = getattr(recipe_dims, name), getattr(hf_dims, name)
        if name == "intermediate_size" and _unused_intermediate(hf_dims):
            continue
        if a != b and not (isinstance(a, float) and abs(a - b) <= 1e-9 * max(abs(a), abs(b))):
            diffs.append(f"model.dims.{name} = {a} but the checkpoint has {b}")
    if diffs:
        raise CheckpointMismatchError(
            f"{where}: the checkpoint is for another model:\n  " + "\n  ".join(diffs)
        )
