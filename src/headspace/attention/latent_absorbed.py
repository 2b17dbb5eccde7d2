r"""The decoding step of multi-head latent attention with ``W_kb`` and ``W_vb`` absorbed (DeepSeek's
"weight absorption"): the heads' keys and values are never expanded from the cached latent.

With ``c_j`` the cached latent [kv_lora_rank], ``r_j`` the shared rotated key part [rope], and per head
``W_kb[h]`` [nope, kv_lora_rank], ``W_vb[h]`` [dv, kv_lora_rank] (``kv_b_proj``'s rows)::

    q_h . k_hj = q_h[:nope] . (W_kb[h] c_j) + q_h[nope:] . r_j = [q_h[:nope] W_kb[h], q_h[nope:]] . [c_j, r_j]
    z_h        = sum_j p_hj (W_vb[h] c_j)                       = (sum_j p_hj c_j) W_vb[h]^T

the same sums as :meth:`~headspace.attention.latent.LatentAttention.forward`'s (expanded keys and values)
taken in another order: equal to float32 rounding. One new position costs ``O(H (nope + dv) r)`` for the
absorbed projections and ``O(H Sk (r + rope))`` for the scores and the weighted latent, where expanding
costs ``O(Sk H (nope + dv) r)``. Used only where nothing can see the expanded keys or values or the
untraced scores (:func:`absorbable`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..nn.masks import CanonicalMask, causal_mask
from .functional import attention_pattern


def absorbable(layer: nn.Module, seq_q: int, has_cache: bool) -> bool:
    """Whether ``layer`` (a :class:`~headspace.attention.latent.LatentAttention`) may run
    :func:`absorbed_attention` for this call: one new position on a cache, no dropout, no bias on
    ``kv_b_proj``, and none of ``hook_k``, ``hook_v``, ``hook_scores``, ``hook_pattern``, ``hook_z``
    active (they see expanded keys, values, scores or z)."""
    if not has_cache or seq_q != 1 or (layer.training and layer.dropout > 0.0):
        return False
    if layer.kv_b_proj.bias is not None:
        return False
    points = (layer.hook_k, layer.hook_v, layer.hook_scores, layer.hook_pattern, layer.hook_z)
    return not any(p.active for p in points)


def absorbed_attention(
    layer: nn.Module, q: Tensor, c: Tensor, k_rope: Tensor, mask: CanonicalMask
) -> tuple[Tensor, Tensor]:
    """z [B, Sq, H, dv] and the pattern [B, H, Sq, Sk] (module docstring) of q [B, H, Sq, nope + rope]
    (rotated), the latent c [B, 1, Sk, r] and the rotated shared key part k_rope [B, 1, Sk, rope]."""
    lat, H = layer.latent, layer.n_heads
    nope, dv, r = lat.qk_nope_head_dim, lat.v_head_dim, lat.kv_lora_rank
    B, _, Sq, _ = q.shape
    Sk = c.shape[2]
    w = layer.kv_b_proj.weight.view(H, nope + dv, r)  # (H, nope + dv, r): W_kb[h] then W_vb[h]
    q = q * layer.scale  # (B, H, Sq, dqk): scaled before the product, as the reference scores
    q_lat = torch.matmul(q[..., :nope], w[:, :nope])  # (B, H, Sq, r): q_nope W_kb[h]
    q_all = torch.cat((q_lat, q[..., nope:]), dim=-1).reshape(B, 1, H * Sq, r + lat.qk_rope_head_dim)
    # (B, 1, H Sq, r + rope): every head's queries against the one shared key
    keys = torch.cat((c, k_rope), dim=-1)  # (B, 1, Sk, r + rope)
    scores = torch.matmul(q_all, keys.transpose(-2, -1)).view(B, H, Sq, Sk)  # (B, H, Sq, Sk)
    m = causal_mask(Sq, Sk, q.device) if mask.is_causal else mask.mask
    if m is not None:
        scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m
    pattern = attention_pattern(scores, mask)  # (B, H, Sq, Sk)
    mixed = torch.matmul(pattern.reshape(B, 1, H * Sq, Sk), c).view(B, H, Sq, r)  # (B, H, Sq, r)
    z = torch.matmul(mixed, w[:, nope:].transpose(-2, -1))  # (B, H, Sq, dv): (sum_j p c_j) W_vb[h]^T
    return z.transpose(1, 2), pattern  # (B, Sq, H, dv), (B, H, Sq, Sk)
