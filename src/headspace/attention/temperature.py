"""Llama 4's per-position query temperature on its NoPE layers (``AttentionSpec.temperature``).

The query at absolute position ``p`` (0-based; with a KV cache, the cached positions count) is scaled
before the scores::

    t(p) = 1 + attn_scale * log(1 + floor((p + 1) / floor_scale))       q(p) <- t(p) q(p)

exactly as transformers' ``Llama4TextAttention`` (``attn_temperature_tuning``) computes it, in float32
then cast to q's dtype. ``t(p) = 1`` for ``p < floor_scale - 1``: the temperature only acts on long inputs.
The scores of query ``p`` are ``t(p)`` times the untempered ones, so the QK circuit of a head holds with
the factor ``t(p)`` per query position (:func:`temperatures`).
"""

from __future__ import annotations

import torch
from torch import Tensor


def temperatures(positions: Tensor, floor_scale: float, attn_scale: float) -> Tensor:
    """``t(p)`` (module docstring) for int ``positions`` [...] -> float32 [...]."""
    floored = torch.floor((positions.float() + 1.0) / floor_scale)  # [...]
    return torch.log1p(floored) * attn_scale + 1.0


def temper_queries(q: Tensor, start: int, temperature: tuple[float, float]) -> Tensor:
    """q [B, H, Sq, dh] of the positions ``start .. start + Sq - 1``, each multiplied by its ``t(p)``
    (``temperature`` = (floor_scale, attn_scale)): returns [B, H, Sq, dh] in q's dtype."""
    Sq = q.shape[2]
    positions = torch.arange(start, start + Sq, device=q.device)  # (Sq,)
    t = temperatures(positions, float(temperature[0]), float(temperature[1]))  # (Sq,)
    return (q * t.view(1, 1, Sq, 1)).to(q.dtype)  # (B, H, Sq, dh)
