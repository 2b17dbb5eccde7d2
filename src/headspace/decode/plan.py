"""The old home of the cached decoding step; it lives in :mod:`headspace.decode` now.

Kept so that code written against earlier versions runs: :class:`DecodePlan` is a
:class:`headspace.decode.Stepper` built from a model (``plan.logits``, ``plan.idle``, ``plan.pack_rows``,
``plan.use_native``), and the helpers are :mod:`headspace.decode`'s own.
"""

from __future__ import annotations

from typing import Any

from . import Stepper, describe
from .loop import choose_pack_rows, generation_caches
from .step import product_weights

__all__ = ["DecodePlan", "choose_pack_rows", "generation_caches", "product_weights"]


class DecodePlan(Stepper):
    """:func:`headspace.decode.describe` of ``model`` run by a :class:`~headspace.decode.Stepper`
    (``watch_hooks`` is accepted and ignored: a step always steps aside for active hook points)."""

    def __init__(self, model: Any, *, watch_hooks: bool = True, pack_rows: int | None = None) -> None:
        step = describe(model, pack_rows)
        if step is None:
            raise ValueError("this model has no cached decoding step (a block without decode_supported)")
        super().__init__(step)

    @property
    def pack_rows(self) -> int | None:
        """The batch the products' weights were packed for, or None."""
        return self.step.pack_rows

    @property
    def use_native(self) -> bool:
        """Whether steps may run on the native backend (False: always Python)."""
        return self.backend != "python"

    @use_native.setter
    def use_native(self, value: bool) -> None:
        self.backend = None if value else "python"
