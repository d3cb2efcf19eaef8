"""Reduce the gradient of MLA's rotated key across tensor-parallel ranks.

megatron-core 0.16.1's ``MLASelfAttention`` with its local (column-parallel) ``linear_kv_down_proj`` gathers the
projection's slices with ``gather_from_tensor_model_parallel_region`` and splits the result into the compressed
latent and the decoupled RoPE key (``k_pos_emb``). That key is one head shared by every query head, and each
tensor-parallel rank uses it only for its own heads, so each rank's gradient of it is a partial sum. The gather's
backward keeps only the rank's own slice of that partial gradient: nothing adds the other ranks' parts. The
latent is fine (it feeds the column-parallel ``linear_kv_up_proj``, whose input gradient is all-reduced), so the
error is in the RoPE key alone. Measured on the tiny DeepSeek-V3 at TP=2: the forward is exact, and the gradients
of everything below the first MLA layer's key projection (the embedding, ``linear_kv_down_proj``,
``linear_q_down_proj``, the input norm) are off by about 4e-2 against one process.

The patch: while an ``MLASelfAttention`` computes its query, key and value, the module's
``gather_from_tensor_model_parallel_region`` passes the RoPE key columns of the gathered latent through
:class:`_SumGradOverTP` (forward: identity; backward: all-reduce over the tensor-parallel group). The forward is
unchanged. megatron-core's own ``copy_to_tensor_model_parallel_region`` does not serve here: its backward
all-reduces ``grad.contiguous()`` and returns ``grad``, so for the non-contiguous gradient of a column slice the
sum lands in a copy that is thrown away. Needed when a model with MLA runs with ``parallel.tp`` > 1.
"""

from __future__ import annotations

from contextvars import ContextVar

from patches.guard import Handle, check_version, set_attr
from patches.specs import megatron_core_patch

SPEC = megatron_core_patch(
    name="megatron-mla-tp-rope-grad",
    reason="MLA's column-parallel kv down-projection never sums the RoPE key's gradient across TP ranks.",
    targets=(
        "megatron.core.transformer.multi_latent_attention.MLASelfAttention.get_query_key_value_tensors",
        "megatron.core.transformer.multi_latent_attention.gather_from_tensor_model_parallel_region",
    ),
)

_WIDTHS: ContextVar[tuple[int, int] | None] = ContextVar("mla_latent_and_rope_widths", default=None)
"""(kv_lora_rank, qk_pos_emb_head_dim) of the attention whose query, key and value are being computed."""


def apply() -> Handle:
    """Patch MLA's query/key/value step; the trainer applies it to a model with MLA when ``parallel.tp`` > 1."""
    check_version(SPEC)
    import megatron.core.transformer.multi_latent_attention as mla
    import torch
    from megatron.core.parallel_state import get_tensor_model_parallel_group

    class _SumGradOverTP(torch.autograd.Function):
        """Identity forward; backward: the gradient summed over the tensor-parallel group."""

        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous()
            torch.distributed.all_reduce(grad, group=ctx.group)
            return grad, None

    gather = mla.gather_from_tensor_model_parallel_region
    qkv = mla.MLASelfAttention.get_query_key_value_tensors

    def gather_reducing_rope_grad(input_, group=None):
        out = gather(input_, group)
        widths = _WIDTHS.get()
        if widths is None or out.size(-1) != sum(widths):
            return out  # the query latent, or a call from outside an MLA's query/key/value
        latent, rope = torch.split(out, list(widths), dim=-1)
        tp_group = group if group is not None else get_tensor_model_parallel_group()
        return torch.cat([latent, _SumGradOverTP.apply(rope, tp_group)], dim=-1)

    def get_query_key_value_tensors(self, *args, **kwargs):
        c = self.config
        widths = (c.kv_lora_rank, c.qk_pos_emb_head_dim)
        if c.q_lora_rank is not None and c.q_lora_rank == sum(widths):
            raise RuntimeError(
                f"{SPEC.name}: q_lora_rank = {c.q_lora_rank} equals kv_lora_rank + qk_pos_emb_head_dim, so the "
                "query latent's gather cannot be told from the key's; this shape is not verified"
            )
        token = _WIDTHS.set(widths)
        try:
            return qkv(self, *args, **kwargs)
        finally:
            _WIDTHS.reset(token)

    h = Handle(SPEC.name)
    set_attr(h, mla, "gather_from_tensor_model_parallel_region", gather_reducing_rope_grad)
    set_attr(h, mla.MLASelfAttention, "get_query_key_value_tensors", get_query_key_value_tensors)
    return h
