"""The trace: every hook point a model names, recorded in one forward pass.

* :mod:`.trace`: :func:`trace` (a context manager recording the chosen hook points into a :class:`Trace`,
  a read-only mapping name -> tensor), :func:`hooked` (functions run at hook points for one block of code),
  :func:`select_hook_points`, :func:`attention_layers` and :func:`as_module`, and the hook-name groups
  (``ATTN_HOOKS``, ``ROTARY_HOOKS``, ``QK_NORM_HOOKS``, ``BLOCK_HOOKS``).

``headspace.analysis.trace`` was that module before it became this package: it re-exports the module's
public names, and calling the package calls :func:`trace` (as calling the module does).
"""

from __future__ import annotations

import sys
import types
from typing import Any

from .trace import (
    ATTN_HOOKS,
    BLOCK_HOOKS,
    QK_NORM_HOOKS,
    ROTARY_HOOKS,
    NameFilter,
    Trace,
    as_module,
    attention_layers,
    hooked,
    select_hook_points,
    trace,
)

__all__ = [
    "ATTN_HOOKS",
    "BLOCK_HOOKS",
    "QK_NORM_HOOKS",
    "ROTARY_HOOKS",
    "NameFilter",
    "Trace",
    "as_module",
    "attention_layers",
    "hooked",
    "select_hook_points",
    "trace",
]


class _CallablePackage(types.ModuleType):
    """``headspace.analysis.trace(model, ...)`` calls :func:`trace`, as it did when this was a module."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return trace(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
