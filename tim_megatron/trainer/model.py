"""Build a megatron-core ``GPTModel`` for any registered model family, and run it to its final hidden states.

The architecture (TransformerConfig features, one layer spec per layer) comes from the family
(:mod:`tim_megatron.trainer.families`); this module adds what the run decides: dtype, parallel layout, the MoE
dispatcher (:mod:`tim_megatron.trainer.dispatch`), routing replay and recomputation.

The LM head is not run inside the model: :func:`final_hidden_states` stops after the final norm, and
:mod:`tim_megatron.trainer.logprobs` applies the head chunk by chunk, so full-vocabulary logits never
exist for a whole micro-batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from patches.megatron import indexed_dispatcher
from patches.megatron.modules import unwrap
from tim_megatron.attention_kinds import attention_kind
from tim_megatron.recipe.schema import ModelConfig, ModelDims, ParallelismConfig
from tim_megatron.trainer.attention import LayerKernels, uses_explicit_mask
from tim_megatron.trainer.dispatch import indexed_dispatcher_class, resolve_dispatcher
from tim_megatron.trainer.norm import SequenceParallelRMSNorm

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class BuildOptions:
    dtype: str = "float32"
    """Parameter/compute dtype."""
    dispatcher: str = "auto"
    """MoE token dispatcher (:func:`~tim_megatron.trainer.dispatch.resolve_dispatcher`; auto: indexed on CUDA,
    allgather on CPU)."""
    routing_replay: bool = False
    """Create megatron-core's RouterReplay hooks in every router."""
    use_te: bool | None = None
    """Use transformer-engine layers (unset: when installed and CUDA is present)."""
    recompute: str = "none"
    """Activation recomputation: none, or full (every layer, uniformly)."""
    kernels: LayerKernels = field(default_factory=LayerKernels)
    """Core attention and expert path (resolved: :func:`~tim_megatron.trainer.attention.resolve_attention`,
    :func:`~tim_megatron.trainer.experts.resolve_experts`)."""


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def apex_available() -> bool:
    """NVIDIA Apex (not the unrelated PyPI project 'apex'): detected by its CUDA extension modules."""
    try:
        import apex.normalization  # noqa: F401
        import fused_layer_norm_cuda  # noqa: F401
    except Exception:
        return False
    return True


def recompute_kwargs(mode: str) -> dict:
    if mode == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    return {}


def transformer_config(
    dims: ModelDims,
    model_cfg: ModelConfig,
    parallel: ParallelismConfig,
    opts: BuildOptions,
):
    from tim_megatron.trainer.families import get_family

    on_gpu = torch.cuda.is_available()
    dtype = DTYPES[opts.dtype]
    dispatcher = resolve_dispatcher(opts.dispatcher, on_gpu=on_gpu)
    arch = get_family(dims.resolved_family).transformer_config(dims)
    run = {}
    if dims.is_moe:
        run = dict(
            moe_router_load_balancing_type="aux_loss" if model_cfg.load_balancing == "aux_loss" else "none",
            moe_aux_loss_coeff=model_cfg.aux_loss_coeff if model_cfg.load_balancing == "aux_loss" else 0.0,
            moe_router_dtype=model_cfg.router_dtype,
            # indexed: built as allgather, then each layer's dispatcher is replaced (build_model)
            moe_token_dispatcher_type="allgather" if dispatcher == "indexed" else dispatcher,
            # megatron-core's own grouped experts stay off with or without transformer-engine: the grouped path
            # (tim_megatron/trainer/experts.py) is stacked expert weights run as grouped GEMMs
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
            moe_enable_routing_replay=opts.routing_replay,
            expert_model_parallel_size=parallel.ep,
            expert_tensor_parallel_size=parallel.etp,
        )
    config_class = attention_kind(dims).config_class()
    # the family's architecture may override plain_layers' defaults (gpt-oss: biases, its clamped SwiGLU)
    layers = {**plain_layers(), **{k: arch.pop(k) for k in list(arch) if k in plain_layers()}}
    config = config_class(
        num_layers=dims.num_layers,
        hidden_size=dims.hidden_size,
        num_attention_heads=dims.num_attention_heads,
        num_query_groups=dims.num_key_value_heads,
        kv_channels=dims.head_dim,
        layernorm_epsilon=dims.rms_norm_eps,
        **layers,
        use_cpu_initialization=not on_gpu,
        perform_initialization=False,  # every weight is loaded from the HF checkpoint
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        sequence_parallel=parallel.tp > 1,
        calculate_per_token_loss=True,  # our losses are pre-normalized by global denominators: sum grads over DP
        **recompute_kwargs(opts.recompute),
        **arch,
        **attention_features(dims),
        **run,
    )
    for name, value in yarn_attributes(dims).items():
        setattr(config, name, value)
    return config


def attention_features(dims: ModelDims) -> dict:
    """megatron-core config arguments of attention sinks and sliding windows (gpt-oss): a learned sink logit per
    head (``softmax_type = learnable``: ``DotProductAttention.softmax_offset``), and a window of
    ``sliding_window`` tokens (the query and the ``sliding_window - 1`` before it) in layers 0, 2, ... (megatron's
    1-based layer numbers not divisible by 2)."""
    kw: dict = {}
    if dims.attention_sinks:
        kw["softmax_type"] = "learnable"
    if dims.sliding_window:
        kw.update(window_size=(dims.sliding_window - 1, 0), window_attn_skip_freq=2)
    return kw


def yarn_attributes(dims: ModelDims) -> dict:
    """YaRN for ordinary (non-latent) attention: megatron-core's ``GPTModel`` builds ``YarnRotaryEmbedding`` from
    these attributes of its config, and ``SelfAttention`` scales the rotated query and key by YaRN's concentration
    factor from them; a plain ``TransformerConfig`` has no such fields, so they are set on it after construction.
    Latent attention reads its own (``MLATransformerConfig``)."""
    if dims.rope_scaling != "yarn" or attention_kind(dims).latent:
        return {}
    return dict(
        yarn_rotary_scaling_factor=dims.yarn_factor,
        yarn_original_max_position_embeddings=dims.yarn_original_max_position_embeddings,
        yarn_beta_fast=dims.yarn_beta_fast,
        yarn_beta_slow=dims.yarn_beta_slow,
        yarn_mscale=dims.yarn_mscale,
        yarn_mscale_all_dim=dims.yarn_mscale_all_dim,
        yarn_correction_range_round_to_int=dims.yarn_truncate,
    )


def plain_layers() -> dict:
    """megatron-core config arguments every model here shares: RMSNorm, a SwiGLU MLP without biases, no dropout,
    none of megatron's fused kernels (they need transformer-engine or apex, and round differently from the
    rollout engine's), softmax in float32."""
    return dict(
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
    )


def block_spec(dims: ModelDims, use_te: bool, kernels: LayerKernels = LayerKernels()):
    """The decoder's layer specs (from the family) and its final norm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from tim_megatron.trainer.families import get_family

    if use_te:
        attention_kind(dims).check_with_te(dims)
    specs = get_family(dims.resolved_family).layer_specs(dims, use_te, kernels=kernels)
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        final = TENorm
    else:
        final = SequenceParallelRMSNorm
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=final)


def build_model(dims: ModelDims, model_cfg: ModelConfig, parallel: ParallelismConfig, opts: BuildOptions):
    """The bare ``GPTModel`` (no DDP or Float16 wrappers) on this rank, weights uninitialized."""
    from megatron.core.models.gpt import GPTModel

    use_te = te_available() if opts.use_te is None else opts.use_te
    config = transformer_config(dims, model_cfg, parallel, opts)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(dims, use_te, opts.kernels),
        vocab_size=dims.vocab_size,
        max_sequence_length=dims.max_position_embeddings,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=dims.tie_word_embeddings,
        position_embedding_type="yarn" if yarn_attributes(dims) else "rope",
        rotary_base=int(dims.rope_theta) if float(dims.rope_theta).is_integer() else dims.rope_theta,
        rotary_percent=dims.partial_rotary_factor,
        parallel_output=True,
    )
    if dims.is_moe and resolve_dispatcher(opts.dispatcher, on_gpu=torch.cuda.is_available()) == "indexed":
        indexed_dispatcher.install(model, indexed_dispatcher_class())
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if model_cfg.freeze_router:
        for name, p in model.named_parameters():
            if name.endswith("mlp.router.weight"):
                p.requires_grad_(False)
    return model


@contextlib.contextmanager
def _stop_before_head(gpt):
    # GPTModel._postprocess returns the decoder output (final norm applied) when post_process is False.
    old = gpt.post_process
    gpt.post_process = False
    try:
        yield
    finally:
        gpt.post_process = old


def causal_mask(seq_len: int, device) -> torch.Tensor:
    """megatron's boolean mask convention: True = masked out."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1).view(
        1, 1, seq_len, seq_len
    )


def final_hidden_states(
    model, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Run the (wrapped) model to the final norm: ``[seq(/tp with SP), batch, hidden]``. The causal mask is
    given as a tensor only to a core attention that needs one (the materialized one); the fused ones take it from
    the mask type, which lets flash attention run."""
    gpt = unwrap(model)
    if position_ids is None:
        position_ids = (
            torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)
        )
    mask = causal_mask(input_ids.shape[1], input_ids.device) if uses_explicit_mask(gpt) else None
    with _stop_before_head(gpt):
        return model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask)
