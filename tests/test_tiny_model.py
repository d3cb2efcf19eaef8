"""The tiny-model cache (tim_megatron/models/tiny.py): a process that waits for another's build says so.

Issue 56: one tiny-model build held the cache lock while every other tiny run waited in start-up with nothing said.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time

from tim_megatron.models.tiny import _cache_lock


def test_a_process_waiting_for_the_cache_lock_says_who_holds_it(tmp_path, capsys):
    fd = os.open(tmp_path / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.pwrite(fd, b"pid 4242 on node7, building qwen3_moe-abc (50 warm-up steps)", 0)
    entered = threading.Event()

    def waiter() -> None:
        with _cache_lock(tmp_path) as holding:
            holding(", building another")
            entered.set()

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.5)
    assert not entered.is_set()  # it waits for the holder
    os.close(fd)  # the holder is done
    t.join(timeout=10)
    assert entered.is_set()
    out = capsys.readouterr().out
    assert (
        f"tiny model: waiting for the cache lock {tmp_path / '.lock'} (held by pid 4242 on node7, building "
        in out
    )
    assert "the cache lock came free after" in out
    assert (tmp_path / ".lock").read_text().endswith(", building another")  # what the next waiter is told


def test_a_free_cache_lock_is_taken_in_silence(tmp_path, capsys):
    with _cache_lock(tmp_path):
        pass
    assert capsys.readouterr().out == ""
