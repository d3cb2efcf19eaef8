"""A weight sync's tensors packed into one flat shared-memory buffer with a small index, for an engine in a process
of its own (``rollout.engine_process``).

The rank copies each ``(name, tensor)`` of the sync's stream into one anonymous shared-memory file (``memfd``) at
an aligned offset; the index lists each tensor's name, dtype, shape and offset in the stream's order. The engine's
process maps the same file and loads views of it (no copy, no pickling of tensor data). One file descriptor crosses
per buffer, and only when the buffer is new to that process, whatever the number of tensors: the open-file limit
(``RLIMIT_NOFILE``) does not grow with the model. The next sync with the same tensors writes over the same buffer;
a sync whose names, dtypes or shapes differ gets a new one.

The buffer is also the copy of the weights the engine holds that a restarted engine loads.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import mmap
import os
import resource
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import torch

ALIGN = 64
"""Every tensor starts at a multiple of this many bytes (any dtype's alignment, and a cache line)."""
T = TypeVar("T")
FILES_PER_SYNC = 2
"""Open files a sync may add on the rank: the buffer's, and a second while a buffer of a new layout replaces it.
(The engine's process holds the one it is sent, and a second, its mapping's, while it loads.)"""


class FileLimitError(RuntimeError):
    """This process's open-file limit (``RLIMIT_NOFILE``) leaves no room for what it must open."""


@dataclass(frozen=True)
class Entry:
    """One tensor in the buffer."""

    name: str
    dtype: str
    """A ``torch`` dtype's name (``bfloat16``)."""
    shape: tuple[int, ...]
    offset: int
    """Bytes from the buffer's start."""
    nbytes: int


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_open_file_limit(*, needed: int, who: str) -> None:
    """Raise :class:`FileLimitError`, naming the limit and the fix, unless ``needed`` more files can be opened."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    try:
        open_now = len(os.listdir("/proc/self/fd")) - 1  # less the listing's own
    except OSError as e:  # the listing itself found no room
        if e.errno != errno.EMFILE:
            raise
        open_now = soft
    if open_now + needed > soft:
        raise FileLimitError(
            f"{who} has {open_now} files open and an open-file limit (RLIMIT_NOFILE) of {soft} (hard limit "
            f"{hard}): a weight sync into its engine process needs {needed} more, whatever the model's number of "
            f"tensors; raise the limit for the job (ulimit -n {max(4 * soft, 4096)} before tim train, or the "
            "cluster's LimitNOFILE / Slurm's --propagate=NOFILE)"
        )


class FlatWeights:
    """The rank's buffer: the memfd, its mapping, and the index of the last sync packed into it."""

    def __init__(self):
        self.fd = -1
        self.size = 0
        self.index: list[Entry] = []
        self.generation = 0
        """Counts new buffers: an engine process holds the file of one generation."""
        self._bytes: torch.Tensor | None = None

    def view(self, e: Entry) -> torch.Tensor:
        return _view(self._bytes, e)

    def pack(self, stream: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy every tensor of ``stream`` in; the index follows the stream's order (a name sent twice is loaded
        twice, as the stream would have it). Into the current buffer when it has a place of the same name, dtype
        and shape for each tensor; else into a new one."""
        places = {e.name: e for e in self.index}
        order: list[Entry | tuple[str, torch.Tensor]] = []
        written: set[str] = set()
        for name, t in stream:
            e = places.get(name)
            if (
                e is not None
                and name not in written
                and e.dtype == dtype_name(t.dtype)
                and e.shape == tuple(t.shape)
            ):
                self.view(e).copy_(t.detach())
                written.add(name)
                order.append(e)
            else:
                order.append((name, t.detach().clone()))
        if written == set(places) and all(isinstance(x, Entry) for x in order):
            self.index = order  # type: ignore[assignment]
            return
        self._relayout(order)

    def _relayout(self, order: list) -> None:
        index, offset = [], 0
        for x in order:
            name, dtype, shape, nbytes = (
                (x.name, x.dtype, x.shape, x.nbytes)
                if isinstance(x, Entry)
                else (x[0], dtype_name(x[1].dtype), tuple(x[1].shape), x[1].numel() * x[1].element_size())
            )
            index.append(Entry(name, dtype, shape, offset, nbytes))
            offset += -(-nbytes // ALIGN) * ALIGN
        size = max(offset, ALIGN)
        fd = os.memfd_create("tim-engine-weights", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            # torch maps it (and closes its own descriptor): the mapping lives as long as a view of it
            new = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=size, dtype=torch.uint8)
        except BaseException:
            os.close(fd)
            raise
        for e, x in zip(index, order, strict=True):
            src = self.view(x) if isinstance(x, Entry) else x[1]
            _view(new, e).copy_(src)
        self.close()
        self.fd, self.size, self._bytes, self.index = fd, size, new, index
        self.generation += 1

    def close(self) -> None:
        self._bytes = None
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1
        self.size, self.index = 0, []


def _bytes_of(mm: mmap.mmap) -> torch.Tensor:
    """The mapping as a uint8 tensor that holds it open: ``torch.frombuffer`` keeps a reference to the object it
    is given but not its buffer export, so over the map itself ``close()`` would unmap memory under live views;
    over a memoryview of it, ``close()`` raises ``BufferError`` while any view lives."""
    return torch.frombuffer(memoryview(mm), dtype=torch.uint8)


def _view(flat: torch.Tensor, e: Entry) -> torch.Tensor:
    return flat[e.offset : e.offset + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape)


# ------------------------------------------------------------------------------------------ the engine's side


def load_mapped(fd: int, size: int, index: list[Entry], load: Callable[[list], T]) -> T:
    """``load([(name, view), ...])`` over views of every tensor of a buffer (in the index's order), and its result;
    the mapping ends with the call. A view still referenced then (the engine kept one instead of copying it) is an
    error: the rank writes over the buffer at the next sync."""
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    flat = _bytes_of(mm)
    views = [(e.name, _view(flat, e)) for e in index]
    del flat
    try:
        return load(views)
    finally:
        del views
        try:
            mm.close()
        except BufferError:
            gc.collect()
            try:
                mm.close()
            except BufferError:
                raise RuntimeError(
                    "the engine kept a reference to the shared weight buffer after loading it (it must copy the "
                    "weights into its own parameters: the rank writes over the buffer at the next sync)"
                ) from None
