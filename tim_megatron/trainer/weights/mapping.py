"""HF <-> megatron-core parameter mapping, as data: the rule format. Each family's table is in its own module
(:mod:`tim_megatron.trainer.families`), built mostly from the shared rules in ``families/base.py``.

A rule names a megatron-core parameter (with ``{L}`` for the layer and ``{E}`` for the *global* expert
index), the HF tensor(s) it is made of, how they combine, and how the result is split across ranks.
The machinery in :mod:`tim_megatron.trainer.weights.convert` is generic.

Combinations:

* ``copy``: one HF tensor, same layout.
* ``qkv``: HF q, k, v projections interleaved per query group, megatron's fused ``linear_qkv`` layout
  ``[group][q heads of the group, k, v]``.
* ``gate_up``: HF gate and up projections stacked, megatron's gated ``linear_fc1``. Under tensor
  parallelism each rank holds its slice of gate followed by its slice of up.
* ``interleaved_gate_up``: one HF ``[hidden, 2 x width]`` tensor whose columns alternate gate and up (gpt-oss's
  ``gate_up_proj``; its bias ``[2 x width]`` alike), transposed into megatron's gated ``linear_fc1`` (gate rows,
  then up rows).
* ``transpose``: one HF ``[in, out]`` tensor, megatron's ``[out, in]`` (gpt-oss's ``down_proj``); a bias as it is.

Splits: ``rep`` (replicated), ``tp0`` / ``tp1`` (tensor-parallel on dim 0 / 1), ``etp0`` / ``etp1``
(expert-tensor-parallel), ``qkv`` and ``gate_up`` (per-part splits described above). Experts are placed by
expert parallelism: rank ``r`` of the EP group holds global experts ``[r * E / ep, (r + 1) * E / ep)``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    megatron: str
    """megatron-core parameter (or buffer) name, ``{L}`` for the layer and ``{E}`` for the expert."""
    hf: tuple[str, ...]
    """The HF checkpoint tensor(s) it is made of."""
    combine: str = "copy"
    """How the HF tensors combine: copy, qkv, gate_up, interleaved_gate_up or transpose."""
    split: str = "rep"
    """How the result is split across ranks."""
    buffer: bool = False
    """A persistent buffer rather than a parameter (loaded and exported, never trained), e.g. an expert bias."""
    stacked_experts: bool = False
    """The HF tensor holds every expert of the layer, stacked along its first dimension (gpt-oss's fused
    ``mlp.experts.*`` tensors): ``{E}`` of the megatron name indexes it, and the export stacks the experts back."""

    def pattern(self) -> re.Pattern:
        rx = re.escape(self.megatron).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
        return re.compile(f"^{rx}$")


# transformer-engine layer specs fuse the pre-attention (and, for dense MLPs, pre-MLP) norms into the
# following linear layer; these aliases map its parameter names onto the local-spec names above.
TE_ALIASES = (
    (re.compile(r"self_attention\.linear_qkv\.layer_norm_weight$"), "input_layernorm.weight"),
    (re.compile(r"mlp\.linear_fc1\.layer_norm_weight$"), "pre_mlp_layernorm.weight"),
)


def canonical_name(name: str) -> str:
    """A megatron parameter name in local-spec form (TE fused-norm names mapped back)."""
    for rx, repl in TE_ALIASES:
        if rx.search(name):
            head = name[: rx.search(name).start()]
            return head + repl
    return name
