"""Rotary positions applied in place: the untraced attention's rotation of q and k inside the fused
QKV projection, so that no fresh q/k tensor is written and the heads stay views of one buffer.

Notation used for tensor shapes:
    batch, heads, seq, d_head, rotary_dim.
"""

from __future__ import annotations

from torch import Tensor

from .positions import Rotary


def rotate_fused_(x: Tensor, cos: Tensor, sin_signed: Tensor, rotary: Rotary) -> Tensor:
    """Rotate ``x`` [batch, heads, seq, d_head] in place with :func:`~headspace.nn.positions.rotary_tables`'
    cos [batch or 1, 1, seq, rotary_dim] and signed sin (same shape); returns ``x``.

    On the first ``rotary_dim`` features ``x <- x * cos + swap(x) * sin_signed`` (``swap``: the roll by
    ``rotary_dim / 2`` of rotate-half, or the pair flip of interleaved pairs), each product rounded
    before the sum as in :func:`~headspace.nn.positions.rotate_fused`: the same float values, bit for
    bit; the pass-through features are not touched. ``x`` may be a strided view (of the fused
    projection); it must not be needed by an autograd graph (the caller checks ``requires_grad``).
    """
    rd = rotary.rotary_dim
    xr = x if rd == x.shape[-1] else x[..., :rd]  # (batch, heads, seq, rotary_dim), a view of x
    if rotary.interleaved:
        swapped = xr.unflatten(-1, (rd // 2, 2)).flip(-1).flatten(-2)  # (batch, heads, seq, rotary_dim)
    else:
        swapped = xr.roll(rd // 2, dims=-1)  # (batch, heads, seq, rotary_dim): [x_b, x_a] per plane, fresh
    swapped.mul_(sin_signed)
    xr.mul_(cos)
    xr.add_(swapped)
    return x
