"""Per-GPU memory estimate for a recipe, and the layout search ``make new-recipe`` makes with it.

The estimate, per GPU (bytes; all numbers are upper-bound style, documented so they can be argued with):

* parameters: dense params / tp, plus routed-expert params / (ep x expert_tp), in the trainer dtype
  (2 bytes for bf16/fp16, 4 for fp32); the parameter count comes from the model's family
  (:mod:`tim_megatron.trainer.families`, checked against transformers by the tests);
* gradients: the same counts in float32 (megatron's grad buffers reduce in fp32);
* optimizer: Adam's fp32 master copy, first and second moments (12 bytes per parameter), divided by the
  data-parallel size (dense) or expert-data-parallel size (experts) with the distributed optimizer;
* activations, for one micro-batch of ``trainer.micro_batch_size`` sequences of ``rollout.max_model_len``
  tokens: per layer ``34 x s x b x h / tp`` bytes (Korthikanti et al.'s count with sequence parallelism), plus
  ``5 x heads x s^2 x b / tp`` for materialized attention scores on CPU, or on GPU without transformer-engine
  (its fused attention keeps none);
  with ``trainer.recompute: full`` only each layer's input is kept (``2 x s x b x h / tp`` per layer) plus one
  layer's full set during its recomputation; plus the LM head's one chunk (``logprob_chunk x b x vocab / tp``
  logits, 8 bytes each: the float32 logits, the 16-bit GEMM output they come from and, in the backward, their
  16-bit gradient) and one chunk's head-weight gradient (``vocab / tp x h`` in the trainer dtype, added into the
  fp32 gradient buffer);
* the optimizer step's transient, when it runs after the backward's activations are gone (so the update's peak is
  the larger of the two): torch's foreach AdamW (``trainer.optimizer_kernel: foreach``, and ``auto`` on CPU)
  allocates 4 bytes per parameter the rank steps; the fused kernel (``auto`` on GPUs) none;
* vLLM: the weights in the rollout dtype (whole model / rollout.tensor_parallel_size) and the KV cache it
  reserves: vLLM takes ``gpu_memory_utilization`` x GPU memory and fills what its weights leave with KV cache.
  The plan asks for room for at least one GRPO group there (``rollout.n`` sequences of ``rollout.max_model_len``
  tokens; K and V of every layer, a GPU holding ``max(kv_heads / rollout TP, 1)`` heads).

Two phases share the GPU. While vLLM holds its share, the trainer keeps on the GPU what
``trainer.offload_during_rollout`` does not move to host memory (``optimizer``: Adam's moments and fp32 master
copy; ``optimizer+grads``: and the fp32 gradient buffers; ``all``: and the parameters). The parameters leave
(with ``all``) only after the weight sync has been checked, and by then the KV cache is back: so during the sync the
parameters are resident beside vLLM's whole share, and that moment sets the rollout phase's peak. During the
update everything is back, the activations join, and vLLM's share leaves only with ``rollout.sleep_between_steps``.
The plan's total is the larger phase; it fits within 95% of the GPU.

:func:`largest_utilization` is the vLLM share the free memory allows; ``tim plan`` prints it beside the recipe's
own ``rollout.gpu_memory_utilization`` (the job always uses the recipe's value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tim_megatron.attention_kinds import attention_kind
from tim_megatron.modes import modes_of, rollout_backend
from tim_megatron.recipe.schema import GPU_MEMORY_GIB, ModelDims, Recipe

GIB = 2**30
HEADROOM = 0.95
"""Fraction of GPU memory a plan may use (the rest: CUDA context, NCCL buffers, fragmentation)."""
MAX_NODES = 128
"""The layout search's largest cluster."""
USUAL_MAX_ROLLOUT_TP = 16
"""Largest vLLM tensor-parallel size the search tries first (beyond one node it needs a multi-node vLLM engine)."""
MAX_ROLLOUT_TP = 64
"""Largest vLLM tensor-parallel size the search tries when nothing fits with :data:`USUAL_MAX_ROLLOUT_TP` (a bf16
DeepSeek-V3 is 1.25 TiB of weights: 78 GiB per GPU at 16, 20 GiB at 64)."""
MAX_GPU_MEMORY_UTILIZATION = 0.9
"""Largest vLLM memory share the search sets, and the largest :func:`largest_utilization` proposes."""
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def param_count(d: ModelDims):
    """The model's parameter counts (total, active, routed experts), from its family."""
    from tim_megatron.trainer.families import get_family

    return get_family(d.resolved_family).params(d)


def split_params(d: ModelDims) -> tuple[int, int]:
    """(dense, routed-expert) parameter counts, from the model's family."""
    c = param_count(d)
    return c.dense, c.routed_experts


def kv_cache_bytes_per_token(d: ModelDims, *, rollout_tp: int, dtype: str) -> float:
    """K and V of every layer for one token on one vLLM GPU (KV heads are replicated when TP exceeds them). With
    multi-head latent attention the cache holds one compressed latent and the shared rotated key per layer,
    ``kv_lora_rank + qk_rope_head_dim`` wide, on every TP rank."""
    return attention_kind(d).kv_cache_bytes_per_token(d, rollout_tp=rollout_tp, dtype_bytes=_BYTES[dtype])


@dataclass(frozen=True)
class ExactCache:
    """The exact sampler's KV cache on one data-parallel rank (:mod:`tim_megatron.exact.kv_cache`), were the
    recipe run with ``diagnostics.vexact = exact``."""

    rows: int
    """Sequences the rank generates: its share of ``prompts_per_step x n``."""
    width: int
    """Positions per row: the longest prompt plus the budget (the old-logprob pass's width)."""
    cache: int
    """Bytes of keys and values per GPU, in the model's dtype (as the training forward holds them);
    also what one decode step reads in place with every row live (a per-step gather of the rows would copy twice
    that: the gather, then the heads' reshape)."""


def exact_cache(recipe: Recipe, *, tp: int | None = None, dp: int | None = None) -> ExactCache | None:
    """:class:`ExactCache` for ``recipe`` at its layout, or at another tensor- and data-parallel size (the layout
    :func:`estimate` tries); None for latent attention, which exact mode does not cache."""
    from tim_megatron.exact.kv_cache import cache_bytes

    d, r, p = recipe.model.dims, recipe.rollout, recipe.parallel
    if not attention_kind(d).exact_cache:
        return None
    tp, dp = tp or p.tp, dp or p.dp
    rows = math.ceil(recipe.data.prompts_per_step * r.n / max(dp, 1))
    width = recipe.data.max_prompt_tokens + r.max_tokens
    total = cache_bytes(
        rows=rows,
        width=width,
        layers=d.num_layers,
        groups=max(math.ceil(d.num_key_value_heads / tp), 1),
        head_dim=d.head_dim,
        dtype_bytes=_BYTES[recipe.trainer_dtype],  # the model's dtype, as the training forward holds them
    )
    return ExactCache(rows, width, total)


def dispatch_fanout(d: ModelDims, *, ep: int) -> tuple[int, int]:
    """How many expert-parallel ranks one token's top-k experts can sit on: (with the model's group-limited routing,
    without it). Experts are laid out in order, ``num_experts / ep`` per rank, and group ``g`` is experts
    ``[g E / n_group, (g + 1) E / n_group)``: the token's experts lie in ``topk_group`` groups, which span
    ``ep / n_group`` ranks each (or share ranks, when a rank holds whole groups). DeepSeek-V3 ties its 8 groups to
    its 8 training nodes so that each token reaches at most 4 of them; a layout with another EP spreads a group over
    more ranks or packs groups together."""
    free = min(d.num_experts_per_tok, ep)
    if d.router_groups <= 1:
        return free, free
    span = ep // d.router_groups if ep >= d.router_groups else 1
    return min(d.num_experts_per_tok, d.router_group_topk * span, ep), free


@dataclass
class Plan:
    params: float
    grads: float
    optimizer: float
    activations: float
    vllm_weights: float
    vllm_kv_cache: float
    gpu_gib: float
    vllm_share: float = 0.0
    """gpu_memory_utilization x GPU memory: what vLLM takes (its weights, then KV cache)."""
    kv_needed: float = 0.0
    """KV cache for one GRPO group of full-length sequences."""
    sleep: bool = False
    """vLLM's share leaves the GPU during the update (rollout.sleep_between_steps)."""
    rollout_tp: int = 1
    gpu_memory_utilization: float = 0.0
    layout: list[str] = field(default_factory=list)
    """Why the recipe's ranks cannot be placed on its cluster (the job script would be refused); empty when they
    can, and always empty for a layout the search proposes (its ranks are derived from the node count)."""
    offload: str = "none"
    """``trainer.offload_during_rollout`` the plan assumes."""
    offloaded: tuple[str, ...] = ()
    """The parts it moves to host memory while vLLM generates (``params``, ``grads``, ``optimizer``)."""
    step_transient: float = 0.0
    """What the optimizer step allocates beyond its state (foreach AdamW: 4 bytes per parameter it steps), alive
    after the backward's activations are freed."""

    @property
    def trainer_state(self) -> float:
        return self.params + self.grads + self.optimizer

    def _kept(self, *, also: tuple[str, ...] = ()) -> float:
        parts = {"params": self.params, "grads": self.grads, "optimizer": self.optimizer}
        return sum(v for k, v in parts.items() if k not in self.offloaded or k in also)

    @property
    def generating_state(self) -> float:
        """The trainer's bytes on the GPU while vLLM generates."""
        return self._kept()

    @property
    def sync_state(self) -> float:
        """The trainer's bytes on the GPU beside vLLM's whole share: during the weight sync and its check the
        parameters are still there (``all`` moves them only afterwards)."""
        return self._kept(also=("params",))

    @property
    def offloaded_bytes(self) -> float:
        """What goes to host memory after the update and comes back before the next one."""
        return self.trainer_state - self.generating_state

    @property
    def vllm_resident(self) -> float:
        return max(self.vllm_share, self.vllm_weights)

    @property
    def rollout_phase(self) -> float:
        return self.sync_state + self.vllm_resident

    @property
    def update_phase(self) -> float:
        return self.trainer + (0.0 if self.sleep else self.vllm_resident)

    @property
    def trainer(self) -> float:
        """The update's peak: the state, and the larger of the backward's activations and the optimizer step's
        transient (the step runs once the activations are freed)."""
        return self.trainer_state + max(self.activations, self.step_transient)

    @property
    def total(self) -> float:
        return max(self.rollout_phase, self.update_phase)

    @property
    def budget(self) -> float:
        return HEADROOM * self.gpu_gib * GIB

    @property
    def fits(self) -> bool:
        """The job can start with this layout (its ranks fill the nodes) and, on GPUs, its memory fits."""
        return not self.problems()

    def problems(self) -> list[str]:
        """Why the plan does not fit, one reason per line (empty when it fits)."""
        out = list(self.layout)
        if self.gpu_gib == 0:
            return out
        g = GIB
        if self.vllm_weights >= self.vllm_share:
            out.append(
                f"vLLM weights {self.vllm_weights / g:.1f} GiB (rollout TP {self.rollout_tp}) exceed its share "
                f"rollout.gpu_memory_utilization {self.gpu_memory_utilization:g} x {self.gpu_gib} GiB = "
                f"{self.vllm_share / g:.1f} GiB: no room for a KV cache"
            )
        elif self.vllm_kv_cache < self.kv_needed:
            out.append(
                f"vLLM KV cache {self.vllm_kv_cache / g:.1f} GiB holds less than one group of rollout.n sequences "
                f"of rollout.max_model_len tokens ({self.kv_needed / g:.1f} GiB)"
            )
        if self.rollout_phase > self.budget:
            kept = "" if self.offload == "none" else f" kept (offload {self.offload})"
            out.append(
                f"generation: trainer state{kept} {self.sync_state / g:.1f} GiB + vLLM {self.vllm_resident / g:.1f} GiB "
                f"= {self.rollout_phase / g:.1f} GiB > {self.budget / g:.1f} GiB ({HEADROOM:.0%} of {self.gpu_gib} GiB)"
            )
        if self.update_phase > self.budget:
            what = "trainer state + max(activations, optimizer step transient)" + (
                "" if self.sleep else " + vLLM (not asleep)"
            )
            out.append(f"update: {what} = {self.update_phase / g:.1f} GiB > {self.budget / g:.1f} GiB")
        return out

    def rows(self) -> list[tuple[str, float]]:
        return [
            ("parameters", self.params),
            ("gradients (fp32)", self.grads),
            ("optimizer (fp32 master + Adam)", self.optimizer),
            ("activations (one micro-batch)", self.activations),
            ("optimizer step transient", self.step_transient),
            ("vLLM weights", self.vllm_weights),
            ("vLLM KV cache", self.vllm_kv_cache),
        ]


def _kernels(recipe: Recipe, *, on_gpu: bool):
    """The trainer's kernels on the cluster's devices, by the trainer's own rule
    (:func:`tim_megatron.trainer.kernel_choice.choose_kernels`; the grouped GEMM judged by its stated rules, with no
    GPU here to ask). A grouped-experts setting the device would refuse is counted as asked: the run's doctor and
    trainer name the refusal."""
    from dataclasses import replace

    from tim_megatron.trainer.kernel_choice import choose_kernels, planned_grouped_problem

    modes = modes_of(recipe)
    try:
        return choose_kernels(recipe, modes, on_gpu=on_gpu, grouped_problem=planned_grouped_problem)
    except ValueError:
        trainer = recipe.trainer.model_copy(update={"experts": "loop"})
        loop = choose_kernels(recipe.model_copy(update={"trainer": trainer}), modes, on_gpu=on_gpu)
        return replace(loop, experts="grouped")


def estimate(
    recipe: Recipe,
    *,
    tp: int | None = None,
    ep: int | None = None,
    nodes: int | None = None,
    rollout_tp: int | None = None,
    gpu_memory_utilization: float | None = None,
    materialized_attention: bool | None = None,
    offload: str | None = None,
    grouped_experts: bool | None = None,
) -> Plan:
    """The recipe's plan, or the plan it would have with another layout (unset: the recipe's own).
    ``materialized_attention``: count the attention scores (megatron-core's local spec, without
    transformer-engine's fused attention); unset: on CPU, and where the trainer would build the materialized
    attention on GPUs (exact mode; :func:`_kernels`). ``offload``: another ``trainer.offload_during_rollout`` (unset: the recipe's).
    ``grouped_experts``: count the grouped experts' transient stack of one layer's local fc1 weights
    (:mod:`tim_megatron.trainer.experts`); unset: where the trainer would take the grouped path (:func:`_kernels`:
    GPUs, ``grouped``, or ``auto`` in bfloat16 without expert biases, not in exact mode)."""
    from tim_megatron.rollout.backends import backend_for
    from tim_megatron.trainer.offload import LEVELS

    d, p, c, r = recipe.model.dims, recipe.parallel, recipe.cluster, recipe.rollout
    relayout = tp is not None or ep is not None or nodes is not None
    tp = tp or p.tp
    ep = ep or p.ep
    etp = (1 if ep > 1 else tp) if relayout else p.etp
    world = (nodes or c.nodes) * max(c.gpus_per_node, 1) if relayout else p.world_size
    dp = max(world // (tp * p.pp), 1)
    edp = max(world // (ep * etp * p.pp), 1)
    dense, experts = split_params(d)
    pbytes = _BYTES[recipe.trainer_dtype]
    dense_local = dense / tp
    expert_local = experts / (ep * etp)
    dist_opt = recipe.trainer.distributed_optimizer is not False
    params = (dense_local + expert_local) * pbytes
    grads = (dense_local + expert_local) * 4
    optimizer = 12 * (dense_local / (dp if dist_opt else 1) + expert_local / (edp if dist_opt else 1))
    s, b, h = r.max_model_len, recipe.trainer.micro_batch_size, d.hidden_size
    choice = _kernels(recipe, on_gpu=bool(c.gpus_per_node))
    if materialized_attention is None:  # on CPU megatron's local attentions (latent too) hold the scores
        materialized_attention = not c.gpus_per_node or choice.attention == "materialized"
    scores = 5 * d.num_attention_heads * s * s * b / tp if materialized_attention else 0
    layer = 34 * s * b * h / tp + scores
    if recipe.trainer.recompute == "full":
        act = d.num_layers * 2 * s * b * h / tp + layer
    else:
        act = d.num_layers * layer
    act += recipe.trainer.logprob_chunk * b * d.vocab_size / tp * 8 + d.vocab_size / tp * h * pbytes
    if grouped_experts is None:
        grouped_experts = choice.experts == "grouped"
    if grouped_experts and d.is_moe:  # the larger of its two stacks (fc1: gate and up), alive during one GEMM
        act += d.num_experts / ep * 2 * d.moe_intermediate_size / etp * h * pbytes
    kernel = choice.optimizer
    stepped = dense_local / (dp if dist_opt else 1) + expert_local / (edp if dist_opt else 1)
    transient = 4 * stepped if kernel == "foreach" else 0.0
    placement = [] if relayout else layout_problems(recipe)
    offload = offload or recipe.trainer.offload_during_rollout
    moved = LEVELS[offload]
    if not c.gpus_per_node:
        return Plan(
            params,
            grads,
            optimizer,
            act,
            0.0,
            0.0,
            0,
            layout=placement,
            offload=offload,
            offloaded=moved,
            step_transient=transient,
        )
    gpu = GPU_MEMORY_GIB[c.gpu_type]
    if backend_for(
        rollout_backend(recipe)
    ).own_copy:  # vLLM: its weights, then its KV cache, inside its share of the GPU
        rtp = rollout_tp or r.tensor_parallel_size
        util = gpu_memory_utilization or r.gpu_memory_utilization
        vllm_w = (dense + experts) * _BYTES[recipe.rollout_dtype] / rtp
        share = util * gpu * GIB
        kv = max(share - vllm_w, 0.0)
        kv_needed = kv_cache_bytes_per_token(d, rollout_tp=rtp, dtype=recipe.rollout_dtype) * s * r.n
    else:  # the exact sampler: the trainer's weights, and its cache (every row of the rank at the training width)
        rtp, util, vllm_w = tp, 0.0, 0.0
        ex = exact_cache(recipe, tp=tp, dp=dp)
        kv = share = kv_needed = (
            ex.cache
            if ex is not None
            else kv_cache_bytes_per_token(d, rollout_tp=tp, dtype=recipe.trainer_dtype) * s * r.n
        )
    return Plan(
        params,
        grads,
        optimizer,
        act,
        vllm_w,
        kv,
        gpu,
        vllm_share=share,
        kv_needed=kv_needed,
        sleep=r.sleep_between_steps,
        rollout_tp=rtp,
        gpu_memory_utilization=util,
        layout=placement,
        offload=offload,
        offloaded=moved,
        step_transient=transient,
    )


def largest_utilization(plan: Plan) -> float:
    """The largest vLLM share (``gpu_memory_utilization``, in 0.01 steps, at most MAX_GPU_MEMORY_UTILIZATION) that
    fits the budget beside what the trainer keeps on the GPU while vLLM holds its share (and, when vLLM stays
    awake, beside the update's trainer state and activations too); 0 when nothing is free."""
    if not plan.gpu_gib:
        return 0.0
    busy = plan.sync_state if plan.sleep else max(plan.sync_state, plan.trainer)
    free = (plan.budget - busy) / (plan.gpu_gib * GIB)
    return max(min(math.floor(free * 100 + 1e-9) / 100, MAX_GPU_MEMORY_UTILIZATION), 0.0)


def layout_problems(recipe: Recipe) -> list[str]:
    """Why the recipe's tp x pp x dp ranks do not fill ``cluster.nodes`` x ``cluster.gpus_per_node`` (the check the
    job script's renderer makes), so that a plan never says "fits" for a job that cannot start."""
    from tim_megatron.slurm.render import RenderError, procs_per_node

    try:
        procs_per_node(recipe)
    except RenderError as e:
        return [f"layout: {e}"]
    return []


# ------------------------------------------------------------------------------------------- layout search


@dataclass
class LayoutChoice:
    """What ``make new-recipe`` writes into a new recipe, and why."""

    tp: int
    ep: int
    nodes: int
    rollout_tp: int
    gpu_memory_utilization: float
    plan: Plan
    tried: list[str] = field(default_factory=list)
    """One line per cluster size that did not fit, with its best layout's reasons."""
    offload: str = "none"
    """``trainer.offload_during_rollout`` the layout needs."""

    @property
    def fits(self) -> bool:
        return self.plan.fits


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if (1 << i) <= limit]


def _needed_utilization(recipe: Recipe, rollout_tp: int) -> float:
    """The smallest vLLM share (in 0.05 steps, never below the recipe's) that holds its weights and one group."""
    probe = estimate(recipe, rollout_tp=rollout_tp)
    gpu = GPU_MEMORY_GIB[recipe.cluster.gpu_type] * GIB
    need = (probe.vllm_weights + probe.kv_needed) / gpu
    return max(
        recipe.rollout.gpu_memory_utilization, min(math.ceil(need * 20) / 20, MAX_GPU_MEMORY_UTILIZATION)
    )


def _layouts(recipe: Recipe, nodes: int, max_rollout_tp: int = USUAL_MAX_ROLLOUT_TP, min_rollout_tp: int = 1):
    """Candidate (tp, ep, rollout_tp) on ``nodes`` nodes: a single-node vLLM engine first, then small TP and small
    EP (less communication), then vLLM's size as ordered below. Each satisfies the recipe checks (divisibility of
    heads, experts, vocab and the minibatch)."""
    d, c = recipe.model.dims, recipe.cluster
    per_node = max(c.gpus_per_node, 1)
    world = nodes * per_node
    mb_seqs = recipe.sequences_per_step // recipe.rl.minibatches
    src = recipe.rollout.tensor_parallel_size
    valid = [
        t
        for t in _powers_of_two(min(max_rollout_tp, world))
        if t >= min_rollout_tp
        if d.num_attention_heads % t == 0 and d.vocab_size % t == 0
    ]
    # One engine serves every rollout, so its GPU count is the rollout throughput: the source's size first, then
    # larger, then smaller ones on one node; an engine spanning nodes last.
    rtps = (
        [t for t in valid if t == src]
        + [t for t in valid if src < t <= per_node]
        + sorted((t for t in valid if t < src), reverse=True)
        + [t for t in valid if t > per_node and t != src]
    )
    for multi_node_engine in (False, True):
        for tp in (1, 2, 4, 8):
            if tp > per_node or d.num_key_value_heads % tp or d.num_attention_heads % tp or d.vocab_size % tp:
                continue
            dp = world // tp
            if mb_seqs % dp or recipe.data.prompts_per_step % dp:  # each DP rank trains whole prompt groups
                continue
            eps = [e for e in _powers_of_two(world) if d.num_experts % e == 0] if d.is_moe else [1]
            for ep in eps:
                if world % ep:
                    continue
                for rtp in rtps:
                    if (rtp > per_node) != multi_node_engine:
                        continue
                    yield tp, ep, rtp


def choose_layout(
    recipe: Recipe, *, max_nodes: int = MAX_NODES, min_nodes: int | None = None
) -> LayoutChoice:
    """The fewest nodes (from ``min_nodes``, else the recipe's, doubling) and on them the first layout of
    :func:`_layouts` that fits, with the recipe's ``trainer.offload_during_rollout`` and vLLM engines of at most
    :data:`USUAL_MAX_ROLLOUT_TP` GPUs. When nothing fits up to ``max_nodes`` that way, the same search with engines
    of up to :data:`MAX_ROLLOUT_TP` GPUs, then with each larger offload level in turn (wider engines span more
    nodes over the network, and moving trainer state to host memory while vLLM generates costs transfer time each
    step, so they are the later resorts).

    When nothing fits at all, the layout with the smallest total on the largest cluster tried is returned
    (``fits`` is False) and ``tried`` says why each size failed.
    """
    from tim_megatron.trainer.offload import LEVELS

    c = recipe.cluster
    levels = list(LEVELS)
    own = recipe.trainer.offload_during_rollout
    tried: list[str] = []
    best = None
    # (offload, smallest and largest engine): the second pass tries only the wider engines, since the first has
    # tried every narrower one with the same offload on every cluster size
    passes = [(own, 1, USUAL_MAX_ROLLOUT_TP), (own, 2 * USUAL_MAX_ROLLOUT_TP, MAX_ROLLOUT_TP)]
    passes += [(o, 1, MAX_ROLLOUT_TP) for o in levels[levels.index(own) + 1 :]]
    for offload, min_rtp, max_rtp in passes:
        nodes = min_nodes or c.nodes
        while True:
            if min_rtp > nodes * max(c.gpus_per_node, 1):  # no engine that wide on this few nodes
                nodes *= 2
                continue
            best_here = None
            for tp, ep, rtp in _layouts(recipe, nodes, max_rtp, min_rtp):
                util = _needed_utilization(recipe, rtp)
                plan = estimate(
                    recipe,
                    tp=tp,
                    ep=ep,
                    nodes=nodes,
                    rollout_tp=rtp,
                    gpu_memory_utilization=util,
                    offload=offload,
                )
                choice = LayoutChoice(tp, ep, nodes, rtp, util, plan, tried, offload)
                if plan.fits:
                    return choice
                if best_here is None or plan.total < best_here.plan.total:
                    best_here = choice
            kept = ("" if offload == own else f", offload {offload}") + (
                f", engines up to {max_rtp} GPUs" if max_rtp > USUAL_MAX_ROLLOUT_TP else ""
            )
            if best_here is not None:
                if best is None or (best_here.nodes, -best_here.plan.total) > (best.nodes, -best.plan.total):
                    best = best_here
                b = best_here
                tried.append(
                    f"{nodes} node(s) x {c.gpus_per_node} {c.gpu_type}{kept}: best tp={b.tp} ep={b.ep} rollout TP "
                    f"{b.rollout_tp} needs {b.plan.total / GIB:.1f} GiB per GPU: "
                    + "; ".join(b.plan.problems())
                )
            else:
                tried.append(f"{nodes} node(s){kept}: no layout divides the model and the minibatch")
            if nodes * 2 > max_nodes or not c.gpus_per_node:
                break
            nodes *= 2
    if best is None:
        raise ValueError(
            f"no tensor/expert-parallel layout divides the model and the minibatch on up to {max_nodes} node(s): "
            + " | ".join(tried)
        )
    return best


# ----------------------------------------------------------------------------------------------- output


def format_plan(recipe: Recipe, plan: Plan, name: str) -> str:
    p, c = recipe.parallel, recipe.cluster
    lines = [
        f"{name}: {c.nodes} node(s) x {c.gpus_per_node} x {c.gpu_type if c.gpus_per_node else 'cpu'}; "
        f"tp={p.tp} ep={p.ep} pp={p.pp} dp={p.dp}, "
        f"micro-batch {recipe.trainer.micro_batch_size} x {recipe.rollout.max_model_len} tokens, trainer {recipe.trainer_dtype}"
    ]
    dense, experts = split_params(recipe.model.dims)
    lines.append(
        f"  model: {(dense + experts) / 1e9:.2f}B parameters ({experts / 1e9:.2f}B in routed experts)"
        f" [{recipe.model.dims.resolved_family}]"
    )
    for label, v in plan.rows():
        lines.append(f"  {label:<32} {v / GIB:9.2f} GiB")
    ex = exact_cache(recipe)
    if ex is not None:
        lines.append(
            f"  {'exact sampler (vexact = exact)':<32} KV cache {ex.cache / GIB:.2f} GiB per GPU ({ex.rows} rows x "
            f"{ex.width} positions, {recipe.trainer_dtype}); a decode step reads {ex.cache / GIB:.2f} GiB in place "
            f"(a per-step gather would copy {2 * ex.cache / GIB:.2f} GiB)"
            + (
                f"; more than the GPU's {plan.gpu_gib} GiB: fewer rows per rank (more data-parallel ranks) or "
                "a shorter width"
                if plan.gpu_gib and ex.cache > plan.gpu_gib * GIB
                else ""
            )
        )
    if not plan.gpu_gib:
        lines.append(f"  {'total per GPU':<32} {plan.total / GIB:9.2f} GiB (CPU: no GPU budget)")
        lines.extend(f"  DOES NOT RUN: {why}" for why in plan.problems())
        return "\n".join(lines)
    d = recipe.model.dims
    if d.is_moe and d.router_groups > 1:
        grouped, free = dispatch_fanout(d, ep=p.ep)
        lines.append(
            f"  {'routing':<32} top-{d.num_experts_per_tok} of {d.num_experts} experts within "
            f"{d.router_group_topk} of {d.router_groups} groups: a token's experts on at most {grouped} of EP "
            f"{p.ep} ranks ({free} without the group limit)"
        )
    lines.append(
        f"  {'vLLM':<32} TP {plan.rollout_tp}, gpu_memory_utilization {plan.gpu_memory_utilization:g}, "
        f"KV cache for one group {plan.kv_needed / GIB:.2f} GiB"
    )
    if plan.offload != "none":
        lines.append(
            f"  {'offload during rollout':<32} {plan.offload}: {plan.offloaded_bytes / GIB:.2f} GiB to host memory, "
            f"{plan.sync_state / GIB:.2f} GiB kept beside vLLM"
        )
    sleep = "vLLM asleep" if plan.sleep else "vLLM resident"
    lines.append(
        f"  {'peak: generation / update':<32} {plan.rollout_phase / GIB:9.2f} / {plan.update_phase / GIB:.2f} GiB ({sleep})"
    )
    lines.append(
        f"  {'total per GPU':<32} {plan.total / GIB:9.2f} GiB of {plan.gpu_gib} GiB: "
        + ("fits" if plan.fits else "DOES NOT RUN" if plan.layout else "DOES NOT FIT")
    )
    for why in plan.problems():
        lines.append(f"    {why}")
    if recipe.rollout.tensor_parallel_size > max(c.gpus_per_node, 1):
        lines.append(
            f"  note: rollout.tensor_parallel_size {recipe.rollout.tensor_parallel_size} spans nodes: each engine is "
            f"{recipe.rollout.tensor_parallel_size // max(c.gpus_per_node, 1)} whole nodes, with vLLM tensor "
            "parallelism over the inter-node network (slow; not yet run anywhere)"
        )
    return "\n".join(lines)
