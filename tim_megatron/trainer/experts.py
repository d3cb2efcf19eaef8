"""Routed experts as two grouped GEMMs (``torch._grouped_mm``) over stacked expert weights, instead of a loop over
experts.

megatron-core's local ``SequentialMLP`` runs each expert's two GEMMs on the tokens routed to it, one expert after
another: at Qwen3-30B-A3B's layer shape (128 experts of width 768) on an H100 that is 0.7% of peak, where one
grouped GEMM over all experts (``torch._grouped_mm``, what torchtitan uses) reaches about 32%
(``../shared/gpu/layer_kernels.txt``). megatron-core's own grouped experts need transformer-engine
(``TEGroupedMLP``) or the ``grouped_gemm`` package (``GroupedMLP``).

:class:`StackedExperts` (the grouped path, ``trainer.experts = grouped``) holds one ``weight1``
``[local experts, 2 x width, hidden]`` (each expert's gated ``linear_fc1``: its gate rows, then its up rows) and one
``weight2`` ``[local experts, hidden, width]`` (each expert's ``linear_fc2``) per layer: this rank's experts, and
under expert tensor parallelism this rank's slice of each (``width`` = the expert's width / expert-TP). The grouped
GEMMs read them as they are (no stacking), and the backward gives each one gradient (one AccumulateGrad node, one
DDP hook, one add into the fp32 main gradient per tensor, where the per-expert layout had two per expert).

Expert ``e``'s weights are the views ``weight1[e]`` and ``weight2[e]``, laid out as ``SequentialMLP``'s
``local_experts.{e}.linear_fc1.weight`` and ``...linear_fc2.weight``. :func:`per_expert_parameters` gives the model's
parameters with each stacked weight as those views under the loop's names, so the HF <-> Megatron weight mapping
(``tim_megatron/trainer/weights/convert.py``), the weight sync to vLLM and ``export-hf`` (which read the mapping's
export) work on per-expert views, never copies. The distributed checkpoint (:meth:`StackedExperts.sharded_state_dict`)
is the loop's: per-expert sharded tensors under ``SequentialMLP``'s keys, with its expert axis, its gated-fc1 split
under TP and its replica ids, built by megatron-core's own helpers, as a factory that optimizer states go through
too; a checkpoint saved on one path loads on the other (weights, and optimizer states wherever the optimizer saves
them by parameter: the checkpoint format of megatron's distributed optimizer that this project uses,
``dp_reshardable``, saves them by gradient bucket, whose layout differs between the two paths, and such a resume
is refused by name: :func:`bucket_resume_problem`, docs/families.md).

Which path runs is the trainer setting ``trainer.experts`` (:func:`resolve_experts`); exact mode keeps the loop
(megatron-core's ``SequentialMLP``), whose per-expert GEMMs its row-invariant kernels replace.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator

import torch

EXPERT_KERNELS = ("auto", "loop", "grouped")
"""Values of ``trainer.experts``."""

STACKED = (("weight1", "linear_fc1", 0), ("weight2", "linear_fc2", 1))
"""Each stacked weight of :class:`StackedExperts`: its name, the loop's per-expert linear layer it stacks, and the
axis of that layer's weight that tensor parallelism splits (``SequentialMLP``'s column- and row-parallel layers)."""

_LOOP_EXTRA_STATE = re.compile(r"local_experts\.\d+\.linear_fc[12]\._extra_state$")
"""The loop's per-expert ``_extra_state`` entries, which a stacked module saves for the loop and ignores on load."""


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
    setting: str,
    *,
    exact: bool,
    dtype: torch.dtype,
    on_gpu: bool,
    widths: tuple[int, ...] = (),
    biases: bool = False,
    problem: Callable[..., str] | None = None,
) -> str:
    """The expert path a run builds: exact mode keeps the loop; ``auto`` takes the grouped GEMMs on CUDA where the
    kernel runs in the run's dtype and at the model's ``widths`` (:func:`grouped_mm_problem`), and the loop
    elsewhere (on CPU torch's grouped GEMM runs one GEMM per expert itself, so the gain is small and
    shape-dependent, ``make bench experts``; the project's CPU figures were measured on the loop); ``grouped``
    where the kernel cannot run is refused, and so is it for experts with ``biases`` (gpt-oss), which the stacked
    weights do not hold (``auto`` takes the loop). ``problem``: the grouped GEMM's check (default
    :func:`grouped_mm_problem`, the kernel's own probe)."""
    if setting not in EXPERT_KERNELS:
        raise ValueError(f"trainer.experts = {setting!r}; allowed: {', '.join(EXPERT_KERNELS)}")
    if biases and setting == "grouped":
        raise ValueError(
            "trainer.experts = grouped: the grouped experts have no biases (allowed here: loop, auto)"
        )
    if exact or biases:
        return "loop"
    if setting == "loop":
        return "loop"
    device = "cuda" if on_gpu else "cpu"
    problem = (problem or grouped_mm_problem)(device=device, dtype=dtype, widths=widths)
    if setting == "auto":
        return "grouped" if on_gpu and not problem else "loop"
    if problem:
        raise ValueError(f"trainer.experts = grouped: {problem} (allowed here: loop, auto)")
    return "grouped"


def weights_layout(experts: str) -> str:
    """How a run's routed-expert weights lie in megatron's parameter and gradient buffers, for the expert path
    ``experts`` (:func:`resolve_experts`): ``stacked`` (the grouped path) or ``per-expert`` (the loop)."""
    return "stacked" if experts == "grouped" else "per-expert"


def bucket_resume_problem(*, saved: str | None, current: str | None) -> str:
    """Why a checkpoint whose distributed-optimizer state was saved with the expert weights laid out ``saved``
    cannot resume a trainer whose are laid out ``current`` ('' when it can; None: no state by bucket on that side).

    megatron's distributed optimizer saves its state (Adam's moments, fp32 master weights) in the format this
    project uses (``dp_reshardable``) as flat gradient buckets, not per parameter: the bytes of one layout read
    into the other fill the experts' states with other experts' numbers, and nothing in megatron notices (the
    buckets hold as many numbers). The weights themselves resume across the two (per-expert sharded tensors)."""
    if saved is None or current is None or saved == current:
        return ""
    path = {"stacked": "grouped", "per-expert": "loop"}
    return (
        f"its optimizer state was saved by megatron's distributed optimizer with {saved} expert weights "
        f"(trainer.experts = {path.get(saved, '?')}), and this run has {current} ones (trainer.experts = "
        f"{path.get(current, '?')}); that state is saved by gradient bucket, whose layout differs between the two, "
        f"so it cannot be read into this run's. Resume with trainer.experts = {path.get(saved, '?')} (the recorded "
        "layout), or from a checkpoint saved that way"
    )


class _GroupedLinear(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ weight[e]^T`` for every expert ``e`` as one grouped GEMM over the stacked
    ``[experts, out, in]`` weight. What the backward keeps is the input and the weight itself (no copy); the
    weight's gradient comes out ``[experts, out, in]`` and contiguous, the weight's own layout (torch's own formulas
    for ``_grouped_mm``, which would give it transposed)."""

    @staticmethod
    def forward(ctx, x, offs, weight):
        ctx.save_for_backward(x, offs, weight)
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, grad):
        x, offs, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad, weight, offs=offs)
        if ctx.needs_input_grad[2]:
            grad_w = torch._grouped_mm(
                grad.t(), x, offs=offs
            )  # [E, out, in]; an expert with no row gets zeros
        return grad_x, None, grad_w


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``x``'s rows, grouped by expert (``tokens_per_expert`` of them each, in order), through their expert's
    ``[out, in]`` slice of the stacked ``weight`` ``[experts, out, in]``: one grouped GEMM (:class:`_GroupedLinear`)."""
    offs = torch.cumsum(tokens_per_expert.to(device=x.device), 0).to(torch.int32)
    return _GroupedLinear.apply(x, offs, weight)


def expert_views(weight: torch.Tensor) -> list[torch.Tensor]:
    """Each expert's ``[out, in]`` view of a stacked weight (no copy), carrying as ``main_grad`` its view of the
    weight's gradient (megatron's ``main_grad``, else ``.grad``) when the weight has one."""
    grad = getattr(weight, "main_grad", None)
    if grad is None:
        grad = weight.grad
    views = []
    for e in range(weight.shape[0]):
        v = weight.detach()[e]
        if grad is not None:
            v.main_grad = grad[e]
        views.append(v)
    return views


def per_expert_parameters(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``module.named_parameters()``, with each :class:`StackedExperts` weight given as its experts' views
    (:func:`expert_views`) under ``SequentialMLP``'s names (``...experts.local_experts.{e}.linear_fc1.weight``)."""
    cls = stacked_experts_class()
    stacked: dict[str, tuple[str, str]] = {}
    for mname, m in module.named_modules():
        if isinstance(m, cls):
            for attr, linear, _ in STACKED:
                stacked[f"{mname}.{attr}" if mname else attr] = (f"{mname}." if mname else "", linear)
    for name, p in module.named_parameters():
        hit = stacked.get(name)
        if hit is None:
            yield name, p
            continue
        head, linear = hit
        for e, view in enumerate(expert_views(p)):
            yield f"{head}local_experts.{e}.{linear}.weight", view


def _stacked_experts_class():
    from dataclasses import replace
    from functools import partial

    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        get_expert_parallel_rng_tracker_name,
    )
    from megatron.core.tensor_parallel.utils import divide
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.utils import (
        ensure_metadata_has_dp_cp_group,
        make_sharded_tensors_for_checkpoint,
    )

    class StackedExperts(MegatronModule):
        """This rank's routed experts as two stacked weights run by two grouped GEMMs; the loop's checkpoint
        layout (module docstring). Built in place of ``SequentialMLP`` by :func:`use_grouped_experts`."""

        def __init__(self, num_local_experts, config, submodules=None, pg_collection=None):
            super().__init__(config=config)
            if config.add_bias_linear:
                raise ValueError(
                    "StackedExperts: expert biases are not supported (add_bias_linear must be False)"
                )
            if config.fp8 or config.fp4:
                raise ValueError(
                    "StackedExperts: fp8/fp4 expert GEMMs are not supported (use trainer.experts = loop)"
                )
            if not config.gated_linear_unit:
                raise ValueError("StackedExperts: only gated (SwiGLU-style) experts are built")
            if getattr(config, "moe_latent_size", None) is not None:
                raise ValueError(
                    f"StackedExperts: moe_latent_size = {config.moe_latent_size} is not supported (allowed: None)"
                )
            if pg_collection is None:
                raise ValueError(
                    "StackedExperts: pg_collection is required (megatron-core's MoE layer gives it)"
                )
            self.num_local_experts = num_local_experts
            self.ep_group = pg_collection.ep
            self.tp_group = pg_collection.expt_tp
            self.dp_group = pg_collection.expt_dp
            self.width = divide(config.moe_ffn_hidden_size, self.tp_group.size())
            """An expert's width on this rank (its slice under expert tensor parallelism)."""
            device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
            shapes = {
                "weight1": (num_local_experts, 2 * self.width, config.hidden_size),
                "weight2": (num_local_experts, config.hidden_size, self.width),
            }
            expert_parallel = config.expert_model_parallel_size > 1
            for attr, _, axis in STACKED:
                w = torch.nn.Parameter(torch.empty(shapes[attr], dtype=config.params_dtype, device=device))
                # the attributes SequentialMLP's expert linear layers give their weights, the split axis one
                # further in (behind the expert axis): megatron's DDP, optimizer and grad norm read them
                stride = 2 if attr == "weight1" else 1  # a gated fc1 is split per half (gate, up)
                set_tensor_model_parallel_attributes(w, is_parallel=True, dim=axis + 1, stride=stride)
                w.allreduce = not expert_parallel
                setattr(self, attr, w)
            if config.perform_initialization:
                self._initialize()

        @torch.no_grad()
        def _initialize(self):
            """A random initialization (the project loads every weight): each expert's slice drawn with the
            weights' init methods, on CUDA under megatron's expert-parallel RNG stream."""
            methods = {"weight1": self.config.init_method, "weight2": self.config.output_layer_init_method}
            for attr, _, _ in STACKED:
                w = getattr(self, attr)
                for e in range(self.num_local_experts):
                    if w.is_cuda:
                        with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                            methods[attr](w[e])
                    else:
                        methods[attr](w[e])

        glu_probs_fn = None
        """The slot :mod:`tim_megatron.trainer.compile` sets on an instance (the compiled ``glu_probs``) where the
        activation is SiLU without clamp or offset; unset, the eager ``_glu`` runs."""

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
            if x.shape[0] == 0:
                # no token for this rank's experts: the grouped GEMM is not asked for zero rows; both weights
                # still get a (zero) gradient, as megatron's grouped experts give them
                h = (self._glu(x @ self.weight1[0].t()) * probs.unsqueeze(-1)).to(x.dtype)
                return h @ self.weight2[0].t(), None
            if self.weight1.is_cuda and (self.weight1.data_ptr() % 16 or self.weight2.data_ptr() % 16):
                raise RuntimeError(
                    "StackedExperts: a stacked expert weight does not start on a 16-byte boundary, which "
                    "torch._grouped_mm requires on CUDA (megatron's distributed optimizer, the CUDA default, aligns "
                    "every parameter: set trainer.distributed_optimizer = true, or trainer.experts = loop)"
                )
            h = grouped_linear(x, self.weight1, tokens_per_expert)
            fused = self.__dict__.get(
                "glu_probs_fn"
            )  # the compiled glu_probs, set on the instance where it fits
            h = fused(h, probs) if fused is not None else (self._glu(h) * probs.unsqueeze(-1)).to(h.dtype)
            return grouped_linear(h, self.weight2, tokens_per_expert), None

        def backward_dw(self):
            """No delayed weight gradients (the interface of megatron-core's expert modules)."""

        # ------------------------------------------------------------------------------- checkpoints

        def _expert_offsets(self, sharded_offsets: tuple, singleton: bool, e: int) -> tuple:
            """``SequentialMLP``'s sharded offsets of local expert ``e``: the global expert axis in front."""
            if singleton:
                return tuple(sharded_offsets)
            n_global = self.ep_group.size() * self.num_local_experts
            g = self.ep_group.rank() * self.num_local_experts + e
            return (*sharded_offsets, (len(sharded_offsets), g, n_global))

        def _loop_key(self, head: str, linear: str, e: int, singleton: bool) -> str:
            """The key ``SequentialMLP`` saves local expert ``e``'s ``linear`` weight under (``head``: what comes
            before ``experts.``: the module's prefix, and an optimizer's state prefix)."""
            if not singleton:
                return f"{head}experts.{linear}.weight"
            return f"{head}experts.{self.ep_group.rank() * self.num_local_experts + e}.{linear}.weight"

        def _expert_shards(
            self, key, t, replica_id, flattened_range, *, linear, axis, sharded_offsets, metadata
        ):
            """The ``ShardedTensorFactory`` build: ``t`` (a stacked weight, or an optimizer state of its shape) as
            the loop's per-expert sharded tensors, each made as ``SequentialMLP`` makes it (megatron's own
            helpers; a gated fc1 split into its gate and up halves), with ``replica_id`` (the one an optimizer
            gives its state)."""
            if flattened_range is not None:
                raise NotImplementedError(
                    f"{key}: a flattened range of stacked expert weights is not supported (a checkpoint format "
                    "that saves parameters by parameter or by bucket is: fully_reshardable, dp_reshardable)"
                )
            tail = f"experts.{linear}.weight"
            if not key.endswith(tail):
                raise ValueError(f"StackedExperts: sharded key {key!r} does not end in {tail!r}")
            head = key[: -len(tail)]
            singleton = metadata.get("singleton_local_shards", False)
            shards = []
            for e in range(self.num_local_experts):
                offsets = self._expert_offsets(sharded_offsets, singleton, e)
                name = self._loop_key(head, linear, e, singleton)
                prefix = name[: -len("weight")]
                sh = make_sharded_tensors_for_checkpoint(
                    {"weight": t[e]},
                    prefix,
                    {"weight": axis},
                    offsets,
                    tp_group=self.tp_group,
                    dp_cp_group=metadata["dp_cp_group"],
                )[name]
                sh = replace(sh, replica_id=replica_id)
                if linear == "linear_fc1":  # MLP.sharded_state_dict's gated fc1
                    shards.append(apply_swiglu_sharded_factory(sh, offsets, singleton).build())
                else:
                    shards.append(sh)
            return shards

        @staticmethod
        def _merge_experts(loaded, *, linear):
            """The ``ShardedTensorFactory`` merge: the loaded per-expert tensors stacked back."""
            with torch.no_grad():
                if linear == "linear_fc1":
                    return torch.stack([torch.cat(halves) for halves in loaded])
                return torch.stack(loaded)

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            """``SequentialMLP``'s sharded state: each stacked weight a factory that builds the loop's per-expert
            sharded tensors (and merges them back on load), and the loop's per-expert ``_extra_state`` objects."""
            metadata = ensure_metadata_has_dp_cp_group(metadata)
            singleton = metadata.get("singleton_local_shards", False)
            out = {}
            for attr, linear, axis in STACKED:
                w = getattr(self, attr)
                # SequentialMLP's replica id: its linear layer's, replicated over the expert-data-parallel ranks
                name = self._loop_key(prefix, linear, 0, singleton)
                first = make_sharded_tensors_for_checkpoint(
                    {"weight": w[0]},
                    name[: -len("weight")],
                    {"weight": axis},
                    self._expert_offsets(sharded_offsets, singleton, 0),
                    tp_group=self.tp_group,
                    dp_cp_group=metadata["dp_cp_group"],
                )[name]
                replica_id = (*first.replica_id[:2], self.dp_group.rank())
                out[f"{prefix}{attr}"] = ShardedTensorFactory(
                    f"{prefix}experts.{linear}.weight",
                    w,
                    partial(
                        self._expert_shards,
                        linear=linear,
                        axis=axis,
                        sharded_offsets=tuple(sharded_offsets),
                        metadata=metadata,
                    ),
                    partial(self._merge_experts, linear=linear),
                    replica_id,
                )
                for e in range(self.num_local_experts):  # the loop's linear layers' (empty) extra state
                    name = self._loop_key(prefix, linear, e, singleton)
                    extra = make_sharded_tensors_for_checkpoint(
                        {"_extra_state": None},
                        name[: -len("weight")],
                        {},
                        self._expert_offsets(sharded_offsets, singleton, e),
                        tp_group=self.tp_group,
                        dp_cp_group=metadata["dp_cp_group"],
                    )[f"{name[: -len('weight')]}_extra_state"]
                    extra.replica_id = (*extra.replica_id[:2], self.dp_group.rank())
                    out[f"{prefix}local_experts.{e}.{linear}._extra_state"] = extra
            return out

        def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
            for k in [k for k in state_dict if k.startswith(prefix) and _LOOP_EXTRA_STATE.search(k)]:
                del state_dict[k]  # saved for the loop (SequentialMLP's linear layers keep nothing in them)
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    return StackedExperts


@functools.cache
def stacked_experts_class():
    """The ``StackedExperts`` class (built on first use: megatron-core is imported only then)."""
    return _stacked_experts_class()


def use_grouped_experts(spec) -> None:
    """Give an MoE layer spec (megatron-core's, with ``SequentialMLP`` experts) :class:`StackedExperts` in their
    place (its per-expert linear submodules are not built)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    experts = spec.submodules.mlp.submodules.experts
    if experts.module is not SequentialMLP:
        raise ValueError(
            f"grouped experts replace SequentialMLP; this layer spec has {experts.module.__name__}"
        )
    experts.module = stacked_experts_class()
