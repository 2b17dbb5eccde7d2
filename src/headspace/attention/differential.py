"""Differential attention (DiffLlama, Ye et al. 2024) as transformers' ``DiffLlamaAttention`` computes it.

Every query head ``h`` has its own softmax map ``P_h = softmax(q_h k_g(h)^T * scale + mask)`` (the
``hook_pattern`` [batch, n_heads, seq_q, seq_k], as transformers returns it). Heads pair up, ``j`` with
``j + n_heads / 2`` (transformers' layout), ``j`` in ``[0, n_heads / 2)``; with ``g = g(j)`` the
key/value head of ``j`` and ``n_kv_heads`` even::

    lambda = exp(sum(lambda_q1 * lambda_k1)) - exp(sum(lambda_q2 * lambda_k2)) + lambda_init   (per layer)
    D_j    = P_j - lambda P_{j + n_heads/2}                        hook_diff_pattern [b, n_pairs, sq, sk]
    z_h    = P_h [v_g, v_{g + n_kv_heads/2}]     (g: of h's pair)  hook_z [b, sq, n_heads, 2 d_head]
    y_j    = (1 - lambda_init) RMSNorm(z_j - lambda z_{j + n_heads/2})     no weight; hook_z_normed
           = (1 - lambda_init) RMSNorm(D_j [v_g, v_{g + n_kv_heads/2}])
    out    = sum_j y_j W_O[2j : 2j + 2] + b_O                      W_O's rows of the pair's two heads

``lambda_init = 0.8 - 0.6 exp(-0.3 layer)`` is the description's ``differential`` field. As in
transformers, each head's map weighs its pair's values (``hook_z``, per head, so that patching or
ablating a head's ``hook_z`` removes that head's map from its pair) and the pair's difference comes
after; ``hook_diff_pattern`` is a value to read (what a hook returns there changes nothing: edit
``hook_pattern`` or ``hook_z``). A head's QK circuit is the classic one (``head.qk`` is exact for each
map ``P_h``); its value is its pair's ``[v_g, v_{g + n_kv_heads/2}]``, mixed through the difference and
the norm: a single head has no OV circuit of its own: ``head.ov()`` refuses by the field's name.
Decoding runs this forward with its KV cache; the cached steps refuse the field ``differential`` by
name.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.hooks import HookPoint
from ..nn.kv_cache import KVCache
from ..nn.norms import rms_inverse
from .heads import FactoredMatrix, Head, HeadList
from .layer import MultiHeadAttention


class DifferentialHead(Head):
    """A head of a :class:`DifferentialAttention`: its QK views and circuit as any head's; no OV circuit."""

    def ov(self) -> FactoredMatrix:
        """Refused: the head's value is its pair's two value heads, mixed by ``p_1 - lambda p_2`` and the
        pair's norm, so no ``W_V W_O`` of one head is what the layer computes."""
        raise ValueError(
            f"head {self.index}: the attention field 'differential' mixes each pair's values through "
            "p_1 - lambda p_2 and a norm; a single head has no OV circuit (read hook_z_normed and "
            "hook_result per pair)"
        )


class DifferentialHeads(HeadList):
    """``attn.heads`` of a :class:`DifferentialAttention`: :class:`DifferentialHead` views."""

    def __getitem__(self, index: int) -> Head:
        return DifferentialHead(self.attn, index)

    def __iter__(self) -> Iterator[Head]:
        return (DifferentialHead(self.attn, i) for i in range(self.attn.n_heads))


def lambda_init_of(layer: int) -> float:
    """DiffLlama's ``lambda_init = 0.8 - 0.6 exp(-0.3 layer)`` of layer ``layer`` (0-based)."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer)


class DifferentialAttention(MultiHeadAttention):
    """DiffLlama's attention (module docstring for the formula): :class:`MultiHeadAttention`'s
    projections, views, rotation and KV cache, with ``lambda_q1``, ``lambda_k1``, ``lambda_q2``,
    ``lambda_k2`` [d_head] parameters, ``lambda_init`` (the description's ``differential``), the pair
    norm's ``norm_eps``, and the hook points ``hook_diff_pattern`` [batch, n_pairs, seq_q, seq_k] and
    ``hook_z_normed`` [batch, seq_q, n_pairs, 2 d_head] beside the layer's own (``hook_z`` is each head's
    z [batch, seq_q, n_heads, 2 d_head]; ``hook_result`` each pair's part [batch, seq_q, n_pairs,
    d_model]). Self-attention only; needs an even ``n_kv_heads``; no dropout."""

    prunable = False  # heads come in pairs across the two halves: pruning one breaks its pair

    def __init__(self, *args: Any, lambda_init: float, norm_eps: float = 1e-6, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.n_kv_heads % 2 or self.n_heads % 2:
            raise ValueError(
                f"differential attention needs an even n_kv_heads (and n_heads); got n_heads={self.n_heads}, "
                f"n_kv_heads={self.n_kv_heads}"
            )
        if self.dropout:
            raise ValueError(f"differential attention has no dropout; got dropout={self.dropout}")
        self._spec = dataclasses.replace(self._spec, differential=float(lambda_init))
        self.norm_eps = float(norm_eps)
        dh, f = self.d_head, {"device": self.o_weight.device, "dtype": self.o_weight.dtype}
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            self.register_parameter(name, nn.Parameter(torch.normal(0.0, 0.1, (dh,)).to(**f)))
        self.hook_diff_pattern = HookPoint()  # [batch, n_pairs, seq_q, seq_k]
        self.hook_z_normed = HookPoint()  # [batch, seq_q, n_pairs, 2 d_head]
        self._hook_points += (self.hook_diff_pattern, self.hook_z_normed)

    @property
    def heads(self) -> HeadList:
        """``attn.heads[h]``: each head's views (:class:`DifferentialHead`: no OV circuit)."""
        return DifferentialHeads(self)

    @property
    def lambda_init(self) -> float:
        """``lambda_init`` of this layer (the description's ``differential``)."""
        assert self._spec.differential is not None
        return float(self._spec.differential)

    @property
    def n_pairs(self) -> int:
        """The differential pairs, ``n_heads / 2``."""
        return self.n_heads // 2

    @property
    def pairs(self) -> list[tuple[int, int]]:
        """Each pair's (positive head, negative head): ``(j, j + n_heads / 2)``."""
        return [(j, j + self.n_pairs) for j in range(self.n_pairs)]

    def lambda_full(self) -> Tensor:
        """The layer's ``lambda`` (a 0-d tensor, float32 then the weights' dtype, as transformers)."""
        one = torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1, dim=-1, dtype=torch.float32))
        two = torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2, dim=-1, dtype=torch.float32))
        dtype = self.o_weight.dtype
        return one.to(dtype) - two.to(dtype) + self.lambda_init

    def head_parts(self, z: Tensor) -> Tensor:
        """Each head's part of the layer's output (``b_O`` aside), from ``hook_z`` values z [..., n_heads,
        2 d_head] -> [..., n_heads, d_model], float32 or wider, with each pair's norm frozen at this run's
        scale ``s_j = 1 / rms(z_j - lambda z_{j+P})``::

            part_j     = (1 - lambda_init) s_j z_j W_pair[j]
            part_{j+P} = -(1 - lambda_init) s_j lambda z_{j+P} W_pair[j]

        ``W_pair[j]`` the [2 d_head, d_model] rows of ``W_O`` of pair ``j``: ``part_j + part_{j+P}`` is pair
        ``j``'s ``hook_result`` (to float rounding)."""
        P = self.n_pairs
        zf = z.to(torch.promote_types(z.dtype, torch.float32))  # (..., H, 2 dh)
        lam = self.lambda_full().detach().to(zf.dtype)
        pair = zf[..., :P, :] - lam * zf[..., P:, :]  # (..., P, 2 dh)
        coef = (1.0 - self.lambda_init) * rms_inverse(pair, self.norm_eps)  # (..., P, 1)
        W = self.o_weight.detach().view(self.d_model, P, 2 * self.d_head).permute(1, 2, 0).to(zf.dtype)
        # W: (P, 2 dh, d_model), each pair's rows of W_O
        pos = torch.einsum("...pd,pdm->...pm", coef * zf[..., :P, :], W)  # (..., P, d_model)
        neg = torch.einsum("...pd,pdm->...pm", -lam * coef * zf[..., P:, :], W)  # (..., P, d_model)
        return torch.cat((pos, neg), dim=-2)  # (..., H, d_model)

    def forward(  # type: ignore[override]
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        key_padding: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        kv_cache: KVCache | None = None,
        positions: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """:meth:`MultiHeadAttention.forward`'s arguments and shapes (self-attention only): out [batch,
        seq_q, d_model], and with ``need_weights`` every head's softmax map [batch, n_heads, seq_q, seq_k]."""
        if key is not None or value is not None:
            raise ValueError("differential attention is self-attention only: pass key=None and value=None")
        _, k_in, v_in = self._checked_call(query, None, None, attn_mask, kv_cache, positions)
        B, Sq, _ = query.shape
        seq_k = Sq + (kv_cache.held if kv_cache is not None else 0)
        mask = self._call_mask(query, seq_k, key_padding, attn_mask, is_causal, kv_cache)
        q, k, v = self._heads_qkv(query, k_in, v_in, True, self.hooks_active, None, positions, kv_cache)
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)  # (B, Hkv, Sk, dh) x 2
        P, lam = self.n_pairs, self.lambda_full()
        values = self._pair_values(v)  # (B, P, Sk, 2 dh)
        watched = (self.hook_scores, self.hook_pattern, self.hook_diff_pattern, self.hook_z)
        if need_weights or any(h.active for h in watched):
            pattern = self._pattern(q, k, mask)  # (B, H, Sq, Sk)
            if self.hook_diff_pattern.active:  # a value to read: the output is made from hook_z below
                self.hook_diff_pattern(pattern[:, :P] - lam * pattern[:, P:])  # (B, P, Sq, Sk)
            z = torch.matmul(pattern, torch.cat([values, values], dim=1))  # (B, H, Sq, 2 dh): each head's
            z = self.hook_z(z.transpose(1, 2))  # (B, Sq, H, 2 dh)
            z = z[:, :, :P] - lam * z[:, :, P:]  # (B, Sq, P, 2 dh): each pair's
        else:  # nothing watches a map or a head's z: each pair's (p_1 - lambda p_2) v in one product
            z = self._pair_z(q, k, values, mask, lam)  # (B, Sq, P, 2 dh)
        normed = (1 - self.lambda_init) * (z * rms_inverse(z, self.norm_eps)).to(z.dtype)  # (B, Sq, P, 2 dh)
        normed = self.hook_z_normed(normed)
        if self.hook_result.active:
            W = self.o_weight.view(self.d_model, P, 2 * self.d_head).permute(1, 2, 0)  # (P, 2 dh, d_model)
            result = self.hook_result(torch.einsum("bspd,pdm->bspm", normed, W))  # (B, Sq, P, d_model)
            out = result.sum(dim=2) if self.o_bias is None else result.sum(dim=2) + self.o_bias
        else:
            out = F.linear(normed.reshape(B, Sq, P * 2 * self.d_head), self.o_weight, self.o_bias)
        return (out, pattern) if need_weights else out  # (B, Sq, d_model)

    def _pair_z(self, q: Tensor, k: Tensor, values: Tensor, mask: Any, lam: Tensor) -> Tensor:
        """Each pair's ``z_j - lambda z_{j+P} = (P_j - lambda P_{j+P}) [v_g, v_{g + n_kv_heads/2}]``, the
        difference taken on the maps (one product of half the heads, no per-head z): q [B, H, Sq, dh],
        k [B, Hkv, Sk, dh], values [B, P, Sk, 2 dh] -> [B, Sq, P, 2 dh] (0 on dead rows). The
        same values as the hooked path's to float rounding (the scale is applied to q, not the scores)."""
        P, Sq, Sk = self.n_pairs, q.shape[2], k.shape[2]
        if self.group_size > 1:
            k = k.repeat_interleave(self.group_size, dim=1)  # (B, H, Sk, dh): each query head's key head
        scores = torch.matmul(q * self.scale, k.transpose(2, 3))  # (B, H, Sq, Sk), fresh
        if mask.is_causal:
            above = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device).triu(Sk - Sq + 1)  # (Sq, Sk)
            scores = scores.masked_fill_(above, float("-inf"))
        elif mask.mask is not None:
            m = mask.mask
            scores = scores + m if m.is_floating_point() else scores.masked_fill(~m, float("-inf"))
        pattern = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # (B, H, Sq, Sk)
        diff = torch.sub(pattern[:, :P], pattern[:, P:] * lam)  # (B, P, Sq, Sk): p_1 - lambda p_2
        dead = mask.dead_rows  # (B|1, H|1, Sq, 1): both maps 0 there, so their difference
        if dead is not None:
            diff = diff.masked_fill(dead[:, :P] if dead.shape[1] > 1 else dead, 0.0)  # (B, P, Sq, Sk)
        return torch.matmul(diff, values).transpose(1, 2)  # (B, Sq, P, 2 dh)

    def _pattern(self, q: Tensor, k: Tensor, mask: Any) -> Tensor:
        """Every query head's softmax map, ``hook_scores`` and ``hook_pattern`` fired: q [B, H, Sq, dh],
        k [B, Hkv, Sk, dh] -> [B, H, Sq, Sk] (float32 softmax, a row with nothing to attend to 0)."""
        Sq = q.shape[2]
        if self.group_size > 1:  # (one query head per key head: k as it is, no copy)
            k = k.repeat_interleave(self.group_size, dim=1)  # (B, H, Sk, dh): each query head's key head
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale  # (B, H, Sq, Sk)
        if mask.is_causal:
            m = torch.ones(Sq, k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - Sq)
            scores = scores.masked_fill(~m, float("-inf"))
        elif mask.mask is not None:
            m = mask.mask
            scores = scores + m if m.is_floating_point() else scores.masked_fill(~m, float("-inf"))
        scores = self.hook_scores(scores)
        pattern = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # (B, H, Sq, Sk)
        if mask.dead_rows is not None:
            pattern = pattern.masked_fill(mask.dead_rows, 0.0)
        return self.hook_pattern(pattern)

    def _pair_values(self, v: Tensor) -> Tensor:
        """Each pair's value ``[v_g, v_{g + n_kv_heads/2}]``: v [B, Hkv, Sk, dh] -> [B, P, Sk, 2 dh]."""
        half = self.n_kv_heads // 2
        wide = torch.cat([v[:, :half], v[:, half:]], dim=-1)  # (B, Hkv/2, Sk, 2 dh)
        if self.group_size == 1:
            return wide  # (B, P, Sk, 2 dh): pair j's own
        return wide.repeat_interleave(self.group_size, dim=1)  # (B, P, Sk, 2 dh): pair j's g(j)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", differential(lambda_init={self.lambda_init:.4g})"
