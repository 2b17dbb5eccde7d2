"""The fields every positional-target result holds: attention mass on five targets, and the entropy.

The targets of a query are the key just before it (``previous``), just after it (``next``), itself
(``current``), and the first and the last real key (``first``, ``last``); ``entropy`` is the pattern
row's entropy in nats. :class:`~headspace.analysis.chunked.PatternSummary` holds them per query,
:class:`~headspace.analysis.roles.HeadRoles` as per-head means.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .._common import JsonResult

__all__ = ["TargetMasses"]


@dataclass
class TargetMasses(JsonResult):
    """The mass on ``previous``, ``next``, ``current``, ``first`` and ``last``, and the ``entropy``.

    The shapes are the subclass's (per query or per head); the subclasses add their own fields after these.
    """

    previous: Tensor
    next: Tensor
    current: Tensor
    first: Tensor
    last: Tensor
    entropy: Tensor
