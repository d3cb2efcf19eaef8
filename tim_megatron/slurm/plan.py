"""Per-GPU memory estimate for a recipe, and the TP/EP choice ``make new-recipe`` makes with it.

The estimate, per GPU (bytes; all numbers are upper-bound style, documented so they can be argued with):

* parameters: dense params / tp, plus routed-expert params / (ep x expert_tp), in the trainer dtype
  (2 bytes for bf16/fp16, 4 for fp32);
* gradients: the same counts in float32 (megatron's grad buffers reduce in fp32);
* optimizer: Adam's fp32 master copy, first and second moments (12 bytes per parameter), divided by the
  data-parallel size (dense) or expert-data-parallel size (experts) with the distributed optimizer;
* activations, for one micro-batch of ``trainer.micro_batch_size`` sequences of ``rollout.max_model_len``
  tokens: per layer ``34 x s x b x h / tp`` bytes (Korthikanti et al.'s count with sequence parallelism), plus
  ``5 x heads x s^2 x b / tp`` for materialized attention scores on CPU (fused attention on GPU keeps none);
  with ``trainer.recompute: full`` only each layer's input is kept (``2 x s x b x h / tp`` per layer) plus one
  layer's full set during its recomputation; plus one logits chunk (``logprob_chunk x b x vocab / tp x 4``);
* vLLM: the bf16 weights (whole model / rollout.tensor_parallel_size) and the KV cache it reserves, taken as
  ``gpu_memory_utilization`` x GPU memory minus those weights (vLLM fills its share with KV cache).
"""

from __future__ import annotations

from dataclasses import dataclass

from tim_megatron.recipe.schema import GPU_MEMORY_GIB, ModelDims, Recipe

GIB = 2**30


def split_params(d: ModelDims) -> tuple[int, int]:
    """(dense, routed-expert) parameter counts, from the model's family."""
    from tim_megatron.trainer.families import get_family

    c = get_family(d.resolved_family).params(d)
    return c.dense, c.routed_experts


@dataclass
class Plan:
    params: float
    grads: float
    optimizer: float
    activations: float
    vllm_weights: float
    vllm_kv_cache: float
    gpu_gib: float

    @property
    def trainer(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations

    @property
    def total(self) -> float:
        return self.trainer + self.vllm_weights + self.vllm_kv_cache

    @property
    def fits(self) -> bool:
        return self.gpu_gib == 0 or self.total <= 0.95 * self.gpu_gib * GIB

    def rows(self) -> list[tuple[str, float]]:
        return [
            ("parameters", self.params),
            ("gradients (fp32)", self.grads),
            ("optimizer (fp32 master + Adam)", self.optimizer),
            ("activations (one micro-batch)", self.activations),
            ("vLLM weights", self.vllm_weights),
            ("vLLM KV cache", self.vllm_kv_cache),
        ]


def estimate(recipe: Recipe, *, tp: int | None = None, ep: int | None = None) -> Plan:
    d, p, c = recipe.model.dims, recipe.parallel, recipe.cluster
    tp = tp or p.tp
    ep = ep or p.ep
    etp = 1 if ep > 1 else tp
    world = p.world_size if tp == p.tp else c.nodes * max(c.gpus_per_node, 1)
    dp = max(world // (tp * p.pp), 1)
    edp = max(world // (ep * etp * p.pp), 1)
    dense, experts = split_params(d)
    pbytes = {"float32": 4, "bfloat16": 2, "float16": 2}[recipe.trainer_dtype]
    dense_local = dense / tp
    expert_local = experts / (ep * etp)
    dist_opt = recipe.trainer.distributed_optimizer is not False
    params = (dense_local + expert_local) * pbytes
    grads = (dense_local + expert_local) * 4
    optimizer = 12 * (dense_local / (dp if dist_opt else 1) + expert_local / (edp if dist_opt else 1))
    s, b, h = recipe.rollout.max_model_len, recipe.trainer.micro_batch_size, d.hidden_size
    layer = 34 * s * b * h / tp + (0 if c.gpus_per_node else 5 * d.num_attention_heads * s * s * b / tp)
    if recipe.trainer.recompute == "full":
        act = d.num_layers * 2 * s * b * h / tp + layer
    else:
        act = d.num_layers * layer
    act += recipe.trainer.logprob_chunk * b * d.vocab_size / tp * 4
    gpu = GPU_MEMORY_GIB[c.gpu_type] if c.gpus_per_node else 0
    total_params = dense + experts
    vllm_w = total_params * 2 / recipe.rollout.tensor_parallel_size if c.gpus_per_node else 0
    kv = max(recipe.rollout.gpu_memory_utilization * gpu * GIB - vllm_w, 0) if c.gpus_per_node else 0
    return Plan(params, grads, optimizer, act, vllm_w, kv, gpu)


def choose_layout(recipe: Recipe) -> tuple[int, int, Plan]:
    """Smallest TP (less communication), then smallest EP, that divides heads/KV heads/experts and fits."""
    d, c = recipe.model.dims, recipe.cluster
    per_node = max(c.gpus_per_node, 1)
    world = c.nodes * per_node
    best = None
    for tp in (1, 2, 4, 8):
        if tp > per_node or d.num_key_value_heads % tp or d.num_attention_heads % tp or d.vocab_size % tp:
            continue
        eps = [
            e
            for e in (1, 2, 4, 8, 16, 32, 64)
            if (not d.is_moe and e == 1) or (d.is_moe and d.num_experts % e == 0)
        ]
        for ep in eps:
            dp = world // tp
            if dp * tp != world or (ep > 1 and dp * tp % ep):
                continue
            plan = estimate(recipe, tp=tp, ep=ep)
            if best is None or plan.total < best[2].total:
                best = (tp, ep, plan)
            if plan.fits:
                return tp, ep, plan
    if best is None:
        raise ValueError(f"no tensor/expert-parallel layout divides the model over {world} GPUs")
    return best


def format_plan(recipe: Recipe, plan: Plan, name: str) -> str:
    p, c = recipe.parallel, recipe.cluster
    lines = [
        f"{name}: {c.nodes} node(s) x {c.gpus_per_node} x {c.gpu_type or 'cpu'}; tp={p.tp} ep={p.ep} pp={p.pp} dp={p.dp}, "
        f"micro-batch {recipe.trainer.micro_batch_size} x {recipe.rollout.max_model_len} tokens, trainer {recipe.trainer_dtype}"
    ]
    dense, experts = split_params(recipe.model.dims)
    lines.append(
        f"  model: {(dense + experts) / 1e9:.2f}B parameters ({experts / 1e9:.2f}B in routed experts)"
    )
    for label, v in plan.rows():
        lines.append(f"  {label:<32} {v / GIB:9.2f} GiB")
    lines.append(
        f"  {'total per GPU':<32} {plan.total / GIB:9.2f} GiB"
        + (
            f" of {plan.gpu_gib} GiB: {'fits' if plan.fits else 'DOES NOT FIT'}"
            if plan.gpu_gib
            else " (CPU: no GPU budget)"
        )
    )
    return "\n".join(lines)
