r"""Per-head views of a latent attention layer (:class:`~headspace.attention.latent.LatentAttention`).

A latent head has no W_Q, W_K, W_V of its own: they exist only as products through the normalised
latents. ``RMSNorm(y) = s(y) * y * w`` with ``s(y) = 1 / rms(y)`` a per-token scale, so at a run's
frozen scales (:meth:`LatentAttention.latent_norm_scales`: ``s_q`` of the query latent, ``s_c`` of the
key/value latent), for one head ``h``::

    q_h = s_q x W_Q             W_Q = W_qa diag(w_q) W_qb[h]        [d_model, qk_head_dim]
                                (no query latent: W_Q = W_q[h], s_q = 1)
    k_h = [s_c x W_K, R(j) x W_K_rope]
                                W_K = W_kva diag(w_c) W_kb[h]       [d_model, qk_nope_head_dim]
                                W_K_rope = W_kr (shared by every head) [d_model, qk_rope_head_dim]
    v_h = s_c x W_V             W_V = W_kva diag(w_c) W_vb[h]       [d_model, v_head_dim]

``W_Q``, ``W_K`` and ``W_V`` are :class:`~headspace.attention.circuits.FactoredMatrix` products (the
norm weights ``w`` folded into the second factor); the scales are the run's, not part of the views:
another input changes them. :meth:`LatentHead.qk` is exact at those scales (its docstring).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from .circuits import FactoredMatrix


class LatentHead:
    """One head of a :class:`~headspace.attention.latent.LatentAttention` (module docstring)."""

    def __init__(self, attn: Any, index: int) -> None:
        n = attn.n_heads
        if isinstance(index, bool) or not hasattr(index, "__index__"):
            raise TypeError(f"head index must be an int in [0, {n}); got {type(index).__name__} {index!r}")
        index = operator.index(index)
        if not -n <= index < n:
            raise IndexError(f"head index must be in [0, {n}) for a layer with n_heads={n}; got {index!r}")
        self.attn = attn
        self.index = index % n

    @property
    def W_Q(self) -> FactoredMatrix:
        """[d_model, qk_head_dim]: ``W_qa diag(w_q) W_qb[h]`` (times ``s_q`` at a run), or ``W_q[h] I``
        without a query latent."""
        a = self.attn
        if a.W_QA is None or a.W_QB is None or a.q_a_layernorm is None:
            W = a.W_Q[self.index]  # (d_model, dqk)
            return FactoredMatrix(W, torch.eye(W.shape[1], dtype=W.dtype, device=W.device))
        w_q = a.q_a_layernorm.weight  # (q_lora_rank,)
        return FactoredMatrix(a.W_QA, w_q[:, None] * a.W_QB[self.index])  # (d_model, q_lora) (q_lora, dqk)

    @property
    def W_K(self) -> FactoredMatrix:
        """[d_model, qk_nope_head_dim]: ``W_kva diag(w_c) W_kb[h]``, the head's own (non-rotary) key part
        through the latent (times ``s_c`` at a run); the rotary part is :attr:`W_K_rope`."""
        a = self.attn
        w_c = a.kv_a_layernorm.weight  # (kv_lora_rank,)
        return FactoredMatrix(a.W_KVA, w_c[:, None] * a.W_KB[self.index])  # (d, r) (r, nope)

    @property
    def W_K_rope(self) -> Tensor:
        """The shared rotary key part ``W_kr`` [d_model, qk_rope_head_dim] (the layer's view, the same
        for every head)."""
        return self.attn.W_K_rope

    @property
    def W_V(self) -> FactoredMatrix:
        """[d_model, v_head_dim]: ``W_kva diag(w_c) W_vb[h]`` (times ``s_c`` at a run)."""
        a = self.attn
        w_c = a.kv_a_layernorm.weight  # (kv_lora_rank,)
        return FactoredMatrix(a.W_KVA, w_c[:, None] * a.W_VB[self.index])  # (d, r) (r, dv)

    @property
    def W_O(self) -> Tensor:
        """[v_head_dim, d_model], this head's rows of ``W_O`` (a view)."""
        return self.attn.W_O[self.index]

    def qk(self, delta: int | None = None, *, key_scale: float | Tensor = 1.0) -> FactoredMatrix:
        """The QK circuit [d_model, d_model] of query input ``x_i`` on key input ``x_j`` (``delta = i - j``,
        None: 0), the key's latent scale ``s_c[j]`` (``key_scale``) folded in::

            A = [W_Q[:, :nope], W_Q[:, nope:] R(delta)]          [d_model, qk_head_dim]
            B = [key_scale W_K, W_K_rope]^T                       [qk_head_dim, d_model]
            x_i @ head.qk(i - j, key_scale=s_c[b, j]).AB @ x_j^T * s_q[b, i]
                == hook_scores[b, h, i, j] / scale

        exact at the run's frozen scales (:meth:`LatentAttention.latent_norm_scales`; ``s_q = 1`` without a
        query latent). The rotary part's score does not take ``s_c``: the scales cannot be pulled out of
        the whole circuit, so the key's scale enters it.
        """
        a = self.attn
        nope = a.latent.qk_nope_head_dim
        W_Q = self.W_Q.AB  # (d_model, dqk)
        q_rope = W_Q[:, nope:]  # (d_model, rope)
        if a.rotary is not None:
            rotation = a.rotary.rotation(0 if delta is None else delta, dtype=W_Q.dtype, device=W_Q.device)
            q_rope = q_rope @ rotation  # (d_model, rope)
        A = torch.cat((W_Q[:, :nope], q_rope), dim=-1)  # (d_model, dqk)
        B = torch.cat((self.W_K.AB * key_scale, self.W_K_rope), dim=-1).T  # (dqk, d_model)
        return FactoredMatrix(A, B)

    def ov(self) -> FactoredMatrix:
        """The OV circuit ``W_V W_O`` [d_model, d_model] (times ``s_c`` of the attended token at a run)."""
        return FactoredMatrix(self.W_V.AB, self.W_O)

    def __repr__(self) -> str:
        lat = self.attn.latent
        return (
            f"LatentHead({self.index} of {self.attn.n_heads}, kv_lora_rank={lat.kv_lora_rank}, "
            f"qk_nope={lat.qk_nope_head_dim}, qk_rope={lat.qk_rope_head_dim}, v_head_dim={lat.v_head_dim})"
        )


class LatentHeadList:
    """Sequence of :class:`LatentHead` views: ``attn.heads[3]``, ``len(attn.heads)``, iteration."""

    def __init__(self, attn: Any) -> None:
        self.attn = attn

    def __len__(self) -> int:
        return self.attn.n_heads

    def __getitem__(self, index: int) -> LatentHead:
        return LatentHead(self.attn, index)

    def __iter__(self) -> Iterator[LatentHead]:
        return (LatentHead(self.attn, i) for i in range(self.attn.n_heads))
