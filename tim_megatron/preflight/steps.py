"""The preflight's real loop steps: ``run_setup.setup`` and ``loop.run_steps``, watched through the loop's hook.

Nothing in the loop changes and nothing is wrapped. :class:`Records` is the loop's observer
(:class:`tim_megatron.observer.StepObserver`): it notes what the metrics do not keep apart, each engine's
generation (tokens, seconds), each sync's own records (per engine bytes, seconds, agreement and verdict; a failed
verification is noted before it propagates, with the failing engines the error carries) and each update's
forward/backward and optimizer seconds. A :class:`PeakMemory` sampler records the device's peak.
"""

from __future__ import annotations

import resource
import threading
from dataclasses import asdict

from tim_megatron.observer import StepObserver


class Records(StepObserver):
    """What this rank saw of the loop, through its hook: each generation, each sync, each update's seconds."""

    def __init__(self) -> None:
        self.generations: list[dict] = []
        self.syncs: list[dict] = []
        self.train: dict[int, dict[str, float]] = {}

    def generated(self, *, step: int, engine: int, prompts: int, sequences: int, stats) -> None:
        self.generations.append(
            {
                "step": step,
                "engine": engine,
                "prompts": prompts,
                "sequences": sequences,
                "response_tokens": stats.response_tokens,
                "prompt_tokens": stats.prompt_tokens,
                "seconds": stats.seconds,
            }
        )

    def synced(self, *, sync, check, metrics=None, error=None, load=None, agreements=None) -> None:
        """A failed sync keeps its bytes, seconds and agreements; the failing engines come from the error."""
        row: dict = {"sync": sync, "check": check}
        if error is not None:
            row.update(error=str(error), engines_failed=list(getattr(error, "engines", [])))
        elif not metrics:
            return
        else:
            row["metrics"] = metrics
        if load is not None:
            row["load"] = {"tensors": load.tensors, "bytes": load.bytes, "seconds": load.seconds}
        if agreements is not None:
            row["agreements"] = [asdict(ag) for ag in agreements]
        self.syncs.append(row)

    def trained(self, *, step: int, times: dict[str, float]) -> None:
        t = self.train.setdefault(step, {"fwd_bwd": 0.0, "optimizer": 0.0, "updates": 0})
        t["fwd_bwd"] += times.get("fwd_bwd", 0.0)
        t["optimizer"] += times.get("optimizer", 0.0)
        t["updates"] += 1

    def as_dict(self) -> dict:
        return {
            "generations": self.generations,
            "syncs": self.syncs,
            "train": {str(k): v for k, v in self.train.items()},
        }


class PeakMemory(threading.Thread):
    """Peak memory of this rank's device: on CUDA the device's used memory (everything on it: trainer, vLLM,
    NCCL buffers, the context), sampled every ``poll_s``, and torch's reserved peak; on CPU the process's peak
    resident set (vLLM runs in the same process)."""

    def __init__(self, *, poll_s: float = 0.05):
        super().__init__(daemon=True, name="preflight-memory")
        import torch

        self.cuda = torch.cuda.is_available()
        self.device = torch.cuda.current_device() if self.cuda else None
        self.poll_s = poll_s
        self.peak_used = 0
        self._halt = threading.Event()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def _sample(self) -> None:
        import torch

        free, total = torch.cuda.mem_get_info(self.device)
        self.peak_used = max(self.peak_used, total - free)

    def run(self) -> None:
        if not self.cuda:
            return
        while not self._halt.wait(self.poll_s):
            self._sample()

    def result(self) -> dict:
        self._halt.set()
        if not self.cuda:
            return {
                "source": "rss",
                "device": "cpu",
                "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            }
        import torch

        self._sample()
        reserved = torch.cuda.max_memory_reserved(self.device)
        return {
            "source": "cuda",
            "device": f"cuda:{self.device}",
            "peak_bytes": max(self.peak_used, reserved),
            "peak_device_used_bytes": self.peak_used,
            "peak_torch_reserved_bytes": reserved,
        }


def classify_setup_error(e: BaseException) -> dict:
    """Where start-up failed: in the rollout engine (then whether it does not fit or did not load, as the engine
    said) or elsewhere (the trainer, data, the checkpoint)."""
    from tim_megatron.rollout.base import EngineStartError

    if isinstance(e, EngineStartError):
        return {"where": "engine", "kind": e.kind, "error": str(e)}
    return {"where": "setup", "error": f"{type(e).__name__}: {e}"}
