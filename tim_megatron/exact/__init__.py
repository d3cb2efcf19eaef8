"""Exact mode's building blocks: row-invariant kernels (:mod:`.kernels`) and the KV cache (:mod:`.kv_cache`)."""
