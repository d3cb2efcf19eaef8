"""Sampling injection inside the vLLM fleet (``diagnostics.sampling_injection.engine: vllm``).

vLLM 0.32's V1 engine takes batch-level logits processors, classes given to ``LLM(logits_processors=[...])``
(``vllm.v1.sample.logits_processor.LogitsProcessor``); the per-request callables of ``SamplingParams`` are gone in
V1. A processor sees the float32 logits of the whole batch before the temperature, and learns which request sits
in which row through ``update_state``. :class:`SamplingInjection` acts only on requests whose
``SamplingParams.extra_args`` carry ``"tim_injection"`` (the fleet adds them to sampled requests, never to greedy
validation), and replaces their logits by ``T * log mu`` with mu = perturb(softmax(z / T))
(:func:`tim_megatron.algo.injection.perturbed_logprobs`, the exact sampler's function, with the same noise for the
same sample and position). vLLM then divides by T and samples from softmax(log mu) = mu; with
``logprobs_mode="processed_logprobs"`` the logprob it reports is log mu's, so real and injected mismatch stack in
what is sampled and in what is logged.

Precision on a bfloat16 engine: its logits are already rounded, so Eq. 45's logit rounding does nothing there; the
recipe requires float32 logits (``rollout.dtype: float32`` or ``remedies.fp32_lm_head``).
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from tim_megatron.algo.injection import perturbed_logprobs, sampling_noise

KEY = "tim_injection"
"""The ``SamplingParams.extra_args`` key this processor reads."""


def request_args(injection, *, sample_seed: int, temperature: float) -> dict:
    """The ``extra_args`` of one sampled request (plain numbers and strings: vLLM ships them by MessagePack)."""
    return {
        KEY: {
            "type": injection.type,
            "dtype": injection.dtype,
            "std": float(injection.std),
            "delta": float(injection.delta),
            "pi_low": float(injection.pi_low),
            "seed": int(injection.seed),
            "sample_seed": int(sample_seed),
            "temperature": float(temperature),
        }
    }


class SamplingInjection(LogitsProcessor):
    """mu = perturb(pi) for the requests that ask for it (see the module docstring)."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.rows: dict[int, tuple[dict, list[int]]] = {}
        """Batch row -> (the request's injection arguments, its running list of output token ids)."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        args = (sampling_params.extra_args or {}).get(KEY)
        if args is not None and args.get("type") not in ("precision", "noise", "bias"):
            raise ValueError(f"{KEY}.type = {args.get('type')!r}: allowed precision, noise, bias")

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token is most likely

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def state(params, _prompt, output_ids):
            args = (params.extra_args or {}).get(KEY) if params is not None else None
            return None if args is None else (args, output_ids)

        process_dict_updates(self.rows, batch_update, state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (a, output_ids) in self.rows.items():
            t = a["temperature"]
            z = logits[row].float() / t
            noise = None
            if a["type"] == "noise":
                noise = sampling_noise(
                    seed=a["seed"], sample_seed=a["sample_seed"], position=len(output_ids), vocab=z.shape[-1]
                ).to(z.device)
            logmu = perturbed_logprobs(
                logits=z,
                kind=a["type"],
                dtype=a["dtype"],
                std=a["std"],
                delta=a["delta"],
                pi_low=a["pi_low"],
                noise=noise,
            )
            logits[row] = (logmu * t).to(logits.dtype)
        return logits
