"""Checksums of files written once and read later (checkpoints, the tiny-model cache), and the warning
given when corrupt data is set aside."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tim_megatron.untrusted import open_regular


class IntegrityWarning(UserWarning):
    """Corrupt data was found and set aside (a checkpoint skipped, a cache rebuilt)."""


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """sha256 of the regular file ``path``; anything else (a FIFO would block, a device never end) is refused with
    :class:`tim_megatron.untrusted.UnreadableFile` before it is read. Checkpoints refuse links first
    (:func:`tim_megatron.trainer.checkpoint.refuse_special`)."""
    h = hashlib.sha256()
    with open_regular(path) as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
