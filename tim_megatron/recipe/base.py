"""What every recipe section shares: strict validation, the named cross-field error, and the common types."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator

Dtype = Literal["float32", "bfloat16", "float16"]

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
"""Run names and sweep ids: they become folder names, Slurm job names and wandb names."""
INT_LIMIT = 2**31 - 1
"""No integer knob is sane beyond int32 (steps, sizes, seeds); larger values are typos or attacks."""


class Section(BaseModel):
    """Strict: ``true`` is not 1, ``1e29`` is not an integer, ``"3"`` is not 3; no NaN or infinity in a float
    unless its field says so (``allow_inf_nan=True``), and no integer beyond :data:`INT_LIMIT`."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
        strict=True,
        allow_inf_nan=False,
    )

    @field_validator("*")
    @classmethod
    def _int_range(cls, v):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > INT_LIMIT:
            raise ValueError(f"integers here must lie within +-{INT_LIMIT} (2**31 - 1)")
        return v


class RecipeValueError(ValueError):
    """A cross-field validation failure that names the dotted keys involved."""

    def __init__(self, keys: list[str], message: str):
        self.keys = keys
        super().__init__(message)
