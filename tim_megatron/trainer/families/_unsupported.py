"""Architectures we know and refuse, each with the piece that is missing (checked on this project's stack)."""

from __future__ import annotations

REFUSED: dict[str, str] = {}
"""HF architecture -> why it is refused."""
