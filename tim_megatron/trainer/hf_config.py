"""Read an HF ``config.json`` into :class:`ModelDims`, and refuse what we cannot build exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tim_megatron.recipe.schema import ModelDims

SUPPORTED = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3ForCausalLM": "qwen3",
}


class UnsupportedModelError(ValueError):
    pass


class CheckpointMismatchError(ValueError):
    pass


def read_hf_config(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    if not f.exists():
        raise FileNotFoundError(f"model checkpoint {path}: no config.json (expected {f})")
    return json.loads(f.read_text())


def model_family(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    for a in archs:
        if a in SUPPORTED:
            return SUPPORTED[a]
    mt = cfg.get("model_type")
    if mt in SUPPORTED.values():
        return mt
    raise UnsupportedModelError(
        f"architecture {archs or mt!r} is not supported; supported: {', '.join(SUPPORTED)} "
        "(add a mapping table in tim_megatron/trainer/weights/mapping.py to support another family)"
    )


def dims_from_hf(cfg: dict[str, Any]) -> ModelDims:
    family = model_family(cfg)
    rope = cfg.get("rope_scaling") or {}
    params = cfg.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type")) or params.get("rope_type", "default")
    if rope_type not in (None, "default"):
        raise UnsupportedModelError(f"rope_scaling type {rope_type!r} is not supported (only default RoPE)")
    if cfg.get("attention_bias"):
        raise UnsupportedModelError("attention_bias = true is not supported (Qwen3 has no attention bias)")
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    heads = cfg["num_attention_heads"]
    moe = family == "qwen3_moe"
    if moe:
        if cfg.get("mlp_only_layers"):
            raise UnsupportedModelError(
                f"mlp_only_layers = {cfg['mlp_only_layers']}: mixed dense/MoE stacks are not supported"
            )
        if cfg.get("decoder_sparse_step", 1) != 1:
            raise UnsupportedModelError(
                f"decoder_sparse_step = {cfg['decoder_sparse_step']}: only 1 (every layer MoE) is supported"
            )
        if cfg.get("shared_expert_intermediate_size"):
            raise UnsupportedModelError("shared experts are not supported")
    n_exp = cfg.get("num_experts", cfg.get("num_local_experts", 0)) if moe else 0
    return ModelDims(
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"],
        num_experts=n_exp,
        num_experts_per_tok=cfg.get("num_experts_per_tok", 0) if moe else 0,
        moe_intermediate_size=cfg.get("moe_intermediate_size", 0) if moe else 0,
        intermediate_size=cfg.get("intermediate_size", 1),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        rope_theta=float(theta),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def check_dims_match(recipe_dims: ModelDims, hf_dims: ModelDims, *, where: str) -> None:
    """The recipe's ``model.dims`` must describe the checkpoint it points at."""
    diffs = []
    for name in ModelDims.model_fields:
        if name == "max_position_embeddings":
            continue
        a, b = getattr(recipe_dims, name), getattr(hf_dims, name)
        if name == "intermediate_size" and hf_dims.is_moe:
            continue
        if a != b and not (isinstance(a, float) and abs(a - b) <= 1e-9 * max(abs(a), abs(b))):
            diffs.append(f"model.dims.{name} = {a} but the checkpoint has {b}")
    if diffs:
        raise CheckpointMismatchError(
            f"{where}: the checkpoint is for another model:\n  " + "\n  ".join(diffs)
        )
