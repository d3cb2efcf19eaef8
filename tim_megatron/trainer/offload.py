"""The trainer's state in host memory while the rollout engine generates (``trainer.offload_during_rollout``).

Moves whole storages, the way megatron-core's own ``_ParamAndGradBuffer.offload_to_cpu`` moves its buffers: the
bytes are copied to a host buffer (pinned on CUDA, reused from step to step) and the device storage is resized to
zero; coming back, the storage is resized and the bytes copied in. Every tensor that views a storage (a parameter
in megatron's contiguous buffer, its ``main_grad``, Adam's moments) stays the same Python object with the same
shape, so the optimizer, the DDP buffers and the hooks never notice, and the bits that return are the bits that
left. While a storage is away its tensors must not be touched (their data is gone; on CPU a kernel reading one
can crash): the trainer refuses its own forward, update and export until :meth:`HostOffload.onload`.

Which storages are which part is decided by what owns them: ``params`` are the model's parameters (and
megatron's parameter buffers), ``grads`` the DDP gradient buffers, ``optimizer`` every other tensor the optimizer
holds (Adam's moments; the fp32 master weights of a 16-bit model). A storage in two parts belongs to the first in
that order, so an fp32 model's parameters (which are also the optimizer's) move only with ``all``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

LEVELS: dict[str, tuple[str, ...]] = {
    "none": (),
    "optimizer": ("optimizer",),
    "optimizer+grads": ("optimizer", "grads"),
    "all": ("optimizer", "grads", "params"),
}
"""``trainer.offload_during_rollout`` -> the parts it moves."""
PARTS = ("params", "grads", "optimizer")
"""Ownership order: a storage shared by two parts belongs to the first."""


@dataclass(frozen=True)
class Transfer:
    """One move: bytes and seconds per part."""

    bytes: dict[str, int]
    seconds: float

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


@dataclass
class _Away:
    storage: torch.UntypedStorage
    view: torch.Tensor
    """uint8 over the whole storage: valid again once the storage has its size back."""
    nbytes: int
    part: str


def storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage`` (it stays valid across ``resize_`` of the storage)."""
    n = storage.nbytes()
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (n,), (1,))


def _tensors_of(obj) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_of(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors_of(v)


def inner_optimizers(optimizer) -> list:
    """The torch optimizers inside megatron's (chained, mixed-precision or distributed) optimizer."""
    chained = getattr(optimizer, "chained_optimizers", None)
    outer = list(chained) if chained is not None else [optimizer]
    return [getattr(o, "optimizer", o) for o in outer]


def trainer_tensors(model, optimizer) -> dict[str, list[torch.Tensor]]:
    """The tensors of each part (see the module docstring), from megatron's DDP ``model`` and its optimizer."""
    buffers = list(getattr(model, "buffers", [])) + list(getattr(model, "expert_parallel_buffers", []))
    params = list(model.parameters()) + [b.param_data for b in buffers if b.param_data is not None]
    grads = [b.grad_data for b in buffers if b.grad_data is not None]
    opt = []
    for inner in inner_optimizers(optimizer):
        for group in inner.param_groups:
            opt += [p for p in group["params"] if isinstance(p, torch.Tensor)]
        opt += list(_tensors_of(list(inner.state.values())))
    return {"params": params, "grads": grads, "optimizer": opt}


class HostOffload:
    """Owns the host copies of a trainer's storages while they are away. One per trainer."""

    def __init__(self, *, device: torch.device):
        self.device = device
        self._away: dict[int, _Away] = {}
        self._host: dict[int, torch.Tensor] = {}
        """Host buffers by storage, kept for the next move (pinned memory is slow to allocate)."""

    def away(self) -> frozenset[int]:
        """The storages now in host memory (``UntypedStorage._cdata``), for checks that nothing touches them."""
        return frozenset(self._away)

    @property
    def offloaded(self) -> tuple[str, ...]:
        """The parts now in host memory."""
        return tuple(p for p in PARTS if any(a.part == p for a in self._away.values()))

    def storages(self, tensors: dict[str, list[torch.Tensor]]) -> dict[str, dict[int, torch.UntypedStorage]]:
        """Each part's distinct, non-empty storages (a storage in two parts goes to the first of :data:`PARTS`)."""
        seen: set[int] = set()
        out: dict[str, dict[int, torch.UntypedStorage]] = {}
        for part in PARTS:
            mine = out.setdefault(part, {})
            for t in tensors.get(part, []):
                s = t.untyped_storage()
                key = s._cdata  # the storage itself, stable across resize_ (data_ptr is not)
                if key in seen or s.nbytes() == 0 or s.device != self.device:  # (Adam's host-side steps)
                    continue
                seen.add(key)
                mine[key] = s
        return out

    def offload(self, tensors: dict[str, list[torch.Tensor]], parts: Iterable[str]) -> Transfer:
        """Copy ``parts`` of ``tensors`` to host memory and free their device storage."""
        parts = tuple(parts)
        unknown = [p for p in parts if p not in PARTS]
        if unknown:
            raise ValueError(f"offload parts {unknown}: allowed {', '.join(PARTS)}")
        t0 = time.perf_counter()
        moved: dict[str, int] = dict.fromkeys(parts, 0)
        leaving: list[_Away] = []
        chosen = {p: st for p, st in self.storages(tensors).items() if p in parts}
        fixed = [(p, s.nbytes()) for p, st in chosen.items() for s in st.values() if not s.resizable()]
        if fixed:  # checked before anything moves: never half offloaded
            raise RuntimeError(
                f"trainer.offload_during_rollout: {len(fixed)} storage(s) cannot be freed ({fixed[0][0]}, "
                f"{fixed[0][1]} bytes: not resizable, e.g. shared with numpy); set "
                "trainer.offload_during_rollout = none"
            )
        for part, storages in chosen.items():
            for key, s in storages.items():
                if key in self._away:
                    continue
                n = s.nbytes()
                view = storage_bytes(s)
                host = self._host.get(key)
                if host is None or host.numel() != n:
                    host = torch.empty(n, dtype=torch.uint8, pin_memory=view.is_cuda)
                    self._host[key] = host
                host.copy_(view, non_blocking=view.is_cuda)
                leaving.append(_Away(s, view, n, part))
                self._away[key] = leaving[-1]
                moved[part] += n
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # every byte is on the host before its storage goes
        for a in leaving:
            a.storage.resize_(0)
        return Transfer(moved, time.perf_counter() - t0)

    def onload(self) -> Transfer:
        """Bring every part back: the same storages, the same bytes."""
        t0 = time.perf_counter()
        moved: dict[str, int] = {}
        for key, a in self._away.items():
            a.storage.resize_(a.nbytes)
            a.view.copy_(self._host[key], non_blocking=a.view.is_cuda)
            moved[a.part] = moved.get(a.part, 0) + a.nbytes
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._away.clear()
        return Transfer(moved, time.perf_counter() - t0)
