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
    if not rotary.interleaved:
        return _rotate_halves_(x, xr, cos, sin_signed, rd // 2)
    swapped = xr.unflatten(-1, (rd // 2, 2)).flip(-1).flatten(-2)  # (batch, heads, seq, rotary_dim)
    swapped.mul_(sin_signed)
    xr.mul_(cos)
    xr.add_(swapped)
    return x


def _rotate_halves_(x: Tensor, xr: Tensor, cos: Tensor, sin_signed: Tensor, half: int) -> Tensor:
    """Rotate-half in place on the halves ``a = xr[..., :half]``, ``b = xr[..., half:]``, with no rolled
    copy of ``xr``: ``a <- a * cos_a + b * sin_a``, ``b <- b * cos_b + a * sin_b`` (``sin_a = -sin``,
    ``sin_b = +sin``: the signed table), the turn's two products taken before either half is written.
    Each output is the sum of the same two rounded products as :func:`rotate_fused_`'s ``xr * cos +
    roll(xr) * sin_signed``: the same values, bit for bit. Returns ``x``."""
    a, b = xr[..., :half], xr[..., half:]  # (batch, heads, seq, half) x 2, views of x
    turn_b = a * sin_signed[..., half:]  # (batch, heads, seq, half): b's turn term, a * sin
    turn_a = b * sin_signed[..., :half]  # (batch, heads, seq, half): a's turn term, -b * sin
    a.mul_(cos[..., :half]).add_(turn_a)
    b.mul_(cos[..., half:]).add_(turn_b)
    return x
