"""The attention maths of the circuit runner, for all of a layer's heads or a selection of them.

The projections without biases (:func:`project`; under RMSNorm the norm's scale folded past them, so the
normalised copies of per-receiver inputs are never written), the mixing with the biases, rotation, key
sharing, scale and window of the layer's spec (:func:`mix`), each head's output (:func:`head_outputs`) and
their sum by one fused product (:func:`summed`). Inputs are [B, S, d] read by every receiver of a layer,
or [n, B, S, d], each receiver its own copy.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...attention.layer import MultiHeadAttention
from ...nn.masks import window_mask
from ...nn.norms import RMSNorm, rms_inverse
from ...nn.positions import rotary_tables, rotate_fused

__all__ = [
    "HeadSelection",
    "RotaryTables",
    "head_outputs",
    "mix",
    "mixed_of",
    "per_receiver",
    "project",
    "summed",
]


class HeadSelection:
    """The query heads of one layer that a patched run computes, and the key/value heads they read."""

    def __init__(self, attn: MultiHeadAttention, heads: Tensor | None, groups: Tensor | None) -> None:
        self.heads, self.groups = heads, groups  # int64 (n,), (n_groups,); None: all of them
        if heads is None:
            self.W_Q, self.W_K, self.W_V, self.W_O = attn.W_Q, attn.W_K, attn.W_V, attn.W_O
            self.kv = None
            return
        assert groups is not None
        self.W_Q, self.W_O = attn.W_Q[heads], attn.W_O[heads]  # (n, d, dh), (n, dh, d)
        self.W_K, self.W_V = attn.W_K[groups], attn.W_V[groups]  # (n_groups, d, dh) x 2
        # each computed query head's key/value head among the computed ones (None: the same order)
        kv = torch.searchsorted(groups, heads // (attn.n_heads // attn.n_kv_heads))  # (n,)
        self.kv = None if torch.equal(kv, torch.arange(groups.numel(), device=kv.device)) else kv

    @property
    def n_heads(self) -> int:
        return self.W_Q.shape[0]


def project(attn: Any, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q [B, H, S, dh], k and v [B, Hkv, S, dh] without biases, from normalised inputs: x [B, S, d] read
    by every receiver of the layer, or x [H + 2 Hkv, B, S, d], each receiver its own (``attn``: the
    layer, or a :class:`HeadSelection` of some of its heads, H and Hkv then counting those)."""
    if x.dim() == 3:
        q = torch.einsum("bsd,hde->bhse", x, attn.W_Q)  # (B, H, S, dh)
        k = torch.einsum("bsd,gde->bgse", x, attn.W_K)  # (B, Hkv, S, dh)
        v = torch.einsum("bsd,gde->bgse", x, attn.W_V)  # (B, Hkv, S, dh)
        return q, k, v
    H, Hkv = attn.W_Q.shape[0], attn.W_K.shape[0]
    xq, xk, xv = x.split([H, Hkv, Hkv], dim=0)  # (H, B, S, d), (Hkv, B, S, d) x 2
    q = torch.einsum("hbsd,hde->bhse", xq, attn.W_Q)  # (B, H, S, dh)
    k = torch.einsum("gbsd,gde->bgse", xk, attn.W_K)  # (B, Hkv, S, dh)
    v = torch.einsum("gbsd,gde->bgse", xv, attn.W_V)  # (B, Hkv, S, dh)
    return q, k, v


def _foldable(norm: nn.Module, x: Tensor) -> bool:
    return (
        isinstance(norm, RMSNorm)
        and x.dtype in (torch.float32, torch.float64)
        and norm.weight.dtype == x.dtype
    )


def _project_folded(sel: HeadSelection, norm: RMSNorm, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`project` of ``norm(x)`` for per-receiver raw inputs x [H + 2 Hkv, B, S, d] (float32 or
    float64), RMSNorm's scale moved past the projection: ``RMSNorm(x) W = rsqrt(mean(x^2) + eps) (x ((offset
    + w) W))``, so the normalised copies of the inputs are never written (the same maths, a different
    order of roundings)."""
    H, Hkv = sel.W_Q.shape[0], sel.W_K.shape[0]
    s = (norm.offset + norm.weight)[:, None]  # (d, 1)
    r = rms_inverse(x, norm.eps).transpose(0, 1)  # (B, n, S, 1)
    xq, xk, xv = x.split([H, Hkv, Hkv], dim=0)  # (H, B, S, d), (Hkv, B, S, d) x 2
    q = torch.einsum("hbsd,hde->bhse", xq, sel.W_Q * s) * r[:, :H]  # (B, H, S, dh)
    k = torch.einsum("gbsd,gde->bgse", xk, sel.W_K * s) * r[:, H : H + Hkv]  # (B, Hkv, S, dh)
    v = torch.einsum("gbsd,gde->bgse", xv, sel.W_V * s) * r[:, H + Hkv :]  # (B, Hkv, S, dh)
    return q, k, v


class RotaryTables:
    """Rotary cos/sin tables of one run, computed once per Rotary module (the layers share positions)."""

    def __init__(self, positions: Tensor) -> None:
        self.positions = positions
        self.memo: dict[int, tuple[Tensor, Tensor]] = {}

    def rotate(self, attn: MultiHeadAttention, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        key = id(attn.rotary)
        if key not in self.memo:
            self.memo[key] = rotary_tables(attn.rotary, self.positions, q.dtype, q.device)
        cos, sin = self.memo[key]  # each (1, 1, S, rotary_dim)
        return rotate_fused(q, cos, sin, attn.rotary), rotate_fused(k, cos, sin, attn.rotary)


def mix(
    attn: MultiHeadAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    tables: RotaryTables,
    sel: HeadSelection | None = None,
) -> Tensor:
    """Each head's mixed values ``z_h`` [B, H, S, dh] from :func:`project`'s q, k, v (of the heads of
    ``sel`` where given, H and Hkv then counting those)."""
    H, Hkv = attn.n_heads, attn.n_kv_heads
    part = sel is not None and sel.heads is not None
    if attn.b_Q is not None:
        b_Q, b_K, b_V = attn.b_Q, attn.b_K, attn.b_V
        if part:
            b_Q, b_K, b_V = b_Q[sel.heads], b_K[sel.groups], b_V[sel.groups]
        q = q + b_Q[None, :, None, :]  # (B, H, S, dh)
        k = k + b_K[None, :, None, :]  # (B, Hkv, S, dh)
        v = v + b_V[None, :, None, :]  # (B, Hkv, S, dh)
    if attn.rotary is not None:
        q, k = tables.rotate(attn, q, k)  # (B, H, S, dh), (B, Hkv, S, dh)
    if part:
        if sel.kv is not None:
            k, v = k.index_select(1, sel.kv), v.index_select(1, sel.kv)  # (B, H, S, dh) x 2
    elif Hkv != H:
        k = k.repeat_interleave(H // Hkv, dim=1)  # (B, H, S, dh)
        v = v.repeat_interleave(H // Hkv, dim=1)  # (B, H, S, dh)
    spec = attn.spec  # the layer's description, read at run time: its scale and window
    scale = spec.score_scale
    if spec.window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)  # (B, H, S, dh)
    S = q.shape[-2]
    band = window_mask(S, S, spec.window, q.device)  # (S, S): causal and within the window
    return F.scaled_dot_product_attention(q, k, v, attn_mask=band, scale=scale)  # (B, H, S, dh)


def head_outputs(attn: Any, z: Tensor) -> Tensor:
    """Each head's output ``z_h W_O[h]`` [H, B, S, d_model] from z [B, H, S, dh]."""
    return torch.einsum("bhse,hem->hbsm", z, attn.W_O)  # (H, B, S, d_model)


def mixed_of(
    attn: MultiHeadAttention, norm: nn.Module, x: Tensor, sel: HeadSelection, tables: RotaryTables
) -> Tensor:
    """The mixed values z [B, n, S, dh] of ``sel``'s heads from raw (not yet normalised) inputs: x [B, S, d]
    read by all of them, or [n + 2 n_groups, B, S, d] (their queries', then their key/value heads' keys and
    values), each receiver its own."""
    if x.dim() == 4 and _foldable(norm, x):
        q, k, v = _project_folded(sel, norm, x)
    else:
        q, k, v = project(sel, norm(x))
    return mix(attn, q, k, v, tables, sel)


def summed(attn: MultiHeadAttention, z: Tensor) -> Tensor:
    """The heads' outputs summed, ``sum_h z_h W_O[h]`` [B, S, d_model] from z [B, H, S, dh], by one fused
    product."""
    return z.transpose(1, 2).flatten(2) @ attn.W_O.flatten(0, 1)  # (B, S, H dh) @ (H dh, d)


def per_receiver(x: Tensor, n: int) -> Tensor:
    """x [B, S, d] or [n, B, S, d] -> [n, B, S, d] (a view where every receiver reads the same x)."""
    return x if x.dim() == 4 else x.unsqueeze(0).expand(n, *x.shape)  # (n, B, S, d)
