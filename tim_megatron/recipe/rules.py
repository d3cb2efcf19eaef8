"""The recipe's cross-field rules, by section: each failure names every key involved (:class:`RecipeValueError`).

Each rule takes the whole :class:`~tim_megatron.recipe.schema.Recipe` (untyped here: the schema calls these rules
from its validator, and this module imports nothing of it)."""

from __future__ import annotations

import itertools

from tim_megatron.recipe.base import RecipeValueError
from tim_megatron.recipe.decisions import rollout_backend


def check_recipe(r) -> None:
    """Cross-field rules, by section, in this order (the first failure is reported). Each failure names every
    key involved."""
    _check_model_and_parallel(r)
    _check_rl(r)
    _check_precision_and_lengths(r)
    _check_fleet(r)
    _check_diagnostics(r)
    _check_injection(r)
    _check_task_and_schedule(r)
    _check_offpolicy_schedule(r)
    r.rollout.partial.check_recipe(r)  # rollout.partial's own rules (recipe/schema.py PartialRollouts)
    _check_engine_process(r)
    _check_run_bounds(r)
    _check_offpolicy_correction(r)


def _check_model_and_parallel(r) -> None:
    """Attention heads, experts and vocabulary against the tensor-, expert- and pipeline-parallel sizes."""
    d, p = r.model.dims, r.parallel
    if p.pp != 1:
        raise RecipeValueError(["parallel.pp"], f"parallel.pp = {p.pp}: only pp = 1 is implemented")
    if d.num_attention_heads % d.num_key_value_heads:
        raise RecipeValueError(
            ["model.dims.num_attention_heads", "model.dims.num_key_value_heads"],
            f"num_key_value_heads = {d.num_key_value_heads} must divide num_attention_heads = {d.num_attention_heads}",
        )
    if d.num_attention_heads % p.tp:
        raise RecipeValueError(
            ["parallel.tp", "model.dims.num_attention_heads"],
            f"parallel.tp = {p.tp} must divide model.dims.num_attention_heads = {d.num_attention_heads}",
        )
    if d.num_key_value_heads % p.tp:
        raise RecipeValueError(
            ["parallel.tp", "model.dims.num_key_value_heads"],
            f"parallel.tp = {p.tp} must divide model.dims.num_key_value_heads = {d.num_key_value_heads} (megatron-core splits query groups)",
        )
    if d.is_moe:
        if not 0 < d.num_experts_per_tok <= d.num_experts:
            raise RecipeValueError(
                ["model.dims.num_experts_per_tok", "model.dims.num_experts"],
                f"num_experts_per_tok = {d.num_experts_per_tok} must be in 1..num_experts = {d.num_experts}",
            )
        if d.num_experts % p.ep:
            raise RecipeValueError(
                ["parallel.ep", "model.dims.num_experts"],
                f"parallel.ep = {p.ep} must divide model.dims.num_experts = {d.num_experts}",
            )
        if (p.tp * p.dp) % (p.ep * p.etp):
            raise RecipeValueError(
                ["parallel.ep", "parallel.expert_tp", "parallel.tp", "parallel.dp"],
                f"parallel.ep x parallel.expert_tp = {p.ep * p.etp} must divide parallel.tp x parallel.dp = {p.tp * p.dp}",
            )
        if p.ep == 1 and p.etp != p.tp:
            # megatron-core reduces the gradients of non-expert-parallel experts over the dense data-parallel
            # group only; with expert_tp < tp the TP ranks' expert gradients would never be summed.
            raise RecipeValueError(
                ["parallel.expert_tp", "parallel.tp", "parallel.ep"],
                f"parallel.expert_tp = {p.etp} with parallel.ep = 1 must equal parallel.tp = {p.tp} "
                "(otherwise expert gradients are not reduced across TP ranks); unset it, or use parallel.ep > 1",
            )
    else:
        if p.ep != 1:
            raise RecipeValueError(
                ["parallel.ep"], f"parallel.ep = {p.ep} needs an MoE model (model.dims.num_experts > 0)"
            )
        if r.remedies.router_replay != "off":
            raise RecipeValueError(
                ["remedies.router_replay"],
                f"remedies.router_replay = {r.remedies.router_replay} needs an MoE model",
            )
    if d.vocab_size % p.tp:
        raise RecipeValueError(
            ["parallel.tp", "model.dims.vocab_size"],
            f"parallel.tp = {p.tp} must divide model.dims.vocab_size = {d.vocab_size}",
        )
    _check_sinks_and_biases(r)
    if d.is_mla and r.diagnostics.vexact == "exact":
        raise RecipeValueError(
            ["diagnostics.vexact", "model.dims.kv_lora_rank"],
            "diagnostics.vexact = exact with multi-head latent attention: exact mode's row-invariant kernels and "
            "KV-cache sampler cover megatron-core's ordinary attention, not MLA's; allowed for MLA: "
            "diagnostics.vexact = off",
        )


def _check_sinks_and_biases(r) -> None:
    """gpt-oss's features against the trainer's settings that cannot compute them."""
    d, p = r.model.dims, r.parallel
    if d.linear_biases and d.is_moe and p.etp > 1:
        raise RecipeValueError(
            ["parallel.expert_tp", "model.dims.linear_biases"],
            f"parallel.expert_tp = {p.etp} with expert biases (model.dims.linear_biases): megatron-core sums the "
            "expert-TP ranks' outputs, and each would add the whole fc2 bias; allowed: expert_tp = 1 (with "
            "parallel.tp > 1, set parallel.ep > 1 and parallel.expert_tp = 1)",
        )
    if d.linear_biases and d.is_moe and r.trainer.experts == "grouped":
        raise RecipeValueError(
            ["trainer.experts", "model.dims.linear_biases"],
            "trainer.experts = grouped with expert biases (model.dims.linear_biases): the grouped experts "
            "(tim_megatron/trainer/experts.py) have no biases; allowed: loop, auto (which takes the loop here)",
        )
    if (d.attention_sinks or d.sliding_window) and r.diagnostics.vexact == "exact":
        raise RecipeValueError(
            ["diagnostics.vexact", "model.dims.attention_sinks", "model.dims.sliding_window"],
            "diagnostics.vexact = exact with attention sinks or sliding windows: exact mode's row-invariant "
            "attention and its sampler's KV cache compute neither; allowed for such models: diagnostics.vexact = "
            "off",
        )


def _check_rl(r) -> None:
    """The RL algorithm: loss and aggregation, minibatches, the rollout correction."""
    p = r.parallel
    # GSPO is defined on a sequence ratio averaged per sequence: token-mean would reweight by length.
    if r.rl.loss == "gspo" and r.rl.aggregation != "seq-mean-token-mean":
        raise RecipeValueError(
            ["rl.loss", "rl.aggregation"],
            f"rl.loss = gspo needs rl.aggregation = seq-mean-token-mean (got {r.rl.aggregation})",
        )
    if r.sequences_per_step % r.rl.minibatches:
        raise RecipeValueError(
            ["rl.minibatches", "data.prompts_per_step", "rollout.n"],
            f"rl.minibatches = {r.rl.minibatches} must divide data.prompts_per_step x rollout.n = {r.sequences_per_step}",
        )
    mb_seqs = r.sequences_per_step // r.rl.minibatches
    if mb_seqs % p.dp:
        raise RecipeValueError(
            ["parallel.dp", "rl.minibatches", "data.prompts_per_step", "rollout.n"],
            f"each minibatch holds {mb_seqs} sequences, which parallel.dp = {p.dp} must divide",
        )
    c = r.rl.correction
    if c.bypass and c.mode != "none":
        # Bypass makes the old policy the rollout's, so every correction weight would be exactly 1.
        raise RecipeValueError(
            ["rl.correction.bypass", "rl.correction.mode"],
            f"rl.correction.bypass = true with rl.correction.mode = {c.mode}: bypass uses the rollout logprobs as "
            f"the old policy, so the {c.mode} weights pi_old / pi_rollout are all 1 and the correction does nothing "
            "(and no mismatch is measured); set rl.correction.mode = none, or bypass = false",
        )
    if c.bypass and r.rollout.max_staleness:
        raise RecipeValueError(
            ["rl.correction.bypass", "rollout.max_staleness"],
            f"rl.correction.bypass = true with rollout.max_staleness = {r.rollout.max_staleness}: bypass skips the "
            "trainer's pass over the samples, which is what splits the ratio into staleness and TIM; allowed: "
            "bypass = false, or max_staleness = 0",
        )
    if c.target != "total" and c.mode == "none":
        raise RecipeValueError(
            ["rl.correction.target", "rl.correction.mode"],
            f"rl.correction.target = {c.target} with rl.correction.mode = none: there is no correction to aim; "
            "allowed: target = total, or a mode (tis, mis, icepop)",
        )
    if c.mode == "icepop" and not c.low < 1 < c.high:
        raise RecipeValueError(
            ["rl.correction.low", "rl.correction.high"],
            f"IcePop bounds must satisfy low < 1 < high (got low = {c.low}, high = {c.high})",
        )
    if c.mode in ("tis", "mis") and c.c < 1:
        raise RecipeValueError(
            ["rl.correction.c"],
            f"rl.correction.c = {c.c}: TIS/MIS thresholds below 1 reject on-policy tokens",
        )


def _check_precision_and_lengths(r) -> None:
    """Precision on both sides, and the sequence lengths against the model's positions."""
    d = r.model.dims
    # Precision: one remedy switch drives both sides; a deliberate difference must be declared.
    if r.remedies.fp16:
        for key, val in (("trainer.dtype", r.trainer.dtype), ("rollout.dtype", r.rollout.dtype)):
            if val not in (None, "float16") and not r.diagnostics.allow_precision_mismatch:
                raise RecipeValueError(
                    [key, "remedies.fp16"],
                    f"{key} = {val} contradicts remedies.fp16 = true (leave it unset, or float16)",
                )
    if r.trainer_dtype != r.rollout_dtype and not r.diagnostics.allow_precision_mismatch:
        raise RecipeValueError(
            ["trainer.dtype", "rollout.dtype", "diagnostics.allow_precision_mismatch"],
            f"trainer.dtype = {r.trainer_dtype} but rollout.dtype = {r.rollout_dtype}; set "
            "diagnostics.allow_precision_mismatch = true if the difference is on purpose",
        )
    if r.rollout.max_tokens + r.data.max_prompt_tokens > r.rollout.max_model_len:
        raise RecipeValueError(
            ["rollout.max_tokens", "data.max_prompt_tokens", "rollout.max_model_len"],
            f"rollout.max_tokens = {r.rollout.max_tokens} + data.max_prompt_tokens = {r.data.max_prompt_tokens} "
            f"exceeds rollout.max_model_len = {r.rollout.max_model_len}",
        )
    if r.rollout.max_model_len > d.max_position_embeddings:
        raise RecipeValueError(
            ["rollout.max_model_len", "model.dims.max_position_embeddings"],
            f"rollout.max_model_len = {r.rollout.max_model_len} exceeds model.dims.max_position_embeddings = {d.max_position_embeddings}",
        )


def _check_fleet(r) -> None:
    """The rollout fleet: engines against nodes, prompts against engines and data-parallel ranks."""
    p = r.parallel
    # The rollout fleet.
    R = r.rollout.tensor_parallel_size
    gpn = r.cluster.gpus_per_node
    if gpn and gpn % R and R % gpn:
        raise RecipeValueError(
            ["rollout.tensor_parallel_size", "cluster.gpus_per_node"],
            f"rollout.tensor_parallel_size = {R} must divide cluster.gpus_per_node = {gpn} (engines inside a node) "
            f"or be a multiple of it (engines of whole nodes)",
        )
    if r.data.prompts_per_step % p.dp:
        raise RecipeValueError(
            ["data.prompts_per_step", "parallel.dp"],
            f"data.prompts_per_step = {r.data.prompts_per_step} must be a multiple of parallel.dp = {p.dp}: each "
            "data-parallel rank trains whole prompt groups",
        )
    if r.diagnostics.vexact != "exact" and p.world_size % R == 0:
        engines = p.world_size // R
        if r.data.prompts_per_step < engines:
            raise RecipeValueError(
                ["data.prompts_per_step", "rollout.tensor_parallel_size", "parallel.dp"],
                f"data.prompts_per_step = {r.data.prompts_per_step} leaves some of the {engines} rollout engines "
                f"(world {p.world_size} / rollout.tensor_parallel_size {R}) without a prompt",
            )


def _check_diagnostics(r) -> None:
    """VeXact: bypass, and what exact mode needs of the rollout, the parallel layout and the router."""
    p = r.parallel
    # Diagnostics.
    dg = r.diagnostics
    implied = "trainer" if dg.vexact == "exact" else "vllm"
    if r.rollout.backend is not None and r.rollout.backend != implied:
        raise RecipeValueError(
            ["rollout.backend", "diagnostics.vexact"],
            f"rollout.backend = {r.rollout.backend} with diagnostics.vexact = {dg.vexact}: the trainer backend is "
            "exact mode's sampler (the trainer's own forward), and exact mode samples with nothing else. "
            f"Allowed here: rollout.backend = {implied} (or unset)",
        )
    if dg.vexact != "off" and r.rl.correction.bypass:
        raise RecipeValueError(
            ["diagnostics.vexact", "rl.correction.bypass"],
            f"rl.correction.bypass = true is refused with diagnostics.vexact = {dg.vexact}: without an injection the "
            "rollout and old logprobs are the same forward, so it would change nothing; with "
            "diagnostics.sampling_injection it would make the ratio pi / mu (mu the injected sampling distribution) "
            "and change what the arm measures. Allowed: rl.correction.bypass = false",
        )
    if dg.vexact == "exact":
        if r.remedies.router_replay == "r3":
            raise RecipeValueError(
                ["diagnostics.vexact", "remedies.router_replay"],
                "remedies.router_replay = r3 replays vLLM's experts, but vexact = exact uses no vLLM rollout "
                "(its routing is the trainer's own already)",
            )
        if r.trainer.offload_during_rollout != "none":
            raise RecipeValueError(
                ["diagnostics.vexact", "trainer.offload_during_rollout"],
                f"trainer.offload_during_rollout = {r.trainer.offload_during_rollout}: vexact = exact samples "
                "from the trainer's own weights, so nothing can leave while it generates; allowed: none",
            )
        ro = r.rollout
        if ro.top_p < 1 or ro.top_k != -1 or ro.stop:
            raise RecipeValueError(
                ["diagnostics.vexact", "rollout.top_p", "rollout.top_k", "rollout.stop"],
                f"vexact = exact samples from the whole softmax and stops at the end-of-text token only; got "
                f"rollout.top_p = {ro.top_p}, rollout.top_k = {ro.top_k}, rollout.stop = {ro.stop} (leave them unset)",
            )
        if p.tp > 2:
            raise RecipeValueError(
                ["diagnostics.vexact", "parallel.tp"],
                f"vexact = exact sums the LM head's vocabulary shards over at most 2 tensor-parallel ranks (a + b is "
                f"exact in either order; the vocab-parallel cross-entropy's all-reduce over 3 or more depends on the "
                f"buffer size): got parallel.tp = {p.tp}; allowed tp <= 2 (the expert group may be any size: its "
                "sums are gathered and added in rank order)",
            )
        if r.trainer.moe_dispatcher in ("alltoall", "indexed"):
            raise RecipeValueError(
                ["diagnostics.vexact", "trainer.moe_dispatcher"],
                "vexact = exact runs the experts on row-invariant kernels over the allgather dispatcher; got "
                f"trainer.moe_dispatcher = {r.trainer.moe_dispatcher}: set it to allgather or auto",
            )
        if r.trainer.experts == "grouped":
            raise RecipeValueError(
                ["diagnostics.vexact", "trainer.experts"],
                "trainer.experts = grouped with vexact = exact: exact mode runs each expert's GEMMs on its "
                "row-invariant kernels (a grouped GEMM's rows depend on the other experts' token counts); set "
                "trainer.experts = loop or auto",
            )
        if r.trainer.attention == "sdpa":
            raise RecipeValueError(
                ["diagnostics.vexact", "trainer.attention"],
                "trainer.attention = sdpa with vexact = exact: exact mode replaces the materialized attention's "
                "GEMMs with its invariant kernels; set trainer.attention = materialized or auto",
            )


def _check_injection(r) -> None:
    """The sampling-distribution injection: which side it acts on, and what that side must allow."""
    dg = r.diagnostics
    inj = dg.sampling_injection
    if inj.type != "off" and inj.engine == "trainer" and dg.vexact != "exact":
        raise RecipeValueError(
            ["diagnostics.sampling_injection.engine", "diagnostics.vexact"],
            f"diagnostics.sampling_injection.engine = trainer perturbs the exact sampler's distribution, so it "
            f"needs diagnostics.vexact = exact (got {dg.vexact}); or use engine = vllm",
        )
    if inj.type == "precision":
        side = "trainer" if inj.engine == "trainer" else "rollout"
        dtype = r.trainer_dtype if side == "trainer" else r.rollout_dtype
        if dtype != "float32" and not r.remedies.fp32_lm_head:
            raise RecipeValueError(
                ["diagnostics.sampling_injection.type", f"{side}.dtype", "remedies.fp32_lm_head"],
                f"precision injection rounds float32 logits (Eq. 45), but the {side}'s LM head makes {dtype} "
                f"logits, already rounded: the logit rounding would cancel in rho. Set {side}.dtype = float32 or "
                "remedies.fp32_lm_head = true",
            )
    if inj.type != "off" and inj.engine == "vllm":
        if dg.vexact != "off":
            raise RecipeValueError(
                ["diagnostics.sampling_injection.engine", "diagnostics.vexact"],
                "diagnostics.sampling_injection.engine = vllm acts in the vLLM fleet, which vexact = exact does not "
                "use; set engine = trainer",
            )
        if r.rollout.sync_check == "every":
            raise RecipeValueError(
                ["diagnostics.sampling_injection.engine", "rollout.sync_check"],
                "rollout.sync_check = every verifies each weight sync on the next step's samples by comparing the "
                "trainer's logprobs with the rollout's, which the injection makes mu's: set rollout.sync_check = "
                "probe (every sync verified on a probe batch, scored without the injection)",
            )
        if not r.rollout.logprobs_after_temperature:
            raise RecipeValueError(
                ["diagnostics.sampling_injection.engine", "rollout.logprobs_after_temperature"],
                "with engine = vllm the logged logprobs must be the perturbed distribution's, which vLLM reports "
                "only after its logits processors (rollout.logprobs_after_temperature = true)",
            )


def _check_task_and_schedule(r) -> None:
    """The task's ranges, the probability buckets and the LR schedule."""
    dg = r.diagnostics
    t = r.data.task
    if t.kind == "countdown" and not t.min_target <= t.max_target <= 9 * t.max_terms:
        raise RecipeValueError(
            ["data.task.min_target", "data.task.max_target", "data.task.max_terms"],
            f"data.task.kind = countdown needs data.task.min_target <= data.task.max_target <= 9 x "
            f"data.task.max_terms (got {t.min_target}, {t.max_target}, 9 x {t.max_terms}): the warm-up's chains "
            "must be able to end on every target",
        )
    edges = dg.bucket_edges
    if len(edges) < 2 or any(b <= a for a, b in itertools.pairwise(edges)) or edges[0] < 0 or edges[-1] > 1:
        raise RecipeValueError(
            ["diagnostics.bucket_edges"],
            f"diagnostics.bucket_edges = {edges}: need >= 2 increasing values in [0, 1]",
        )
    lr = r.remedies.lr_schedule
    if (
        lr.type == "length_decay"
        and lr.trigger == "step"
        and lr.decay_period is None
        and lr.trigger_step == 0
    ):
        raise RecipeValueError(
            ["remedies.lr_schedule.decay_period", "remedies.lr_schedule.trigger_step"],
            "length_decay with trigger = step needs decay_period, or a trigger_step > 0 to derive it from",
        )


def _check_offpolicy_schedule(r) -> None:
    """The overlapped off-policy schedule: a lag to overlap, an engine with weights of its own, and memory for
    the engine and the trainer at once."""
    ro = r.rollout
    if ro.schedule != "overlapped":
        return
    if ro.max_staleness < 1:
        raise RecipeValueError(
            ["rollout.schedule", "rollout.max_staleness"],
            f"rollout.schedule = overlapped with rollout.max_staleness = {ro.max_staleness}: an on-policy step "
            "trains the batch it has just sampled, so there is nothing to sample beside the update; allowed: "
            "max_staleness >= 1, or schedule = sequential",
        )
    if rollout_backend(r) != "vllm":
        raise RecipeValueError(
            ["rollout.schedule", "rollout.backend", "diagnostics.vexact"],
            f"rollout.schedule = overlapped with the {rollout_backend(r)!r} rollout backend: it samples from the "
            "trainer's own weights, which the update changes while it would sample; allowed: backend vllm, or "
            "schedule = sequential (exact mode runs off-policy in sequence)",
        )
    if r.trainer.offload_during_rollout != "none" or ro.sleep_between_steps:
        raise RecipeValueError(
            ["rollout.schedule", "trainer.offload_during_rollout", "rollout.sleep_between_steps"],
            f"rollout.schedule = overlapped with trainer.offload_during_rollout = {r.trainer.offload_during_rollout} "
            f"and rollout.sleep_between_steps = {ro.sleep_between_steps}: the engine samples while the trainer "
            "updates, so neither can give its memory to the other; allowed: offload_during_rollout = none and "
            "sleep_between_steps = false",
        )
    if ro.tensor_parallel_size > 1:
        raise RecipeValueError(
            ["rollout.schedule", "rollout.tensor_parallel_size"],
            f"rollout.schedule = overlapped with rollout.tensor_parallel_size = {ro.tensor_parallel_size}: an "
            "engine over several ranks runs collectives while the trainer runs its own on the same ranks, which "
            "this schedule does not order; allowed: tensor_parallel_size = 1, or schedule = sequential",
        )


def _check_engine_process(r) -> None:
    """An engine in its own process, and the fire drill that needs one."""
    ro, d = r.rollout, r.rollout.fault_drill
    if ro.engine_process and rollout_backend(r) != "vllm":
        raise RecipeValueError(
            ["rollout.engine_process", "rollout.backend", "diagnostics.vexact"],
            f"rollout.engine_process = true with the {rollout_backend(r)!r} rollout backend: it samples with the "
            "trainer's own model, in the trainer's process; allowed: backend vllm, or engine_process = false",
        )
    if ro.engine_process and ro.tensor_parallel_size > 1:
        raise RecipeValueError(
            ["rollout.engine_process", "rollout.tensor_parallel_size"],
            f"rollout.engine_process = true with rollout.tensor_parallel_size = {ro.tensor_parallel_size}: an engine "
            "in its own process serves one rank; allowed: tensor_parallel_size = 1, or engine_process = false",
        )
    if d.kind != "none" and not ro.engine_process:
        raise RecipeValueError(
            ["rollout.fault_drill.kind", "rollout.engine_process"],
            f"rollout.fault_drill.kind = {d.kind} with rollout.engine_process = false: an engine in the rank's own "
            "process takes the rank down with it, so there is nothing to recover; allowed: engine_process = true, "
            "or kind = none",
        )
    if d.kind == "stale" and (d.phase == "sync" or d.step < 2):
        raise RecipeValueError(
            ["rollout.fault_drill.kind", "rollout.fault_drill.phase", "rollout.fault_drill.step"],
            f"rollout.fault_drill.kind = stale with phase = {d.phase}, step = {d.step}: a stale restart skips "
            "loading weights an update put in the engine, so it needs one before it (step 2 or later) and a call "
            "that is not itself the load (a failed load runs again); allowed: phase generate or wake, step >= 2",
        )
    if d.kind != "none" and d.rank >= r.parallel.world_size:
        raise RecipeValueError(
            ["rollout.fault_drill.rank", "parallel"],
            f"rollout.fault_drill.rank = {d.rank}: the run has ranks 0 to {r.parallel.world_size - 1}",
        )


UNBIASED_PAIRS = {"current": "total", "sampled": "tim"}
"""For each ``rl.proximal``, the ``rl.correction.target`` that weights PPO's ratio by the proximal policy over the
behaviour policy: against pi_t, pi_t / mu_s (decoupled PPO, AReaL); against pi_s, pi_s / mu_s."""


def _check_offpolicy_correction(r) -> None:
    """Off-policy (``rollout.max_staleness`` > 0), PPO's ratio must be corrected by the proximal policy over the
    behaviour policy, or the loss is biased: refused by name unless ``rl.correction.allow_biased``."""
    ro, c, prox = r.rollout, r.rl.correction, r.rl.proximal
    if not ro.max_staleness or c.allow_biased or c.bypass:  # bypass: refused off-policy by _check_rl
        return
    want = UNBIASED_PAIRS[prox]
    if c.mode == "none":
        raise RecipeValueError(
            ["rl.correction.mode", "rollout.max_staleness", "rl.proximal"],
            f"rl.correction.mode = none with rollout.max_staleness = {ro.max_staleness}: the batch was sampled by an "
            "older policy (and another engine), so PPO around the proximal policy needs each token weighted by "
            f"the proximal over the behaviour policy, and without a correction the loss is biased; set "
            f"rl.correction.mode = tis, mis or icepop with rl.correction.target = {want} (rl.proximal = {prox}; "
            "AReaL's decoupled loss is proximal current, target total, mode mis), or rl.correction.allow_biased = "
            "true to study the bias",
        )
    if c.target != want:
        raise RecipeValueError(
            ["rl.proximal", "rl.correction.target", "rollout.max_staleness"],
            f"rl.proximal = {prox} with rl.correction.target = {c.target} and rollout.max_staleness = "
            f"{ro.max_staleness}: the correction must weight PPO's ratio by its own proximal policy over the "
            f"behaviour policy, which with proximal {prox} is target {want}; another pair gives a biased loss. Set "
            f"rl.correction.target = {want}, or rl.correction.allow_biased = true to study the bias",
        )


def _check_run_bounds(r) -> None:
    """Values that can never take effect in this run, or that would size work without a bound the run sets."""
    run, ro, d, m = r.run, r.rollout, r.rollout.fault_drill, r.model
    if d.kind != "none" and d.step > run.steps:
        raise RecipeValueError(
            ["rollout.fault_drill.step", "run.steps"],
            f"rollout.fault_drill.step = {d.step} with run.steps = {run.steps}: the drill would never fire; allowed: "
            f"a step from 1 to {run.steps}",
        )
    if ro.max_staleness >= run.steps and ro.max_staleness:
        raise RecipeValueError(
            ["rollout.max_staleness", "run.steps"],
            f"rollout.max_staleness = {ro.max_staleness} with run.steps = {run.steps}: step 1 would sample "
            f"{ro.max_staleness + 1} batches, of which {ro.max_staleness + 1 - run.steps} would never be trained; "
            f"allowed: 0 to {run.steps - 1}",
        )
    if not ro.engine_process and ro.faults != type(ro.faults)():
        raise RecipeValueError(
            ["rollout.faults", "rollout.engine_process"],
            "rollout.faults is set with rollout.engine_process = false: its timeout and restart budgets apply to an "
            "engine in a process of its own, and an engine in the rank's process is never restarted; allowed: "
            "engine_process = true, or the rollout.faults defaults",
        )
    if r.rl.correction.target == "staleness" and not ro.max_staleness:
        raise RecipeValueError(
            ["rl.correction.target", "rollout.max_staleness"],
            "rl.correction.target = staleness with rollout.max_staleness = 0: on-policy the sampling weights are "
            "the current ones, so every staleness weight is 1 and the correction does nothing; allowed: target = "
            "total or tim, or max_staleness >= 1",
        )
    if r.trainer.attention == "materialized" and getattr(m.dims, "kv_lora_rank", 0):
        raise RecipeValueError(
            ["trainer.attention", "model.dims.kv_lora_rank"],
            f"trainer.attention = materialized with latent attention (model.dims.kv_lora_rank = "
            f"{m.dims.kv_lora_rank}): latent attention has one core attention, torch's fused kernel (sdpa), which "
            "would run anyway; allowed: auto or sdpa",
        )
    if run.val_samples and not run.val_every:
        raise RecipeValueError(
            ["run.val_samples", "run.val_every"],
            f"run.val_samples = {run.val_samples} with run.val_every = 0: the policy is evaluated only at "
            "validations, and there are none; allowed: run.val_every >= 1, or val_samples = 0",
        )
