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
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.masks import CanonicalMask
from ..nn.positions import Rotary, rotate_fused

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


def _stacked_down(layer: nn.Module) -> tuple[Tensor, Tensor | None] | None:
    """The weight [n_q + kv_lora_rank + rope, d_model] and bias of the two projections that read the
    layer's input (``q_proj`` or ``q_a_proj``, then ``kv_a_proj_with_mqa``) stacked, or None where they
    cannot be (one has a bias and the other not, gradients wanted, ``torch.compile``). Remembered per
    layer, keyed by each tensor's storage, version, dtype and device (and the inference mode), so an
    edit in place, a load or a move of either weight stacks them again."""
    first = layer.q_proj if layer.q_proj is not None else layer.q_a_proj
    parts = (first.weight, layer.kv_a_proj_with_mqa.weight, first.bias, layer.kv_a_proj_with_mqa.bias)
    if (parts[2] is None) != (parts[3] is None) or torch.compiler.is_compiling():
        return None
    if torch.is_grad_enabled() and any(p is not None and p.requires_grad for p in parts):
        return None
    key = (
        torch.is_inference_mode_enabled(),  # an inference tensor may not be saved for a backward
        *((p.data_ptr(), p._version, p.dtype, p.device) if p is not None else None for p in parts),
    )
    memo = layer.__dict__.get("_stacked_down_memo")
    if memo is None or memo[0] != key:
        with torch.no_grad():
            weight = torch.cat(parts[:2])  # (n_q + r + rope, d_model)
            bias = None if parts[2] is None else torch.cat(parts[2:])  # (n_q + r + rope,)
        memo = (key, weight, bias)
        layer.__dict__["_stacked_down_memo"] = memo
    return memo[1], memo[2]


def down_projections(layer: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """(``q_proj(x)`` or ``q_a_proj(x)``, ``kv_a_proj_with_mqa(x)``) of the layer's input x [B, S, d_model]:
    [B, S, n_q] and [B, S, kv_lora_rank + rope], by one GEMM on the stacked weights where
    :func:`_stacked_down` allows (views of its result), else by the two linears."""
    first = layer.q_proj if layer.q_proj is not None else layer.q_a_proj
    stacked = _stacked_down(layer)
    if stacked is None:
        return first(x), layer.kv_a_proj_with_mqa(x)
    y = F.linear(x, *stacked)  # (B, S, n_q + r + rope)
    q, kv = y.split([first.out_features, layer.kv_a_proj_with_mqa.out_features], dim=-1)
    return q, kv  # (B, S, n_q), (B, S, r + rope): views


def rotated_queries(
    q: Tensor, nope: int, cos: Tensor, sin: Tensor, rotary: Rotary, scale: float | None
) -> Tensor:
    """The rotated queries [B, H, S, dqk] (contiguous, head-major) of q [B, S, H, dqk] (``hook_q``'s
    layout; only its last ``dqk - nope`` features rotate), times ``scale`` unless it is None.

    Bit for bit ``torch.cat((q_nope, rotate_fused(q_rope, cos, sin, rotary)), -1)`` (then ``* scale``):
    the same elementwise ops (``x * cos``, then ``+= swap(x) * sin``), written straight into the
    head-major result instead of a rotated copy and a concatenation (those themselves where q needs a
    gradient); cos / sin [b|1, 1, S, rotary_dim] (:func:`~headspace.nn.positions.rotary_tables`)."""
    if torch.is_grad_enabled() and q.requires_grad:  # out= ops have no gradient: the reference ops
        heads = q.transpose(1, 2)  # (B, H, S, dqk)
        out = torch.cat((heads[..., :nope], rotate_fused(heads[..., nope:], cos, sin, rotary)), dim=-1)
        return out if scale is None else out * scale  # (B, H, S, dqk)
    B, S, H, dqk = q.shape
    rd = rotary.rotary_dim
    out = q.new_empty(B, H, S, dqk)  # (B, H, S, dqk)
    tok = out.transpose(1, 2)  # (B, S, H, dqk): a view of out, in q's layout
    xr = q[..., nope : nope + rd]  # (B, S, H, rd)
    if rotary.interleaved:
        swapped = torch.stack((xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)  # (B, S, H, rd)
    else:
        swapped = xr.roll(rd // 2, dims=-1)  # (B, S, H, rd): [x_b, x_a] per plane
    rot = tok[..., nope : nope + rd]  # (B, S, H, rd)
    torch.mul(xr, cos.transpose(1, 2), out=rot)  # cos (b|1, S, 1, rd)
    rot.add_(swapped.mul_(sin.transpose(1, 2)))
    rest = [(0, nope), (nope + rd, dqk)]  # the features that do not rotate
    for a, b in rest:
        if b > a:
            if scale is None:
                tok[..., a:b].copy_(q[..., a:b])
            else:
                torch.mul(q[..., a:b], scale, out=tok[..., a:b])
    if scale is not None:
        rot.mul_(scale)
    return out


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
    layer: nn.Module, qs: Tensor, c: Tensor, k_rope: Tensor, mask: CanonicalMask
) -> Tensor:
    """z [B, Sq, H, dv] (contiguous) of the rotated queries already times ``scale``, qs [B, H, Sq, dqk]
    (``_project(x, cos, sin, scale)``), the latent c [B, 1, Sk, r] and the rotated shared key part
    k_rope [B, 1, Sk, rope] (module docstring for the maths)."""
    B, H, Sq, _ = qs.shape
    Sk = c.shape[2]
    k, v = _heads_kv(layer, c, k_rope)  # (B, H, Sk, dqk), (B, H, Sk, dv)
    kt = k.transpose(-2, -1)  # (B, H, dqk, Sk)
    z = qs.new_empty(B, Sq, H, layer.d_head)  # (B, Sq, H, dv)
    if not mask.is_causal:
        scores = _masked(torch.matmul(qs, kt), mask)  # (B, H, Sq, Sk)
        pattern = torch.softmax(scores, dim=-1)  # (B, H, Sq, Sk)
        if mask.dead_rows is not None:
            pattern = pattern.masked_fill_(mask.dead_rows, 0.0)
        z.copy_(torch.matmul(pattern, v).transpose(1, 2))  # (B, Sq, H, dv)
        return z
    offset = Sk - Sq  # query i sees keys j <= i + offset
    above = torch.ones(BLOCK_ROWS, BLOCK_ROWS, dtype=torch.bool, device=qs.device).triu(1)
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
