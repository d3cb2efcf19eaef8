"""``torch.compile`` of the layers' small pure functions (``trainer.compile``; issue 57, item 6).

Three functions of every layer are chains of small elementwise kernels, each launched on its own and each saving its
own activation for the backward: the RMSNorms (:func:`~tim_megatron.trainer.norm.rms_norm`: the input layer norm,
the pre-MLP norm, the q and k norms and the final norm), megatron-core's unfused rotary embedding
(``_apply_rotary_pos_emb_bshd``, for q and k) and the experts' SwiGLU times the routing probabilities
(:func:`glu_probs`). Compiled (Inductor, ``dynamic=True`` so that one graph serves every sequence length and batch)
each becomes one or two fused kernels forward and backward.

Where it applies (:func:`resolve_compile`): on CUDA, never in exact mode (compiled kernels fuse and round otherwise
than the row-invariant ones), not on CPU (Inductor's C++ compile costs seconds per function at every process start,
and the CPU figures of this project were measured eagerly), and ``trainer.compile: off`` turns it off everywhere.

How it is wired (:func:`apply`, on a built model):

* each :class:`~tim_megatron.trainer.norm.SequenceParallelRMSNorm` gets the compiled :func:`rms_norm` as its
  ``norm_fn`` (an instance attribute over the class's eager one);
* megatron-core's ``_apply_rotary_pos_emb_bshd`` is bound to its compiled form (``patches/megatron/compiled_rope.py``,
  version-guarded), process-wide until the trainer closes;
* a module of the model that declares a ``glu_probs_fn`` slot (a class attribute holding :func:`glu_probs`, called
  where the module applies ``activation(gate) * up * probs``) gets the compiled :func:`glu_probs`, where the layer's
  activation is SiLU without clamp or offset. The experts of :mod:`tim_megatron.trainer.experts` do not declare the
  slot yet: until they do, the SwiGLU runs eagerly, and :attr:`Compiled.functions` says so.

The compile itself runs at the first call of each graph; :meth:`Compiled.seconds` is dynamo's own account of the
time spent compiling since :func:`apply` (``torch._dynamo.utils.calculate_time_spent``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from patches.guard import Handle

COMPILE_SETTINGS = ("auto", "off")
"""Values of ``trainer.compile``."""
BACKEND = "inductor"
"""The backend a run compiles with (tests pass ``aot_eager``: the same tracing and autograd, no C++ or Triton)."""


def resolve_compile(setting: str, *, exact: bool, on_gpu: bool) -> str:
    """Why the functions are not compiled for this run ('' when they are)."""
    if setting not in COMPILE_SETTINGS:
        raise ValueError(f"trainer.compile = {setting!r}; allowed: {', '.join(COMPILE_SETTINGS)}")
    if setting == "off":
        return "trainer.compile = off"
    if exact:
        return "exact mode (its row-invariant kernels are never compiled)"
    if not on_gpu:
        return "on CPU (trainer.compile = auto compiles on CUDA only)"
    return ""


def glu_probs(h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up * probs`` in ``h``'s dtype, ``h = [rows, 2 x width]`` (gate, then up), ``probs = [rows]``:
    the gated activation of the grouped experts (``activation_func`` SiLU, no clamp, no offset) times each row's
    routing probability, as megatron-core's experts compute it."""
    gate, up = torch.chunk(h, 2, dim=-1)
    return (torch.nn.functional.silu(gate) * up * probs.unsqueeze(-1)).to(h.dtype)


def dynamo_compile_seconds() -> float | None:
    """Seconds dynamo has spent compiling in this process, by its own account (None: this torch keeps none)."""
    try:
        from torch._dynamo.utils import calculate_time_spent
    except ImportError:
        return None
    return float(calculate_time_spent().get("total_wall_time", 0.0))


@functools.cache
def compiled_functions(backend: str = BACKEND) -> dict[str, Callable]:
    """The compiled forms, one per function and backend in a process: dynamo keeps its graphs per function, so
    trainers built one after another reuse what the first compiled."""
    from patches.megatron import compiled_rope
    from tim_megatron.trainer.norm import rms_norm

    def c(fn):
        return torch.compile(fn, dynamic=True, backend=backend)

    return {"rms_norm": c(rms_norm), "rope": c(compiled_rope.original()), "glu_probs": c(glu_probs)}


def _glu_fits(module) -> bool:
    cfg = getattr(module, "config", None)
    return (
        cfg is not None
        and cfg.activation_func is torch.nn.functional.silu
        and cfg.activation_func_clamp_value is None
        and not cfg.glu_linear_offset
        and not cfg.moe_apply_probs_on_input
    )


def _set_on_instance(handle: Handle, module, name: str, value) -> None:
    """``module.name = value`` as an instance attribute over the class's; undone by deleting it again."""
    setattr(module, name, value)
    handle.undo.append(lambda: delattr(module, name))


@dataclass
class Compiled:
    """What ``trainer.compile`` did to one built model; a patch handle (:meth:`revert`, on the trainer's close) that
    :meth:`disable` and :meth:`enable` also switch off and on (the ``moe layer`` profile's lever)."""

    why_not: str
    """Why nothing is compiled ('' when it is)."""
    backend: str = BACKEND
    norms: list = field(default_factory=list)
    """The model's RMSNorm modules that run the compiled :func:`rms_norm`."""
    glus: list = field(default_factory=list)
    """The modules with a ``glu_probs_fn`` slot that run the compiled :func:`glu_probs`."""
    name: str = "trainer-compile"
    _handle: Handle | None = None
    _since: float | None = None

    @property
    def active(self) -> bool:
        """The compiled functions are in place now."""
        return self._handle is not None

    @property
    def functions(self) -> str:
        """What runs compiled, in words (or why nothing does)."""
        if self.why_not:
            return f"nothing compiled: {self.why_not}"
        glu = (
            f"SwiGLU x probs in {len(self.glus)} expert modules"
            if self.glus
            else "SwiGLU x probs not wired (no experts module declares a glu_probs_fn slot)"
        )
        return (
            f"RMSNorm in {len(self.norms)} modules, megatron's RoPE, {glu} ({self.backend}, dynamic shapes)"
        )

    def enable(self) -> None:
        if self.why_not or self._handle is not None:
            return
        from patches.megatron import compiled_rope

        fns = compiled_functions(self.backend)
        h = compiled_rope.apply(fns["rope"])
        for m in self.norms:
            _set_on_instance(h, m, "norm_fn", fns["rms_norm"])
        for m in self.glus:
            _set_on_instance(h, m, "glu_probs_fn", fns["glu_probs"])
        self._handle = h

    def disable(self) -> None:
        """The eager functions again (the instance attributes removed, megatron's RoPE restored)."""
        if self._handle is not None:
            self._handle.revert()
            self._handle = None

    def revert(self) -> None:
        self.disable()

    def seconds(self) -> float | None:
        """Dynamo's compile seconds since :func:`apply` (every graph compiled meanwhile, in this process)."""
        now = dynamo_compile_seconds()
        if self.why_not or now is None or self._since is None:
            return None
        return now - self._since


def apply(gpt, *, setting: str, exact: bool, on_gpu: bool, backend: str = BACKEND) -> Compiled:
    """Compile the functions of the built model ``gpt`` (module docstring), where :func:`resolve_compile` allows it;
    returns the handle either way (``why_not`` says why nothing was compiled)."""
    from tim_megatron.trainer.norm import SequenceParallelRMSNorm

    out = Compiled(why_not=resolve_compile(setting, exact=exact, on_gpu=on_gpu), backend=backend)
    if out.why_not:
        return out
    for m in gpt.modules():
        if isinstance(m, SequenceParallelRMSNorm):
            out.norms.append(m)
        elif hasattr(type(m), "glu_probs_fn") and _glu_fits(m):
            out.glus.append(m)
    out._since = dynamo_compile_seconds()
    out.enable()
    return out
