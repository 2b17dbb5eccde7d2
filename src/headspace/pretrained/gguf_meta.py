"""`GGUFError` and the checked reads of metadata values, shared by the GGUF reader modules.

Their own module, so that :mod:`.gguf_format` and the architecture modules it dispatches to
(:mod:`.gguf_gemma`) import them without a circle.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

__all__ = ["GGUFError", "meta_float", "meta_int"]


class GGUFError(ValueError):
    """A GGUF file that cannot be read: malformed, truncated, hostile, or not a supported model.

    ``str(error)`` is ``"<path>: <problem>"``; the two parts are also kept as ``path`` and ``problem``.
    """

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


def meta_int(meta: dict[str, Any], key: str, path: Path, lo: int, hi: int, default: int | None = None) -> int:
    """Integer metadata ``key`` in [lo, hi] (``default`` when absent, or an error when that is None)."""
    if key not in meta:
        if default is None:
            raise GGUFError(path, f"metadata {key!r} is missing")
        return default
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise GGUFError(path, f"metadata {key!r} is {value!r}, not an integer")
    if not lo <= value <= hi:
        raise GGUFError(path, f"metadata {key!r} is {value}, outside the sane range [{lo}, {hi}]")
    return value


def meta_float(meta: dict[str, Any], key: str, path: Path, lo: float, hi: float, default: float) -> float:
    """Float metadata ``key`` in (lo, hi) exclusive, or ``default`` when absent."""
    if key not in meta:
        return default
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GGUFError(path, f"metadata {key!r} is {value!r}, not a number")
    value = float(value)
    if not (math.isfinite(value) and lo < value < hi):
        raise GGUFError(path, f"metadata {key!r} is {value}, outside the sane range ({lo}, {hi})")
    return value
