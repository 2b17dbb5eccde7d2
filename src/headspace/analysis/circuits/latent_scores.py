r"""A latent attention head's score split over the parts of its input (``why`` on DeepSeek MLA).

For head ``h`` of a :class:`~headspace.attention.latent.LatentAttention`, query ``i`` and key ``j``, with
the latent norms frozen at this run's scales (``s_q[i]`` of the query latent, ``s_c[j]`` of the key/value
latent, :meth:`~headspace.attention.latent.LatentAttention.latent_norm_scales`), the score is bilinear
in the augmented inputs ``[x_i, 1]`` and ``[x_j, 1]``::

    Q = s_q[i] [W_qa; b_qa] diag(w_q) W_qb[h]            [d_model + 1, qk_head_dim]
        (no query latent: [W_q[h]; 0], s_q = 1), its last qk_rope_head_dim columns times R(i - j)
    K = [s_c[j] [W_kva; b_kva] diag(w_c) W_kb[h],  [W_kr; b_kr]]     [d_model + 1, qk_head_dim]
    score(i, j) = scale [x_i, 1] Q K^T [x_j, 1]^T

as :meth:`~headspace.attention.latent_heads.LatentHead.qk` states it (there without the biases). Split
``x`` into its parts (rows ``[part, 0]`` and ``[bias, 1]``): ``parts[a, b] = scale u_a Q K^T v_b^T`` sum
to the traced ``hook_scores`` (to float rounding; computed in float64).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["latent_score_parts"]


def _affine(linear: Any, columns: slice | None = None) -> Tensor:
    """``[W; b]`` [d_in + 1, d_out] of an ``nn.Linear`` (rows ``columns`` of its output), float64; b = 0
    where the linear has no bias."""
    W = linear.weight.detach().double()  # (d_out, d_in)
    b = torch.zeros(W.shape[0], dtype=W.dtype) if linear.bias is None else linear.bias.detach().double()
    if columns is not None:
        W, b = W[columns], b[columns]
    return torch.cat((W.T, b[None]), dim=0)  # (d_in + 1, d_out)


def latent_score_parts(
    attn: Any, head: int, rows_i: Tensor, rows_j: Tensor, x: Tensor, i: int, j: int
) -> Tensor:
    """``parts`` [n_i, n_j] of head ``head``'s score of query ``i`` on key ``j`` (module docstring).

    ``rows_i`` [n_i, d_model + 1] and ``rows_j`` [n_j, d_model + 1] are the augmented parts of the layer's
    input at ``i`` and at ``j``; ``x`` [1, seq, d_model] the layer's input itself (for the frozen scales).
    """
    lat = attn.latent
    dqk, nope = lat.qk_head_dim, lat.qk_nope_head_dim
    s_q, s_c = attn.latent_norm_scales(x.to(attn.o_proj.weight.dtype))  # (1, seq) x 2 (s_q: or None)
    if attn.q_proj is not None:  # no query latent: q = x W_q[h]
        Q = _affine(attn.q_proj, slice(head * dqk, (head + 1) * dqk))  # (d + 1, dqk)
    else:
        up = attn.q_a_layernorm.weight.detach().double()[:, None] * attn.W_QB[head].detach().double()
        # up: (q_lora_rank, dqk), the norm's weight folded in
        Q = _affine(attn.q_a_proj) @ up * float(s_q[0, i])  # (d + 1, dqk)
    if attn.rotary is not None:
        rotation = attn.rotary.rotation(i - j, dtype=torch.float64)  # (rope, rope)
        Q = torch.cat((Q[:, :nope], Q[:, nope:] @ rotation), dim=-1)  # (d + 1, dqk)
    r = lat.kv_lora_rank
    k_up = attn.kv_a_layernorm.weight.detach().double()[:, None] * attn.W_KB[head].detach().double()
    # k_up: (kv_lora_rank, nope), the latent norm's weight folded in
    K_nope = _affine(attn.kv_a_proj_with_mqa, slice(0, r)) @ k_up * float(s_c[0, j])  # (d + 1, nope)
    K_rope = _affine(attn.kv_a_proj_with_mqa, slice(r, r + lat.qk_rope_head_dim))  # (d + 1, rope)
    K = torch.cat((K_nope, K_rope), dim=-1)  # (d + 1, dqk)
    return (rows_i.double() @ Q) @ (rows_j.double() @ K).T * float(attn.scale)  # (n_i, n_j)
