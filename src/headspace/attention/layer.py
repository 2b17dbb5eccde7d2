"""MultiHeadAttention: the four projections, per-head views and forward (its KV cache is
:class:`headspace.nn.kv_cache.KVCache`; the rotation is :func:`headspace.positions.rotate_fused`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels.workspace import THREAD_SCRATCH_MIN_BYTES, thread_workspace
from ..nn.alibi import with_alibi
from ..nn.hooks import HookPoint
from ..nn.kv_cache import KVCache
from ..nn.masks import CanonicalMask, canonical_mask, check_window
from ..nn.norms import HeadLayerNorm, L2Norm, RMSNorm
from ..nn.positions import Rotary
from ..nn.positions import rotary_tables as rotary_tables  # re-exported: analysis/chunked.py reads them here
from ..nn.positions import rotate_fused as rotate_fused
from ..nn.spec import AttentionSpec
from . import recording
from .checks import QK_NORMS as QK_NORMS  # re-exported: their old home
from .checks import _check_finite as _check_finite
from .checks import _check_layer_args, _check_qk_norm, _shape
from .checks import check_input_tensor as check_input_tensor
from .checks import resolve_head_dims as resolve_head_dims
from .described import DescribedAttention
from .functional import get_backend
from .gates import W_G, add_gate, b_G, gate_of, gated
from .heads import Head, HeadList
from .projection import HeadProjections
from .recording import QKVOps as QKVOps  # re-exported: their old home
from .recording import output_sum as output_sum
from .recording import project_stages as project_stages
from .sinks import add_sinks, fire_sink, sink_attention

#: a hook point nothing is added to: a gated layer's attention fires hook_z itself, after the gate
_UNWATCHED = HookPoint()


def _last_keys(
    key_padding: Tensor | None, attn_mask: Tensor | None, seq_k: int
) -> tuple[Tensor | None, Tensor | None]:
    """The masks' last ``seq_k`` key columns (a windowed KV cache holds only the newest keys); masks
    already that narrow, or None, are returned as they are."""
    if key_padding is not None and key_padding.dim() == 2 and key_padding.shape[1] > seq_k:
        key_padding = key_padding[:, -seq_k:]  # (batch, seq_k)
    if attn_mask is not None and attn_mask.dim() >= 2 and attn_mask.shape[-1] > seq_k:
        attn_mask = attn_mask[..., -seq_k:]  # (..., seq_q, seq_k)
    return key_padding, attn_mask


def output_linear(z: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The attention output from z [B, Sq, H, dh] with the heads concatenated: one GEMM by ``W_O``."""
    B, Sq, H, dh = z.shape
    return F.linear(z.reshape(B, Sq, H * dh), weight, bias)  # (B, Sq, d_model)


class MultiHeadAttention(DescribedAttention, HeadProjections, nn.Module):
    r"""Multi-head attention with every head's projections in plain sight.

    For each head ``h`` (right-multiplication convention, as in the textbook and TransformerLens)::

        q_h = x W_Q[h] + b_Q[h]            W_Q: [n_heads, d_model, d_head]
        k_h = c W_K[g(h)] + b_K[g(h)]      W_K: [n_kv_heads, kdim, d_head]
        v_h = c W_V[g(h)] + b_V[g(h)]      W_V: [n_kv_heads, vdim, d_head]
        z_h = softmax(q_h k_h^T * scale + mask) v_h          scale = 1 / sqrt(d_head)
        out = concat_h(z_h) W_O + b_O = sum_h z_h W_O[h] + b_O     W_O: [n_heads, d_head, d_model]

    With rotary positions (``rotary``, a :class:`~headspace.positions.Rotary`, RoPE), the query at
    position ``i`` and the key at position ``j`` are turned before the scores::

        q_h(i) = (x_i W_Q[h] + b_Q[h]) R(i)      k_h(j) = (c_j W_K[g(h)] + b_K[g(h)]) R(j)
        q_h(i) k_h(j)^T = (x_i W_Q[h] + b_Q[h]) R(i - j) (c_j W_K[g(h)] + b_K[g(h)])^T

    so a score depends on the positions only through ``i - j`` (:meth:`Head.qk` with ``delta``).

    with ``x`` the query input, ``c`` the key/value input (``x`` itself for self-attention) and
    ``g(h) = h // (n_heads / n_kv_heads)`` the key/value head serving query head ``h`` (grouped-query
    attention; ``n_kv_heads = n_heads`` is ordinary multi-head attention, ``1`` multi-query).

    Paper symbols (Vaswani et al. 2017): ``W_Q[h] = W_i^Q``, ``W_K[h] = W_i^K``, ``W_V[h] = W_i^V``,
    ``W_O = W^O`` split into per-head row blocks ``W_O[h]``. Defaults give the paper's d_model=512,
    8 heads, d_head=64.

    Storage is fused for speed: ``qkv_weight`` [(n_heads + 2 n_kv_heads) d_head, d_model] (or separate
    ``q_weight``/``k_weight``/``v_weight`` when kdim or vdim differ from d_model), ``qkv_bias``,
    ``o_weight`` [d_model, n_heads d_head] and ``o_bias``, in ``nn.Linear``'s [out, in] layout.
    ``bias`` switches both biases; ``qkv_bias`` / ``out_bias`` (default: ``bias``) switch them apart
    (Qwen2 has biases on q, k and v but not on the output projection). The
    properties ``W_Q``, ``W_K``, ``W_V``, ``W_O``, ``b_Q``, ``b_K``, ``b_V``, ``b_O`` and ``heads[h]`` are
    zero-copy views of that storage: writing into them (under ``torch.no_grad()``) changes the layer.

    Masks: bool masks mean True = may attend; ``key_padding`` is True for real tokens; float masks are
    additive. See :mod:`headspace.masks` for the whole convention. A query with nothing to attend to
    gives zeros with finite gradients.

    Rotary positions (``rotary`` given; self-attention only): q and k are rotated after the projections
    (and after ``hook_q``/``hook_k``), before the scores; the rotated values pass the hook points
    ``hook_rot_q`` [batch, seq_q, n_heads, d_head] and ``hook_rot_k`` [batch, seq_k, n_kv_heads, d_head]
    (which exist only on rotary layers). A KV cache stores rotated keys. ``forward``'s ``positions``
    (default ``kv_cache.length + arange(seq_q)``) says where each query (and its key) sits. The untraced
    path rotates q and k together, on the fused projection, in a few elementwise ops.

    Beyond the classic layer (issue #27: Gemma 2 / 3, Qwen3, OLMo 2, Mistral), each off by default:

    * ``window`` (sliding-window attention): key ``j`` is visible from query ``i`` iff
      ``i - window < j <= i``, combined by AND with every other mask, on every path; positions are
      absolute (with a KV cache, the cached keys count: :func:`headspace.masks.window_mask`).
    * ``qk_norm``: ``"head"`` normalises each head's q and k over d_head (one RMSNorm weight [d_head]
      each for q and k: Qwen3, Gemma 3), ``"all"`` all heads' q (k) together (OLMo 2); after
      ``hook_q``/``hook_k``, before the rotation; hook points ``hook_q_normed`` [batch, seq_q, n_heads,
      d_head] and ``hook_k_normed`` [batch, seq_k, n_kv_heads, d_head]. ``qk_norm_offset`` 1 is
      Gemma's ``(1 + w)``. With QK-norm the QK circuit ``W_Q[h] W_K[g]^T`` no longer gives the scores
      alone: they are ``RMSNorm(x W_Q[h]) RMSNorm(c W_K[g])^T``, bilinear in the inputs only at each
      token's frozen norm scale ``1 / rms(x W_Q[h])`` (and likewise for k): :meth:`qk_norm_scales` reads
      those off a run, and :meth:`headspace.Head.qk` folds the norms' gains (:meth:`qk_norm_gains`) in.
    * ``softcap`` (Gemma 2): the scaled scores become ``softcap * tanh(s / softcap)`` before the mask;
      ``hook_scores`` sees the capped, masked scores. Soft-capped layers run the reference maths.
    * ``scale``: Gemma's ``query_pre_attn_scalar`` is ``scale = query_pre_attn_scalar ** -0.5``.
    * ``alibi_slopes`` (ALiBi: BLOOM, MPT, Falcon): ``-m_h * (i - j)`` joins every path's mask
      (:func:`headspace.nn.alibi.with_alibi`), so ``hook_scores`` include it (spec ``bias="alibi"``).
    * Llama 4 (set through ``spec``): ``chunk`` (chunked attention, :func:`headspace.nn.masks.chunk_mask`),
      ``temperature`` (the NoPE layers' per-position query scale after ``hook_q``,
      :mod:`headspace.attention.temperature`) and ``qk_norm="l2"`` (weightless RMSNorm per head: it
      commutes with the rotation, so it runs before it like the other QK-norms).

    ``check_finite`` (default False, as checking costs a pass over the inputs): when True, NaN/Inf in
    the inputs (NaN/+inf in a float ``attn_mask``) or the output raise ``ValueError`` naming the tensor
    and the first bad index. With the default, NaN/Inf propagate like in any torch layer.
    """

    #: :func:`headspace.prune_heads` may remove heads of this layer (subclasses with a fixed layout say no).
    prunable: bool = True

    def __init__(
        self,
        d_model: int = 512,
        n_heads: int = 8,
        d_head: int | None = None,
        n_kv_heads: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        *,
        scale: float | None = None,
        check_finite: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        qkv_bias: bool | None = None,
        out_bias: bool | None = None,
        rotary: Rotary | None = None,
        window: int | None = None,
        qk_norm: str | None = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_offset: float = 0.0,
        softcap: float | None = None,
        sink: str | None = None,
        alibi_slopes: Sequence[float] | None = None,
        gate: str | None = None,
    ) -> None:
        super().__init__()
        d_head, n_kv_heads = resolve_head_dims(d_model, n_heads, d_head, n_kv_heads)
        check_window(window)
        _check_qk_norm(qk_norm, softcap)
        _check_layer_args(d_model, d_head, qkv_bias, out_bias, rotary, kdim, vdim, dropout, scale, dtype)
        qkv_bias = bool(bias) if qkv_bias is None else qkv_bias
        out_bias = bool(bias) if out_bias is None else out_bias
        self._spec = AttentionSpec(
            d_model, n_heads, d_head, n_kv_heads, qkv_bias=qkv_bias, out_bias=out_bias, positions=rotary,
            scale=None if scale is None else float(scale), window=window,
            softcap=None if softcap is None else float(softcap), qk_norm=qk_norm, qk_norm_eps=qk_norm_eps,
            qk_norm_offset=qk_norm_offset, dropout=dropout, sink=sink, gate=gate,
            bias=None if alibi_slopes is None else "alibi", alibi_slopes=alibi_slopes,
        )  # fmt: skip
        self.kdim = d_model if kdim is None else kdim
        self.vdim = d_model if vdim is None else vdim
        self.check_finite = check_finite
        self.fused = self.kdim == d_model and self.vdim == d_model
        f = {"device": device, "dtype": dtype}
        hq, hkv = n_heads * d_head, n_kv_heads * d_head
        if self.fused:
            self.qkv_weight = nn.Parameter(torch.empty(hq + 2 * hkv, d_model, **f))
        else:
            self.q_weight = nn.Parameter(torch.empty(hq, d_model, **f))
            self.k_weight = nn.Parameter(torch.empty(hkv, self.kdim, **f))
            self.v_weight = nn.Parameter(torch.empty(hkv, self.vdim, **f))
        self.qkv_bias = nn.Parameter(torch.empty(hq + 2 * hkv, **f)) if qkv_bias else None
        self.o_weight = nn.Parameter(torch.empty(d_model, hq, **f))
        self.o_bias = nn.Parameter(torch.empty(d_model, **f)) if out_bias else None
        self.register_module("rotary", rotary)  # no parameters, no persistent buffers: no state-dict keys
        self._init_qk_norm(qk_norm, qk_norm_eps, qk_norm_offset, f)

        self.hook_q = HookPoint()  # [batch, seq_q, n_heads, d_head]
        self.hook_k = HookPoint()  # [batch, seq_k, n_kv_heads, d_head]
        self.hook_v = HookPoint()  # [batch, seq_k, n_kv_heads, d_head]
        self.hook_scores = HookPoint()  # [batch, n_heads, seq_q, seq_k]
        self.hook_pattern = HookPoint()  # [batch, n_heads, seq_q, seq_k]
        self.hook_z = HookPoint()  # [batch, seq_q, n_heads, d_head]
        self.hook_result = HookPoint()  # [batch, seq_q, n_heads, d_model]
        # rotary layers only: a layer without rotation has nothing to show there
        self.register_module("hook_rot_q", HookPoint() if rotary is not None else None)  # [b, sq, H, dh]
        self.register_module("hook_rot_k", HookPoint() if rotary is not None else None)  # [b, sk, Hkv, dh]
        self._hook_points = (self.hook_q, self.hook_k, self.hook_v, self.hook_scores, self.hook_pattern)
        self._hook_points += (self.hook_z, self.hook_result)
        self._hook_points += () if rotary is None else (self.hook_rot_q, self.hook_rot_k)
        self._hook_points += () if qk_norm is None else (self.hook_q_normed, self.hook_k_normed)
        self._hook_points += add_sinks(self, sink, f) + add_gate(
            self, gate, qkv_bias, f
        )  # sinks.py, gates.py
        self.reset_parameters()

    def _init_qk_norm(self, qk_norm: str | None, eps: float, offset: float, f: dict[str, Any]) -> None:
        """``q_norm`` / ``k_norm`` (:class:`~headspace.norms.RMSNorm` over d_head for ``"head"``, over
        n_heads d_head / n_kv_heads d_head for ``"all"``) and their hook points, or None each."""
        norms = qk_norm is not None
        hq, hkv = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        width_q, width_k = (self.d_head, self.d_head) if qk_norm == "head" else (hq, hkv)
        if qk_norm == "l2":  # Llama 4: a weightless RMSNorm over each head
            self.register_module("q_norm", L2Norm(self.d_head, eps).to(**f))
            self.register_module("k_norm", L2Norm(self.d_head, eps).to(**f))
        elif qk_norm == "head_layernorm":  # StableLM / Cohere: a LayerNorm per head, its own weight
            self.register_module("q_norm", HeadLayerNorm(self.n_heads, self.d_head, eps).to(**f))
            self.register_module("k_norm", HeadLayerNorm(self.n_kv_heads, self.d_head, eps).to(**f))
        else:
            self.register_module("q_norm", RMSNorm(width_q, eps, offset=offset).to(**f) if norms else None)
            self.register_module("k_norm", RMSNorm(width_k, eps, offset=offset).to(**f) if norms else None)
        # QK-norm layers only: q and k after their RMSNorm, before any rotation
        self.register_module("hook_q_normed", HookPoint() if norms else None)  # [b, sq, H, dh]
        self.register_module("hook_k_normed", HookPoint() if norms else None)  # [b, sk, Hkv, dh]

    # ------------------------------------------------------------------ parameters and views
    def reset_parameters(self) -> None:
        """Xavier-uniform projections and zero biases (as torch.nn.MultiheadAttention)."""
        hq, hkv = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        with torch.no_grad():
            if self.fused:
                # each of W_Q, W_K, W_V initialised as its own [out, in] matrix
                for rows in (slice(0, hq), slice(hq, hq + hkv), slice(hq + hkv, hq + 2 * hkv)):
                    nn.init.xavier_uniform_(self.qkv_weight[rows])
            else:
                for w in (self.q_weight, self.k_weight, self.v_weight):
                    nn.init.xavier_uniform_(w)
            nn.init.xavier_uniform_(self.o_weight)
            if self.qkv_bias is not None:
                self.qkv_bias.zero_()
            if self.o_bias is not None:
                self.o_bias.zero_()

    @property
    def W_G(self) -> Tensor | None:
        """Gated layers: the output gate's weights [n_heads, d_model, width], a view (:mod:`.gates`)."""
        return W_G(self)

    @property
    def b_G(self) -> Tensor | None:
        """Gated layers with q/k/v biases: the gate's biases [n_heads, width], a view; else None."""
        return b_G(self)

    @property
    def heads(self) -> HeadList:
        """``attn.heads[h]``: one head's W_Q, W_K, W_V, W_O and biases (views)."""
        return HeadList(self)

    def head(self, index: int) -> Head:
        return self.heads[index]

    @property
    def hooks_active(self) -> bool:
        return any(h.fns for h in self._hook_points)

    def make_kv_cache(self, batch: int, capacity: int) -> KVCache:
        """A cache for incremental self-attention decoding, in this layer's dtype and device; a
        sliding-window layer's holds only the last ``window`` positions (:class:`KVCache`)."""
        w = self.o_weight
        return KVCache(
            batch, self.n_kv_heads, self.d_head, capacity, dtype=w.dtype, device=w.device, window=self.window
        )

    def extra_repr(self) -> str:
        s = f"d_model={self.d_model}, n_heads={self.n_heads}, d_head={self.d_head}"
        if self.n_kv_heads != self.n_heads:
            s += f", n_kv_heads={self.n_kv_heads}"
        if not self.fused:
            s += f", kdim={self.kdim}, vdim={self.vdim}"
        qkv_bias, out_bias = self.qkv_bias is not None, self.o_bias is not None
        if qkv_bias == out_bias:
            s += f", bias={qkv_bias}"
        else:
            s += f", qkv_bias={qkv_bias}, out_bias={out_bias}"
        s += f", dropout={self.dropout}"
        rotary = getattr(self, "rotary", None)
        if rotary is not None:
            s += f", rotary(rotary_dim={rotary.rotary_dim}, base={rotary.base:g}, {rotary.rope_type})"
        if self.window is not None:
            s += f", window={self.window}"
        if self.qk_norm is not None:
            s += f", qk_norm={self.qk_norm!r}"
        if self.softcap is not None:
            s += f", softcap={self.softcap:g}"
        return s + (", alibi" if self._spec.bias else "")

    # ------------------------------------------------------------------ checks
    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        w = self.o_weight
        check_input_tensor("query", query, self.d_model, "d_model", w)
        check_input_tensor("key", key, self.kdim, "kdim", w)
        check_input_tensor("value", value, self.vdim, "vdim", w)
        if key.shape[0] != query.shape[0] or value.shape[0] != query.shape[0]:
            raise ValueError(
                f"query, key and value must have the same batch size; got query {_shape(query)}, key "
                f"{_shape(key)}, value {_shape(value)}"
            )
        if key.shape[1] != value.shape[1]:
            raise ValueError(
                f"key and value must have the same length seq_k; got key {_shape(key)}, value {_shape(value)}"
            )

    # ------------------------------------------------------------------ forward
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
        kv_cache: KVCache | None = None,
        positions: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``query`` to ``key``/``value`` (self-attention when both are None).

        Notation used for tensor shapes:
            batch, seq_q, seq_k, d_model, kdim, vdim, n_heads, n_kv_heads, d_head.

        Args:
            query: [batch, seq_q, d_model].
            key: [batch, seq_k, kdim] or None (self-attention).
            value: [batch, seq_k, vdim] or None (= key).
            key_padding: bool [batch, seq_k], True for real tokens (with a KV cache, seq_k counts every
                cached position).
            attn_mask: bool (True = may attend) or float (additive) [seq_q, seq_k], [batch, seq_q, seq_k]
                or [batch, n_heads, seq_q, seq_k].
            is_causal: combine (AND) a causal mask aligned bottom-right with any other mask.
            need_weights: also return the per-head pattern [batch, n_heads, seq_q, seq_k] (never averaged;
                the softmax itself, before dropout: rows sum to 1, rows with nothing to attend to are 0).
            kv_cache: a :class:`KVCache` from :meth:`make_kv_cache`; the new keys and values are appended
                and the queries attend to every cached position (self-attention only).
            positions: rotary layers only: int [seq_q] or [batch, seq_q], the position of each query and
                of its key (None: ``kv_cache.length + arange(seq_q)``, or ``arange(seq_q)`` without a
                cache). Left-padded rows may count from their first real token; only differences of
                positions reach the scores.

        Returns:
            out [batch, seq_q, d_model], or (out, pattern) with ``need_weights=True``.
        """
        self_attention, k_in, v_in = self._checked_call(query, key, value, attn_mask, kv_cache, positions)
        B, Sq, _ = query.shape
        H, dh = self.n_heads, self.d_head
        seq_k = k_in.shape[1] + (kv_cache.held if kv_cache is not None else 0)
        mask = self._call_mask(query, seq_k, key_padding, attn_mask, is_causal, kv_cache)
        if B == 0 or Sq == 0:
            z = query.new_zeros(B, Sq, H * dh)  # (B, Sq, H dh)
            out = F.linear(z, self.o_weight, self.o_bias)  # (B, Sq, d_model)
            if need_weights:
                return out, query.new_zeros(B, H, Sq, seq_k)
            return out

        traced = self.hooks_active
        scratch = None
        if not need_weights and self._may_use_thread_workspace(query, self_attention, traced, kv_cache):
            scratch = thread_workspace()  # q, k, v below are views of it, dead before this call returns
        q, k, v = self._heads_qkv(query, k_in, v_in, self_attention, traced, scratch, positions, kv_cache)
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)  # (B, Hkv, Sk, dh) x 2
        dropout_p = self.dropout if self.training else 0.0
        gate = gate_of(self, query)  # (B, Sq, H, width) or None
        sunk = None if traced or need_weights else sink_attention(self, q, k, v, mask, dropout_p)
        if sunk is None and (traced or self.softcap is not None or self.sinks is not None):  # (caps, sinks)
            z, pattern, _ = self.traced_attention(
                q, k, v, mask, dropout_p, need_pattern=need_weights, gate=gate
            )
            out = self.output_from_heads(z)  # (B, Sq, d_model)
        else:
            backend = get_backend("explicit" if need_weights else "sdpa")
            z, pattern = sunk or backend(q, k, v, mask, scale=self.scale, dropout_p=dropout_p)  # (B,H,Sq,dh)
            # (bench helper) drop our references to the fused projection before W_O allocates the
            # output: without grad this frees [B, S, 3 d_model] early and lowers the peak memory.
            del q, k, v
            z = gated(z.transpose(1, 2), gate).reshape(B, Sq, H * dh)  # (B, Sq, H dh): heads concatenated
            out = F.linear(z, self.o_weight, self.o_bias)  # (B, Sq, d_model)
        if self.check_finite:
            _check_finite("attention output (inputs were finite: check the weights)", out)
        if need_weights:
            return out, pattern
        return out

    def _call_mask(
        self,
        query: Tensor,
        seq_k: int,
        key_padding: Tensor | None,
        attn_mask: Tensor | None,
        is_causal: bool,
        kv_cache: KVCache | None,
    ) -> CanonicalMask:
        """The call's canonical mask over ``seq_k`` keys (the cached ones included), with the layer's
        window; a KV cache is checked against the call first (a refused call leaves it as it was)."""
        B, Sq, _ = query.shape
        if kv_cache is not None:
            kv_cache.check(B, Sq, self.o_weight.dtype, self.o_weight.device)
            if kv_cache.held < kv_cache.length:
                # a windowed cache dropped its oldest keys: the masks, given over every position, lose
                # those columns (the window mask is bottom-right aligned, so it needs no offset)
                key_padding, attn_mask = _last_keys(key_padding, attn_mask, seq_k)
        mask = canonical_mask(
            batch=B, n_heads=self.n_heads, seq_q=Sq, seq_k=seq_k, key_padding=key_padding,
            attn_mask=attn_mask, is_causal=is_causal, dtype=query.dtype, device=query.device,
            window=self.window, window_sides=self._spec.window_sides, chunk=self._spec.chunk,
        )  # fmt: skip
        slopes = self._spec.alibi_slopes  # ALiBi: -m_h (i - j) joins the mask (headspace.nn.alibi)
        return mask if slopes is None else with_alibi(mask, slopes, Sq, seq_k, query.dtype, query.device)

    def _checked_call(
        self,
        query: Tensor,
        key: Tensor | None,
        value: Tensor | None,
        attn_mask: Tensor | None,
        kv_cache: KVCache | None,
        positions: Tensor | None,
    ) -> tuple[bool, Tensor, Tensor]:
        """:meth:`forward`'s argument checks (masks are checked by ``canonical_mask``).

        Returns (self-attention?, the key input, the value input).
        """
        self_attention = key is None and value is None
        if key is None and value is not None:
            raise ValueError("value was given without key; pass key too (value defaults to key)")
        if self_attention and not self.fused:
            raise ValueError(
                f"self-attention needs kdim == vdim == d_model; this layer has d_model={self.d_model}, "
                f"kdim={self.kdim}, vdim={self.vdim}: pass key and value"
            )
        k_in = query if key is None else key
        v_in = k_in if value is None else value
        self._check_inputs(query, k_in, v_in)
        if kv_cache is not None and not isinstance(kv_cache, KVCache):
            raise TypeError(
                f"kv_cache must be a KVCache (from make_kv_cache) or None; got {type(kv_cache).__name__}"
            )
        if kv_cache is not None and not self_attention:
            raise ValueError("kv_cache is for self-attention decoding; pass key=None and value=None with it")
        rotary = self._modules.get("rotary")  # (a dict lookup: the untraced path stays cheap)
        if rotary is None and positions is not None:
            raise ValueError(
                "positions were given but this layer has no rotary positions (rotary=None); positions are "
                "used only to rotate queries and keys (learned positions are added to the input instead)"
            )
        if rotary is not None and not self_attention:
            raise ValueError(
                "this layer has rotary positions, which are defined for self-attention only; pass key=None "
                "and value=None (or build the layer without rotary for cross-attention)"
            )
        if self.check_finite:
            _check_finite("query", query)
            if not self_attention:
                _check_finite("key", k_in)
                if v_in is not k_in:
                    _check_finite("value", v_in)
            if isinstance(attn_mask, Tensor) and attn_mask.is_floating_point():
                _check_finite("attn_mask", attn_mask, allow_neg_inf=True)
        if not self_attention and k_in.shape[1] == 0:
            # (self-attention on an empty sequence is the seq_q == 0 case of forward: an empty output)
            raise ValueError(f"key length seq_k must be at least 1; got key of shape {_shape(k_in)}")
        return self_attention, k_in, v_in

    def _may_use_thread_workspace(
        self, query: Tensor, self_attention: bool, traced: bool, kv_cache: KVCache | None
    ) -> bool:
        """Whether the fused QKV projection may go to the thread's workspace (see :mod:`headspace.workspace`).

        Only when nothing can keep a reference to it past this call: self-attention on the CPU, no
        autograd graph (it would save the projection for backward), no hook (a hook may keep q, k or
        v), no KV cache (it may keep the new keys and values); and only when large enough to gain.
        The caller also leaves it out with ``need_weights=True``: there the projection is freed before
        the output GEMM, which keeps that path's peak memory below torch MHA's (kept in the workspace,
        it would rise above it: docs/benchmarks.md).
        """
        if not (self_attention and self.fused) or traced or kv_cache is not None:
            return False
        if query.device.type != "cpu":
            return False
        if torch.is_grad_enabled() and (
            query.requires_grad
            or self.qkv_weight.requires_grad
            or (self.qkv_bias is not None and self.qkv_bias.requires_grad)
        ):
            return False
        n_out = self.qkv_weight.shape[0]
        return query.numel() // query.shape[-1] * n_out * query.element_size() >= THREAD_SCRATCH_MIN_BYTES

    def traced_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: CanonicalMask,
        dropout_p: float,
        *,
        need_pattern: bool = True,
        qk_sources: tuple[Any, Any] | None = None,
        gate: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The traced path: the reference backend with ``hook_scores``, ``hook_pattern`` and ``hook_z`` fired.

        Used while any hook point of the layer is active (here and in :mod:`headspace.compat`).
        q [B, H, Sq, dh], k, v [B, Hkv, Sk, dh] (after ``hook_q``/``hook_k``/``hook_v``) ->
        (z [B, Sq, H, dh] after ``hook_z``, pattern [B, H, Sq, Sk], weights after dropout).
        ``need_pattern=False``: the pattern may be left out (pattern and weights None) where nothing
        can replace it; how the trace records it then, and ``qk_sources``, are the trace's executor's
        (:func:`headspace.attention.recording.traced_attention`). ``gate`` [B, Sq, H, width] (a gated
        layer's :func:`~headspace.attention.gates.gate_of`): z is gated before ``hook_z``.
        """
        points = (self.hook_scores, self.hook_pattern, self.hook_z if gate is None else _UNWATCHED)
        z, pattern, weights = recording.traced_attention(
            q, k, v, mask, dropout_p, points, scale=self.scale, softcap=self.softcap,
            need_pattern=need_pattern, qk_sources=qk_sources, sinks=getattr(self, "sinks", None),
        )  # fmt: skip
        fire_sink(self, pattern)
        if gate is not None:
            z = self.hook_z(gated(z, gate))  # (B, Sq, H, dh): the input of W_O
        return z, pattern, weights

    def output_from_heads(self, z: Tensor) -> Tensor:
        """``out = sum_h z_h W_O[h] + b_O`` from z [B, Sq, H, dh], firing ``hook_result`` while it is active.

        ``hook_result`` sees each head's part ``z_h W_O[h]`` [B, Sq, H, d_model] (as the trace's executor
        fires it: :func:`headspace.attention.recording.output_from_heads`); without it the heads are
        concatenated and multiplied by ``W_O`` in one GEMM. Returns [B, Sq, d_model].
        """
        if not self.hook_result.active:
            return output_linear(z, self.o_weight, self.o_bias)  # (B, Sq, d_model)
        return recording.output_from_heads(z, self.W_O, self.o_bias, self.hook_result)[0]
