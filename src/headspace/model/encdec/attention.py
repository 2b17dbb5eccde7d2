"""The attention layers of an encoder-decoder: :class:`MultiHeadAttention` with T5's bucket bias in its
head views, and cross-attention with keys and values computed once per input.

A cross-attention head reads two streams: ``q_h = x W_Q[h] + b_Q[h]`` from the decoder's stream ``x`` and
``k_h = e W_K[h] + b_K[h]``, ``v_h = e W_V[h] + b_V[h]`` from the encoder's output ``e``, so its QK circuit
``W_Q[h] W_K[h]^T`` is [d_model (decoder), d_model (encoder)] and its OV circuit ``W_V[h] W_O[h]`` writes
what it reads from the encoder into the decoder's stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ...attention.circuits import FactoredMatrix
from ...attention.heads import Head, HeadList
from ...attention.layer import MultiHeadAttention
from .positions import RelativeBias


class BucketQK(FactoredMatrix):
    """A T5 head's QK circuit at an offset: the factors of ``W_Q W_K^T`` and ``bias``, the head's bucket
    bias at that offset ([*delta.shape]); the score is ``x_i @ AB @ x_j^T + bias`` (:meth:`score`)."""

    def __init__(self, A: Tensor, B: Tensor, bias: Tensor) -> None:
        super().__init__(A, B)
        self.bias = bias

    def score(self, x_i: Tensor, x_j: Tensor) -> Tensor:
        """The score of query input ``x_i`` [d_model] on key input ``x_j`` [d_model] (times the layer's scale,
        which is 1 for T5): ``x_i W_Q W_K^T x_j^T + bias``."""
        return x_i @ self.AB @ x_j + self.bias


class BucketHead(Head):
    """A head of a layer with T5's relative-position bias: :meth:`qk` at an offset adds the bucket bias."""

    def qk(self, delta: int | Tensor | None = None, *, augmented: bool = False) -> FactoredMatrix:
        """The QK circuit ``W_Q W_K^T`` (:meth:`Head.qk`) and, at an offset ``delta = i - j`` (query minus
        key position), the head's bucket bias there: a :class:`BucketQK` whose ``bias`` is
        ``weight[bucket(delta), h]``. With ``augmented=True`` the bias is folded in exactly: one more
        column of ``A`` holding the bias and one more row of ``B`` selecting the constant input::

            [x_i, 1] @ head.qk(i - j, augmented=True).AB @ [x_j, 1]^T == hook_scores[b, h, i, j]

        (T5's scale is 1 and its projections have no bias). Without ``delta`` the plain circuit.
        """
        base = super().qk(delta, augmented=augmented)
        bias_table = getattr(self.attn, "position_bias", None)
        if delta is None or bias_table is None:
            return base
        d = torch.as_tensor(delta, device=base.A.device)
        bias = bias_table.at(d)[..., self.index].to(base.A.dtype)  # (*delta,)
        if not augmented:
            return BucketQK(base.A, base.B, bias)
        A, B = base.A, base.B  # (..., d+1, r), (..., r, k+1)
        col = A.new_zeros(*A.shape[:-1], 1)  # (..., d+1, 1)
        col[..., -1, 0] = bias
        row = B.new_zeros(*B.shape[:-2], 1, B.shape[-1])  # (..., 1, k+1)
        row[..., 0, -1] = 1.0
        return BucketQK(torch.cat((A, col), dim=-1), torch.cat((B, row), dim=-2), bias)


class _BucketHeads(HeadList):
    def __getitem__(self, index: int) -> Head:
        return BucketHead(self.attn, index)

    def __iter__(self) -> Iterator[Head]:
        return (BucketHead(self.attn, i) for i in range(self.attn.n_heads))


class EncDecAttention(MultiHeadAttention):
    """A :class:`MultiHeadAttention` of an encoder-decoder (self- or cross-attention).

    ``position_bias``: the stack's shared :class:`RelativeBias` (T5's self-attention), or None; it is kept
    outside the module tree (its one weight belongs to the stack), and the stack adds it to the scores as
    an additive ``attn_mask`` [batch, n_heads, seq_q, seq_k], so that ``hook_scores`` sees
    ``q k^T * scale + bias``. The head views (``heads[h]``) are :class:`BucketHead` s.
    """

    prunable = False

    def __init__(self, *args: Any, position_bias: RelativeBias | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.__dict__["position_bias"] = position_bias  # not a submodule: the stack owns the weight

    @property
    def heads(self) -> HeadList:
        return _BucketHeads(self)

    def head(self, index: int) -> Head:
        return BucketHead(self, index)

    def cross_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """The keys and values of the encoder's output ``memory`` [batch, seq_k, d_model], computed once
        per input for every decoding step: k, v [batch, n_heads, seq_k, d_head]."""
        B, Sk, _ = memory.shape
        H, dh = self.n_heads, self.d_head
        b = self.qkv_bias
        kv = F.linear(
            memory, self.qkv_weight[H * dh :], None if b is None else b[H * dh :]
        )  # (B, Sk, 2 H dh)
        kv = kv.view(B, Sk, 2 * H, dh).transpose(1, 2)  # (B, 2H, Sk, dh)
        k, v = kv.split([H, H], dim=1)  # (B, H, Sk, dh) x 2
        return k, v

    def attend_cached(self, x: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """Cross-attention of queries ``x`` [batch, seq_q, d_model] on cached ``k``, ``v`` [batch, n_heads,
        seq_k, d_head] (:meth:`cross_kv`): ``softmax(q k^T * scale + mask) v`` then ``W_O``; ``mask``: an
        additive float mask broadcasting to [batch, n_heads, seq_q, seq_k], or None. Returns [batch, seq_q,
        d_model]. No hook point fires here (the traced forward is :meth:`forward` with ``key``)."""
        B, Sq, _ = x.shape
        H, dh = self.n_heads, self.d_head
        b = self.qkv_bias
        q = F.linear(x, self.qkv_weight[: H * dh], None if b is None else b[: H * dh])  # (B, Sq, H dh)
        q = q.view(B, Sq, H, dh).transpose(1, 2)  # (B, H, Sq, dh)
        z = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)  # (B, H, Sq, dh)
        z = z.transpose(1, 2).reshape(B, Sq, H * dh)  # (B, Sq, H dh)
        return F.linear(z, self.o_weight, self.o_bias)  # (B, Sq, d_model)
