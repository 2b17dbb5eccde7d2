"""The attention of Gemma 3n / Gemma 4 beyond Gemma 3's: a value norm, values from the key projection,
keys and values shared between layers, and Gemma 4's proportional rotation.

Per head ``h`` of a :class:`GemmaAttention` (``g = g(h)`` its key/value head; ``N_q``, ``N_k`` the
QK-norms over d_head, whose weights scale directly (Gemma 4: ``qk_norm_offset`` 0)):

    q_h = R(i) N_q(x W_Q[h])          k_g = R(j) N_k(x W_K[g])          scale 1 (``AttentionSpec.scale``)
    v_g = x W_V[g] / sqrt(mean((x W_V[g])^2) + eps)                      (``v_norm``: no weight)
    k_eq_v: v_g = (x W_K[g]) / sqrt(mean((x W_K[g])^2) + eps), i.e. ``W_V`` IS ``W_K`` (same storage)

``kv_source = s``: the layer has only ``W_Q`` and ``W_O``; its queries attend to the keys and values
layer ``s`` computed in the same forward (from layer ``s``'s own input), so ``W_K``, ``W_V``,
``k_norm`` and ``b_K`` / ``b_V`` are layer ``s``'s own tensors (the owner is held by reference, not as a
submodule: it adds no parameters). The owner leaves its keys and values (after its KV cache, so every
cached position) in the model's shared store (:attr:`GemmaAttention.kv_store`, a :class:`SharedKV`
that the model opens at the start of its forward and empties and closes at its end). A sharing layer
run anywhere else (alone, or by an analysis that runs blocks one by one) raises, naming the field and
the owner it waits for: never stale keys of another run.

Storage: ``qkv_weight`` holds the rows the layer owns: ``[W_Q; W_K; W_V]`` ((H + 2 Hkv) d_head rows),
``[W_Q; W_K]`` with ``k_eq_v`` ((H + Hkv) d_head) and ``W_Q`` alone with ``kv_source`` (H d_head).
The decoding steps refuse ``v_norm``, ``k_eq_v`` and ``kv_source`` by name; decoding runs the forward
with its KV cache (:attr:`headspace.TransformerBlock.decode_supported` is False), whose one-token steps
run without module calls while no hook is active (:mod:`headspace.model.gemma4_step`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention.functional import get_backend
from ..attention.layer import MultiHeadAttention, _last_keys
from ..core.checks import check_positive_int
from ..nn.hooks import HookPoint
from ..nn.kv_cache import KVCache
from ..nn.masks import canonical_mask
from ..nn.norms import RMSNorm, rms_inverse
from ..nn.positions import Rotary
from ..nn.spec import AttentionSpec, refuse_unsupported
from .gemma_rotate import rotate_heads_


class SharedKV(dict):
    """{owner layer index: (k, v) [batch, n_kv_heads, seq_k, d_head] x 2} of the forward that runs now;
    ``active`` while the model's forward runs (outside it owners store nothing and sharers refuse)."""

    active: bool = False

    def open(self) -> None:
        """Start a forward: empty, active."""
        self.clear()
        self.active = True

    def close(self) -> None:
        """End a forward: empty, inactive (no keys outlive their run)."""
        self.clear()
        self.active = False


#: The attention features :class:`GemmaAttention`'s forward computes.
GEMMA_FORWARD_FEATURES = ("window", "softcap", "qk_norm", "v_norm", "k_eq_v", "kv_source")


def proportional_rotary(d_head: int, base: float, partial: float, factor: float = 1.0) -> Rotary:
    """transformers' ``"proportional"`` RoPE (Gemma 4's global layers) as a :class:`Rotary`: rotate-half
    over the whole ``d_head`` (planes ``(i, i + d_head / 2)``), plane ``i`` turning at ``base^(-2i /
    d_head) / factor`` for ``i < int(partial * d_head) // 2`` and not at all beyond (frequency 0: those
    features pass unchanged), exactly the frequencies transformers computes."""
    rotary = Rotary(d_head, base=base)
    angles = int(partial * d_head // 2)
    cpu = torch.device("cpu")  # (the master copy stays on the CPU, as Rotary keeps it)
    inv_freq = torch.zeros(d_head // 2, device=cpu)
    steps = torch.arange(0, 2 * angles, 2, dtype=torch.int64, device=cpu).float()
    inv_freq[:angles] = 1.0 / (base ** (steps / d_head))
    inv_freq = inv_freq / factor
    rotary.rope_type = "proportional"
    rotary._original_inv_freq = inv_freq
    rotary._inv_freq_cpu = inv_freq
    rotary._build_tables(rotary.inv_freq.device)
    return rotary


class SharerCache(KVCache):
    """The KV cache of a layer that reads another layer's keys and values (``kv_source``): it holds no
    positions (``k`` and ``v`` are [batch, n_kv_heads, 0, d_head]); :meth:`append` raises, naming the
    owner whose cache holds them. ``capacity`` is the model's (what the owner's cache accepts)."""

    def __init__(
        self, batch: int, n_kv_heads: int, d_head: int, capacity: int, source: int, like: Tensor
    ) -> None:
        super().__init__(1, 1, 1, 1, dtype=like.dtype, device=like.device)  # (checks, then emptied)
        check_positive_int("KVCache capacity", capacity)
        self._capacity, self.source = capacity, source
        self.k = like.new_zeros(batch, n_kv_heads, 0, d_head)  # (batch, n_kv_heads, 0, d_head): nothing
        self.v = torch.zeros_like(self.k)

    @property
    def capacity(self) -> int:
        return self._capacity

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        raise ValueError(
            f"this cache belongs to a layer that reads layer {self.source}'s keys and values (the attention "
            f"field 'kv_source'); layer {self.source}'s cache holds them"
        )

    append_one = append


class GemmaAttention(MultiHeadAttention):
    """:class:`~headspace.MultiHeadAttention` with Gemma 3n / 4's value norm, ``k_eq_v`` and shared
    keys and values (module docstring). Built from its :class:`~headspace.nn.spec.AttentionSpec`
    (:meth:`from_spec`); a sharing layer is bound to its owner by :meth:`share_from`."""

    prunable = False  # (the rows it owns depend on k_eq_v / kv_source)

    @classmethod
    def from_spec(cls, a: AttentionSpec) -> GemmaAttention:
        """The layer ``a`` describes (self-attention; fresh Xavier-uniform weights)."""
        plain = dataclasses.replace(a, v_norm=False, k_eq_v=False, kv_source=None)
        layer = cls(
            a.d_model, a.n_heads, d_head=a.d_head, n_kv_heads=a.n_kv_heads, dropout=a.dropout,
            qkv_bias=a.qkv_bias, out_bias=a.out_bias, rotary=a.positions, window=a.window,
            qk_norm=a.qk_norm, qk_norm_eps=a.qk_norm_eps, qk_norm_offset=a.qk_norm_offset,
            softcap=a.softcap, scale=a.scale, sink=a.sink,
        )  # fmt: skip
        refuse_unsupported(a, "the Gemma attention forward", GEMMA_FORWARD_FEATURES)
        hq, hkv = a.n_heads * a.d_head, a.n_kv_heads * a.d_head
        rows = hq if a.kv_source is not None else hq + hkv if a.k_eq_v else hq + 2 * hkv
        w = layer.qkv_weight
        with torch.no_grad():
            layer.qkv_weight = nn.Parameter(w[:rows].clone())
            if layer.qkv_bias is not None:
                layer.qkv_bias = nn.Parameter(layer.qkv_bias[:rows].clone())
        if a.kv_source is not None:
            layer.k_norm = None  # the owner's k_norm normalises the keys
        layer._spec = dataclasses.replace(plain, v_norm=a.v_norm, k_eq_v=a.k_eq_v, kv_source=a.kv_source)
        layer.register_module("hook_v_normed", HookPoint() if a.v_norm else None)  # [b, sk, Hkv, dh]
        if a.v_norm:
            layer._hook_points += (layer.hook_v_normed,)
        #: the model's store of each owner layer's keys and values in the current forward
        layer.kv_store = SharedKV()  # the model's, shared by its layers (set by the model)
        #: this layer's index in its model (set by the model; where it leaves its keys and values)
        layer.layer_index = None
        object.__setattr__(layer, "_kv_owner", None)
        return layer

    # ------------------------------------------------------------------ description and views
    @property
    def spec(self) -> AttentionSpec:
        """The layer's description (see :class:`~headspace.MultiHeadAttention`)."""
        return MultiHeadAttention.spec.fget(self)  # type: ignore[attr-defined]

    @spec.setter
    def spec(self, spec: AttentionSpec) -> None:
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"attention spec must be a headspace.nn.spec.AttentionSpec; got {type(spec)}")
        refuse_unsupported(spec, "the Gemma attention forward", GEMMA_FORWARD_FEATURES)
        for name in ("v_norm", "k_eq_v", "kv_source", "d_model", "n_heads", "d_head", "n_kv_heads"):
            if getattr(spec, name) != getattr(self._spec, name):
                raise ValueError(
                    f"attention spec: {name} must be {getattr(self._spec, name)!r}, fixed by the layer's "
                    f"weights; got {getattr(spec, name)!r} (build a new layer to change it)"
                )
        for name in ("q_norm", "k_norm"):
            norm = self._modules.get(name)
            if norm is not None:
                norm.eps, norm.offset = float(spec.qk_norm_eps), float(spec.qk_norm_offset)
        if spec.positions is not None:
            self._modules["rotary"] = spec.positions
        self._spec = spec

    def share_from(self, owner: GemmaAttention) -> None:
        """Bind this ``kv_source`` layer to the layer that owns its keys and values (``owner``, whose
        ``layer_index`` is this layer's ``kv_source``; same key/value heads and width)."""
        if self._spec.kv_source is None or owner.layer_index != self._spec.kv_source:
            raise ValueError(
                f"share_from: this layer's kv_source is {self._spec.kv_source!r}; got the layer "
                f"{owner.layer_index!r}"
            )
        if (owner.n_kv_heads, owner.d_head) != (self.n_kv_heads, self.d_head):
            raise ValueError(
                f"share_from: the owner's keys are {owner.n_kv_heads} heads of {owner.d_head}; this layer "
                f"reads {self.n_kv_heads} of {self.d_head}"
            )
        object.__setattr__(self, "_kv_owner", owner)

    def make_kv_cache(self, batch: int, capacity: int) -> KVCache:
        """:meth:`~headspace.MultiHeadAttention.make_kv_cache`; a sharing layer's (``kv_source``) holds
        nothing: its keys and values are its owner's cache's, so its buffers are [batch, n_kv_heads, 0,
        d_head] (:class:`SharerCache`)."""
        if self._spec.kv_source is None:
            return super().make_kv_cache(batch, capacity)
        w = self.o_weight
        return SharerCache(batch, self.n_kv_heads, self.d_head, capacity, self._spec.kv_source, w)

    @property
    def kv_owner(self) -> GemmaAttention | None:
        """The layer whose keys and values this one attends to (None: its own)."""
        return self._kv_owner

    def _rows(self, which: str) -> Tensor:
        """The [out, in] rows of 'q', 'k' or 'v': the owner's for k and v of a sharing layer, the key
        rows for v with ``k_eq_v`` (views of the one storage)."""
        owner = self._kv_owner
        if which != "q" and owner is not None:
            return owner._rows(which)
        if which != "q" and self._spec.kv_source is not None:
            raise RuntimeError(f"layer {self.layer_index}: kv_source={self._spec.kv_source} is not bound")
        hq, hkv = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        if which == "v" and self._spec.k_eq_v:
            which = "k"
        start = {"q": 0, "k": hq, "v": hq + hkv}[which]
        return self.qkv_weight[start : start + (hq if which == "q" else hkv)]

    def _bias_rows(self, which: str) -> Tensor | None:
        owner = self._kv_owner
        if which != "q" and owner is not None:
            return owner._bias_rows(which)
        if self.qkv_bias is None:
            return None
        hq, hkv = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        if which == "v" and self._spec.k_eq_v:
            which = "k"
        start = {"q": 0, "k": hq, "v": hq + hkv}[which]
        return self.qkv_bias[start : start + (hq if which == "q" else hkv)]

    def qk_norm_gains(self) -> tuple[Tensor, Tensor] | None:
        """As :meth:`~headspace.MultiHeadAttention.qk_norm_gains`; a sharing layer's key gain is its
        owner's (the owner's ``k_norm`` normalises the keys it reads)."""
        owner = self._kv_owner
        if owner is None or self.q_norm is None:
            return super().qk_norm_gains()
        g_q = (self.q_norm.weight + self.q_norm.offset).expand(self.n_heads, self.d_head)  # (H, dh)
        gains = owner.qk_norm_gains()
        assert gains is not None
        return g_q, gains[1]

    def qk_norm_scales(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """As :meth:`~headspace.MultiHeadAttention.qk_norm_scales`; a sharing layer's key scales are
        its owner's norm's (``k`` its owner's ``hook_k``)."""
        owner = self._kv_owner
        if owner is None or self.q_norm is None or self.qk_norm != "head":
            return super().qk_norm_scales(q, k)
        s_q = rms_inverse(q.float(), self.q_norm.eps, (-1,))[..., 0]  # (B, Sq, H)
        return s_q, owner.qk_norm_scales(k, k)[1]

    # ------------------------------------------------------------------ forward
    def project_qkv(
        self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None, *, workspace: Any = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, H, Sq, dh] and this layer's own k, v [B, Hkv, Sq, dh] (self-attention only; v is the key
        projection with ``k_eq_v``; a sharing layer's k and v are its owner's: call its forward)."""
        del workspace
        if key is not None or value is not None:
            raise ValueError("GemmaAttention is self-attention only: pass key=None and value=None")
        B, Sq, _ = query.shape
        H, Hkv, dh = self.n_heads, self.n_kv_heads, self.d_head
        out = F.linear(query, self.qkv_weight, self.qkv_bias)  # (B, Sq, rows)
        q = out[..., : H * dh].reshape(B, Sq, H, dh).transpose(1, 2)  # (B, H, Sq, dh)
        if self._spec.kv_source is not None:
            raise ValueError(f"layer {self.layer_index} has no keys of its own (kv_source)")
        k = out[..., H * dh : (H + Hkv) * dh].reshape(B, Sq, Hkv, dh).transpose(1, 2)  # (B, Hkv, Sq, dh)
        if self._spec.k_eq_v:
            return q, k, k
        v = out[..., (H + Hkv) * dh :].reshape(B, Sq, Hkv, dh).transpose(1, 2)  # (B, Hkv, Sq, dh)
        return q, k, v

    def _new_qkv(
        self, query: Tensor, positions: Tensor | None, kv_cache: KVCache | None
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The new q [B, H, Sq, dh] (normed, rotated) and, for an owner, k and v [B, Hkv, Sq, dh]
        through their hook points (k normed and rotated, v normed)."""
        from ..attention.checks import check_rotary_positions
        from ..nn.positions import rotary_tables, rotate_fused

        B, Sq, _ = query.shape
        H, Hkv, dh = self.n_heads, self.n_kv_heads, self.d_head
        shared = self._spec.kv_source is not None
        rows = self.qkv_weight
        out = F.linear(query, rows, self.qkv_bias)  # (B, Sq, rows)
        q = out[..., : H * dh].reshape(B, Sq, H, dh)  # (B, Sq, H, dh)
        q = self.hook_q(q) if self.hook_q.fns else q
        k = v = None
        if not shared:
            k = out[..., H * dh : (H + Hkv) * dh].reshape(B, Sq, Hkv, dh)  # (B, Sq, Hkv, dh)
            v = k if self._spec.k_eq_v else out[..., (H + Hkv) * dh :].reshape(B, Sq, Hkv, dh)
            k = self.hook_k(k) if self.hook_k.fns else k
            v = self.hook_v(v) if self.hook_v.fns else v
        if self.q_norm is not None:
            q = self.q_norm(q)  # (B, Sq, H, dh)
            q = self.hook_q_normed(q) if self.hook_q_normed.fns else q
            if k is not None:
                k = self.k_norm(k)  # (B, Sq, Hkv, dh)
                k = self.hook_k_normed(k) if self.hook_k_normed.fns else k
        if v is not None and self._spec.v_norm:
            vf = v.float()
            v = (vf * torch.pow(vf.pow(2).mean(-1, keepdim=True) + self._spec.qk_norm_eps, -0.5)).to(v.dtype)
            v = self.hook_v_normed(v) if self.hook_v_normed.fns else v  # (B, Sq, Hkv, dh)
        rotary = self._modules.get("rotary")
        if rotary is not None:
            if positions is None:
                start = 0 if kv_cache is None else kv_cache.length
                positions = torch.arange(start, start + Sq, device=query.device)  # (Sq,)
            else:
                check_rotary_positions(positions, B, Sq, query.device)
            cos, sin = rotary_tables(rotary, positions, query.dtype, query.device)  # (B|1, 1, Sq, dh)
            if self._rotates_in_place(q, k):  # rotated in place in the [B, Sq, heads, dh] layout
                q, k, rotary = rotate_heads_(q, k, cos, sin, rotary)
        q = q.transpose(1, 2)  # (B, H, Sq, dh)
        k = None if k is None else k.transpose(1, 2)  # (B, Hkv, Sq, dh)
        v = None if v is None else v.transpose(1, 2)  # (B, Hkv, Sq, dh)
        if rotary is not None:
            q = rotate_fused(q, cos, sin, rotary)  # (B, H, Sq, dh)
            if self.hook_rot_q is not None and self.hook_rot_q.fns:
                q = self.hook_rot_q(q.transpose(1, 2)).transpose(1, 2)  # (B, H, Sq, dh)
            if k is not None:
                k = rotate_fused(k, cos, sin, rotary)  # (B, Hkv, Sq, dh)
                if self.hook_rot_k is not None and self.hook_rot_k.fns:
                    k = self.hook_rot_k(k.transpose(1, 2)).transpose(1, 2)  # (B, Hkv, Sq, dh)
        return q, k, v

    def _rotates_in_place(self, q: Tensor, k: Tensor | None) -> bool:
        """Whether q [B, Sq, H, dh] and k (None for a sharing layer) are the QK-norms' fresh outputs that
        no hook point and no autograd graph sees: the rotation may then overwrite them."""
        fresh = [(self.q_norm, q)] + ([] if k is None else [(self.k_norm, k)])
        return not self.hooks_active and all(type(n) is RMSNorm and not x.requires_grad for n, x in fresh)

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
        """:meth:`~headspace.MultiHeadAttention.forward`, self-attention only, with the value norm,
        ``k_eq_v`` and shared keys and values (module docstring); a sharing layer leaves ``kv_cache``
        untouched (its keys are its owner's, every cached position included)."""
        if key is not None or value is not None:
            raise ValueError("GemmaAttention is self-attention only: pass key=None and value=None")
        self._checked_call(query, None, None, attn_mask, kv_cache, positions)
        B, Sq, _ = query.shape
        H, dh = self.n_heads, self.d_head
        source = self._spec.kv_source
        q, k, v = self._new_qkv(query, positions, None if source is not None else kv_cache)
        if source is None:
            if kv_cache is not None:
                kv_cache.check(B, Sq, self.o_weight.dtype, self.o_weight.device)
                k, v = kv_cache.append(k, v)  # (B, Hkv, Sk, dh) x 2
            if self.layer_index is not None and self.kv_store.active:
                self.kv_store[self.layer_index] = (k, v)
        else:
            if not self.kv_store.active or source not in self.kv_store:
                raise RuntimeError(
                    f"the attention field 'kv_source': layer {self.layer_index} reads the keys and values "
                    f"of layer {source}, which only the whole model's forward gives it (this call runs "
                    "the layer without its owner)"
                )
            k, v = self.kv_store[source]
        seq_k = k.shape[2]
        key_padding, attn_mask = _last_keys(key_padding, attn_mask, seq_k)
        mask = canonical_mask(
            batch=B, n_heads=H, seq_q=Sq, seq_k=seq_k, key_padding=key_padding, attn_mask=attn_mask,
            is_causal=is_causal, dtype=query.dtype, device=query.device, window=self.window,
        )  # fmt: skip
        dropout_p = self.dropout if self.training else 0.0
        if self.hooks_active or self.softcap is not None or need_weights:
            z, pattern, _ = self.traced_attention(q, k, v, mask, dropout_p, need_pattern=need_weights)
            out = self.output_from_heads(z)  # (B, Sq, d_model)
        else:
            z, pattern = get_backend("sdpa")(q, k, v, mask, scale=self.scale, dropout_p=dropout_p)
            z = z.transpose(1, 2).reshape(B, Sq, H * dh)  # (B, Sq, H dh): heads concatenated
            out = F.linear(z, self.o_weight, self.o_bias)  # (B, Sq, d_model)
        return (out, pattern) if need_weights else out
