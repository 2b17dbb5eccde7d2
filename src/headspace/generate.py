"""The old home of :func:`generate`; it lives in :mod:`headspace.decode.loop` now (this path keeps
working)."""

from __future__ import annotations

from .decode.loop import generate, sample

__all__ = ["generate", "sample"]
