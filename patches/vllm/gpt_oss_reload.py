"""Load gpt-oss's fused expert tensors and attention sinks through their weight loaders (vLLM), so that an in-place
weight reload (the RL weight sync) reaches them.

The bug (vLLM 0.32, unquantized gpt-oss, ``GptOssModel._load_weights_other``): the checkpoint's fused expert
tensors (``mlp.experts.gate_up_proj`` ``[experts, hidden, 2 x width]``, ``down_proj``, their biases) are written
with ``param.copy_`` and the sinks (``self_attn.sinks``) with ``param.data.copy_``, around the parameters' weight
loaders. The first load is fine. An in-place reload (``reload_weights``, vLLM's layerwise reload) swaps each layer's
parameters for meta tensors and counts what arrives through the (wrapped) weight loaders, then puts the old kernel
tensors back for a layer that received nothing: the copies go to meta tensors and are lost, and the engine keeps
the experts and sinks it had, with no error. Measured on the tiny gpt-oss after one update: 5.0 nats from the
trainer with the fused tensors; 0.099 nats with per-expert tensors but the sinks copied around their loader.

The fix, inside ``_load_weights_other`` (every load, first and reloads): a fused expert tensor is passed on as one
tensor per expert under vLLM's own per-expert names (``...mlp.experts.<e>.w13_weight``), which its
``GptOssRoutedExperts`` weight loader takes (its "streamed" path); a sinks tensor is given, as this rank's heads,
to the parameter's weight loader. Everything else goes to the original function unchanged. Applied by the rollout
engine before its model is built; models other than gpt-oss are not touched.
"""

from __future__ import annotations

from patches.guard import check_version
from patches.specs import vllm_patch

SPEC = vllm_patch(
    name="vllm-gpt-oss-reload",
    reason="gpt-oss's fused expert tensors and sinks are copied around their weight loaders, so vLLM's in-place "
    "reload drops them (the engine keeps the old experts and sinks).",
    targets=("vllm.model_executor.models.gpt_oss.GptOssModel._load_weights_other",),
)

FUSED = ("w13_weight", "w2_weight", "w13_bias", "w2_bias")
"""vLLM's names of gpt-oss's fused expert tensors (after its checkpoint name mapping)."""


def split_stream(weights, params: dict, *, head_start: int, heads_per_rank: int, loaded: set):
    """``weights`` with each fused expert tensor as one tensor per expert, and the sinks loaded here through their
    weight loaders (recorded in ``loaded``)."""
    for name, weight in weights:
        if name.endswith(".sinks") and name in params:
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                from vllm.model_executor.model_loader.weight_utils import default_weight_loader as loader
            loader(param, weight.narrow(0, head_start, heads_per_rank))
            loaded.add(name)
            continue
        prefix, sep, rest = name.rpartition(".mlp.experts.")
        if sep and rest in FUSED:
            for e in range(weight.shape[0]):
                yield f"{prefix}.mlp.experts.{e}.{rest}", weight[e]
            continue
        yield name, weight


def apply() -> bool:
    """Wrap ``GptOssModel._load_weights_other``; True when this call changed it (idempotent)."""
    check_version(SPEC)
    from vllm.model_executor.models.gpt_oss import GptOssModel

    original = GptOssModel._load_weights_other
    if getattr(original, "__tim_patch__", None) == SPEC.name:
        return False

    def _load_weights_other(
        self, ep_rank_end, ep_rank_start, heads_per_rank, head_start, weights, stacked_params_mapping
    ):
        loaded: set[str] = set()
        stream = split_stream(
            weights,
            dict(self.named_parameters()),
            head_start=head_start,
            heads_per_rank=heads_per_rank,
            loaded=loaded,
        )
        done = original(
            self, ep_rank_end, ep_rank_start, heads_per_rank, head_start, stream, stacked_params_mapping
        )
        return set(done) | loaded

    _load_weights_other.__tim_patch__ = SPEC.name
    _load_weights_other.__wrapped__ = original
    GptOssModel._load_weights_other = _load_weights_other
    return True


def revert() -> bool:
    """Undo :func:`apply` (tests: the reload without the patch); True when something was undone."""
    from vllm.model_executor.models.gpt_oss import GptOssModel

    current = GptOssModel._load_weights_other
    if getattr(current, "__tim_patch__", None) != SPEC.name:
        return False
    GptOssModel._load_weights_other = current.__wrapped__
    return True
