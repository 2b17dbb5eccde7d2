"""Gemma 3n / 4 attention's rotation in place, on the QK-norms' fresh outputs in their [batch, seq,
heads, d_head] layout (before the heads are transposed), so that no rolled copy, no fresh rotated
tensor and no strided broadcast over transposed heads is made.

Notation used for tensor shapes:
    B batch, Sq seq, H heads, Hkv key/value heads, dh d_head, rd rotary_dim.
"""

from __future__ import annotations

from torch import Tensor

from ..nn.positions import Rotary
from ..nn.rotate_inplace import rotate_fused_


def rotate_heads_(
    q: Tensor, k: Tensor | None, cos: Tensor, sin_signed: Tensor, rotary: Rotary
) -> tuple[Tensor, Tensor | None, None]:
    """Rotate q [B, Sq, H, dh] and k [B, Sq, Hkv, dh] (or None) in place with
    :func:`~headspace.nn.positions.rotary_tables`' cos and signed sin [B|1, 1, Sq, rd]: the values of
    :func:`~headspace.nn.positions.rotate_fused` on their transposed heads, bit for bit
    (:func:`~headspace.nn.rotate_inplace.rotate_fused_`). Returns (q, k, None): the rotation is done
    (None is the caller's rotary, left to apply). q and k must be tensors no hook and no autograd
    graph sees."""
    cos_s, sin_s = cos.transpose(1, 2), sin_signed.transpose(1, 2)  # (B|1, Sq, 1, rd) x 2
    rotate_fused_(q, cos_s, sin_s, rotary)  # (B, Sq, H, dh)
    if k is not None:
        rotate_fused_(k, cos_s, sin_s, rotary)  # (B, Sq, Hkv, dh)
    return q, k, None
