"""``tim_megatron.untrusted`` under its earlier name, for one reader: ``tim_megatron/lab/runstats.py``, a rule file
whose sha256 experiment E's runs recorded as they started (``lab.json``), so that its bytes stay what those runs
hashed (``tim_megatron/lab/provenance.py``). Everything else imports :mod:`tim_megatron.untrusted`."""

from tim_megatron.untrusted import UnreadableFile

__all__ = ["UnreadableFile"]
