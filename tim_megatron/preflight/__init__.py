"""``tim preflight`` / ``make preflight``: know before a long allocation that the job will run.

A short Slurm job with the recipe's real layout (nodes, GPUs, TP/EP/DP, rollout engines, dtypes, remedies, the
real model) and a shrunk workload (:mod:`.shrink`), submitted through ``tim submit``'s own path
(:mod:`.submit`). Inside it every rank runs the phases of :mod:`.job` in order, each under a heartbeat
(:mod:`.heartbeat`): doctor checks, a device probe (:mod:`.devices`), all-reduce bus bandwidth
(:mod:`.bandwidth`), then two real loop steps watched through the loop's hook (:mod:`.steps`). What was gathered becomes
``preflight.json`` (:mod:`.report`, schema ``tim-preflight/1``), with step time and memory extrapolated to the
full recipe (:mod:`.extrapolate`), and a pure :func:`~.judge.judge` turns it into go / no-go.
"""

from tim_megatron.preflight.judge import Verdict, judge
from tim_megatron.preflight.shrink import Preflight, load_preflight

__all__ = ["Preflight", "Verdict", "judge", "load_preflight"]
