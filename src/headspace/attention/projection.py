"""The attention layer's projections and the stages of q and k, as a mixin of
:class:`~headspace.MultiHeadAttention`: the zero-copy per-head views of the fused storage (``W_Q``,
``W_K``, ``W_V``, ``W_O``, ``b_Q`` ...), the q/k/v projections (:meth:`HeadProjections.project_qkv`),
the new queries, keys and values of one call through their hook points (rotated on rotary layers),
and the QK-norm (:meth:`HeadProjections.normed_qk`, its gains and its frozen scales).

Notation used for tensor shapes:
    B batch, Sq / Sk sequence (query / key), H n_heads, Hkv n_kv_heads, dh d_head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels.workspace import Workspace
from ..nn.kv_cache import KVCache
from ..nn.norms import HeadLayerNorm, L2Norm, RMSNorm, rms_inverse
from ..nn.positions import rotary_tables, rotate_fused
from ..nn.rotate_inplace import rotate_fused_
from .checks import check_rotary_positions
from .temperature import temper_queries


class HeadProjections:
    """The projections of a :class:`~headspace.MultiHeadAttention` (a mixin of it: the layer owns the
    description's head counts and widths, ``fused``, ``qkv_weight`` or ``q_weight`` / ``k_weight`` /
    ``v_weight``, ``qkv_bias``, ``o_weight``, ``o_bias``, ``kdim`` / ``vdim``, ``rotary``, ``q_norm`` /
    ``k_norm`` and the stages' hook points)."""

    # ------------------------------------------------------------------ per-head views of the storage
    def _rows(self, which: str) -> Tensor:
        """The [out, in] weight rows of one projection ('q', 'k' or 'v'), a view of the storage."""
        hq, hkv = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        if not self.fused:
            return {"q": self.q_weight, "k": self.k_weight, "v": self.v_weight}[which]
        start = {"q": 0, "k": hq, "v": hq + hkv}[which]
        return self.qkv_weight[start : start + (hq if which == "q" else hkv)]

    def _bias_rows(self, which: str) -> Tensor | None:
        if self.qkv_bias is None:
            return None
        hq, hkv = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        start = {"q": 0, "k": hq, "v": hq + hkv}[which]
        return self.qkv_bias[start : start + (hq if which == "q" else hkv)]

    def _bias_heads(self, which: str) -> Tensor | None:
        """The bias of one projection ('q', 'k' or 'v') per head, a view, or None without bias."""
        b = self._bias_rows(which)
        heads = self.n_heads if which == "q" else self.n_kv_heads
        return None if b is None else b.view(heads, self.d_head)  # (n_heads | n_kv_heads, d_head)

    @property
    def W_Q(self) -> Tensor:
        """[n_heads, d_model, d_head] view: ``q_h = x @ W_Q[h]``."""
        return self._rows("q").view(self.n_heads, self.d_head, self.d_model).transpose(1, 2)

    @property
    def W_K(self) -> Tensor:
        """[n_kv_heads, kdim, d_head] view: ``k_g = c @ W_K[g]``."""
        return self._rows("k").view(self.n_kv_heads, self.d_head, self.kdim).transpose(1, 2)

    @property
    def W_V(self) -> Tensor:
        """[n_kv_heads, vdim, d_head] view: ``v_g = c @ W_V[g]``."""
        return self._rows("v").view(self.n_kv_heads, self.d_head, self.vdim).transpose(1, 2)

    @property
    def W_O(self) -> Tensor:
        """[n_heads, d_head, d_model] view: ``out = sum_h z_h @ W_O[h] + b_O``."""
        return self.o_weight.view(self.d_model, self.n_heads, self.d_head).permute(1, 2, 0)

    @property
    def b_Q(self) -> Tensor | None:
        """[n_heads, d_head] view, or None without bias."""
        return self._bias_heads("q")

    @property
    def b_K(self) -> Tensor | None:
        """[n_kv_heads, d_head] view, or None without bias."""
        return self._bias_heads("k")

    @property
    def b_V(self) -> Tensor | None:
        """[n_kv_heads, d_head] view, or None without bias."""
        return self._bias_heads("v")

    @property
    def b_O(self) -> Tensor | None:
        """[d_model] (shared by all heads), or None without bias."""
        return self.o_bias

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.n_heads // self.n_kv_heads

    # ------------------------------------------------------------------ projections and stages
    def project_qkv(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        workspace: Workspace | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The per-head projections.

        ``workspace``: self-attention only: write the fused projection into its ``"qkv"`` matrix
        instead of fresh memory; q, k, v are then views of the workspace, valid until its next use.

        Returns q [batch, n_heads, seq_q, d_head] and k, v [batch, n_kv_heads, seq_k, d_head].
        """
        B, Sq, _ = query.shape
        H, Hkv, dh = self.n_heads, self.n_kv_heads, self.d_head
        if key is None and self.fused:
            qkv = self._fused_projection(query, workspace)  # (B, H + 2 Hkv, Sq, dh)
            q, k, v = qkv.split([H, Hkv, Hkv], dim=1)  # (B, H, Sq, dh), (B, Hkv, Sq, dh) x 2
            return q, k, v
        key = query if key is None else key
        value = key if value is None else value
        q = F.linear(query, self._rows("q"), self._bias_rows("q"))  # (B, Sq, H dh)
        q = q.view(B, Sq, H, dh).transpose(1, 2)  # (B, H, Sq, dh)
        Sk = key.shape[1]
        if self.fused and key is value:
            hq = H * dh
            b = None if self.qkv_bias is None else self.qkv_bias[hq:]
            kv = F.linear(key, self.qkv_weight[hq:], b)  # (B, Sk, 2 Hkv dh)
            kv = kv.view(B, Sk, 2 * Hkv, dh).transpose(1, 2)  # (B, 2 Hkv, Sk, dh)
            k, v = kv.split([Hkv, Hkv], dim=1)  # (B, Hkv, Sk, dh) x 2
            return q, k, v
        k = F.linear(key, self._rows("k"), self._bias_rows("k"))  # (B, Sk, Hkv dh)
        k = k.view(B, Sk, Hkv, dh).transpose(1, 2)  # (B, Hkv, Sk, dh)
        v = F.linear(value, self._rows("v"), self._bias_rows("v"))  # (B, Sk, Hkv dh)
        v = v.view(B, Sk, Hkv, dh).transpose(1, 2)  # (B, Hkv, Sk, dh)
        return q, k, v

    def _fused_projection(self, query: Tensor, workspace: Workspace | None) -> Tensor:
        """Self-attention's one QKV GEMM: query [B, Sq, d_model] -> [B, H + 2 Hkv, Sq, dh] (a view)."""
        B, Sq, _ = query.shape
        H, Hkv, dh = self.n_heads, self.n_kv_heads, self.d_head
        if workspace is None:
            qkv = F.linear(query, self.qkv_weight, self.qkv_bias)  # (B, Sq, (H + 2 Hkv) dh)
        else:
            x2 = query.reshape(B * Sq, query.shape[-1])  # (B Sq, d_model)
            qkv = workspace.linear("qkv", x2, self.qkv_weight, self.qkv_bias)  # (B Sq, (H + 2 Hkv) dh)
        return qkv.view(B, Sq, H + 2 * Hkv, dh).transpose(1, 2)  # (B, H + 2 Hkv, Sq, dh)

    def _heads_qkv(
        self,
        query: Tensor,
        k_in: Tensor,
        v_in: Tensor,
        self_attention: bool,
        traced: bool,
        scratch: Workspace | None,
        positions: Tensor | None,
        kv_cache: KVCache | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The new queries, keys and values per head, rotated on rotary layers, through their hook points.

        Returns q [B, H, Sq, dh] and k, v [B, Hkv, Sk_new, dh] (views of ``scratch`` when given). Untraced
        rotary layers rotate q and k
        together on the fused projection; traced ones fire ``hook_q``, ``hook_k``, ``hook_v``, then
        rotate and fire ``hook_rot_q``, ``hook_rot_k``.
        """
        rotary = self._modules.get("rotary")
        B, Sq, _ = query.shape
        H = self.n_heads
        if rotary is not None:
            if positions is None:
                start = 0 if kv_cache is None else kv_cache.length
                positions = torch.arange(start, start + Sq, device=query.device)  # (Sq,)
            else:
                check_rotary_positions(positions, B, Sq, query.device)
            cos, sin = rotary_tables(rotary, positions, query.dtype, query.device)  # (B|1, 1, Sq, rd) x 2
        qk_norm = self.qk_norm is not None
        if rotary is not None and not traced and not qk_norm:
            # q and k rotated together: they are neighbouring heads of the fused projection
            Hkv = self.n_kv_heads
            qkv = self._fused_projection(query, scratch)  # (B, H + 2 Hkv, Sq, dh)
            if not qkv.requires_grad:  # no graph: rotated in the projection itself, heads stay views
                rotate_fused_(qkv[:, : H + Hkv], cos, sin, rotary)
                q, k, v = qkv.split([H, Hkv, Hkv], dim=1)  # (B, H, Sq, dh), (B, Hkv, Sq, dh) x 2: views
                return self._tempered(q, kv_cache), k, v
            qk = rotate_fused(qkv[:, : H + Hkv], cos, sin, rotary)  # (B, H + Hkv, Sq, dh), fresh
            q, k = qk.split([H, Hkv], dim=1)  # (B, H, Sq, dh), (B, Hkv, Sq, dh)
            return self._tempered(q, kv_cache), k, qkv[:, H + Hkv :]  # v: (B, Hkv, Sq, dh)
        q, k, v = self.project_qkv(
            query,
            None if self_attention else k_in,
            None if self_attention else v_in,
            workspace=scratch,
        )
        if traced:
            q = self.hook_q(q.transpose(1, 2)).transpose(1, 2)  # (B, H, Sq, dh)
            k = self.hook_k(k.transpose(1, 2)).transpose(1, 2)  # (B, Hkv, Sk_new, dh)
            v = self.hook_v(v.transpose(1, 2)).transpose(1, 2)  # (B, Hkv, Sk_new, dh)
        if qk_norm:
            q, k = self.normed_qk(q, k)  # (B, H, Sq, dh), (B, Hkv, Sk_new, dh)
        if rotary is not None and qk_norm and not traced and self._fresh_qk_norms(q, k):
            # the norm's fresh outputs, seen by no hook and no graph: rotated in place (the same values)
            return (
                self._tempered(rotate_fused_(q, cos, sin, rotary), kv_cache),
                rotate_fused_(k, cos, sin, rotary),
                v,
            )
        if rotary is not None and (traced or qk_norm):
            q = rotate_fused(q, cos, sin, rotary)  # (B, H, Sq, dh)
            k = rotate_fused(k, cos, sin, rotary)  # (B, Hkv, Sk_new, dh)
            if traced:
                if self.hook_rot_q is not None:  # (None if rotary was attached after construction)
                    q = self.hook_rot_q(q.transpose(1, 2)).transpose(1, 2)  # (B, H, Sq, dh)
                    k = self.hook_rot_k(k.transpose(1, 2)).transpose(1, 2)  # (B, Hkv, Sk_new, dh)
        return self._tempered(q, kv_cache), k, v

    def _fresh_qk_norms(self, q: Tensor, k: Tensor) -> bool:
        """Whether q and k, just out of the layer's own QK-norms, are fresh tensors that no autograd graph
        records: the untraced path may then rotate them in place."""
        own = (RMSNorm, L2Norm, HeadLayerNorm)
        return (
            type(self.q_norm) in own and type(self.k_norm) in own and not (q.requires_grad or k.requires_grad)
        )

    def _tempered(self, q: Tensor, kv_cache: KVCache | None) -> Tensor:
        """q [B, H, Sq, dh] times the description's per-position temperature (as it is without one)."""
        temperature = self._spec.temperature
        if temperature is None:
            return q
        return temper_queries(q, 0 if kv_cache is None else kv_cache.length, temperature)  # (B, H, Sq, dh)

    def normed_qk(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """QK-norm: q [B, H, Sq, dh] and k [B, Hkv, Sk, dh] through ``q_norm`` / ``k_norm``, firing
        ``hook_q_normed`` / ``hook_k_normed`` ([B, S, heads, dh]) while they are active.

        ``qk_norm="head"`` (Qwen3, Gemma 3): ``q_h <- RMSNorm(q_h)`` over each head's d_head features,
        one weight [d_head] shared by every head; ``"all"`` (OLMo 2): one RMSNorm over the
        concatenated heads' n_heads * d_head (n_kv_heads * d_head for k) features.
        """
        B, H, Sq, dh = q.shape
        Hkv, Sk = k.shape[1], k.shape[2]
        if self.qk_norm in ("head", "head_layernorm", "l2"):
            q, k = self.q_norm(q), self.k_norm(k)  # (B, H, Sq, dh), (B, Hkv, Sk, dh)
        else:
            q = self.q_norm(q.transpose(1, 2).reshape(B, Sq, H * dh))  # (B, Sq, H dh)
            q = q.view(B, Sq, H, dh).transpose(1, 2)  # (B, H, Sq, dh)
            k = self.k_norm(k.transpose(1, 2).reshape(B, Sk, Hkv * dh))  # (B, Sk, Hkv dh)
            k = k.view(B, Sk, Hkv, dh).transpose(1, 2)  # (B, Hkv, Sk, dh)
        if self.hook_q_normed.fns or self.hook_k_normed.fns:
            q = self.hook_q_normed(q.transpose(1, 2)).transpose(1, 2)  # (B, H, Sq, dh)
            k = self.hook_k_normed(k.transpose(1, 2)).transpose(1, 2)  # (B, Hkv, Sk, dh)
        return q, k

    def qk_norm_gains(self) -> tuple[Tensor, Tensor] | None:
        """QK-norm's per-feature gains ``offset + weight`` of ``q_norm`` / ``k_norm`` per head: (``g_q``
        [n_heads, d_head], ``g_k`` [n_kv_heads, d_head]); None without QK-norm. ``"head"``: the one
        [d_head] weight repeated for every head; ``"all"``: each head's slice of the [heads d_head] weight.
        :meth:`headspace.Head.qk` folds them into the QK circuit."""
        if self.qk_norm is None:
            return None
        if self.qk_norm == "head_layernorm":  # centring per head and token: no fixed gain makes it
            raise ValueError(
                "qk_norm_gains: the attention field 'qk_norm' ('head_layernorm', a LayerNorm per head) "
                "centres q and k per token: no fixed circuit gives the scores"
            )
        H, Hkv, dh = self.n_heads, self.n_kv_heads, self.d_head
        if self.qk_norm == "l2":  # weightless: the gains are 1
            ones = torch.ones(dh, dtype=self.o_weight.dtype, device=self.o_weight.device)  # (dh,)
            return ones.expand(H, dh), ones.expand(Hkv, dh)  # (H, dh), (Hkv, dh)
        g_q = self.q_norm.weight + self.q_norm.offset  # (dh,) or (H dh,)
        g_k = self.k_norm.weight + self.k_norm.offset  # (dh,) or (Hkv dh,)
        if self.qk_norm in ("head", "l2"):
            return g_q.expand(H, dh), g_k.expand(Hkv, dh)  # (H, dh), (Hkv, dh)
        return g_q.view(H, dh), g_k.view(Hkv, dh)  # (H, dh), (Hkv, dh)

    def qk_norm_scales(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """QK-norm's scales ``1 / sqrt(mean(q^2) + eps)`` of one run, per token and head, from
        ``hook_q`` q [batch, seq_q, n_heads, d_head] and ``hook_k`` k [batch, seq_k, n_kv_heads, d_head]
        (before the norm): (``s_q`` [batch, seq_q, n_heads], ``s_k`` [batch, seq_k, n_kv_heads]); the
        mean is over each head's d_head (``"head"``) or over all heads' features (``"all"``, the same
        scale for every head of a token). Frozen at these values the norm is linear, ``hook_q_normed =
        hook_q * s_q[..., None] * g_q`` (:meth:`qk_norm_gains`), and so are the scores in the inputs (see
        :meth:`headspace.Head.qk`)."""
        if self.qk_norm is None:
            raise ValueError("qk_norm_scales: this layer has no QK-norm (qk_norm=None)")
        if self.qk_norm == "head_layernorm":
            raise ValueError(
                "qk_norm_scales: the attention field 'qk_norm' ('head_layernorm') centres q and k per "
                "token: no per-token scale makes it linear"
            )
        over = (-1,) if self.qk_norm in ("head", "l2") else (-2, -1)
        s_q = rms_inverse(q.float(), self.q_norm.eps, over)  # (B, Sq, H|1, 1)
        s_k = rms_inverse(k.float(), self.k_norm.eps, over)  # (B, Sk, Hkv|1, 1)
        s_q = s_q.expand(*q.shape[:-1], 1)[..., 0]  # (B, Sq, H)
        s_k = s_k.expand(*k.shape[:-1], 1)[..., 0]  # (B, Sk, Hkv)
        return s_q, s_k
