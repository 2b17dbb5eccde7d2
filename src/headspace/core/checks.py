"""Small checks shared by every module that refuses bad values (docs/design.md, the bad-input contract).

Each ``check_*`` raises ``ValueError`` whose message names the argument, what was expected and what came;
``bool`` is never accepted as a number (``True`` is an ``int`` in Python, never a meaningful size).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_positive_int(name: str, value: Any, *, note: str = "") -> int:
    """``value`` must be an int > 0: ``"{name} must be a positive int{note}; got {value!r}"``."""
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive int{note}; got {value!r}")
    return value


def check_index(
    name: str, value: Any, n: int, *, where: str = "", negative: bool = False, of: str = ""
) -> int:
    """``value`` must be an int in [0, n) (also [-n, 0) with ``negative``); returns it in [0, n).

    Message: ``"{name} must be an int in [0, {n}){where}; got {value!r}"`` (``[0, {of}={n})`` with ``of``).
    """
    low = -n if negative else 0
    if not is_int(value) or not low <= value < n:
        bound = f"{of}={n}" if of else str(n)
        raise ValueError(f"{name} must be an int in [0, {bound}){where}; got {value!r}")
    return value % n


def check_probability(name: str, value: Any) -> float:
    """``value`` must be a number in [0, 1) (a dropout rate): ``"{name} must be a float in [0, 1)"``."""
    if not is_number(value) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be a float in [0, 1); got {value!r}")
    return float(value)


def check_positive_float(name: str, value: Any) -> float:
    """``value`` must be a finite number > 0: ``"{name} must be a finite positive float; got ..."``."""
    if not is_number(value) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite positive float; got {value!r}")
    return float(value)


def shape_or_type(value: Any) -> list[int] | str:
    """What came, as an error message says it: a tensor's shape (a list), anything else its type's name."""
    return list(value.shape) if isinstance(value, Tensor) else type(value).__name__


def check_tensor_dims(value: Any, dims: int, what: str) -> Tensor:
    """``value`` must be a tensor with ``dims`` dimensions: ``"{what}; got {shape or type}"`` otherwise.

    ``what`` names the argument and its layout, e.g. ``"A must be a matrix [d, p]"``.
    """
    if not isinstance(value, Tensor) or value.dim() != dims:
        raise ValueError(f"{what}; got {shape_or_type(value)}")
    return value


def nonfinite_count(t: Tensor) -> int:
    """How many NaN/Inf values ``t`` holds (0 when all are finite; one pass, the count only on failure)."""
    finite = torch.isfinite(t)
    return 0 if bool(finite.all()) else int((~finite).sum())
