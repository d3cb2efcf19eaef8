"""The wire between a rank and its engine process: length-prefixed frames over a Unix stream socket, and every read
and write on the rank's side bounded by a deadline.

A frame is an 8-byte little-endian length and that many bytes. The rank's end of the socket is non-blocking: a
write waits (``poll``) for room in the socket's buffer and a read for data, each only until the call's deadline.
So an engine that stops (SIGSTOP, a deadlock) in the middle of a reply, or before it reads a request larger than
the socket's buffer, is found when the deadline passes (:class:`WireTimeout`), and one that dies is found at once:
its end of the socket closes, or ``alive()`` says so (:class:`WireClosed`). Any other ``OSError`` is the caller's
own (an open-file limit, memory) and is raised as it is.

File descriptors (the weights' shared memory) cross beside a frame's first bytes (``SCM_RIGHTS``). The engine's
side reads and writes blocking (:func:`read_frame`, :func:`write_frame`): it waits for its rank, and it dies with it.
"""

from __future__ import annotations

import array
import contextlib
import math
import os
import select
import socket
import time
from collections.abc import Callable, Sequence

HEADER = 8
"""Bytes of a frame's length prefix."""
MAX_FRAME = 1 << 40
"""A length past this is not a frame (a corrupt stream)."""
POLL_S = 0.05
"""How often a wait looks at ``alive()``."""


class WireClosed(Exception):
    """The other side's end of the socket closed (its process ended)."""


class WireTimeout(Exception):
    """The deadline passed in the middle of a read or a write."""


def _wait(
    sock: socket.socket, events: int, *, deadline: float, alive: Callable[[], bool] | None, what: str
) -> None:
    """Until ``sock`` is ready for ``events``; :class:`WireTimeout` past ``deadline``, :class:`WireClosed` once
    ``alive()`` is False and nothing is ready."""
    p = select.poll()
    p.register(sock, events | select.POLLHUP | select.POLLERR)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise WireTimeout(what)
        if p.poll(max(1, math.ceil(min(POLL_S, left) * 1000))):
            return
        if alive is not None and not alive():
            if p.poll(0):  # it wrote its last bytes, then ended
                return
            raise WireClosed(what)


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(HEADER, "little") + payload


def send_frames(
    sock: socket.socket,
    payloads: Sequence[bytes],
    *,
    deadline: float,
    alive: Callable[[], bool] | None = None,
    fds: Sequence[int] = (),
) -> None:
    """Write ``payloads`` as frames, ``fds`` beside the first byte; every wait bounded by ``deadline``."""
    data = memoryview(b"".join(frame(p) for p in payloads))
    sent = 0
    while sent < len(data):
        try:
            if fds and sent == 0:
                n = sock.sendmsg(
                    [data[: 1 << 16]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                )
            else:
                n = sock.send(data[sent:])
        except BlockingIOError:
            _wait(sock, select.POLLOUT, deadline=deadline, alive=alive, what=f"writing {len(data)} bytes")
            continue
        except (BrokenPipeError, ConnectionResetError):
            raise WireClosed("writing") from None
        sent += n


def _recv_exact(
    sock: socket.socket, n: int, *, deadline: float, alive: Callable[[], bool] | None, what: str
) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got)
        except BlockingIOError:
            _wait(
                sock, select.POLLIN, deadline=deadline, alive=alive, what=f"{what} ({got} of {n} bytes read)"
            )
            continue
        except ConnectionResetError:
            raise WireClosed(what) from None
        if k == 0:
            raise WireClosed(f"{what} ({got} of {n} bytes read)")
        got += k
    return buf


def recv_frame(sock: socket.socket, *, deadline: float, alive: Callable[[], bool] | None = None) -> bytes:
    """Read one frame; every wait bounded by ``deadline``."""
    head = _recv_exact(sock, HEADER, deadline=deadline, alive=alive, what="reading a reply's length")
    n = int.from_bytes(head, "little")
    if n > MAX_FRAME:
        raise WireClosed(f"a frame of {n} bytes: the stream is corrupt")
    return bytes(_recv_exact(sock, n, deadline=deadline, alive=alive, what="reading a reply"))


# ------------------------------------------------------------------------------------------ the engine's side


def read_frame(sock: socket.socket, *, max_fds: int = 0) -> tuple[bytes, list[int]] | None:
    """Read one frame (blocking) and the file descriptors beside it; None once the rank's end has closed."""
    head, fds = bytearray(), []
    while len(head) < HEADER:
        if max_fds:
            data, got, flags, _ = socket.recv_fds(sock, HEADER - len(head), max_fds)
            fds += got
            if flags & socket.MSG_CTRUNC:
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                raise OSError(
                    "file descriptors sent with a request were dropped (MSG_CTRUNC): this process is at its "
                    "open-file limit (RLIMIT_NOFILE)"
                )
        else:
            data = sock.recv(HEADER - len(head))
        if not data:
            return None
        head += data
    n = int.from_bytes(head, "little")
    if n > MAX_FRAME:
        raise OSError(f"a frame of {n} bytes: the stream is corrupt")
    body = bytearray(n)
    view, got = memoryview(body), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return None
        got += k
    return bytes(body), fds


def write_frame(
    sock: socket.socket, payload: bytes, *, stop_midway: Callable[[], None] | None = None
) -> None:
    """Write one frame (blocking); ``stop_midway`` (the fire drill) runs after half of it is written."""
    data = frame(payload)
    if stop_midway is None:
        sock.sendall(data)
        return
    half = len(data) // 2
    sock.sendall(data[:half])
    stop_midway()
    sock.sendall(data[half:])
