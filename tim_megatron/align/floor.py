"""The tolerance ``tim align`` judges half-precision sides with, from a measurement on the running machine.

Two healthy sides that compute in bfloat16 differ by bf16 rounding, and how much depends on the CPU's kernels:
the tiny Qwen3-MoE's healthy engine and trainer differed by 1.6e-2 nats at the head on an AMD EPYC and by 6.2e-2 to
9.4e-2 on an Intel Xeon with AMX, so no fixed number serves every machine. The floor is measured instead, on the
same tokens and this machine: the HF transformers model in the half dtype against itself in float32 (what rounding
to that dtype alone costs), judged exactly as the comparison judges (:func:`~tim_megatron.align.compare.judged`).
The tolerance is :data:`FLOOR_FACTOR` times that floor.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

FLOAT32_TOLERANCE = 1e-5
"""When every compared side computes in float32: the sides agree to float32 rounding (largest judged difference
3.8e-6 on the tiny models)."""

FLOOR_FACTOR = 4.0
"""Tolerance / measured floor. Two sides each about one floor away from float32 can be two floors apart; the other
factor 2 is for kernels that round more often than HF's. Measured on an AMD EPYC (2 cores) with 6 random sequences
of 12 tokens: a healthy bf16 engine against the bf16 trainer reached 2.0 x the floor on the tiny Qwen3-MoE (floor
1.4e-2, largest difference 2.8e-2 at the final norm), 1.1 x on Mixtral and at most 0.4 x on OLMoE, GLM-4.5,
DeepSeek-V2 and V3. A broken transfer (a rotated or stale tensor) differs by order 1."""

HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Tolerance:
    """The tolerance a comparison judges with, and where it comes from."""

    value: float
    source: str
    """``given`` (``--tolerance``, or a caller's number), ``float32`` (every side computes in float32) or
    ``measured``."""
    dtype: str = "float32"
    """The coarsest dtype among the compared sides."""
    floor: float | None = None
    """``measured``: the largest judged difference of the HF model in ``dtype`` against float32."""
    floor_at: str | None = None
    """Where that largest difference is (``layer 1, router logits``)."""
    factor: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """One line for the report."""
        if self.source == "given":
            return f"tolerance {self.value:g}, as given"
        if self.source == "float32":
            return f"tolerance {self.value:g}: every side computes in float32"
        return (
            f"tolerance {self.value:.3g} = {self.factor:g} x the floor {self.floor:.3g} measured on this machine "
            f"(HF transformers in {self.dtype} against float32 on the same tokens, largest at {self.floor_at})"
        )


def side_dtype(recipe, side: str) -> str:
    """What ``side`` computes in: the engine the recipe's rollout dtype, the trainer its trainer dtype, HF float32
    (the reference)."""
    return {"engine": recipe.rollout_dtype, "trainer": recipe.trainer_dtype, "hf": "float32"}[side]


def coarsest(recipe, sides) -> str:
    """The half dtype among the sides' (fp16 before bf16 never matters: a recipe has one of them), else float32."""
    dtypes = {side_dtype(recipe, s) for s in sides}
    return next((d for d in HALF if d in dtypes), "float32")


def measure_floor(model_path: Path, sequences: list[list[int]], *, dims, dtype: str) -> tuple[float, str]:
    """(the largest judged difference, where) of the HF model in ``dtype`` against float32 on ``sequences``: the
    model is loaded once in float32, recorded, cast to ``dtype`` in place and recorded again."""
    from transformers import AutoModelForCausalLM

    from tim_megatron.align.capture import hf_capture
    from tim_megatron.align.compare import compare, judged

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    reference = hf_capture(model, sequences, dims=dims)
    rounded = hf_capture(model.to(HALF[dtype]), sequences, dims=dims)
    del model
    figures = judged(compare(rounded, reference, tolerance=1.0))
    broken = [where for where, x in figures.items() if math.isnan(x)]
    if broken:
        return math.nan, broken[0]
    where, floor = max(figures.items(), key=lambda kv: kv[1])
    return floor, where


def tolerance_of(recipe, sides, *, given: float | None, measure) -> Tolerance:
    """``given`` when there is one; 1e-5 when every side computes in float32; else :data:`FLOOR_FACTOR` x the floor
    that ``measure(dtype)`` returns as (floor, where)."""
    dtype = coarsest(recipe, sides)
    if given is not None:
        return Tolerance(given, "given", dtype)
    if dtype == "float32":
        return Tolerance(FLOAT32_TOLERANCE, "float32")
    floor, where = measure(dtype)
    if not floor > 0:  # NaN, or a model whose half-precision copy computes exactly: nothing to scale
        raise ValueError(
            f"tim align: the measured {dtype} floor is {floor} ({where}); give --tolerance to judge this model"
        )
    return Tolerance(FLOOR_FACTOR * floor, "measured", dtype, floor, where, FLOOR_FACTOR)
