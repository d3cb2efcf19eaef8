"""The typed recipe: every knob of a run, with a docstring under each field.

A recipe is YAML that may inherit from parents (``base:``); ``tim_megatron.recipe.loader`` merges the
files, applies dotted overrides and validates the result against :class:`Recipe`. Derived settings
(dtypes implied by remedies, the data-parallel size) are resolved here, in one place.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from tim_megatron import metric_names as names
from tim_megatron.recipe.base import INT_LIMIT, NAME_PATTERN, Dtype, RecipeValueError, Section  # noqa: F401
from tim_megatron.recipe.dims import FAMILIES, ModelDims  # noqa: F401
from tim_megatron.recipe.faults import FaultDrillConfig, FaultsConfig
from tim_megatron.recipe.rules import check_recipe
from tim_megatron.warning_defaults import MEDIAN_RATIO, SURGE, TREND

# ----------------------------------------------------------------------------------------------- model


class ModelConfig(Section):
    path: str = "tiny"
    """HF checkpoint: a local folder, a hub name (cluster only), or ``tiny`` for the built-in tiny MoE."""
    dims: ModelDims = ModelDims()
    """Architecture numbers. For ``tiny`` they define the model; otherwise they must match config.json."""
    router_dtype: Literal["fp32", "fp64"] = "fp32"
    """Precision of the router GEMM and softmax in the trainer (MoE-for-RL default: fp32)."""
    load_balancing: Literal["none", "aux_loss"] = "none"
    """Router load balancing during RL. ``none`` leaves the pretrained routing alone."""
    aux_loss_coeff: float = Field(0.0, ge=0)
    """Coefficient of the load-balancing loss when ``load_balancing: aux_loss``."""
    freeze_router: bool = False
    """Keep router weights fixed during RL (no gradient, no update)."""
    tiny_seed: int = Field(0, ge=0)
    """Seed of the built-in tiny model's weights (``path: tiny`` only)."""
    tiny_warmup_steps: int = Field(300, ge=0, le=20_000)
    """Supervised format warm-up steps baked into the tiny checkpoint, so rewards start above zero (``path: tiny``
    only; built once and cached)."""


# ------------------------------------------------------------------------------------------- parallel


class ParallelismConfig(Section):
    tp: int = Field(1, ge=1)
    """Tensor-parallel size: attention heads, MLP and vocab are split over this many ranks."""
    ep: int = Field(1, ge=1)
    """Expert-parallel size: the routed experts are split over this many ranks."""
    pp: int = Field(1, ge=1)
    """Pipeline-parallel size. Only 1 is implemented."""
    dp: int = Field(1, ge=1)
    """Data-parallel size. World size = tp * pp * dp."""
    expert_tp: int | None = Field(None, ge=1)
    """Tensor-parallel size inside each expert (megatron-core's expert_tensor_parallel_size). Unset: tp."""
    timeout_minutes: float = Field(60.0, gt=0, le=24 * 60)
    """Process-group timeout: a collective that waits longer aborts the job. It must exceed the longest wait of
    one rank for the others in a step (the slowest engine's generation, a checkpoint write)."""

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def etp(self) -> int:
        return self.tp if self.expert_tp is None else self.expert_tp


# -------------------------------------------------------------------------------------------- rollout


class PartialRollouts(Section):
    """Partial rollouts (:mod:`tim_megatron.rl.partial`): a step generates at most ``tokens_per_step`` tokens of each
    sequence of a batch trained later; a sequence still running goes on at the next step, after the weight sync,
    under the new weights (re-submitted as its prompt and the tokens so far), so a long response does not hold a
    step back. Each token keeps the version (updates applied) of the weights that sampled it, and its pi_s is the
    trainer's logprob at those weights. The batch of step t starts at step max(t - k, 1) (k =
    ``rollout.max_staleness``), gets up to ``tokens_per_step`` more tokens at each step before t, and its sequences
    still running at step t are finished under that step's weights before it trains: no token is older than k."""

    tokens_per_step: int = Field(0, ge=0)
    """The most tokens a step generates of each sequence of a batch trained at a later step (0: partial rollouts
    off, each batch is generated whole at one step). Allowed 1 to ``rollout.max_tokens - 1`` with
    ``rollout.max_staleness`` >= 1; with tokens_per_step x max_staleness >= max_tokens no sequence is left to finish
    at its training step once the run is k steps in."""

    @property
    def enabled(self) -> bool:
        return self.tokens_per_step > 0

    def check_recipe(self, r) -> None:
        """The recipe's rules for these keys (named :class:`~tim_megatron.recipe.base.RecipeValueError`); ``r``:
        the whole recipe (called from :func:`tim_megatron.recipe.rules.check_recipe`)."""
        ro, t = r.rollout, self.tokens_per_step
        if not t:
            return
        if ro.max_staleness < 1:
            raise RecipeValueError(
                ["rollout.partial.tokens_per_step", "rollout.max_staleness"],
                f"rollout.partial.tokens_per_step = {t} with rollout.max_staleness = 0: a partial sequence goes on "
                "at a later step under newer weights, and on-policy each batch is sampled and trained at one step; "
                "allowed: max_staleness >= 1, or tokens_per_step = 0",
            )
        if t >= ro.max_tokens:
            raise RecipeValueError(
                ["rollout.partial.tokens_per_step", "rollout.max_tokens"],
                f"rollout.partial.tokens_per_step = {t} with rollout.max_tokens = {ro.max_tokens}: every sequence "
                f"would be generated whole at one step; allowed: 1 to {ro.max_tokens - 1}, or 0 (off)",
            )
        if ro.stop:
            raise RecipeValueError(
                ["rollout.partial.tokens_per_step", "rollout.stop"],
                f"rollout.partial.tokens_per_step = {t} with rollout.stop = {list(ro.stop)}: a continued request "
                "matches stop strings in its new text only, so one that spans two steps' tokens would be missed; "
                "allowed: rollout.stop = [] (the EOS token ends a response), or tokens_per_step = 0",
            )


class RolloutConfig(Section):
    backend: Literal["vllm", "trainer"] | None = None
    """What samples the responses (:mod:`tim_megatron.rollout.backends`): ``vllm``, the vLLM fleet; ``trainer``,
    the Megatron model's own forward (exact mode). Unset: ``trainer`` with ``diagnostics.vexact: exact``, else
    ``vllm``."""
    dtype: Dtype | None = None
    """vLLM weight/compute dtype. Unset: float16 with ``remedies.fp16``, else bfloat16."""
    n: int = Field(8, ge=1)
    """Responses sampled per prompt (the GRPO group size)."""
    max_tokens: int = Field(16, ge=1)
    """Generation budget per response, in tokens."""
    max_staleness: int = Field(0, ge=0, le=64)
    """Off-policy lag k: the batch trained at step t was sampled with the weights of step s >= t - k (the weights
    after s - 1 updates). 0: on-policy, the batch is sampled with the weights it is trained from. With k > 0 each
    step samples the batch it trains k steps later (the first step samples steps 1..k+1), in sequence on the same
    machine, and the ratio is split per token into staleness and TIM (``mismatch/staleness/*``,
    ``mismatch/tim/*``)."""
    schedule: Literal["sequential", "overlapped"] = "sequential"
    """How an off-policy run (``max_staleness`` > 0) runs its sampling ahead. ``sequential``: each step samples,
    then trains. ``overlapped``: the batch for a later step is sampled on a thread beside the update (the engine
    has its own copy of the weights and keeps the pre-update ones until the step's sync), and scored at its
    sampling weights after the update from a copy of them (:mod:`tim_megatron.rl.overlap`). Both train on the same
    samples with the same numbers; the overlapped one needs the engine and the trainer resident at once."""
    partial: PartialRollouts = PartialRollouts()
    """Partial rollouts: each step generates a bounded number of tokens per sequence, and sequences still running
    go on under the next step's weights (off unless ``partial.tokens_per_step`` > 0)."""
    max_model_len: int = Field(256, ge=2)
    """Longest prompt + response vLLM accepts. Longer prompts are rejected before generation."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature. Logprobs on both sides are taken after it (see ``logprobs_after_temperature``)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass. Below 1 the rollout samples from a truncated distribution (off-policy)."""
    top_k: int = -1
    """Top-k sampling cut (-1: off)."""
    stop: list[str] = []
    """Strings that end a response early (the EOS token always does)."""
    logprobs_after_temperature: bool = True
    """Rollout logprobs are of softmax(logits / temperature), and the trainer uses the same convention."""
    gpu_memory_utilization: float = Field(0.35, gt=0, le=1)
    """Fraction of GPU memory vLLM may take when colocated with the trainer (GPU only)."""
    cpu_memory_utilization: float = Field(0.2, gt=0, le=1)
    """CPU runs: fraction of the NUMA node's memory vLLM may reserve (it refuses to start if that much is not free)."""
    cpu_kvcache_gib: float = Field(1.0, ge=1)
    """KV-cache size on CPU, in whole GiB: vLLM's ``VLLM_CPU_KVCACHE_SPACE``, which the engine sets from this
    value (an environment value that differs is replaced, with a notice)."""

    @field_validator("cpu_kvcache_gib")
    @classmethod
    def _whole_gib(cls, v: float) -> float:
        if v != int(v):
            raise ValueError(
                f"{v} GiB: vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE) takes whole GiB, e.g. {int(v)}"
            )
        return v

    tensor_parallel_size: int = Field(1, ge=1)
    """R: ranks per vLLM engine (vLLM's own tensor-parallel size). The job runs world / R engines, engine k on
    ranks [kR, kR+R) and their GPUs, each generating its own block of the step's prompts."""
    enforce_eager: bool = True
    """Skip graph capture/compilation (needed for routed-expert capture hooks on CPU)."""
    sleep_between_steps: bool = False
    """Release vLLM's GPU memory while the trainer runs (no-op on CPU)."""
    sync_check: Literal["every", "probe", "first", "off"] = "every"
    """How weight syncs are verified (the structural check always runs). every: on the next step's own samples,
    whose trainer logprobs the loop computes anyway (free), plus a probe on the first and last syncs; probe: an
    extra probe batch after every sync; first: probe the first sync only; off: structure only."""
    sync_tolerance: float | None = None
    """A verified sync needs |p_vllm - p_trainer| within this for at least 80% of the checked tokens (a few tokens
    may differ more: real MoE mismatch, logged). Unset: 1e-4 when both sides are fp32, 0.01 otherwise."""
    capture_routed_experts: bool = False
    """Record the top-k experts vLLM used for every token (needed by R3; derived when R3 is on)."""
    engine_process: bool = False
    """Run each rank's vLLM engine in a process of its own (:mod:`tim_megatron.rollout.process_engine`), so that an
    engine that dies, hangs or raises is restarted and the step's lost samples regenerated, instead of taking the
    rank down. False: in the rank's process, weights passed by reference."""
    faults: FaultsConfig = FaultsConfig()
    """How long an engine in its own process may take, and how often it may be restarted."""
    fault_drill: FaultDrillConfig = FaultDrillConfig()
    """A planted fault, to watch recovery work (tests, and a cluster before a long job)."""


# -------------------------------------------------------------------------------------------- trainer


class TrainerConfig(Section):
    dtype: Dtype | None = None
    """Megatron params/compute dtype. Unset: float16 with ``remedies.fp16``, else bfloat16."""
    micro_batch_size: int = Field(8, ge=1)
    """Sequences per forward/backward; gradients accumulate across micro-batches."""
    recompute: Literal["none", "full"] = "none"
    """Activation recomputation: full recomputes each layer in the backward pass (inputs kept only)."""
    logprob_chunk: int = Field(1024, ge=1)
    """Sequence positions per chunk when turning logits into logprobs (bounds peak memory)."""
    nan_guard_max: int = Field(3, ge=1)
    """Consecutive non-finite updates tolerated (each skipped); one more aborts with a checkpoint."""
    distributed_optimizer: bool | None = None
    """Split the optimizer state over data-parallel ranks (megatron-core's distributed optimizer). Unset: on with CUDA, off on CPU."""
    offload_during_rollout: Literal["none", "optimizer", "optimizer+grads", "all"] = "none"
    """What of the trainer's state moves to (pinned) host memory while the rollout engine generates, so the
    engine can take that accelerator memory: ``optimizer`` (Adam's moments and fp32 master weights),
    ``optimizer+grads`` (and the gradient buffers), ``all`` (and the parameters). It leaves after the update and
    the weight sync and returns when the rollout is done. ``none`` keeps everything resident."""
    deterministic: bool = True
    """Ask torch for deterministic kernels (bitwise-repeatable runs on CPU)."""
    moe_dispatcher: Literal["auto", "allgather", "alltoall", "indexed"] = "auto"
    """MoE token dispatcher. ``indexed``: megatron-core's all-to-all dispatcher with the permute and the combine as
    index gathers and fixed-order sums (deterministic without atomics), the tokens per expert kept on the device: no
    host read in the forward at one rank per expert group; ``allgather`` / ``alltoall``: megatron-core's own
    (alltoall needs CUDA streams); ``auto``: indexed on CUDA, allgather on CPU (the project's CPU figures were
    measured with it). Exact mode always runs allgather."""
    experts: Literal["auto", "loop", "grouped"] = "auto"
    """Routed experts' GEMMs. ``grouped``: two grouped GEMMs over all of a rank's experts (``torch._grouped_mm``,
    with or without transformer-engine's layers); ``loop``: one expert after another (megatron-core's
    ``SequentialMLP``); ``auto``: grouped on CUDA where the kernel runs in the trainer's dtype, the loop on CPU
    and in exact mode. Both keep the same parameters and checkpoints."""
    attention: Literal["auto", "sdpa", "materialized"] = "auto"
    """Core attention of the non-latent families. ``sdpa``: torch's fused attention (flash attention on CUDA in
    bfloat16); ``materialized``: megatron-core's local ``DotProductAttention`` (the scores as a tensor); ``auto``:
    sdpa on CUDA, materialized on CPU and in exact mode. Latent attention (MLA) always runs on sdpa."""
    optimizer_kernel: Literal["auto", "fused", "foreach"] = "auto"
    """The Adam kernel where neither apex nor transformer-engine provides one (megatron-core then uses torch's
    AdamW). ``fused``: torch's fused AdamW (one kernel per tensor group, no temporaries of the parameters' size);
    ``foreach``: torch's default multi-tensor AdamW (a temporary of 4 bytes per parameter at the step); ``auto``:
    fused on CUDA, foreach on CPU. A checkpoint saved under either resumes under the other."""
    compile: Literal["auto", "off"] = "auto"
    """``torch.compile`` (Inductor, dynamic shapes) of the layers' small pure functions: the RMSNorms, the rotary
    embedding and the experts' SwiGLU times the routing probabilities (:mod:`tim_megatron.trainer.compile`).
    ``auto``: on CUDA, never in exact mode and not on CPU; ``off``: they run eagerly everywhere. Compiling costs
    seconds at the first steps of a run (``make gpu-check``'s ``moe layer`` section reports them)."""
    initial_loss_scale: float = Field(2.0**16, gt=0)
    """Starting dynamic loss scale in fp16 mode."""
    min_loss_scale: float = Field(1.0, gt=0)
    """Floor of the dynamic loss scale in fp16 mode."""
    loss_scale_window: int = Field(100, ge=1)
    """Overflow-free steps before the fp16 loss scale grows again."""


class OptimConfig(Section):
    lr: float = Field(1e-6, ge=0)
    """Initial (peak) learning rate (0 freezes the weights: layout-equivalence tests)."""
    weight_decay: float = Field(0.01, ge=0)
    """AdamW weight decay."""
    beta1: float = Field(0.9, ge=0, lt=1)
    """Adam beta1."""
    beta2: float = Field(0.999, ge=0, lt=1)
    """Adam beta2."""
    eps: float = Field(1e-8, gt=0)
    """Adam epsilon."""
    grad_clip: float = Field(1.0, ge=0)
    """Global gradient-norm clip (0: off)."""


# ---------------------------------------------------------------------------------------- algorithm


class ClipConfig(Section):
    low: float = Field(0.2, ge=0)
    """Token clip: ratios below 1 - low are clipped (epsilon_low)."""
    high: float = Field(0.2, ge=0)
    """Token clip: ratios above 1 + high are clipped (epsilon_high; > low is DAPO's clip-higher)."""
    dual: float | None = Field(None, gt=1)
    """Dual-clip constant c (> 1) bounding the loss of negative-advantage tokens; unset: off."""


class SeqClipConfig(Section):
    low: float = Field(3e-4, ge=0)
    """GSPO: sequence ratios below 1 - low are clipped."""
    high: float = Field(4e-4, ge=0)
    """GSPO: sequence ratios above 1 + high are clipped."""


class CorrectionConfig(Section):
    mode: Literal["none", "tis", "mis", "icepop"] = "none"
    """Rollout correction between the trainer's old policy and the rollout policy."""
    level: Literal["token", "sequence", "geometric"] = "token"
    """Ratio the correction acts on: per token, the sequence product, or its geometric mean."""
    c: float = Field(2.0, gt=0)
    """TIS truncation / MIS mask threshold C."""
    low: float = Field(0.5, gt=0)
    """IcePop: ratios below this are masked. The default [0.5, 2.0] is slime's IcePop (THUDM/slime,
    ``icepop_function`` in ``slime/backends/megatron_utils/loss.py``, run with ``--tis-clip-low 0.5 --tis-clip
    2.0``; 2.0 is its ``--tis-clip`` default) and verl's ratio-rejection default ``"0.5_2.0"``
    (``RolloutCorrectionConfig.decoupled_seq_is_rs``). IcePop's authors (Ring-1T report, arXiv 2510.18855) write
    the region as [alpha, beta]; reproductions cite [0.5, 5.0] and INTELLECT-3 (arXiv 2512.16144) uses
    [0.2, 5.0], so set low/high when you reproduce one of those."""
    high: float = Field(2.0, gt=0)
    """IcePop: ratios above this are masked (need not be 1/low). Default 2.0: see ``low`` for the source."""
    target: Literal["total", "staleness", "tim"] = "total"
    """What the correction's ratio is: ``total``, pi_t / mu_s (the trainer now over the sampler then); ``staleness``,
    pi_t / pi_s (the trainer now over the trainer at the sampling weights); ``tim``, pi_s / mu_s (the trainer over the
    sampler, both at the sampling weights). On-policy (``rollout.max_staleness`` 0) pi_s is pi_t: ``total`` and
    ``tim`` are the same, and ``staleness`` weighs every token 1."""
    bypass: bool = False
    """Use the rollout logprobs as the old policy (skip the old-logprob recompute). Only with ``mode: none``:
    with TIS/MIS/IcePop every weight would be 1, so the combination is rejected at load."""
    allow_biased: bool = False
    """Accept an off-policy loss (``rollout.max_staleness`` > 0) that is not weighted by the proximal policy over
    the behaviour one: no correction at all (``mode: none``), or a (``rl.proximal``, ``target``) pair other than
    (current, total) and (sampled, tim). Such a loss is biased; this is for experiments on that bias. Off:
    refused by name."""


class RLConfig(Section):
    loss: Literal["token_clip", "gspo"] = "token_clip"
    """Policy loss: PPO/GRPO token-level clipping, or GSPO's sequence-level ratio and clip."""
    clip: ClipConfig = ClipConfig()
    """Token-level clip ranges."""
    seq_clip: SeqClipConfig = SeqClipConfig()
    """GSPO sequence-level clip ranges."""
    aggregation: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How per-token losses become one number."""
    advantage: Literal["grpo", "grpo_no_std", "rloo"] = "grpo"
    """Advantage estimator over each prompt's group of responses."""
    correction: CorrectionConfig = CorrectionConfig()
    """Importance-sampling correction for the rollout/trainer mismatch (TIS, MIS, IcePop)."""
    proximal: Literal["current", "sampled"] = "current"
    """The policy PPO's ratio and clip are taken against. ``current``: pi_t, the trainer at the weights the step
    starts from (decoupled PPO, as AReaL: the trust region is around the policy now, and the correction handles
    the behaviour policy). ``sampled``: pi_s, the trainer at the weights that sampled the batch (PPO on stale
    data: the clip also bounds the policy's move since sampling; aim the correction at ``tim``). The same on
    policy (``rollout.max_staleness`` 0), where pi_s is pi_t."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each step's rollouts."""
    minibatches: int = Field(1, ge=1)
    """Optimizer updates per epoch; the step's sequences are split evenly among them."""


# ----------------------------------------------------------------------------------------- remedies


class SurgeDetectorConfig(Section):
    """TIM-LR's length surge: the mean response length multiplies by ``factor`` within ``within`` steps."""

    window: int = Field(SURGE.window, ge=1)
    """Steps averaged for the current response length."""
    baseline_steps: int = Field(SURGE.baseline_steps, ge=1)
    """Steps seen before the detector may fire."""
    factor: float = Field(SURGE.factor, gt=1)
    """The surge fires when the current length reaches this multiple of its smallest value over ``within``."""
    within: int = Field(SURGE.within, ge=1)
    """Steps the multiplication may take: the reference is the smallest current length of the last ``within``
    steps, so a slow drift (1%/step doubles in ~70 steps) never fires."""


class LRScheduleConfig(Section):
    type: Literal["constant", "cosine", "length_decay"] = "constant"
    """LR schedule: constant, cosine with warmup, or the TIM-LR paper's halving decay (Algorithm 1)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps (constant and cosine)."""
    total_steps: int | None = None
    """Cosine horizon; unset: ``run.steps``."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Floor as a fraction of the initial LR (cosine end, length-decay floor)."""
    trigger: Literal["step", "surge"] = "step"
    """length_decay: ``step`` (default) is Algorithm 1 of the TIM-LR paper exactly with ``trigger_step: 0``:
    hold the LR, then halve it at every multiple of ``decay_period`` down to the floor, T_decay chosen in advance
    (the paper: ~1.8 x the step of the length surge seen in an earlier run). ``surge`` (opt-in) waits for the
    surge detector and derives the period from the step it fires: the mean length multiplying by ``surge.factor``
    within ``surge.within`` steps, whatever level the run started at (a base model's curve that starts high, dips
    and surges back fires) and never on a steady growth of ~1%/step."""
    trigger_step: int = Field(0, ge=0)
    """length_decay with ``trigger: step``: halving counts only after this step (0: Algorithm 1 from step 1)."""
    decay_period: int | None = Field(None, ge=1)
    """length_decay: T_decay, halve at every multiple of it. Unset: ``period_factor`` x the trigger step."""
    period_factor: float = Field(1.8, gt=0)
    """length_decay: decay_period = period_factor x the trigger step when decay_period is unset."""
    surge: SurgeDetectorConfig = SurgeDetectorConfig()
    """Response-length surge detector settings (``trigger: surge``, and the early-warning surge event)."""


class RemediesConfig(Section):
    router_replay: Literal["off", "r2", "r3"] = "off"
    """MoE routing replay in the update: r3 replays the rollout's experts, r2 the old-logprob pass's."""
    fp32_lm_head: bool = False
    """Compute the LM head in fp32 from an fp32 copy of its weights, on trainer and rollout alike."""
    fp16: bool = False
    """Run trainer and rollout in float16 (with dynamic loss scaling in the trainer)."""
    lr_schedule: LRScheduleConfig = LRScheduleConfig()
    """Learning-rate schedule (the length-surge decay is a remedy)."""


# -------------------------------------------------------------------------------------- diagnostics


class ObjectiveInjection(Section):
    type: Literal["none", "biased", "unbiased"] = "none"
    """Token-weight distortion in the objective: phi = delta below pi_low, or xi ~ N(1, sigma^2)."""
    delta: float = Field(2.0, ge=0)
    """Biased: weight of tokens whose old-policy probability is below ``pi_low``."""
    pi_low: float = Field(0.1, gt=0, lt=1)
    """Biased: probability threshold defining low-probability tokens."""
    sigma: float = Field(0.2, ge=0, allow_inf_nan=True)
    """Unbiased: std of the per-token weight noise. ``.inf`` is allowed on purpose: it makes every update
    non-finite, which is how the NaN guard is exercised."""
    seed: int = Field(0, ge=0)
    """Seed of the unbiased noise (each step derives its own)."""


class SamplingInjection(Section):
    """Controlled mismatch in the SAMPLING distribution: the rollout samples every token from mu = perturb(pi)
    and logs log mu as its logprob, so training uses tokens drawn from mu, as with a real mismatch
    (:func:`tim_megatron.algo.injection.perturbed_logprobs`). pi = softmax(logits / temperature)."""

    type: Literal["off", "precision", "noise", "bias"] = "off"
    """``precision``: Eq. 45's low-precision softmax on float32 logits; ``noise``: zero-mean logit noise of std
    ``std``; ``bias``: the sampling probabilities of tokens with pi < ``pi_low`` multiplied by ``delta``, then
    renormalised."""
    dtype: Literal["bfloat16", "float16"] = "bfloat16"
    """Precision: the format of Eq. 45's quantizer Q (a real cast, subnormals included)."""
    std: float = Field(0.1, ge=0)
    """Noise: std of the standard normal noise added to every logit (after the temperature)."""
    delta: float = Field(2.0, gt=0)
    """Bias: phi for tokens below ``pi_low`` (> 1 favours them, < 1 suppresses them); 1 changes nothing."""
    pi_low: float = Field(0.1, gt=0, lt=1)
    """Bias: the policy probability below which a token is distorted."""
    seed: int = Field(0, ge=0)
    """Noise: seed of the noise; each sample and position derives its own from it and the sample's seed."""
    engine: Literal["trainer", "vllm"] = "trainer"
    """Where it acts: ``trainer``, the exact sampler (needs ``diagnostics.vexact: exact``, so the only mismatch
    is the injected one), or ``vllm``, a vLLM logits processor in the rollout fleet (real and injected mismatch
    stack)."""


class DumpsConfig(Section):
    every: int = Field(0, ge=0)
    """Write a token dump every this many steps (0: off)."""
    max_tokens: int = Field(200_000, ge=1)
    """Cap on tokens per dump (uniformly subsampled above it)."""
    routed_experts: bool = False
    """Include the routed expert ids in dumps (when captured)."""


class EarlyWarningConfig(Section):
    metrics: list[str] = [names.RHO_STD]
    """Metrics watched for persistent growth."""
    rule: Literal["trend", "median_ratio"] = "trend"
    """trend: noise-aware CUSUM of log(value) against the run's own baseline level and noise
    (``algo/early_warning.py`` TrendDetector); median_ratio: the earlier rule, median of the last ``window``
    values >= ``threshold`` x the median of the first ``baseline_steps`` (blind to the run's noise)."""
    baseline_steps: int = Field(TREND.baseline_steps, ge=2)
    """First positive finite values whose median is a metric's baseline level (both rules; the default is the
    trend rule's: ``median_ratio``'s own, which ``tim report`` replays, is ``warning_defaults.MEDIAN_RATIO``'s)."""
    k: float = Field(TREND.k, ge=0)
    """trend: allowance per step, in noise SDs; growth smaller than this is ignored however long it lasts."""
    h: float = Field(TREND.h, gt=0)
    """trend: fires when the cumulative excess (in noise SDs) exceeds this."""
    z_cap: float = Field(TREND.z_cap, gt=0)
    """trend: one step counts at most this many noise SDs, so a lone spike cannot fire it (with h > z_cap - k)."""
    window: int = Field(MEDIAN_RATIO.window, ge=1)
    """median_ratio: recent values whose median is compared with the baseline."""
    threshold: float = Field(MEDIAN_RATIO.threshold, gt=1)
    """median_ratio: fires when median(recent) >= threshold x baseline."""


class SyncFault(Section):
    kind: Literal["off", "skip", "corrupt"] = "off"
    """A deliberate fault in the weight sync into one engine, to prove that verification catches it (tests,
    preflight): ``skip`` loads nothing (the engine keeps stale weights), ``corrupt`` loads a well-shaped but wrong
    tensor (attention output rows rotated). Off in every real run."""
    engine: int = Field(0, ge=0)
    """The engine the fault hits."""


_REMOVED_VEXACT = {
    "recompute": "it only overwrote the rollout logprobs with the trainer's (the metrics read zero while the tokens "
    "still came from vLLM, so training was unchanged)",
    "trainer_sampler": "it sampled with the trainer's model but not with the training forward's shapes, so its "
    "logprobs were not bit-identical",
}


class DiagnosticsConfig(Section):
    vexact: Literal["off", "exact"] = "off"
    """Zero-mismatch mode. ``exact``: the trainer samples every token from its own logits, computed on row-invariant
    kernels (each position's bits depend only on its own sequence up to it) by a KV-cached decode or a full
    forward (``exact_sampler``), so each logged rollout logprob equals the old logprob bit for bit; the loop checks
    it every step and stops at the first token where they differ."""
    exact_sampler: Literal["kv-cache", "full-forward"] = "kv-cache"
    """How exact mode decodes. ``kv-cache``: incremental decoding through the trainer's model with a fixed-width KV
    cache (one new position per sequence per step); ``full-forward``: one full training forward of the micro-batch
    per generated token (the reference it is tested against). Both run the forward on row-invariant kernels, so
    both give the old-logprob pass's bits, and the same samples for the same seeds."""
    allow_precision_mismatch: bool = False
    """Permit trainer and rollout dtypes or heads to differ (an experiment, not an accident)."""
    objective_injection: ObjectiveInjection = ObjectiveInjection()
    """Controlled token-weight distortion in the loss (objective-level hacking experiments)."""
    sampling_injection: SamplingInjection = SamplingInjection()
    """Controlled mismatch in the sampling distribution (VeXact causality experiments)."""
    surrogate_delta: float = Field(2.0, ge=0)
    """delta used by the logged surrogate J = sum A (phi - 1), whether or not injection is on."""
    bucket_edges: list[float] = [0.0, 0.01, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0]
    """pi_train bucket edges for per-bucket rho statistics."""
    rho_thresholds: list[float] = [1e-3, 1e-2, 1e-1]
    """Report the fraction of tokens with |rho - 1| above each."""
    dumps: DumpsConfig = DumpsConfig()
    """Token dumps for the report."""
    early_warning: EarlyWarningConfig = EarlyWarningConfig()
    """Early-warning detector settings."""
    sync_fault: SyncFault = SyncFault()
    """Deliberate weight-sync fault on one engine (verification tests only)."""

    @field_validator("vexact", mode="before")
    @classmethod
    def _removed_vexact_modes(cls, v):
        if v in _REMOVED_VEXACT:
            raise ValueError(
                f"{v!r} was removed: {_REMOVED_VEXACT[v]}. Use 'exact' (the trainer samples from its own training "
                "forward: rho = 1 bit for bit), or 'off'"
            )
        return v

    @model_validator(mode="before")
    @classmethod
    def _removed_logprob_injection(cls, data):
        if isinstance(data, dict) and "logprob_injection" in data:
            raise ValueError(
                "diagnostics.logprob_injection was removed: it changed only the logged rollout logprobs, never the "
                "sampled tokens, so with rl.correction.mode = none training was unchanged. Use "
                "diagnostics.sampling_injection (type precision, noise or bias), which samples from the perturbed "
                "distribution"
            )
        return data


# --------------------------------------------------------------------------------------------- data


class TaskConfig(Section):
    kind: Literal["arithmetic", "countdown"] = "arithmetic"
    """The built-in task (``data.train.kind: arithmetic``). arithmetic: ``a+b=`` with a 1-2 token answer (the
    smoke demo). countdown: the lab task (``tim_megatron/data/countdown.py``): reach the prompt's target with a
    chain of single digits, writing every running value (``9+8=17+9=26``); responses of 1 to 100+ tokens whose
    length is the policy's choice."""
    max_operand: int = Field(9, ge=1)
    """arithmetic: operands are drawn from 0..max_operand."""
    ops: list[Literal["+", "-", "*"]] = ["+"]
    """Operators: arithmetic draws one per prompt; countdown's warm-up chains draw one per step."""
    num_prompts: int = Field(0, ge=0)
    """Size of the fixed prompt pool, drawn with the data seed (0: every problem of the task)."""
    min_target: int = Field(10, ge=1)
    """countdown: smallest target."""
    max_target: int = Field(40, ge=1)
    """countdown: largest target."""
    max_terms: int = Field(12, ge=1)
    """countdown: the warm-up's random chains have 1..max_terms digits (it shapes the start policy's lengths)."""


class DatasetConfig(Section):
    kind: Literal["arithmetic", "dapo_math", "aime24", "file"] = "arithmetic"
    """Built-in arithmetic task, DAPO-Math-17k, AIME24, or a generic parquet/jsonl file."""
    path: str | None = None
    """Hub name (cluster) or local parquet/jsonl/folder. Unset: the kind's hub name."""
    split: str = "train"
    """Dataset split."""
    prompt_key: str | None = None
    """Column holding the prompt. Unset: the kind's default."""
    answer_key: str | None = None
    """Column holding the reference answer. Unset: the kind's default."""
    limit: int | None = Field(None, ge=1)
    """Use at most this many rows."""


class DataConfig(Section):
    train: DatasetConfig = DatasetConfig()
    """Training prompts."""
    val: DatasetConfig | None = None
    """Validation prompts (unset: the training task's held-out draw for arithmetic, else none)."""
    task: TaskConfig = TaskConfig()
    """Built-in task settings (``data.train.kind: arithmetic``): the arithmetic demo or the countdown lab task."""
    seed: int | None = Field(None, ge=0)
    """Seed of the prompt pool, the prompt order and the validation draw. Unset: ``run.seed``. ``tim lab`` fixes it
    so that every seed of a grid sees the same prompts in the same order (only sampling and shuffling vary)."""
    prompts_per_step: int = Field(8, ge=1)
    """Prompts per RL step (each gets ``rollout.n`` responses)."""
    val_prompts: int = Field(32, ge=1)
    """Validation prompts per evaluation."""
    max_prompt_tokens: int = Field(64, ge=1)
    """Prompts longer than this (in tokens) are an error at load time."""


# ------------------------------------------------------------------------------------------ logging


class WandbConfig(Section):
    mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    """auto: online when WANDB_API_KEY is set, offline otherwise."""
    project: str = "tim-megatron"
    """wandb project."""
    entity: str | None = None
    """wandb entity (team)."""
    tags: list[str] = []
    """Extra run tags (the sweep id and recipe name are added)."""


class LoggingConfig(Section):
    wandb: WandbConfig = WandbConfig()
    """wandb tracker settings."""
    console: bool = True
    """One summary line per step on the console, with a progress bar."""
    engine_level: Literal["debug", "info", "warning", "error"] = "warning"
    """Level of the rollout engine's own log (vLLM's), written with the other libraries' warnings to
    ``<run_dir>/logs/engine.log`` (one file per rank: ``engine.rank<N>.log``); only its errors reach the console,
    so each step is one line there. ``info`` adds vLLM's start-up details and three lines per weight reload. The
    harmless "RotaryEmbedding: Failed to load weights" of every reload is dropped at any level (why:
    tim_megatron/rollout/engine_log.py; the routing: tim_megatron/logging/library_log.py)."""


class CheckpointConfig(Section):
    every: int = Field(0, ge=0)
    """Save every this many steps (0: only at the end and on SIGTERM)."""
    keep: int = Field(2, ge=1)
    """Most recent checkpoints kept."""
    save_optimizer: bool = True
    """Include optimizer state (needed for an exact resume)."""
    at_end: bool = True
    """Save after the last step. Off only for throwaway runs (tests, benchmarks, quick probes): a completed run
    without it cannot be resumed or exported."""


# ------------------------------------------------------------------------------------------ cluster

GPU_MEMORY_GIB: dict[str, int] = {
    "a100-40gb": 40,
    "a100-80gb": 80,
    "h100-80gb": 80,
    "h100-94gb": 94,
    "h200-141gb": 141,
    "b200-180gb": 180,
}
"""Memory of each GPU type ``cluster.gpu_type`` may name, GiB (the memory plan's budget)."""
GPU_PEAK_BF16_FLOPS: dict[str, float] = {
    "a100-40gb": 312e12,
    "a100-80gb": 312e12,
    "h100-80gb": 989e12,
    "h100-94gb": 835e12,
    "h200-141gb": 989e12,
    "b200-180gb": 2250e12,
}
"""Dense bf16 tensor-core peak of each GPU type, FLOP/s (vendor data sheets, without sparsity; h100-94gb is the
H100 NVL): the step estimate's update and old-logprob times are FLOPs / (GPUs x this x ``cluster.assumed_mfu``)."""


class ClusterConfig(Section):
    nodes: int = Field(1, ge=1)
    """Slurm nodes."""
    gpus_per_node: int = Field(0, ge=0)
    """GPUs per node (0: a CPU partition; gloo instead of NCCL)."""
    gpu_type: str = "a100-80gb"
    """GPU model, for memory planning: one of ``GPU_MEMORY_GIB`` (a100-40gb, a100-80gb, h100-80gb, h100-94gb,
    h200-141gb, b200-180gb)."""

    @field_validator("gpu_type")
    @classmethod
    def _known_gpu(cls, v: str) -> str:
        if v not in GPU_MEMORY_GIB:
            raise ValueError(
                f"unknown GPU type; allowed: {', '.join(GPU_MEMORY_GIB)} (the plan needs its memory size; "
                "pick the closest one with no more memory than yours)"
            )
        return v

    assumed_mfu: float = Field(0.2, gt=0, le=1)
    """Model FLOPs utilization ``tim plan`` assumes for the trainer's forward and backward passes: the fraction of
    the GPU's dense bf16 peak (``GPU_PEAK_BF16_FLOPS``) its matmuls and attention reach. The default, 0.2, is
    NVIDIA's published Megatron-Core figure for this model class: Qwen3-30B-A3B pre-training on 16 DGX-H100
    GPUs, 206-208 model TFLOP/s per GPU (Megatron-Bridge ``docs/performance-summary-archive.md``, NeMo
    containers 26.02.01 and 26.04), i.e. 21% of 989 TFLOP/s. That run is FP8 with forced expert balance and
    fixed 4K sequences, so a bf16, dropless RL update reaches at most that: the estimate is a lower bound."""
    assumed_sync_gb_per_s: float = Field(100.0, gt=0)
    """Rate, GB/s (10^9 bytes), at which each GPU receives the whole model in the rollout dtype during the weight
    sync (the export gathers every parameter on every rank). An assumption: about a quarter of an H100's NVLink
    (450 GB/s per direction), since the export moves one parameter at a time and vLLM loads each as it arrives."""
    assumed_host_gb_per_s: float = Field(25.0, gt=0)
    """Rate, GB/s, of one GPU's copies to and from pinned host memory (``trainer.offload_during_rollout``). An
    assumption: PCIe Gen4 x16 is 32 GB/s nominal (Gen5: 64); pinned copies reach about 80% of it."""
    reference_step_seconds: float | None = Field(None, gt=0)
    """A published whole-step time of the setting this recipe reproduces, seconds: ``tim plan`` prints it beside
    its own estimate. A recipe that changes the setting should unset it (``null``)."""
    reference_step_source: str | None = None
    """Where ``reference_step_seconds`` is published (document, version, table row); required with it."""

    @model_validator(mode="after")
    def _reference_has_a_source(self) -> ClusterConfig:
        if self.reference_step_seconds is not None and not self.reference_step_source:
            raise RecipeValueError(
                ["cluster.reference_step_seconds", "cluster.reference_step_source"],
                f"cluster.reference_step_seconds = {self.reference_step_seconds:g} needs "
                "cluster.reference_step_source (where the figure is published)",
            )
        return self

    cpus_per_task: int = Field(2, ge=1)
    """CPUs per launcher task (one per node)."""
    mem: str = "0"
    """Memory per node (Slurm syntax; 0 = all)."""
    partition: str | None = None
    """Slurm partition."""
    account: str | None = None
    """Slurm account."""
    qos: str | None = None
    """Slurm QoS."""
    time: str = "04:00:00"
    """Wall-time limit."""
    job_name: str | None = None
    """Job name (unset: the run name)."""
    requeue: bool = True
    """Let Slurm requeue the job after preemption; the run resumes from its SIGTERM checkpoint."""
    max_requeues: int = Field(3, ge=0, le=1000)
    """Most times the job requeues itself (after a time-limit SIGTERM, and only when that attempt wrote a
    checkpoint); then it stops as ``preempted`` and ``tim submit --resume`` continues it."""
    signal_seconds: int = Field(120, ge=10)
    """Slurm sends SIGTERM this long before the time limit so the run can checkpoint."""
    container_image: str | None = None
    """pyxis/enroot image (``--container-image``); unset: run in the host environment."""
    container_mounts: list[str] = []
    """pyxis mounts, ``src:dst`` each."""
    env: dict[str, str] = {}
    """Extra environment for the job (secrets pass through the submitting shell, never here)."""
    hf_home: str | None = None
    """HF_HOME inside the job."""
    venv: str | None = None
    """Python environment to activate in the job (unset: the submitting one)."""


class RunConfig(Section):
    name: str | None = Field(None, pattern=NAME_PATTERN)
    """Run name: letters, digits, '.', '_' and '-' (unset: derived from the recipe's folder and file)."""
    steps: int = Field(20, ge=1)
    """RL steps."""
    seed: int = Field(0, ge=0)
    """Global seed."""
    output_dir: str = "runs"
    """Folder holding ``<name>/<timestamp>/`` run folders."""
    val_every: int = Field(0, ge=0)
    """Validate every this many steps (0: off)."""
    val_samples: int = Field(0, ge=0, le=256)
    """Sampled policy evaluation at each validation: this many samples per validation prompt, drawn with the
    rollout's sampling settings from the policy itself (no sampling injection), scored, and logged as
    ``val/policy_reward`` (0: off); the untrained policy too, before step 1's rollout (``val/policy_reward_start``
    and ``val/accuracy_start`` in step 1's row). The lab's outcome: an injected arm's training reward is its
    distorted sampler's, not its policy's."""
    sweep_id: str | None = Field(None, pattern=NAME_PATTERN)
    """Set by ``make sweep``: tags every variant of one sweep."""


# ------------------------------------------------------------------------------------------- recipe


def _dtype_default(explicit: Dtype | None, fp16: bool) -> Dtype:
    if explicit is not None:
        return explicit
    return "float16" if fp16 else "bfloat16"


class Recipe(Section):
    """A complete, validated run description."""

    model: ModelConfig = ModelConfig()
    """The policy model."""
    parallel: ParallelismConfig = ParallelismConfig()
    """Megatron parallel layout."""
    rollout: RolloutConfig = RolloutConfig()
    """vLLM rollout engine."""
    trainer: TrainerConfig = TrainerConfig()
    """Megatron trainer."""
    optim: OptimConfig = OptimConfig()
    """Optimizer."""
    rl: RLConfig = RLConfig()
    """RL algorithm: loss, clipping, aggregation, advantages, IS correction, epochs, minibatches."""
    remedies: RemediesConfig = RemediesConfig()
    """TIM remedies: routing replay, FP32 head, FP16, LR schedule."""
    diagnostics: DiagnosticsConfig = DiagnosticsConfig()
    """VeXact mode, injections, dumps, early warning."""
    data: DataConfig = DataConfig()
    """Prompts and rewards."""
    logging: LoggingConfig = LoggingConfig()
    """Trackers and console."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Checkpointing."""
    cluster: ClusterConfig = ClusterConfig()
    """Slurm resources."""
    run: RunConfig = RunConfig()
    """Run length, seeds, output."""

    @model_validator(mode="after")
    def _resolve_and_check(self) -> Recipe:
        check_recipe(self)
        return self

    # Derived settings: read these, not the raw optional fields.
    @property
    def trainer_dtype(self) -> Dtype:
        return _dtype_default(self.trainer.dtype, self.remedies.fp16)

    @property
    def rollout_dtype(self) -> Dtype:
        return _dtype_default(self.rollout.dtype, self.remedies.fp16)

    @property
    def sync_tolerance(self) -> float:
        if self.rollout.sync_tolerance is not None:
            return self.rollout.sync_tolerance
        both_fp32 = self.trainer_dtype == "float32" and self.rollout_dtype == "float32"
        return 1e-4 if both_fp32 else 0.01

    @property
    def sequences_per_step(self) -> int:
        return self.data.prompts_per_step * self.rollout.n
