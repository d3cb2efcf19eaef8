"""HF <-> megatron-core weights: declarative tables (mapping.py) and the generic machinery (convert.py)."""

from tim_megatron.trainer.weights.convert import (
    HFCheckpoint,
    Layout,
    WeightLoadError,
    export_hf,
    load_hf_into_model,
)

__all__ = ["HFCheckpoint", "Layout", "WeightLoadError", "export_hf", "load_hf_into_model"]
