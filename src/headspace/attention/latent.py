r"""Multi-head latent attention (MLA: DeepSeek V2 / V3), its own layer beside :class:`MultiHeadAttention`.

For each head ``h`` (right-multiplication convention; ``x`` the layer's input [d_model])::

    q_h = RMSNorm_q(x W_qa) W_qb[h]           (no query latent, ``q_lora_rank=None``: q_h = x W_q[h])
    c   = RMSNorm_c(x W_kva)                  the key/value latent [kv_lora_rank]: what the cache holds
    k_h = [c W_kb[h], R(j) (x W_kr)]          the rotary part [qk_rope_head_dim] is shared by all heads
    v_h = c W_vb[h]                           [v_head_dim], another width than q and k
    q_h = [q_h[:nope], R(i) q_h[nope:]]       only the last qk_rope_head_dim features of q rotate
    z_h = softmax(q_h k_h^T * scale + mask) v_h
    out = sum_h z_h W_O[h] + b_O

``scale`` is ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)`` unless given (a YaRN checkpoint folds
``mscale ** 2`` in: :mod:`headspace.pretrained.deepseek`). Parameters keep transformers' names
(``q_a_proj``, ``q_a_layernorm``, ``q_b_proj`` or ``q_proj``, ``kv_a_proj_with_mqa`` (``W_kva`` and
``W_kr`` stacked), ``kv_a_layernorm``, ``kv_b_proj`` (``W_kb`` and ``W_vb`` per head), ``o_proj``).

Hook points: ``hook_q`` [batch, seq_q, n_heads, qk_head_dim] (before the rotation), ``hook_latent``
[batch, seq_k, kv_lora_rank] (``c``, after its norm), ``hook_rope_k`` [batch, seq_k, qk_rope_head_dim]
(the rotated shared key part), ``hook_k`` [batch, seq_k, n_heads, qk_head_dim] (rotated), ``hook_v``
[batch, seq_k, n_heads, v_head_dim], ``hook_scores`` / ``hook_pattern`` [batch, n_heads, seq_q, seq_k],
``hook_z`` [batch, seq_q, n_heads, v_head_dim], ``hook_result`` [batch, seq_q, n_heads, d_model].
With a :class:`~headspace.nn.latent_cache.LatentCache` the new positions' ``c`` and rotated key part
are appended (``hook_latent`` / ``hook_rope_k`` show the new positions; ``hook_k`` / ``hook_v`` every
cached one). Per-head views: :mod:`headspace.attention.latent_heads`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from ..nn.hooks import HookPoint
from ..nn.latent_cache import LatentCache
from ..nn.masks import canonical_mask
from ..nn.norms import RMSNorm
from ..nn.positions import rotary_tables, rotate_fused
from ..nn.spec import AttentionSpec, LatentSpec
from . import recording
from .checks import check_input_tensor
from .latent_absorbed import absorbable, absorbed_attention
from .latent_fast import down_projections, fast_forward_ok, fast_latent_attention, rotated_queries
from .latent_heads import LatentHead, LatentHeadList


def no_plain_view(name: str) -> AttributeError:
    """The one-line refusal of a per-layer ``W_Q`` / ``W_K`` / ``W_V`` tensor on a latent layer (an
    ``AttributeError``, so ``hasattr`` is False): what reads it (a weight-based analysis) cannot run
    on the field ``latent``; the per-head views are the factored products through the latent."""
    return AttributeError(
        f"a latent attention layer (the attention field 'latent') has no {name} tensor of its own: use "
        f"attn.heads[h].{name}, a FactoredMatrix through the latent at a run's frozen norm scales "
        "(headspace.attention.latent_heads)"
    )


def _fire(point: HookPoint, x: Tensor) -> Tensor:
    return point(x) if point.active else x


class LatentAttention(nn.Module):
    """Multi-head latent attention (module docstring for the formula, parameters and hook points).

    Built from an :class:`~headspace.nn.spec.AttentionSpec` whose ``latent`` is set
    (:meth:`from_spec`); ``spec`` is kept. ``d_head`` is the value width ``v_head_dim`` (that of
    ``hook_z`` and ``W_O``); ``d_head_qk`` the query/key width. Self-attention only, causal or masked
    as :meth:`MultiHeadAttention.forward`.
    """

    #: :func:`headspace.prune_heads` may not remove heads of this layer.
    prunable: bool = False

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__()
        if not isinstance(spec, AttentionSpec) or not isinstance(spec.latent, LatentSpec):
            raise ValueError(f"LatentAttention needs an AttentionSpec with a latent; got {spec!r}")
        lat, d, H = spec.latent, spec.d_model, spec.n_heads
        self.spec, self.latent = spec, lat
        self.d_model, self.n_heads, self.n_kv_heads = d, H, H
        self.d_head, self.d_head_qk = lat.v_head_dim, lat.qk_head_dim
        self.scale = spec.score_scale
        self.dropout = spec.dropout
        self.fused, self.check_finite, self.window, self.softcap = False, False, None, None
        bias, dqk = spec.qkv_bias, lat.qk_head_dim
        q_lora = lat.q_lora_rank
        self.register_module("q_proj", nn.Linear(d, H * dqk, bias=False) if q_lora is None else None)
        self.register_module("q_a_proj", None if q_lora is None else nn.Linear(d, q_lora, bias=bias))
        self.register_module("q_a_layernorm", None if q_lora is None else RMSNorm(q_lora, spec.qk_norm_eps))
        self.register_module("q_b_proj", None if q_lora is None else nn.Linear(q_lora, H * dqk, bias=False))
        self.kv_a_proj_with_mqa = nn.Linear(d, lat.kv_lora_rank + lat.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(lat.kv_lora_rank, spec.qk_norm_eps)
        self.kv_b_proj = nn.Linear(lat.kv_lora_rank, H * (lat.qk_nope_head_dim + lat.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * lat.v_head_dim, d, bias=spec.out_bias)
        self.register_module("rotary", spec.positions)
        self.hook_q = HookPoint()  # [batch, seq_q, n_heads, qk_head_dim]
        self.hook_latent = HookPoint()  # [batch, seq_k, kv_lora_rank]
        self.hook_rope_k = HookPoint()  # [batch, seq_k, qk_rope_head_dim]
        self.hook_k = HookPoint()  # [batch, seq_k, n_heads, qk_head_dim]
        self.hook_v = HookPoint()  # [batch, seq_k, n_heads, v_head_dim]
        self.hook_scores = HookPoint()  # [batch, n_heads, seq_q, seq_k]
        self.hook_pattern = HookPoint()  # [batch, n_heads, seq_q, seq_k]
        self.hook_z = HookPoint()  # [batch, seq_q, n_heads, v_head_dim]
        self.hook_result = HookPoint()  # [batch, seq_q, n_heads, d_model]

    def __getattr__(self, name: str) -> Any:
        # a property raising AttributeError lands here (nn.Module's lookup): keep the property's message
        if name in ("W_Q", "W_K", "W_V"):
            raise no_plain_view(name)
        return super().__getattr__(name)

    @classmethod
    def from_spec(cls, spec: AttentionSpec) -> LatentAttention:
        """The layer ``spec`` describes (fresh weights: torch's default linears, unit norms)."""
        return cls(spec)

    # ------------------------------------------------------------------ views
    @property
    def group_size(self) -> int:
        """1: every head has its own keys and values (expanded from the one shared latent)."""
        return 1

    @property
    def o_weight(self) -> Tensor:
        """``o_proj.weight`` [d_model, n_heads v_head_dim]."""
        return self.o_proj.weight

    @property
    def o_bias(self) -> Tensor | None:
        """``o_proj.bias`` [d_model] or None."""
        return self.o_proj.bias

    @property
    def W_O(self) -> Tensor:
        """[n_heads, v_head_dim, d_model], a view of ``o_proj.weight``."""
        return self.o_proj.weight.T.unflatten(0, (self.n_heads, self.d_head))  # (H, dv, d_model)

    @property
    def b_O(self) -> Tensor | None:
        return self.o_proj.bias

    @property
    def W_Q(self) -> Tensor:
        """No query latent only: [n_heads, d_model, qk_head_dim], a view of ``q_proj.weight``; with a query
        latent there is none (:func:`no_plain_view`: see :attr:`W_QA` / :attr:`W_QB`, ``heads[h].W_Q``)."""
        if self.q_proj is None:
            raise no_plain_view("W_Q")
        return self.q_proj.weight.unflatten(0, (self.n_heads, self.d_head_qk)).transpose(1, 2)  # (H, d, dqk)

    @property
    def W_K(self) -> Tensor:
        """None of its own (:func:`no_plain_view`): ``heads[h].W_K`` and :attr:`W_K_rope`."""
        raise no_plain_view("W_K")

    @property
    def W_V(self) -> Tensor:
        """None of its own (:func:`no_plain_view`): ``heads[h].W_V``."""
        raise no_plain_view("W_V")

    @property
    def W_QA(self) -> Tensor | None:
        """The query latent's down projection [d_model, q_lora_rank] (a view), or None."""
        return None if self.q_a_proj is None else self.q_a_proj.weight.T

    @property
    def W_QB(self) -> Tensor | None:
        """The query latent's per-head up projection [n_heads, q_lora_rank, qk_head_dim] (a view), or None."""
        if self.q_b_proj is None:
            return None
        w = self.q_b_proj.weight.unflatten(0, (self.n_heads, self.d_head_qk))  # (H, dqk, q_lora_rank)
        return w.transpose(1, 2)  # (H, q_lora_rank, dqk)

    @property
    def W_KVA(self) -> Tensor:
        """The key/value latent's down projection [d_model, kv_lora_rank] (a view)."""
        return self.kv_a_proj_with_mqa.weight[: self.latent.kv_lora_rank].T

    @property
    def W_K_rope(self) -> Tensor:
        """The shared rotary key part ``W_kr`` [d_model, qk_rope_head_dim] (a view): every head's key
        ends with ``R(j) (x_j W_kr)``."""
        return self.kv_a_proj_with_mqa.weight[self.latent.kv_lora_rank :].T

    def _kv_b(self) -> Tensor:
        lat = self.latent
        w = self.kv_b_proj.weight.unflatten(0, (self.n_heads, lat.qk_nope_head_dim + lat.v_head_dim))
        # (H, nope + dv, kv_lora_rank)
        return w.transpose(1, 2)  # (H, kv_lora_rank, nope + dv)

    @property
    def W_KB(self) -> Tensor:
        """Each head's key up projection [n_heads, kv_lora_rank, qk_nope_head_dim] (a view)."""
        return self._kv_b()[..., : self.latent.qk_nope_head_dim]

    @property
    def W_VB(self) -> Tensor:
        """Each head's value up projection [n_heads, kv_lora_rank, v_head_dim] (a view)."""
        return self._kv_b()[..., self.latent.qk_nope_head_dim :]

    @property
    def heads(self) -> LatentHeadList:
        """``attn.heads[h]``: one head's factored views
        (:class:`~headspace.attention.latent_heads.LatentHead`)."""
        return LatentHeadList(self)

    def head(self, index: int) -> LatentHead:
        return self.heads[index]

    def latent_norm_scales(self, x: Tensor) -> tuple[Tensor | None, Tensor]:
        """The frozen norm scales of a run on the layer's input x [batch, seq, d_model]: ``s_q = 1 /
        rms(x W_qa)`` (None without a query latent) and ``s_c = 1 / rms(x W_kva)``, each [batch, seq]
        (``RMSNorm(y) = s * y * weight``)."""

        def scale(y: Tensor, eps: float) -> Tensor:
            return torch.rsqrt(y.float().pow(2).mean(-1) + eps)  # (batch, seq)

        lat = self.latent
        c = self.kv_a_proj_with_mqa(x)[..., : lat.kv_lora_rank]  # (batch, seq, kv_lora_rank)
        s_c = scale(c, self.kv_a_layernorm.eps)
        if self.q_a_proj is None:
            return None, s_c
        return scale(self.q_a_proj(x), self.q_a_layernorm.eps), s_c

    def make_kv_cache(self, batch: int, capacity: int) -> LatentCache:
        """A :class:`~headspace.nn.latent_cache.LatentCache`: ``kv_lora_rank + qk_rope_head_dim`` numbers
        per position, in this layer's dtype and device."""
        w = self.o_proj.weight
        lat = self.latent
        return LatentCache(
            batch, lat.kv_lora_rank, lat.qk_rope_head_dim, capacity, dtype=w.dtype, device=w.device
        )

    def extra_repr(self) -> str:
        lat = self.latent
        return (
            f"d_model={self.d_model}, n_heads={self.n_heads}, q_lora_rank={lat.q_lora_rank}, "
            f"kv_lora_rank={lat.kv_lora_rank}, qk_nope={lat.qk_nope_head_dim}, "
            f"qk_rope={lat.qk_rope_head_dim}, v_head_dim={lat.v_head_dim}"
        )

    # ------------------------------------------------------------------ forward
    def _project(
        self, x: Tensor, cos: Tensor | None, sin: Tensor | None, scale: float | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, H, S, dqk] (rotated; times ``scale`` unless None), the latent c [B, 1, S, kv_lora_rank]
        and the rotated shared key part [B, 1, S, rope] of the input x [B, S, d_model], through
        ``hook_q``, ``hook_latent`` and ``hook_rope_k``."""
        B, S, _ = x.shape
        lat, H = self.latent, self.n_heads
        q, kv_a = down_projections(self, x)  # (B, S, H dqk | q_lora_rank), (B, S, r + rope)
        if self.q_proj is None:
            q = self.q_b_proj(self.q_a_layernorm(q))  # (B, S, H dqk)
        q = _fire(self.hook_q, q.reshape(B, S, H, self.d_head_qk))  # (B, S, H, dqk)
        c, k_rope = kv_a.split([lat.kv_lora_rank, lat.qk_rope_head_dim], dim=-1)
        # (B, S, kv_lora_rank), (B, S, rope)
        c = _fire(self.hook_latent, self.kv_a_layernorm(c))  # (B, S, kv_lora_rank)
        k_rope = k_rope.reshape(B, 1, S, lat.qk_rope_head_dim)  # (B, 1, S, rope)
        if self.rotary is not None:
            assert cos is not None and sin is not None
            q = rotated_queries(q, lat.qk_nope_head_dim, cos, sin, self.rotary, scale)  # (B, H, S, dqk)
            k_rope = rotate_fused(k_rope, cos, sin, self.rotary)  # (B, 1, S, rope)
        else:
            q = q.transpose(1, 2) if scale is None else q.transpose(1, 2) * scale  # (B, H, S, dqk)
        k_rope = _fire(self.hook_rope_k, k_rope.reshape(B, S, lat.qk_rope_head_dim))  # (B, S, rope)
        return q, c.unsqueeze(1), k_rope.unsqueeze(1)  # (B, H, S, dqk), (B, 1, S, r), (B, 1, S, rope)

    def expand_kv(self, c: Tensor, k_rope: Tensor) -> tuple[Tensor, Tensor]:
        """Every head's keys [B, H, Sk, dqk] and values [B, H, Sk, dv] from the latent c [B, 1, Sk,
        kv_lora_rank] and the rotated shared key part [B, 1, Sk, rope], through ``hook_k`` / ``hook_v``."""
        B, _, Sk, _ = c.shape
        lat, H = self.latent, self.n_heads
        kv = self.kv_b_proj(c.squeeze(1)).view(B, Sk, H, lat.qk_nope_head_dim + lat.v_head_dim)
        # (B, Sk, H, nope + dv)
        k_nope, v = kv.split([lat.qk_nope_head_dim, lat.v_head_dim], dim=-1)  # (B, Sk, H, nope), (.., dv)
        k_rope = k_rope.squeeze(1).unsqueeze(2).expand(B, Sk, H, lat.qk_rope_head_dim)  # (B, Sk, H, rope)
        k = _fire(self.hook_k, torch.cat((k_nope, k_rope), dim=-1))  # (B, Sk, H, dqk)
        v = _fire(self.hook_v, v)  # (B, Sk, H, dv)
        return k.transpose(1, 2), v.transpose(1, 2)  # (B, H, Sk, dqk), (B, H, Sk, dv)

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        key_padding: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        kv_cache: LatentCache | None = None,
        positions: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Self-attention of ``query`` [batch, seq_q, d_model] (``key`` / ``value`` must be None), masks as
        :meth:`MultiHeadAttention.forward`; ``kv_cache`` a :class:`LatentCache` (:meth:`make_kv_cache`);
        ``positions`` int [seq_q] or [batch, seq_q] (default ``kv_cache.length + arange(seq_q)``).
        Returns out [batch, seq_q, d_model], or (out, pattern [batch, n_heads, seq_q, seq_k])."""
        if key is not None or value is not None:
            raise ValueError("LatentAttention is self-attention only; pass key=None and value=None")
        check_input_tensor("query", query, self.d_model, "d_model", self.o_proj.weight)
        if kv_cache is not None and not isinstance(kv_cache, LatentCache):
            raise TypeError(
                f"kv_cache must be a LatentCache (from make_kv_cache) or None; got {type(kv_cache).__name__}"
            )
        B, Sq, _ = query.shape
        start = 0 if kv_cache is None else kv_cache.length
        if kv_cache is not None:
            kv_cache.check(B, Sq, self.o_proj.weight.dtype, self.o_proj.weight.device)
        mask = canonical_mask(
            batch=B,
            n_heads=self.n_heads,
            seq_q=Sq,
            seq_k=start + Sq,
            key_padding=key_padding,
            attn_mask=attn_mask,
            is_causal=is_causal,
            dtype=query.dtype,
            device=query.device,
        )  # fmt: skip  (checked before the cache takes the new positions: a refused call leaves it)
        cos = sin = None
        if self.rotary is not None:
            pos = torch.arange(start, start + Sq, device=query.device) if positions is None else positions
            cos, sin = rotary_tables(self.rotary, pos, query.dtype, query.device)  # (b|1, 1, Sq, rope) x 2
        absorb = absorbable(self, Sq, kv_cache is not None)  # a decoding step: W_kb, W_vb absorbed
        fast = not absorb and fast_forward_ok(self, need_weights)  # nothing sees k, v, scores, pattern, z
        q, c, k_rope = self._project(query, cos, sin, self.scale if fast else None)  # fast: q scaled
        if kv_cache is not None:
            c, k_rope = kv_cache.append(c, k_rope)  # (B, 1, Sk, kv_lora_rank), (B, 1, Sk, rope)
        if absorb:
            z, pattern = absorbed_attention(self, q, c, k_rope, mask)  # (B, Sq, H, dv), (B, H, Sq, Sk)
        elif fast:
            z, pattern = fast_latent_attention(self, q, c, k_rope, mask), None  # (B, Sq, H, dv)
        else:
            k, v = self.expand_kv(c, k_rope)  # (B, H, Sk, dqk), (B, H, Sk, dv)
            points = (self.hook_scores, self.hook_pattern, self.hook_z)
            dropout_p = self.dropout if self.training else 0.0
            z, pattern, _ = recording.traced_attention(
                q, k, v, mask, dropout_p, points, scale=self.scale, softcap=None
            )
        if self.hook_result.active:
            out = recording.output_from_heads(z, self.W_O, self.o_proj.bias, self.hook_result)[0]
        else:
            out = self.o_proj(z.reshape(B, Sq, self.n_heads * self.d_head))  # (B, Sq, d_model)
        if need_weights:
            assert pattern is not None
            return out, pattern
        return out


def yarn_mscale(factor: float, mscale_all_dim: float) -> float:
    """YaRN's ``mscale`` of a latent attention's softmax scale: ``0.1 mscale_all_dim ln(factor) + 1``
    (1 for ``factor <= 1``); the scale is multiplied by its square (transformers' ``yarn_apply_mscale``)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale_all_dim * math.log(factor) + 1.0
