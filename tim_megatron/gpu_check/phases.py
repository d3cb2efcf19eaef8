"""The phases of one train step, clocked: where the ``moe layer`` profile's milliseconds go.

A :class:`PhaseClock` splits a step into consecutive intervals, each belonging to one phase (:data:`PHASES`, and
:data:`OTHER` for whatever lies between them: zeroing the gradients, the trainer's bookkeeping). The boundaries are
marked where the step passes them (:func:`instrumented`), with no change to what the step computes:

* forward: a forward pre-hook on the trainer's (DDP-wrapped) model;
* head + loss: our head runs after the model returns (its forward hook); megatron's own head is its
  ``output_layer`` (that module's pre-hook); the loss ends where our loss function returns, or for the bare step
  where the model returns it;
* backward: from there to the finite check (ours) or the optimizer step (bare), with ``finalize_model_grads``;
* finite check: the trainer's ``_all_finite``;
* grad prep, grad norm + clip, Adam, parameter copy: megatron's optimizer step, through the optimizer's
  ``prepare_grads`` and ``step_with_ready_grads`` and the timers megatron's optimizer already calls
  (``OptimizerConfig.timers``: ``optimizer-inner-step``, ``optimizer-copy-main-to-model-params``, ...).

On CUDA each boundary records a CUDA event on the current stream, so a phase is device time between two points
of the stream (no host sync is added); on CPU each is ``time.perf_counter``. With ``memory`` (CUDA) every boundary
also reads the allocator's peak since the previous one, and with ``syncs`` (CUDA) every host sync that
``torch.cuda.set_sync_debug_mode`` reports is counted against the phase it happens in.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch

PHASES = (
    "forward",
    "head + loss",
    "backward",
    "finite check",
    "grad prep",
    "grad norm + clip",
    "Adam",
    "parameter copy",
)
"""The named phases of a step, in order."""
OTHER = "other"
"""Time between the named phases (zeroing gradients, setting the learning rate, the trainer's bookkeeping)."""

OPTIMIZER_TIMERS = {
    "optimizer-copy-to-main-grad": "grad prep",
    "optimizer-unscale-and-check-inf": "grad prep",
    "optimizer-clip-main-grad": "grad norm + clip",
    "optimizer-count-zeros": "grad norm + clip",
    "optimizer-inner-step": "Adam",
    "optimizer-copy-main-to-model-params": "parameter copy",
    "params-all-gather": "parameter copy",
}
"""megatron-core 0.16's optimizer timers and the phase each belongs to (any other timer: the phase it runs in)."""

SYNC_WARNING = "synchronizing"
"""What ``torch.cuda.set_sync_debug_mode('warn')``'s warning says (``called a synchronizing CUDA operation``)."""


class PhaseClock:
    """Boundaries of one step's phases (module docstring): :meth:`begin`, then :meth:`enter` at each top-level
    boundary and :meth:`push`/:meth:`pop` for phases nested in another, then :meth:`end`."""

    def __init__(self, *, cuda: bool, memory: bool = False):
        self.cuda = cuda
        self.memory = memory and cuda
        self.marks: list[tuple[str, object]] = []
        self.stack: list[str] = []
        self.peaks: dict[str, float] = {}
        """Bytes: the allocator's peak within each phase (with ``memory``)."""
        self.syncs: dict[str, int] = defaultdict(int)
        """Host syncs reported within each phase (:meth:`counting_syncs`)."""
        self.wall = 0.0
        """Seconds from :meth:`begin` to :meth:`end` by the host clock, the device synchronized at both ends."""
        self._t0 = 0.0

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else OTHER

    def _stamp(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _mark(self) -> None:
        if self.memory and self.marks:
            done = self.marks[-1][0]
            self.peaks[done] = max(self.peaks.get(done, 0.0), float(torch.cuda.max_memory_allocated()))
            torch.cuda.reset_peak_memory_stats()
        self.marks.append((self.current, self._stamp()))

    def begin(self) -> None:
        self.marks.clear()
        self.stack = [OTHER]
        self.peaks.clear()
        self.syncs.clear()
        if self.cuda:
            torch.cuda.synchronize()
            if self.memory:
                torch.cuda.reset_peak_memory_stats()
        self._t0 = time.perf_counter()
        self._mark()

    def enter(self, phase: str) -> None:
        """The top-level phase changes to ``phase``."""
        self.stack[0:1] = [phase]
        if len(self.stack) == 1:
            self._mark()

    def push(self, phase: str) -> None:
        self.stack.append(phase)
        self._mark()

    def pop(self) -> None:
        self.stack.pop()
        self._mark()

    def end(self) -> None:
        self.stack = ["end"]
        self._mark()
        if self.cuda:
            torch.cuda.synchronize()
        self.wall = time.perf_counter() - self._t0

    def seconds(self) -> dict[str, float]:
        """Seconds in each phase (every interval between two boundaries, summed by the phase it belongs to); call
        after :meth:`end`."""
        out: dict[str, float] = dict.fromkeys((*PHASES, OTHER), 0.0)
        for (phase, a), (_, b) in zip(self.marks, self.marks[1:], strict=False):
            dt = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            out[phase] = out.get(phase, 0.0) + dt
        return out

    def timers(self, name: str, log_level: int | None = None) -> _Timer:
        """megatron's ``OptimizerConfig.timers`` protocol: ``timers(name, log_level=...).start()`` / ``.stop()``."""
        return _Timer(self, OPTIMIZER_TIMERS.get(name))

    @contextlib.contextmanager
    def counting_syncs(self) -> Iterator[None]:
        """Count, per phase, the host syncs ``torch.cuda.set_sync_debug_mode('warn')`` reports inside (CUDA)."""
        if not self.cuda:
            yield
            return
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            shown = warnings.showwarning

            def count(message, category, filename, lineno, file=None, line=None):
                if SYNC_WARNING in str(message):
                    self.syncs[self.current] += 1
                else:
                    shown(message, category, filename, lineno, file, line)

            warnings.showwarning = count
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(previous)


class _Timer:
    def __init__(self, clock: PhaseClock, phase: str | None):
        self.clock, self.phase = clock, phase

    def start(self, barrier: bool = False) -> None:
        self.clock.push(self.phase or self.clock.current)

    def stop(self, barrier: bool = False) -> None:
        self.clock.pop()


def _optimizers(optimizer) -> list:
    return [optimizer, *getattr(optimizer, "chained_optimizers", [])]


@contextlib.contextmanager
def instrumented(trainer, clock: PhaseClock) -> Iterator[None]:
    """Mark ``clock``'s boundaries in ``trainer``'s steps, ours and the bare one alike (module docstring); every
    hook and wrapper is removed on exit. ``RuntimeError`` when megatron's optimizer lacks what it wraps."""
    from megatron.core import __version__ as megatron_version

    from tim_megatron.trainer.model import unwrap

    opt = trainer.optimizer
    for name in ("prepare_grads", "step_with_ready_grads", "step"):
        if not callable(getattr(opt, name, None)):
            raise RuntimeError(
                f"the moe layer profile wraps the optimizer's {name}(), which {type(opt).__name__} of "
                f"megatron-core {megatron_version} lacks"
            )
    model = trainer.model

    def model_in(module, args, kwargs=None):
        clock.enter("forward")

    def model_out(module, args, out):
        # ours: the head runs after the model; bare: megatron's head ran inside it (its output_layer), the loss too
        clock.enter("head + loss" if clock.current == "forward" else "backward")

    def head_in(module, args):
        clock.enter("head + loss")

    handles = [
        model.register_forward_pre_hook(model_in),
        model.register_forward_hook(model_out),
    ]
    head = getattr(unwrap(model), "output_layer", None)
    if head is not None:
        handles.append(head.register_forward_pre_hook(head_in))

    def phase_of(fn: Callable, phase: str, after: str = OTHER) -> Callable:
        def wrapped(*a, **kw):
            clock.enter(phase)
            try:
                return fn(*a, **kw)
            finally:
                clock.enter(after)

        return wrapped

    wrapped: list[tuple[object, str]] = []

    def wrap(obj, name: str, phase: str, after: str = OTHER) -> None:
        setattr(obj, name, phase_of(getattr(obj, name), phase, after))
        wrapped.append((obj, name))

    wrap(trainer, "_all_finite", "finite check")
    wrap(opt, "prepare_grads", "grad prep", after="grad norm + clip")
    wrap(opt, "step_with_ready_grads", OTHER)
    configs = {id(c): c for o in _optimizers(opt) if (c := getattr(o, "config", None)) is not None}
    saved = {k: c.timers for k, c in configs.items()}
    for c in configs.values():
        c.timers = clock.timers
    try:
        yield
    finally:
        for c in configs.values():
            c.timers = saved[id(c)]
        for obj, name in wrapped:
            delattr(obj, name)
        for h in handles:
            h.remove()


def clocked(clock: PhaseClock, step: Callable[[], object]) -> dict[str, float]:
    """Run ``step`` once between :meth:`PhaseClock.begin` and :meth:`PhaseClock.end`; its phases' seconds, with
    ``"step"``: the host's wall time of the whole step (device synchronized at both ends)."""
    clock.begin()
    step()
    clock.end()
    return {**clock.seconds(), "step": clock.wall}


def loss_marked(clock: PhaseClock, loss_fn: Callable) -> Callable:
    """``loss_fn`` whose return ends the head + loss phase (our step: the backward follows)."""

    def marked(*a, **kw):
        out = loss_fn(*a, **kw)
        clock.enter("backward")
        return out

    return marked


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the median over ``runs``."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]} if runs else {}
