"""Small checks shared by every module that refuses bad values (see DESIGN.md, the bad-input contract)."""

from __future__ import annotations

import torch
from torch import Tensor


def nonfinite_count(t: Tensor) -> int:
    """How many NaN/Inf values ``t`` holds (0 when all are finite; one pass, the count only on failure)."""
    finite = torch.isfinite(t)
    return 0 if bool(finite.all()) else int((~finite).sum())
