"""The preflight's real loop steps: ``run_setup.setup`` and ``loop.run_steps``, watched from outside.

Nothing in the loop changes. The prepared run's rollout engine and weight sync are wrapped in recorders that
pass every call through and note what the loop's metrics do not keep apart: each engine's generation (tokens,
seconds) and each sync's own records (per engine bytes, seconds, agreement and verdict; a failed verification is
noted before it propagates). The trainer's ``train_step`` on this one object is wrapped the same way to split the
update's time into forward/backward and optimizer. A :class:`PeakMemory` sampler records the device's peak.
"""

from __future__ import annotations

import re
import resource
import threading
import traceback
from dataclasses import asdict

from tim_megatron.rollout.sync import WeightSyncError


class Records:
    """What the recorders saw on this rank."""

    def __init__(self) -> None:
        self.step = 0
        self.generations: list[dict] = []
        self.syncs: list[dict] = []
        self.train: dict[int, dict[str, float]] = {}

    def as_dict(self) -> dict:
        return {
            "generations": self.generations,
            "syncs": self.syncs,
            "train": {str(k): v for k, v in self.train.items()},
        }


class RecordedRollout:
    """Passes everything to the engine; notes each ``generate`` (the loop generates once per step)."""

    def __init__(self, inner, records: Records):
        self._inner = inner
        self._records = records

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def generate(self, prompts, *, step: int, **kw):
        groups, gen = self._inner.generate(prompts, step=step, **kw)
        self._records.step = step
        self._records.generations.append(
            {
                "step": step,
                "engine": self._inner.engine_index,
                "prompts": len(prompts),
                "sequences": sum(len(g) for g in groups),
                "response_tokens": gen.response_tokens,
                "prompt_tokens": gen.prompt_tokens,
                "seconds": gen.seconds,
            }
        )
        return groups, gen


ENGINES_NAMED = re.compile(r"rollout engine ([\d, ]+)")


def engines_named(message: str) -> list[int]:
    """The engines a :class:`WeightSyncError` names (its messages say ``rollout engine 1, 3 ...``)."""
    m = ENGINES_NAMED.search(message)
    return [int(x) for x in m.group(1).replace(" ", "").split(",") if x] if m else []


class RecordedSync:
    """Passes everything to the weight sync; notes each push (sync i follows step i) and each check of a sync on
    the next step's samples, with the failure, if any, before it propagates.

    A failed verification raises before the sync returns its metrics, so the push's own parts are watched too,
    on this one object: ``load`` (this rank's tensors, bytes and seconds) and ``probe_agreements`` (every
    engine's agreement, already reduced over the ranks). A failed sync keeps its bytes, seconds and |dp|."""

    def __init__(self, inner, records: Records, engines: int):
        self._inner = inner
        self._records = records
        self._engines = engines
        self._pushes = 0
        self._seen: dict = {}
        load, agreements = inner.load, inner.probe_agreements

        def recorded_load(rollout, stream):
            rep = load(rollout, stream)
            self._seen["load"] = {"tensors": rep.tensors, "bytes": rep.bytes, "seconds": rep.seconds}
            return rep

        def recorded_agreements(*a, **kw):
            ags = agreements(*a, **kw)
            self._seen["agreements"] = [asdict(ag) for ag in ags]
            return ags

        inner.load, inner.probe_agreements = recorded_load, recorded_agreements

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _note(self, sync: int, check: str, call):
        self._seen = {}
        try:
            out = call()
        except WeightSyncError as e:
            self._records.syncs.append(
                {
                    "sync": sync,
                    "check": check,
                    "error": str(e),
                    "engines_failed": engines_named(str(e)),
                    **self._seen,
                }
            )
            raise
        if out:
            self._records.syncs.append({"sync": sync, "check": check, "metrics": out, **self._seen})
        return out

    def push(self, rollout, trainer, **kw):
        self._pushes += 1
        return self._note(self._pushes, "probe", lambda: self._inner.push(rollout, trainer, **kw))

    def check_samples(self, **kw):
        return self._note(self._pushes, "samples", lambda: self._inner.check_samples(**kw))


def record_train_steps(trainer, records: Records) -> None:
    """Wrap this trainer object's ``train_step`` to add its forward/backward and optimizer seconds to the step."""
    inner = trainer.train_step

    def train_step(*a, **kw):
        res = inner(*a, **kw)
        t = records.train.setdefault(records.step, {"fwd_bwd": 0.0, "optimizer": 0.0, "updates": 0})
        t["fwd_bwd"] += res.times.get("fwd_bwd", 0.0)
        t["optimizer"] += res.times.get("optimizer", 0.0)
        t["updates"] += 1
        return res

    trainer.train_step = train_step


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


FIT_WORDS = re.compile(r"out of memory|memory|kv cache|OOM|does not fit|no room", re.IGNORECASE)


def classify_setup_error(e: BaseException) -> dict:
    """Where start-up failed: in the rollout engine (then whether it looks like memory: 'does not fit') or
    elsewhere (the trainer, data, the checkpoint)."""
    frames = [f.filename for f in traceback.extract_tb(e.__traceback__)]
    in_engine = any("/vllm/" in f or f.endswith("rollout/engine.py") for f in frames)
    msg = f"{type(e).__name__}: {e}"
    if not in_engine:
        return {"where": "setup", "error": msg}
    return {"where": "engine", "kind": "fit" if FIT_WORDS.search(msg) else "load", "error": msg}
