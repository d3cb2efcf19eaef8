"""The run folder's errors: each message names the folder, the cause and the fix."""

from __future__ import annotations


class RunDirError(RuntimeError):
    """A run folder that cannot be used as asked; the message names the folder, the cause and the fix."""


class RecipeChangeError(RunDirError):
    pass


class StatusTransitionError(RunDirError):
    """A ``run.json`` status change that :data:`ALLOWED_FROM` does not allow."""


class DiskFullError(RunDirError):
    pass


class SharedMemoryError(RunDirError):
    """Shared memory (/dev/shm) full or refusing writes: not the run folder's disk, which a full one looks like."""


class RunDirNotWritable(RunDirError):
    """A run folder (or a subfolder the run writes) that refuses writes: read-only, immutable, no permission."""
