"""Routed experts as two grouped GEMMs (``torch._grouped_mm``) instead of a loop over experts.

megatron-core's local ``SequentialMLP`` runs each expert's two GEMMs on the tokens routed to it, one expert after
another: at Qwen3-30B-A3B's layer shape (128 experts of width 768) on an H100 that is 0.7% of peak, where one
grouped GEMM over all experts (``torch._grouped_mm``, what torchtitan uses) reaches about 32%
(``../shared/gpu/layer_kernels.txt``). megatron-core's own grouped experts need transformer-engine
(``TEGroupedMLP``) or the ``grouped_gemm`` package (``GroupedMLP``).

:class:`GroupedExperts` is ``SequentialMLP`` with another forward. Its parameters are ``SequentialMLP``'s own
(``local_experts.{e}.linear_fc1.weight``, ``...linear_fc2.weight``), so the HF <-> Megatron weight mapping, the
weight sync to vLLM, ``export-hf``, offload and the distributed checkpoints (whose saved state is
``SequentialMLP``'s) are the same for both paths, and a checkpoint saved with one resumes with the other. The
forward runs fc1, the gated activation times the routing probabilities, and fc2 as two grouped GEMMs over the
tokens grouped by expert, as the dispatcher hands them over. Each grouped GEMM stacks this rank's expert weights
into one transient tensor (``num_local_experts x out x in``, in the forward and again in the backward:
:class:`_GroupedLinear`), so no stacked copy is held from the forward to the backward.

Which path runs is the trainer setting ``trainer.experts`` (:func:`resolve_experts`); exact mode keeps the loop,
whose per-expert GEMMs its row-invariant kernels replace.
"""

from __future__ import annotations

import functools

import torch

EXPERT_KERNELS = ("auto", "loop", "grouped")
"""Values of ``trainer.experts``."""


def grouped_mm_problem(
    *, device: torch.device | str, dtype: torch.dtype, widths: tuple[int, ...] = ()
) -> str:
    """Why ``torch._grouped_mm`` cannot run here ('' when it can): asked of the kernel itself on a tiny problem
    (its CUDA kernel takes bfloat16 on recent GPUs only; on CPU it runs in every float dtype); and ``widths`` (the
    GEMMs' inner sizes: hidden, an expert's width on this rank) must give rows of a multiple of 16 bytes, which
    the kernel requires of its strides."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    size = torch.tensor([], dtype=dtype).element_size()
    odd = [w for w in widths if (w * size) % 16]
    if odd:
        return (
            f"rows of {odd[0]} {dtype} values are not a multiple of 16 bytes (torch._grouped_mm needs widths that "
            f"are multiples of {16 // size} here)"
        )
    try:
        x = torch.ones(4, 16, device=device, dtype=dtype)
        w = torch.ones(2, 16, 16, device=device, dtype=dtype)
        offs = torch.tensor([2, 4], device=device, dtype=torch.int32)
        torch._grouped_mm(x, w, offs=offs)
    except Exception as e:  # the kernel's own refusal, named in the error
        first = (str(e).strip().splitlines() or [""])[0]
        return f"torch._grouped_mm refuses {dtype} on {device}: {type(e).__name__}: {first}"
    return ""


def resolve_experts(
    setting: str, *, exact: bool, dtype: torch.dtype, on_gpu: bool, widths: tuple[int, ...] = ()
) -> str:
    """The expert path a run builds: exact mode keeps the loop; ``auto`` takes the grouped GEMMs on CUDA where the
    kernel runs in the run's dtype and at the model's ``widths`` (:func:`grouped_mm_problem`), and the loop
    elsewhere (on CPU torch's grouped GEMM runs one GEMM per expert itself, so the gain is small and
    shape-dependent, ``make bench experts``; the project's CPU figures were measured on the loop); ``grouped``
    where the kernel cannot run is refused."""
    if setting not in EXPERT_KERNELS:
        raise ValueError(f"trainer.experts = {setting!r}; allowed: {', '.join(EXPERT_KERNELS)}")
    if exact:
        return "loop"
    if setting == "loop":
        return "loop"
    device = "cuda" if on_gpu else "cpu"
    problem = grouped_mm_problem(device=device, dtype=dtype, widths=widths)
    if setting == "auto":
        return "grouped" if on_gpu and not problem else "loop"
    if problem:
        raise ValueError(f"trainer.experts = grouped: {problem} (allowed here: loop, auto)")
    return "grouped"


class _GroupedLinear(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ weights[e]^T`` for every expert ``e`` as one grouped GEMM, without keeping a
    stacked copy of the weights for the backward pass: autograd would save ``torch.stack(weights)`` (a copy of
    every local expert's weight) per layer until the backward; here the weights are stacked again in the backward.
    The gradients are torch's own formulas for ``_grouped_mm``."""

    @staticmethod
    def forward(ctx, x, offs, *weights):
        ctx.save_for_backward(x, offs, *weights)
        return torch._grouped_mm(x, torch.stack(weights).transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, grad):
        x, offs, *weights = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad, torch.stack(weights), offs=offs)
        if any(ctx.needs_input_grad[2:]):
            grad_w = torch._grouped_mm(grad.t(), x, offs=offs).unbind(0)  # [E, out, in]: each one contiguous
        return grad_x, None, *(grad_w if grad_w is not None else [None] * len(weights))


def grouped_linear(
    x: torch.Tensor, weights: list[torch.Tensor], tokens_per_expert: torch.Tensor
) -> torch.Tensor:
    """``x``'s rows, grouped by expert (``tokens_per_expert`` of them each, in order), through their expert's
    ``[out, in]`` weight: one grouped GEMM (:class:`_GroupedLinear`)."""
    offs = torch.cumsum(tokens_per_expert.to(device=x.device), 0).to(torch.int32)
    return _GroupedLinear.apply(x, offs, *weights)


def _grouped_experts_class():
    from megatron.core.transformer.moe.experts import SequentialMLP

    class GroupedExperts(SequentialMLP):
        """``SequentialMLP``'s parameters and checkpoint layout, run as two grouped GEMMs (module docstring)."""

        def __init__(self, num_local_experts, config, submodules, pg_collection=None):
            super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)
            if config.add_bias_linear:
                raise ValueError(
                    "GroupedExperts: expert biases are not supported (add_bias_linear must be False)"
                )
            if config.fp8 or config.fp4:
                raise ValueError(
                    "GroupedExperts: fp8/fp4 expert GEMMs are not supported (use trainer.experts = loop)"
                )
            if not config.gated_linear_unit:
                raise ValueError("GroupedExperts: only gated (SwiGLU-style) experts are built")

        def _glu(self, x: torch.Tensor) -> torch.Tensor:
            # megatron-core's MLP.forward without fusions (config.bias_activation_fusion is off in this project)
            gate, linear = torch.chunk(x, 2, dim=-1)
            if (val := self.config.activation_func_clamp_value) is not None:
                gate = gate.clamp(min=None, max=val)
                linear = linear.clamp(min=-val, max=val)
            return self.config.activation_func(gate) * (linear + self.config.glu_linear_offset)

        def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
            x, probs = permuted_local_hidden_states, permuted_probs
            if self.config.moe_apply_probs_on_input:
                x = (probs.unsqueeze(-1) * x).to(x.dtype)
                probs = torch.ones_like(probs)
            w1 = [e.linear_fc1.weight for e in self.local_experts]  # [2 * width, hidden] each
            w2 = [e.linear_fc2.weight for e in self.local_experts]  # [hidden, width] each
            if (
                x.shape[0] == 0
            ):  # no token for this rank's experts: the grouped GEMM is not asked for zero rows
                h = (self._glu(x @ w1[0].t()) * probs.unsqueeze(-1)).to(x.dtype)
                return h @ w2[0].t() + 0.0 * sum(w.sum() for w in (*w1, *w2)), None
            h = grouped_linear(x, w1, tokens_per_expert)
            h = (self._glu(h) * probs.unsqueeze(-1)).to(h.dtype)
            return grouped_linear(h, w2, tokens_per_expert), None

    return GroupedExperts


@functools.cache
def grouped_experts_class():
    """The ``GroupedExperts`` class (built on first use: megatron-core is imported only then)."""
    return _grouped_experts_class()


def use_grouped_experts(spec) -> None:
    """Give an MoE layer spec (megatron-core's, with ``SequentialMLP`` experts) :class:`GroupedExperts` in their
    place; its submodules (the per-expert linear layers) stay as they are."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    experts = spec.submodules.mlp.submodules.experts
    if experts.module is not SequentialMLP:
        raise ValueError(
            f"grouped experts replace SequentialMLP; this layer spec has {experts.module.__name__}"
        )
    experts.module = grouped_experts_class()
