r"""The untraced forward of multi-head latent attention over several positions: the maths of
:meth:`~headspace.attention.latent.LatentAttention.forward` (expanded keys and values, the reference
scores, softmax and weighted sum), computed with fewer copies and without the masked half of a causal
layer.

For each head ``h``, with the rotated queries ``q_h`` [Sq, dqk], the keys ``k_h = [c W_kb[h], r]``
[Sk, dqk] (``r`` the rotated shared key part) and the values ``v_h = c W_vb[h]`` [Sk, dv]::

    z_h = softmax(q_h k_h^T * scale + mask) v_h

* the keys are written once, head-major ([B, H, Sk, dqk], the layout the score GEMM reads), instead of
  a token-major concatenation that the scores copy again;
* a causal call runs a block of :data:`BLOCK_ROWS` query rows at a time against the keys up to its
  last row only (bottom-right aligned: query ``i`` sees keys ``j <= i + Sk - Sq``); the keys it skips
  are exactly those the mask sets to ``-inf``, whose softmax weight is exactly 0. Only the block's
  diagonal square is masked;
* any other mask (padding, a float mask) runs as one block, masked as
  :func:`~headspace.attention.functional.attention_scores` masks, dead rows set to 0 as
  :func:`~headspace.attention.functional.attention_pattern` does.

The scores are ``(q * scale) k^T``, as the reference's; a block's softmax sums fewer zero terms, so z
equals the traced path's to float32 rounding (tested: tests/attention/test_latent_fast.py). Used only
where nothing can see the expanded keys, values, scores, pattern or z (:func:`fast_forward_ok`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..nn.masks import CanonicalMask

#: Query rows per block of a causal call (a block's scores are [B, H, BLOCK_ROWS, keys up to its end]).
BLOCK_ROWS = 32


def fast_forward_ok(layer: nn.Module, need_weights: bool) -> bool:
    """Whether ``layer`` (a :class:`~headspace.attention.latent.LatentAttention`) may run
    :func:`fast_latent_attention`: no pattern asked for, no dropout, and none of ``hook_k``, ``hook_v``,
    ``hook_scores``, ``hook_pattern``, ``hook_z`` active (they see what this path never forms)."""
    if need_weights or (layer.training and layer.dropout > 0.0):
        return False
    points = (layer.hook_k, layer.hook_v, layer.hook_scores, layer.hook_pattern, layer.hook_z)
    return not any(p.active for p in points)


def _heads_kv(layer: nn.Module, c: Tensor, k_rope: Tensor) -> tuple[Tensor, Tensor]:
    """Keys [B, H, Sk, dqk] and values [B, H, Sk, dv] (both contiguous, head-major) from the latent
    c [B, 1, Sk, r] and the rotated shared key part k_rope [B, 1, Sk, rope]: :meth:`expand_kv`'s values."""
    lat, H = layer.latent, layer.n_heads
    B, _, Sk, _ = c.shape
    nope, dv, rope = lat.qk_nope_head_dim, lat.v_head_dim, lat.qk_rope_head_dim
    kv = layer.kv_b_proj(c.squeeze(1)).view(B, Sk, H, nope + dv)  # (B, Sk, H, nope + dv)
    kv = kv.transpose(1, 2)  # (B, H, Sk, nope + dv): a view
    k = torch.cat((kv[..., :nope], k_rope.expand(B, H, Sk, rope)), dim=-1)  # (B, H, Sk, dqk)
    return k, kv[..., nope:].contiguous()  # (B, H, Sk, dqk), (B, H, Sk, dv): both GEMM-ready


def _masked(scores: Tensor, mask: CanonicalMask) -> Tensor:
    """Scores [B, H, Sq, Sk] with a non-causal ``mask`` applied in place (-inf where a bool mask is
    False; a float mask added), as :func:`~headspace.attention.functional.attention_scores`."""
    m = mask.mask
    if m is None:
        return scores
    if m.dtype == torch.bool:
        return scores.masked_fill_(~m, float("-inf"))
    return scores.add_(m) if m.dtype == scores.dtype else scores + m


def fast_latent_attention(
    layer: nn.Module, q: Tensor, c: Tensor, k_rope: Tensor, mask: CanonicalMask
) -> Tensor:
    """z [B, Sq, H, dv] (contiguous) of the rotated queries q [B, H, Sq, dqk], the latent c [B, 1, Sk, r]
    and the rotated shared key part k_rope [B, 1, Sk, rope] (module docstring for the maths)."""
    B, H, Sq, _ = q.shape
    Sk = c.shape[2]
    k, v = _heads_kv(layer, c, k_rope)  # (B, H, Sk, dqk), (B, H, Sk, dv)
    qs = q * layer.scale  # (B, H, Sq, dqk): scaled before the product, as the reference scores
    kt = k.transpose(-2, -1)  # (B, H, dqk, Sk)
    z = q.new_empty(B, Sq, H, layer.d_head)  # (B, Sq, H, dv)
    if not mask.is_causal:
        scores = _masked(torch.matmul(qs, kt), mask)  # (B, H, Sq, Sk)
        pattern = torch.softmax(scores, dim=-1)  # (B, H, Sq, Sk)
        if mask.dead_rows is not None:
            pattern = pattern.masked_fill_(mask.dead_rows, 0.0)
        z.copy_(torch.matmul(pattern, v).transpose(1, 2))  # (B, Sq, H, dv)
        return z
    offset = Sk - Sq  # query i sees keys j <= i + offset
    above = torch.ones(BLOCK_ROWS, BLOCK_ROWS, dtype=torch.bool, device=q.device).triu(1)
    # (rows, rows): True above the diagonal, the keys a block's diagonal square masks
    for i0 in range(0, Sq, BLOCK_ROWS):
        i1 = min(i0 + BLOCK_ROWS, Sq)
        j1 = i1 + offset  # keys of this block: 0 .. j1 - 1
        scores = torch.matmul(qs[:, :, i0:i1], kt[..., :j1])  # (B, H, rows, j1)
        rows = i1 - i0
        scores[..., j1 - rows :].masked_fill_(above[:rows, :rows], float("-inf"))  # (B, H, rows, rows)
        pattern = torch.softmax(scores, dim=-1)  # (B, H, rows, j1)
        z[:, i0:i1] = torch.matmul(pattern, v[:, :, :j1]).transpose(1, 2)  # (B, rows, H, dv)
    return z
