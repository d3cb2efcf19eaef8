"""The RL math of tim-megatron: pure tensor functions, no megatron-core or vLLM imports, CPU or GPU.

Every function takes keyword arguments and returns a value plus, where there are metrics, a
:class:`~tim_megatron.algo.stats.Stats` of sufficient statistics that reduce exactly across micro-batches
and data-parallel ranks.
"""

from tim_megatron.algo.advantages import group_advantages
from tim_megatron.algo.aggregation import aggregate, local_denominator
from tim_megatron.algo.corrections import correction_metrics, rollout_correction
from tim_megatron.algo.early_warning import EarlyWarning, GrowthDetector, SurgeDetector, TrendDetector
from tim_megatron.algo.injection import (
    biased_distortion,
    low_precision_softmax,
    objective_surrogate,
    perturbed_logprobs,
    quantize,
    unbiased_noise,
)
from tim_megatron.algo.lr_schedule import ConstantLR, CosineLR, LengthDecayLR, build_schedule
from tim_megatron.algo.mismatch import compute_mismatch, mismatch_metrics, mismatch_stats
from tim_megatron.algo.policy_loss import gspo_loss, policy_loss_metrics, token_clip_loss
from tim_megatron.algo.response import response_metrics, response_stats
from tim_megatron.algo.routing import routing_agreement_metrics, routing_agreement_stats
from tim_megatron.algo.stats import Stats

__all__ = [
    "ConstantLR",
    "CosineLR",
    "EarlyWarning",
    "GrowthDetector",
    "LengthDecayLR",
    "Stats",
    "SurgeDetector",
    "TrendDetector",
    "aggregate",
    "biased_distortion",
    "build_schedule",
    "compute_mismatch",
    "correction_metrics",
    "group_advantages",
    "gspo_loss",
    "local_denominator",
    "low_precision_softmax",
    "mismatch_metrics",
    "mismatch_stats",
    "objective_surrogate",
    "perturbed_logprobs",
    "policy_loss_metrics",
    "quantize",
    "response_metrics",
    "response_stats",
    "rollout_correction",
    "routing_agreement_metrics",
    "routing_agreement_stats",
    "token_clip_loss",
    "unbiased_noise",
]
