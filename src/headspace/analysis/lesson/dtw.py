"""Whisper's dynamic time warping, many cost matrices at once, one anti-diagonal at a time.

For a cost ``x`` [rows, frames] the accumulated cost is ``acc[0, 0] = 0``, ``acc[i, 0] = acc[0, j] = inf``
and, for ``1 <= i <= rows``, ``1 <= j <= frames``::

    acc[i, j] = x[i - 1, j - 1] + min(acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1])

with the step taken recorded as ``0`` (diagonal) when that term is strictly the least, ``1`` (a row step)
when the row term is, else ``2`` (a frame step): ties prefer the frame step, as ``whisper.timing.dtw_cpu``
does. The path walks the steps back from ``(rows, frames)`` to ``(0, 0)``.

Every cell of an anti-diagonal ``i + j = d`` depends only on diagonals ``d - 1`` and ``d - 2``, so each
diagonal is one vectorised step over all its cells and over a batch of matrices: ``rows + frames``
steps instead of ``rows x frames`` scalar ones. The sums are the same float64 additions in the same
order as the scalar loop, so the accumulated costs, the steps and the paths are identical to it.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def dtw_paths(costs: Tensor) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (row, frame) indices of the cheapest monotonic path of each of ``costs`` [batch, rows, frames]
    (module docstring), one pair of int arrays per matrix, from (0, 0) to (rows - 1, frames - 1)."""
    if costs.dim() != 3 or 0 in costs.shape:
        raise ValueError(f"dtw_paths expects non-empty costs [batch, rows, frames]; got {tuple(costs.shape)}")
    x = costs.detach().to(torch.float64).cpu().numpy()
    b, n, m = x.shape
    acc = np.full((b, n + 1, m + 1), np.inf)
    acc[:, 0, 0] = 0.0
    trace = np.full((b, n + 1, m + 1), 2, dtype=np.int8)
    for d in range(2, n + m + 1):
        i = np.arange(max(1, d - m), min(n, d - 1) + 1)  # the diagonal's rows
        j = d - i  # and frames
        c0, c1, c2 = acc[:, i - 1, j - 1], acc[:, i - 1, j], acc[:, i, j - 1]  # each [batch, cells]
        diag = (c0 < c1) & (c0 < c2)
        up = ~diag & (c1 < c0) & (c1 < c2)
        acc[:, i, j] = x[:, i - 1, j - 1] + np.where(diag, c0, np.where(up, c1, c2))
        trace[:, i, j] = np.where(diag, 0, np.where(up, 1, 2))
    return [_walk_back(t, n, m) for t in trace]


def _walk_back(trace: np.ndarray, n: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """The path from ``(n, m)`` back to ``(0, 0)`` by the steps of ``trace`` [n + 1, m + 1]; on the edges
    only the step along the edge remains."""
    steps = trace.tolist()  # python lists: scalar access is fast
    i, j = n, m
    rows, frames = [], []
    while i > 0 or j > 0:
        rows.append(i - 1)
        frames.append(j - 1)
        t = steps[i][j] if i > 0 and j > 0 else (2 if i == 0 else 1)
        i, j = (i - 1, j - 1) if t == 0 else (i - 1, j) if t == 1 else (i, j - 1)
    return np.array(rows[::-1]), np.array(frames[::-1])
