"""A vLLM engine in a process of its own (``rollout.engine_process: true``), restarted when it fails.

Fault model. An engine call (a generation, a weight load, a score, a wake-up) fails in one of three ways: the
engine's process dies (a kill, an out-of-memory kill, a crash), it stops answering (a hang: the call is not done
within ``rollout.faults.timeout_s``; the process is then killed), or the call raises. The in-process engine
(:class:`~tim_megatron.rollout.vllm_engine.VLLMEngine`, the default) cannot survive the first two: it shares the
rank's process. Here the same engine runs in a child process of the rank (with the rank's ``torch.distributed``
variables removed: it is a one-rank vLLM), and the rank talks to it over a Unix socket.

What the rank guarantees:

* The engine's process never outlives its rank. It asks the kernel for SIGKILL when its parent dies
  (``PR_SET_PDEATHSIG``, set before it imports anything), which needs none of its threads and reaches a stopped
  process (SIGSTOP) or one stuck in C code. The kernel ties that signal to the parent *thread*, and the overlapped
  schedule restarts engines from its sampling thread, so every engine process is started by one launcher thread
  that lives as long as the engine object. No ``multiprocessing`` process, resource tracker or resource sharer is
  involved (the per-tensor path kept for ``make bench`` uses the sharer).
* Every call is bounded by ``rollout.faults.timeout_s``: the request's write and the reply's read are each a
  poll-bounded loop on a non-blocking socket (:mod:`tim_megatron.rollout.engine_wire`), so an engine that stops
  in the middle of a reply, or before it reads a request larger than the socket's buffer, is found like any hang.
* Weights cross in one flat shared-memory buffer with a small index (:mod:`tim_megatron.rollout.flat_weights`):
  one file descriptor, whatever the number of tensors, checked against the open-file limit before the first sync.
* The rank's own errors (pickling a request, packing the weights, an open-file limit) are raised as they are,
  never counted as an engine fault and never a restart.

Recovery happens on the rank that owns the engine, with no collective, so the other ranks only wait for it at their
next one. A failed call: the process is killed (if alive) and a new one started from the checkpoint on disk; it
loads the weights the engine held (the buffer of the last load), and its witness must equal its predecessor's: right
after every load (and its start) an engine scores a small fixed probe, and the rank keeps that answer; a restarted
engine's answer for the same weights must be the same, bit for bit (:data:`WITNESS_TOLERANCE`), or the run stops
with :class:`~tim_megatron.rollout.faults.WitnessMismatch`. Then the failed call runs again. When the failed call
was a weight load, the restart loads nothing first (the call that runs again is the load) and there is no witness
to compare. A generation runs again with the same per-prompt seeds, so its samples are the ones the dead engine
would have returned wherever vLLM's seeded sampling does not depend on the batch. Past
``rollout.faults.max_restarts_per_step`` (or ``max_restarts`` over the run) the call raises :class:`EngineLost`,
naming the rank, the phase and the cause.

What it costs: a weight load copies the weights once into the shared buffer (which the rank keeps: it is what a
restarted engine loads), the witness costs one small score per load, and each restart pays an engine start-up.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import math
import multiprocessing
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Iterable
from pathlib import Path

import torch

from tim_megatron.logging.library_log import engine_log_target
from tim_megatron.rollout import engine_wire as wire
from tim_megatron.rollout.base import EngineStartError, FleetLayout
from tim_megatron.rollout.faults import EngineLost, FaultTally, WitnessMismatch
from tim_megatron.rollout.flat_weights import FILES_PER_SYNC, FlatWeights, check_open_file_limit, load_mapped

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

WITNESS_TOLERANCE = 0.0
"""The largest |logprob| difference allowed between a restarted engine's witness and its predecessor's for the same
weights: none. vLLM's CPU engines are bitwise repeatable (restarted engines score the probe as their predecessors
did, bit for bit), and engine processes are built for CPU engines only; an engine whose kernels are not bitwise
repeatable (CUDA atomics, autotuned split-K) would need a tolerance here."""

_LOADS = frozenset({"load_flat", "load_checkpoint", "load_tensors"})
"""The calls that load weights: one that fails runs again on the restarted engine, which loads nothing first."""

_DRILL_PAD = 8 << 20
"""Bytes added to a request by the ``hang_before_read`` drill: far past a Unix socket's buffer."""

_BOOT = """\
import ctypes, json, os, signal, sys
if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
if os.getppid() != int(sys.argv[1]):  # the rank ended before the signal was set
    os._exit(1)
sys.path[:] = json.loads(sys.argv[3])
from tim_megatron.rollout.process_engine import _serve
_serve(int(sys.argv[2]))
"""
"""The engine process's first lines (``python -c``): the death signal before anything else, then :func:`_serve`."""


class _Failed(Exception):
    """One failed call: ``kind`` died, hung or raised; ``action``: the fire drill planted in it, if any."""

    def __init__(self, kind: str, cause: str, action: str | None = None):
        super().__init__(cause)
        self.kind, self.cause, self.action = kind, cause, action


def witness_probe(*, vocab_size: int, max_model_len: int) -> list[list[int]]:
    """The fixed sequences an engine scores right after each load (its witness): two of up to 16 tokens."""
    length = max(2, min(16, max_model_len - 1))
    span = max(2, min(vocab_size, 64)) - 1
    return [[1 + (7 * i + 5 * j) % span for i in range(length)] for j in range(2)]


# ------------------------------------------------------------------------------------------ the child


def _stop_self() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


def _witness(engine, probe: list[list[int]]) -> dict:
    """The engine's scores of the probe, with what it cached under earlier weights dropped first."""
    t = time.perf_counter()
    engine.reset_prefix_cache()
    scores = engine.score(probe)
    engine.reset_prefix_cache()
    return {"witness": scores, "witness_seconds": time.perf_counter() - t}


def _run(engine, method: str, args: tuple, kw: dict, *, buffer: tuple[int, int] | None, probe) -> object:
    """One call in the engine's process; a load answers with the witness."""
    t = time.perf_counter()
    if method == "load_flat":
        generation, size, index = args
        if buffer is None or buffer[0] != generation:
            raise RuntimeError(f"no shared weight buffer of generation {generation} reached this process")
        load_mapped(buffer[1], size, index, engine.update_weights)
    elif method == "load_checkpoint":
        engine.update_weights(None)
    elif method == "load_tensors":  # the per-tensor path (make bench): tensors rebuilt by torch's reductions
        engine.update_weights(args[0])
        return {"load_seconds": time.perf_counter() - t}
    else:
        return getattr(engine, method)(*args, **kw)
    return {"load_seconds": time.perf_counter() - t, **_witness(engine, probe)}


def _serve(fd: int) -> None:
    """The engine's process: read the spec, build the engine, then answer calls until ``close`` or the socket ends.

    It ignores SIGTERM and SIGINT: a job's stop (Slurm's SIGTERM reaches every process of the step) is the rank's to
    handle, which checkpoints and then closes its engine; it dies with its rank (``PR_SET_PDEATHSIG``)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    got = wire.read_frame(sock)
    if got is None:
        return
    spec = pickle.loads(got[0])
    me = multiprocessing.current_process()
    me.name = f"tim-engine-rank{spec['rank']}"
    me.authkey = spec["authkey"]  # the per-tensor path's descriptors come from the rank's resource sharer

    def reply(status: str, out, *, stop_midway: bool = False) -> None:
        wire.write_frame(
            sock, pickle.dumps((status, out), protocol=5), stop_midway=_stop_self if stop_midway else None
        )

    if spec.get("log") is not None:  # vLLM's log and library warnings to the rank's file, as in its process
        from tim_megatron.logging.library_log import LibraryLog

        path, level = spec["log"]
        LibraryLog(Path(path), level=level)  # held for the process's life
    try:
        from tim_megatron.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine(
            spec["recipe"],
            model_path=spec["model_path"],
            layout=FleetLayout(world=1, ranks_per_engine=1),
            num_moe_layers=spec["num_moe_layers"],
        )
        engine.engine_index = spec["engine_index"]  # its samples carry the fleet's index
        check_open_file_limit(needed=2, who="the engine process")  # the buffer's, and its mapping's
        dims = spec["recipe"].model.dims
        probe = witness_probe(
            vocab_size=int(engine.hf_config.get("vocab_size") or dims.vocab_size),
            max_model_len=spec["recipe"].rollout.max_model_len,
        )
        info = {"load_seconds": engine.load_seconds, "kernels": engine.kernels, **_witness(engine, probe)}
    except BaseException as e:
        reply("error", (f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    reply("ok", info)
    buffer: tuple[int, int] | None = None  # (generation, fd) of the rank's weight buffer
    while True:
        got = wire.read_frame(sock, max_fds=1)
        if got is None:
            return
        (head, fds) = got
        method, where, action, generation = pickle.loads(head)
        if fds:
            if buffer is not None:
                os.close(buffer[1])
            buffer = (generation, fds[0])
        if action == "hang_before_read":
            _stop_self()
        got = wire.read_frame(sock)
        if got is None:
            return
        args, kw = pickle.loads(got[0])
        if action == "hang":
            _stop_self()
        if action == "raise":
            reply("error", (f"RuntimeError: fault drill: {method} raised at {where[0]}, step {where[1]}", ""))
            continue
        try:
            out = _run(engine, method, args, kw, buffer=buffer, probe=probe)
        except BaseException as e:
            reply("error", (f"{type(e).__name__}: {e}", traceback.format_exc()))
            continue
        if action in ("kill", "stale"):  # the work is done and lost: the answer never leaves
            os.kill(os.getpid(), signal.SIGKILL)
        reply("ok", out, stop_midway=action == "hang_in_reply")
        if method == "close":
            return


# ------------------------------------------------------------------------------------------ the rank's side


class _Launcher:
    """The one thread that starts this engine's processes, alive until the engine closes.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that started a process ends, not only its process; the overlapped
    schedule restarts engines from its sampling thread, which ends. Started from here, an engine process gets its
    SIGKILL exactly when the rank's process ends (or after the engine is closed)."""

    def __init__(self, *, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def popen(self, cmd: list[str], **kw) -> subprocess.Popen:
        if not self._thread.is_alive():
            raise RuntimeError("the engine launcher thread has ended: the engine was closed")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((cmd, kw, done))
        return done.result()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            cmd, kw, done = job
            try:
                done.set_result(subprocess.Popen(cmd, **kw))
            except BaseException as e:
                done.set_exception(e)

    def close(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout=10)


class _Child:
    """One engine process: its ``Popen`` and the rank's end of its socket."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket):
        self.proc, self.sock = proc, sock
        self.buffer: int | None = None
        """The generation of the weight buffer whose file this process holds."""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (a stopped process gets it too) and wait for it; an engine ignores SIGTERM."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        self.sock.close()

    def ended(self) -> str:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        code = self.proc.returncode
        if code is None:
            return "its socket closed"
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return f"its process ended ({how})"


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
        self.step = 0
        self.tally = FaultTally()
        self._flat = FlatWeights()
        self._held = "start"
        """What the engine holds: ``start`` (the checkpoint it started from), ``checkpoint`` (the checkpoint read
        again by a load), ``flat`` (the last weights loaded: the buffer), ``lost`` (a sync that failed on this rank
        wrote over the buffer; nothing to restore)."""
        self._witness: list[list[float]] | None = None
        """The engine's scores of the witness probe for the weights it holds."""
        self.last_load: dict = {}
        """The last load's answer (its seconds, the witness and its seconds): for ``make bench``."""
        self._armed = False
        self._child: _Child | None = None
        self._launcher = _Launcher(name=f"tim-engine-launcher-rank{rank}")
        self._closers = [
            weakref.finalize(self, self._launcher.close),
            weakref.finalize(self, self._flat.close),
        ]
        check_open_file_limit(needed=2 + FILES_PER_SYNC, who=f"rank {rank}")  # its socket, then a sync
        self.info = self._start(armed=True)
        self._witness = self.info["witness"]

    # ---------------------------------------------------------------------------- process

    def _start(self, *, armed: bool) -> dict:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in _RANK_VARIABLES and not k.startswith("TORCHELASTIC_")
        }
        cmd = [sys.executable, "-c", _BOOT, str(os.getpid()), str(theirs.fileno()), json.dumps(sys.path)]
        try:
            proc = self._launcher.popen(cmd, pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        mine.setblocking(False)
        self._child = _Child(proc, mine)
        self._closers.append(weakref.finalize(self, self._child.kill))  # the process, not the engine object
        self._armed = armed
        spec = {
            "recipe": self.recipe,
            "model_path": self.model_path,
            "engine_index": self.engine_index,
            "num_moe_layers": self.num_moe_layers,
            "rank": self.rank,
            "authkey": bytes(multiprocessing.current_process().authkey),
            "log": engine_log_target(),  # the rank's engine log: the engine's own output goes there too
        }
        try:
            return self._exchange([pickle.dumps(spec, protocol=5)], timeout=START_TIMEOUT_S)
        except _Failed as f:
            self._child.kill()
            raise EngineStartError(
                f"the engine process of rank {self.rank} did not start: {f.cause}", kind="load"
            ) from None

    def _exchange(self, payloads: list[bytes], *, timeout: float, fds=(), action: str | None = None):
        """Send ``payloads`` and read the answer, all within ``timeout``; :class:`_Failed` when the engine died,
        hung or raised. Any other error is this rank's own and is raised as it is."""
        c = self._child
        deadline = time.monotonic() + timeout
        try:
            wire.send_frames(c.sock, payloads, deadline=deadline, alive=c.alive, fds=fds)
            answer = wire.recv_frame(c.sock, deadline=deadline, alive=c.alive)
        except wire.WireTimeout as e:
            raise _Failed(
                "hung", f"no answer within {timeout:g} s (rollout.faults.timeout_s; {e})", action
            ) from None
        except wire.WireClosed:
            raise _Failed("died", c.ended(), action) from None
        try:
            status, out = pickle.loads(answer)
        except Exception as e:
            raise _Failed(
                "raised", f"its answer could not be read: {type(e).__name__}: {e}", action
            ) from None
        if status != "ok":
            raise _Failed("raised", out[0], action)
        return out

    def _action(self, phase: str) -> str | None:
        """The fire drill planted in this call, if any (armed engines only: the first, or every restart with
        ``every_attempt``)."""
        d = self.drill
        return d[0] if d is not None and self._armed and (d[1], d[2]) == (phase, self.step) else None

    def _rpc(
        self, method: str, args: tuple = (), kw: dict | None = None, *, phase: str, body: bytes | None = None
    ):
        c, action = self._child, self._action(phase)
        fds = (self._flat.fd,) if method == "load_flat" and c.buffer != self._flat.generation else ()
        head = pickle.dumps((method, (phase, self.step), action, self._flat.generation), protocol=5)
        if body is None:
            body = pickle.dumps(
                (args, kw or {}), protocol=5
            )  # this rank's own work: its errors are no engine's
        if action == "hang_before_read":
            body += bytes(_DRILL_PAD)  # the answer to (args, kw) ends before it: unpickling stops there
        out = self._exchange([head, body], timeout=self.limits.timeout_s, fds=fds, action=action)
        if fds:
            c.buffer = self._flat.generation
        return out

    def _call(self, method: str, *args, phase: str, body: bytes | None = None, **kw):
        """Call the engine; on a failure restart it (within the budget) and call again."""
        while True:
            t0 = time.perf_counter()
            try:
                return self._rpc(method, args, kw, phase=phase, body=body)
            except _Failed as f:
                self.tally.detect_seconds = max(self.tally.detect_seconds, time.perf_counter() - t0)
                try:
                    self._recover(f, method=method, phase=phase)
                finally:
                    self.tally.seconds_lost += time.perf_counter() - t0
                if method == "generate":
                    self.tally.prompts_regenerated += len(args[0])

    def _recover(self, f: _Failed, *, method: str, phase: str) -> None:
        """Kill what is left of the engine, and start one that holds the weights the dead one held (its witness
        equal to the dead one's); a restart that fails is one more restart. :class:`EngineLost` past the budget
        (restarts this step, and over the run)."""
        while True:
            self._child.kill()
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
                said = self._restore(f, method=method)
                print(f"fault: rank {self.rank}'s restarted rollout engine {said}", flush=True)
                return
            except _Failed as g:
                f = g
            except EngineStartError as g:
                f = _Failed("died", str(g))

    def _restore(self, f: _Failed, *, method: str) -> str:
        """Load into the restarted engine what its predecessor held, and compare their witnesses."""
        if method in _LOADS:
            return (
                "loads nothing first: the call that failed was a weight load, which runs again (no witness to "
                "compare: the new weights' check is the sync's)"
            )
        if self._held == "lost":
            raise EngineLost(
                f"rank {self.rank}'s rollout engine was restarted, but the weights it held are gone: a weight sync "
                "that failed on this rank wrote over them",
                rank=self.rank,
                phase="recover",
                cause="nothing to restore",
            )
        if f.action == "stale":  # the fire drill: a restart that keeps the checkpoint's weights
            now, how = self.info["witness"], "loaded nothing (fault drill: stale)"
        elif self._held == "flat":
            index = self._flat.index
            now = self._rpc("load_flat", (self._flat.generation, self._flat.size, index), phase="recover")[
                "witness"
            ]
            how = f"loaded the weights its predecessor held ({len(index)} tensors from one shared buffer)"
        elif self._held == "checkpoint":
            now, how = self._rpc("load_checkpoint", phase="recover")["witness"], "read the checkpoint again"
        else:
            now, how = self.info["witness"], "started from the checkpoint, as its predecessor did"
        return f"{how}; {self._compare_witness(now)}"

    def _compare_witness(self, now: list[list[float]]) -> str:
        """The restarted engine's witness against its predecessor's, token by token (:data:`WITNESS_TOLERANCE`)."""
        before = self._witness
        pairs = [
            (a, b) for ra, rb in zip(before, now, strict=False) for a, b in zip(ra[1:], rb[1:], strict=False)
        ]
        same_shape = len(before) == len(now) and all(
            len(a) == len(b) for a, b in zip(before, now, strict=False)
        )
        differ = sum(a != b for a, b in pairs)
        dlp = max((abs(a - b) for a, b in pairs), default=0.0)
        dp = max((abs(math.exp(a) - math.exp(b)) for a, b in pairs), default=0.0)
        if not same_shape or not pairs or (differ and not dlp <= WITNESS_TOLERANCE):
            raise WitnessMismatch(
                f"rank {self.rank}'s restarted rollout engine does not hold the weights its predecessor held: {differ} "
                f"of {len(pairs)} witness probe logprobs differ from what its predecessor scored after the same load "
                f"(max |dlogprob| {dlp:.3g}, max |dp| {dp:.3g}; allowed {WITNESS_TOLERANCE:g}: vLLM's CPU engines are "
                "bitwise repeatable): a stale or partial load",
                rank=self.rank,
                phase="recover",
                cause="its witness differs from its predecessor's",
            )
        self.tally.witness_checks += 1
        self.tally.witness_max_abs_prob_diff = max(self.tally.witness_max_abs_prob_diff, dp)
        return f"matches its predecessor: the witness probe's {len(pairs)} logprobs equal bit for bit"

    # ---------------------------------------------------------------------------- the protocol

    def begin_step(self, step: int) -> None:
        self.step = step
        self.tally = FaultTally(run_restarts=self.tally.run_restarts)

    def faults(self) -> dict[str, float]:
        return self.tally.metrics()

    def arm_drill(self, kind: str, phase: str) -> None:
        """Plant a fire drill (a ``rollout.fault_drill.kind``) in this engine's next ``phase`` call of this step, as
        the recipe's drill is planted at its start (the tests plant one after another in one engine)."""
        self.drill, self._armed = (kind, phase, self.step), True

    def generate(self, prompts: list[list[int]], **kw):
        return self._call("generate", prompts, phase="generate", **kw)

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        return self._call("score", sequences, phase="score")

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | None) -> None:
        """Load the weights (None: the checkpoint on disk again): packed into the shared buffer here, then loaded
        by the engine from views of it."""
        if weights is None:
            out = self._call("load_checkpoint", phase="sync")
            self._held = "checkpoint"
        else:
            check_open_file_limit(needed=FILES_PER_SYNC, who=f"rank {self.rank}")
            if self._held == "flat":
                self._held = "lost"  # until the load: the buffer no longer holds what the engine holds
            self._flat.pack(
                weights
            )  # this rank's own work (the export streams through it): its errors are its own
            f = self._flat
            out = self._call("load_flat", f.generation, f.size, f.index, phase="sync")
            self._held = "flat"
        self._witness, self.last_load = out["witness"], out

    def _update_weights_per_tensor(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict:
        """Each tensor in shared memory of its own, as torch's multiprocessing reductions send it: how weights
        crossed before the flat buffer, kept for ``make bench`` to measure against (one open file per tensor on
        each side while a load is in flight; no witness). A restart after it has nothing to load."""
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401 - registers the tensors' reductions

        loaded = [(n, t.detach().clone()) for n, t in weights]
        body = bytes(ForkingPickler.dumps(((loaded,), {}), protocol=5))
        out = self._call("load_tensors", phase="sync", body=body)
        self._held, self._witness, self.last_load = "lost", None, out
        return out

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
            "process": self._child.proc.pid,
        }

    def close(self) -> None:
        c = self._child
        if c is not None and c.alive():
            with contextlib.suppress(_Failed, OSError):
                self._rpc("close", phase="close")
        for closer in reversed(self._closers):
            closer()
