"""Scratch memory reused across calls: see :mod:`headspace.kernels.workspace` (this path keeps working)."""

from .kernels.workspace import (
    THREAD_SCRATCH_MIN_BYTES,
    PatternMemoryError,
    Workspace,
    recycled_empty,
    release_thread_workspace,
    thread_workspace,
)

__all__ = [
    "THREAD_SCRATCH_MIN_BYTES",
    "PatternMemoryError",
    "Workspace",
    "recycled_empty",
    "release_thread_workspace",
    "thread_workspace",
]
