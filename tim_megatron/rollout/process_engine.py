"""A vLLM engine in a process of its own (``rollout.engine_process: true``), restarted when it fails.

Fault model. An engine call (a generation, a weight load, a score, a wake-up) fails in one of three ways: the
engine's process dies (a kill, an out-of-memory kill, a crash), it stops answering (a hang: no answer within
``rollout.faults.timeout_s``; the process is then killed), or the call raises. The in-process engine
(:class:`~tim_megatron.rollout.vllm_engine.VLLMEngine`, the default) cannot survive the first two: it shares the
rank's process. Here the same engine runs in a child process of the rank (spawned, with the rank's
``torch.distributed`` variables removed: it is a one-rank vLLM), and the rank talks to it over a pipe; the weights
cross as shared-memory tensors.

Recovery happens on the rank that owns the engine, with no collective, so the other ranks only wait for it at their
next one. A failed call: the process is killed (if alive) and a new one started from the checkpoint on disk; it
loads the weights the engine held (the last weights loaded, kept by reference), then scores the sequences the
dead engine scored first after that load (the sync's probe) and must agree with it within the sync tolerance (the
same per-engine check a sync passes); then the failed call runs again. A generation runs again with the same
per-prompt seeds, so its samples are the ones the dead engine would have returned wherever vLLM's seeded sampling
does not depend on the batch. Past ``rollout.faults.max_restarts_per_step`` (or ``max_restarts`` over the run) the
call raises :class:`EngineLost`, naming the rank, the phase and the cause.

What it costs: a weight load crosses a process boundary (shared memory, not a reference), the engine keeps a
reference to the last weights loaded, and each restart pays an engine start-up.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.util
import os
import signal
import time
import traceback
from collections.abc import Iterable

import torch

from tim_megatron.rollout.base import EngineStartError, FleetLayout
from tim_megatron.rollout.faults import EngineLost, FaultTally

_RANK_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)
"""What torchrun tells a rank about its world: the engine's process is a world of its own."""

START_TIMEOUT_S = 600.0
"""Seconds an engine process may take to start (import vLLM, load the checkpoint, warm up)."""


class _Failed(Exception):
    """One failed call: ``kind`` died, hung or raised."""

    def __init__(self, kind: str, cause: str):
        super().__init__(cause)
        self.kind, self.cause = kind, cause


# ------------------------------------------------------------------------------------------ the child


def _die_with_parent(parent: int) -> None:
    """End this process soon after the rank that started it ends, however it ends. (Not ``PR_SET_PDEATHSIG``: it
    fires when the *thread* that started the process ends, and the overlapped schedule restarts engines from its
    sampling thread.)"""
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="tim-engine-parent-watch", daemon=True).start()


def _serve(conn, spec: dict) -> None:
    """The engine's process: build the engine, then answer calls until ``close`` or the pipe ends.

    It ignores SIGTERM and SIGINT: a job's stop (Slurm's SIGTERM reaches every process of the step) is the rank's to
    handle, which checkpoints and then closes its engine; and it ends soon after its rank does."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(spec["parent"])
    for k in list(os.environ):
        if k in _RANK_VARIABLES or k.startswith("TORCHELASTIC_"):
            del os.environ[k]
    from tim_megatron.rollout.vllm_engine import VLLMEngine

    try:
        engine = VLLMEngine(
            spec["recipe"],
            model_path=spec["model_path"],
            layout=FleetLayout(world=1, ranks_per_engine=1),
            num_moe_layers=spec["num_moe_layers"],
        )
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    engine.engine_index = spec["engine_index"]  # its samples carry the fleet's index
    conn.send(("ok", {"load_seconds": engine.load_seconds, "kernels": engine.kernels}))
    drill = spec["drill"]  # (kind, phase, step) or None
    while True:
        try:
            method, args, kw, where = conn.recv()
        except EOFError:
            return
        planted = drill is not None and where == drill[1:]
        if planted and drill[0] == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        if planted and drill[0] == "raise":
            conn.send(
                ("error", f"RuntimeError: fault drill: {method} raised at {where[0]}, step {where[1]}", "")
            )
            continue
        try:
            out = getattr(engine, method)(*args, **kw)
        except BaseException as e:
            conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
            continue
        if planted and drill[0] == "kill":  # the work is done and lost: the answer never leaves
            os.kill(os.getpid(), signal.SIGKILL)
        conn.send(("ok", out))
        if method == "close":
            return


# ------------------------------------------------------------------------------------------ the rank's side


def _kill(proc) -> None:
    if proc.is_alive():
        proc.kill()
    proc.join(timeout=30)


class ProcessEngine:
    """This rank's vLLM engine, in a child process; meets :class:`~tim_megatron.rollout.base.RolloutEngine`."""

    shares_trainer_weights = False
    restartable = True

    def __init__(self, recipe, *, model_path, layout: FleetLayout, rank: int = 0, num_moe_layers: int = 0):
        if torch.cuda.is_available():
            raise EngineStartError(
                "rollout.engine_process = true is built for vLLM's CPU engines only (a CUDA engine in a child process "
                "needs its device chosen and its weights passed by CUDA IPC, which is not built)",
                kind="load",
            )
        if layout.ranks_per_engine != 1:
            raise ValueError(
                "an engine in its own process serves one rank (rollout.tensor_parallel_size = 1)"
            )
        self.recipe = recipe
        self.model_path = str(model_path)
        self.layout = layout
        self.rank = rank
        self.engine_index = layout.engine_of(rank)
        self.num_moe_layers = num_moe_layers
        self.limits = recipe.rollout.faults
        d = recipe.rollout.fault_drill
        self.drill = (d.kind, d.phase, d.step) if d.kind != "none" and d.rank == rank else None
        self.drill_again = d.every_attempt
        self.tolerance = recipe.sync_tolerance
        self.step = 0
        self.tally = FaultTally()
        self._weights: list[tuple[str, torch.Tensor]] | None = None
        """The last weights loaded (None: the checkpoint's): what a restarted engine loads."""
        self._witness: tuple[list[list[int]], list[list[float]]] | None = None
        """The first sequences scored after the last load and their scores: a restarted engine must agree."""
        self._proc = None
        self._conn = None
        self.info = self._start(armed=True)

    # ---------------------------------------------------------------------------- process

    def _start(self, *, armed: bool) -> dict:
        ctx = mp.get_context("spawn")
        mine, theirs = ctx.Pipe()
        spec = {
            "recipe": self.recipe,
            "model_path": self.model_path,
            "engine_index": self.engine_index,
            "num_moe_layers": self.num_moe_layers,
            "drill": self.drill if armed else None,
            "parent": os.getpid(),
        }
        self._proc = ctx.Process(
            target=_serve, args=(theirs, spec), name=f"tim-engine-rank{self.rank}", daemon=True
        )
        self._proc.start()
        # killed before multiprocessing's own exit handler would SIGTERM it (ignored) and wait for it forever, or when
        # this object goes; the finalizer holds the process, not the engine (and its weights)
        mp.util.Finalize(self, _kill, args=(self._proc,), exitpriority=10)
        theirs.close()
        self._conn = mine
        try:
            return self._answer(START_TIMEOUT_S)
        except _Failed as f:
            self._stop()
            raise EngineStartError(
                f"the engine process of rank {self.rank} did not start: {f.cause}", kind="load"
            ) from None

    def _answer(self, timeout: float):
        """The child's answer to the call in flight, or :class:`_Failed` (died, hung, raised)."""
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.05):
            if not self._proc.is_alive():
                raise _Failed("died", self._ended())
            if time.monotonic() > deadline:
                raise _Failed("hung", f"no answer within {timeout:g} s (rollout.faults.timeout_s)")
        try:
            status, *rest = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(timeout=5)
            raise _Failed("died", self._ended()) from None
        if status != "ok":
            raise _Failed("raised", rest[0])
        return rest[0]

    def _ended(self) -> str:
        code = self._proc.exitcode
        if code is None:
            return "its pipe closed"
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return f"its process ended ({how})"

    def _stop(self) -> None:
        """Kill the engine's process (if alive) and wait for it; an engine that ignores SIGTERM is sent SIGKILL."""
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
        if self._proc is not None:
            self._proc.join(timeout=30)
        if self._conn is not None:
            self._conn.close()

    def _rpc(self, method: str, args: tuple, kw: dict, phase: str):
        try:
            self._conn.send((method, args, kw, (phase, self.step)))
        except OSError:  # it died between calls (an OOM kill while idle)
            self._proc.join(timeout=5)
            raise _Failed("died", self._ended()) from None
        return self._answer(self.limits.timeout_s)

    def _call(self, method: str, *args, phase: str, **kw):
        """Call the engine; on a failure restart it (within the budget) and call again."""
        while True:
            t0 = time.perf_counter()
            try:
                return self._rpc(method, args, kw, phase)
            except _Failed as f:
                try:
                    self._recover(f, phase=phase)
                finally:
                    self.tally.seconds_lost += time.perf_counter() - t0
                if method == "generate":
                    self.tally.prompts_regenerated += len(args[0])

    def _recover(self, f: _Failed, *, phase: str) -> None:
        """Kill what is left of the engine, and start one that holds the weights the dead one held (checked against
        what the dead one answered); a restart that fails is one more restart. :class:`EngineLost` past the
        budget (restarts this step, and over the run)."""
        while True:
            self._stop()
            where = (
                f"rank {self.rank}'s rollout engine {f.kind} during {phase} at step {self.step}: {f.cause}"
            )
            over = (
                f"rollout.faults.max_restarts_per_step = {self.limits.max_restarts_per_step}"
                if self.tally.restarts >= self.limits.max_restarts_per_step
                else f"rollout.faults.max_restarts = {self.limits.max_restarts}"
                if self.tally.run_restarts >= self.limits.max_restarts
                else None
            )
            if over:
                print(f"fault: {where}; not restarting it ({over})", flush=True)
                raise EngineLost(
                    f"{where}; it was restarted {self.tally.restarts} time(s) this step and "
                    f"{self.tally.run_restarts} since this process started, and {over} allows no more",
                    rank=self.rank,
                    phase=phase,
                    cause=f"{f.kind}: {f.cause}",
                )
            self.tally.restarts += 1
            self.tally.run_restarts += 1
            print(f"fault: {where}; restarting it (restart {self.tally.restarts} of this step)", flush=True)
            try:
                self.info = self._start(armed=self.drill_again)
                if self._weights is not None:
                    self._rpc("update_weights", (self._weights,), {}, "recover")
                if self._witness is not None:
                    self._check_witness()
                return
            except _Failed as g:
                f = g
            except EngineStartError as g:
                f = _Failed("died", str(g))

    def _check_witness(self) -> None:
        """The restarted engine scores what its predecessor scored first after the same load: at least 80% of the
        tokens' probabilities within the sync tolerance (the sync's rule), judged here alone (no collective)."""
        sequences, before = self._witness
        now = self._rpc("score", (sequences,), {}, "recover")
        a = torch.tensor([x for row in before for x in row[1:]], dtype=torch.float64)
        b = torch.tensor([x for row in now for x in row[1:]], dtype=torch.float64)
        dp = (a.exp() - b.exp()).abs() if len(a) == len(b) else None
        p80 = float(torch.quantile(dp, 0.8)) if dp is not None and len(dp) else float("inf")
        if not p80 <= self.tolerance:
            raise EngineLost(
                f"rank {self.rank}'s restarted rollout engine does not hold the weights its predecessor held: 80% of "
                f"{0 if dp is None else len(dp)} probe tokens within {p80:.3g}, tolerance {self.tolerance:g}",
                rank=self.rank,
                phase="recover",
                cause="the restarted engine's weights disagree",
            )
        self.tally.witness_max_abs_prob_diff = max(self.tally.witness_max_abs_prob_diff, float(dp.max()))

    # ---------------------------------------------------------------------------- the protocol

    def begin_step(self, step: int) -> None:
        self.step = step
        self.tally = FaultTally(run_restarts=self.tally.run_restarts)

    def faults(self) -> dict[str, float]:
        return self.tally.metrics()

    def generate(self, prompts: list[list[int]], **kw):
        return self._call("generate", prompts, phase="generate", **kw)

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        out = self._call("score", sequences, phase="score")
        if self._witness is None and self._weights is not None:
            self._witness = (sequences, out)
        return out

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | None) -> None:
        if weights is None:
            self._call("update_weights", None, phase="sync")
            self._weights = None
        else:
            loaded = [(n, t.detach().clone()) for n, t in weights]  # its own storage, shared with the child
            self._call("update_weights", loaded, phase="sync")
            self._weights = loaded
        self._witness = None

    def sleep(self, level: int) -> None:
        self._call("sleep", level, phase="sleep")

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._call("wake_up", tags, phase="wake")

    def reset_prefix_cache(self) -> None:
        self._call("reset_prefix_cache", phase="sync")

    def head_dtype(self) -> str:
        return self._call("head_dtype", phase="start")

    def describe(self) -> dict:
        return {
            "engine": self.engine_index,
            "ranks": list(self.layout.ranks_of(self.engine_index)),
            "rank": self.rank,
            "device": "cpu",
            "tensor_parallel_size": 1,
            "load_seconds": round(self.info["load_seconds"], 2),
            "kernels": self.info["kernels"],
            "process": self._proc.pid,
        }

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            with contextlib.suppress(_Failed, OSError):
                self._rpc("close", (), {}, "close")
        self._stop()
