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

import contextlib
import hashlib
import os
import shutil
import tempfile
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


_LAUNCHER_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
)


@contextlib.contextmanager
def _without_launcher_env():
    """vLLM must not mistake our trainer's torchrun/Slurm ranks for its own."""
    saved = {k: os.environ.pop(k) for k in _LAUNCHER_ENV if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


class VLLMEngine:
    """Rank 0's rollout engine.

    With one trainer process the engine runs in-process (weights reach it by reference). With several,
    torch.distributed already spans the trainer's ranks and vLLM would try to build its groups over them,
    so the engine core runs in its own processes (vLLM's multiprocessing mode) with the launcher's
    variables hidden, and weights travel through shared-memory safetensors files.
    """

    def __init__(
        self,
        recipe: Recipe,
        *,
        model_path: str | Path,
        num_moe_layers: int = 0,
        separate_process: bool = False,
    ):
        self.recipe = recipe
        self.model_path = Path(model_path)
        self.on_gpu = torch.cuda.is_available()
        self.hf_config = check_model_for_engine(self.model_path, on_gpu=self.on_gpu)
        self.num_moe_layers = num_moe_layers
        self.capture = recipe.capture_routed_experts and num_moe_layers > 0
        self._native_capture = False
        self.sleeping = False
        r = recipe.rollout
        self.separate_process = separate_process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if separate_process else "0"
        if separate_process:
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = (
                "1"  # our worker-side functions travel by cloudpickle
            )
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(r.cpu_kvcache_gib))))
        from vllm import LLM

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
            kwargs["hf_overrides"] = {"head_dtype": "float32"}  # vLLM's own fp32 head GEMM (no patch needed)
        t = time.perf_counter()
        with _without_launcher_env():
            self.llm = LLM(**kwargs)
        self.load_seconds = time.perf_counter() - t
        self.tokenizer = self.llm.get_tokenizer()
        if self.capture and not self._native_capture:
            from patches.vllm import routed_experts_capture

            routed_experts_capture.install(self.llm, num_moe_layers)

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

    # ------------------------------------------------------------------------------------- weights

    def reload(self, weights) -> None:
        """Load ``(hf_name, tensor)`` pairs in place (checkpoint layout). Verify with sync.verify_sync."""
        from patches.vllm import cpu_moe_reload

        if weights is None:
            self.llm.collective_rpc("reload_weights")  # from the checkpoint on disk
        elif self.separate_process:
            self._reload_via_files(weights)
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if cpu_moe_reload.needed() and self.num_moe_layers:
            fixed = cpu_moe_reload.after_reload(self.llm)
            if fixed != self.num_moe_layers:
                raise RuntimeError(
                    f"re-prepacked {fixed} CPU MoE layers of {self.hf_config.get('architectures')} after a reload; "
                    f"the model has {self.num_moe_layers}"
                )
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights

    def _reload_via_files(self, weights) -> None:
        """Stream ``weights`` into shared-memory files, one per layer, then one reload over all of them."""
        from safetensors.torch import save_file

        root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        folder = Path(tempfile.mkdtemp(prefix="tim-sync-", dir=root))
        try:
            paths, chunk, key = [], {}, None
            for name, t in weights:
                k = _layer_key(name)
                if chunk and k != key:
                    paths.append(self._write(save_file, folder, len(paths), chunk))
                    chunk = {}
                chunk[name] = t.detach().contiguous().cpu()
                key = k
            if chunk:
                paths.append(self._write(save_file, folder, len(paths), chunk))
            self.llm.collective_rpc(_reload_from_files, args=([str(p) for p in paths],))
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    @staticmethod
    def _write(save_file, folder: Path, i: int, chunk: dict) -> Path:
        p = folder / f"{i:05d}.safetensors"
        save_file(chunk, str(p))
        return p

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


def _head_dtype(worker) -> str:
    lp = worker.model_runner.model.logits_processor
    return str(lp.head_dtype or worker.model_runner.model_config.dtype)


def _layer_key(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:3]) if len(parts) > 3 and parts[1] == "layers" else name


def _reload_from_files(worker, paths: list[str]) -> None:
    """Runs inside vLLM's worker: one in-place reload that reads the files lazily, in order."""
    from safetensors import safe_open

    def stream():
        for p in paths:
            with safe_open(p, "pt") as f:
                for k in f.keys():  # noqa: SIM118 - safe_open is not iterable
                    yield k, f.get_tensor(k)

    worker.model_runner.reload_weights(weights_iterator=stream())


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
