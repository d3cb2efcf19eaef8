"""Checksums of files written once and read later (checkpoints, the tiny-model cache), and the warning
given when corrupt data is set aside."""

from __future__ import annotations

import hashlib
from pathlib import Path


class IntegrityWarning(UserWarning):
    """Corrupt data was found and set aside (a checkpoint skipped, a cache rebuilt)."""


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
