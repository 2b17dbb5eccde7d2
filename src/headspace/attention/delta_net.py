"""Gated DeltaNet: the linear-attention layer of Qwen3-Next and Qwen3.5, in plain torch.

For an input x [batch, seq, d_model] (right-multiplication convention)::

    [q, k, v] = silu(causal_conv([x W_Q, x W_K, x W_V]))      depthwise, conv_kernel taps per channel
    beta_t = sigmoid(x_t W_b)                                [n_v_heads]: write strength
    g_t = -exp(A_log) * softplus(x_t W_a + dt_bias)          [n_v_heads]: log decay (<= 0)
    S_t = exp(g_t) S_{t-1} + k_t^T (beta_t (v_t - k_t exp(g_t) S_{t-1}))     per value head, [d_k, d_v]
    o_t = (q_t / sqrt(d_k)) S_t                              q_t, k_t L2-normalised
    z_h = RMSNorm(o_h) * w_norm * silu(x W_Z[h])             the gated norm, over d_v
    out = sum_h z_h W_O[h]

(:mod:`headspace.attention.delta_rule` runs the rule as transformers' torch fallback does: chunked for
a prompt, a position at a time for a cached step.) There is no softmax and no pattern: analyses that
need one refuse these layers by name (:func:`refuse_linear_attention`). Each query/key head serves
``n_v_heads / n_k_heads`` consecutive value heads.

Per-head views (of the fused storage; writing into them changes the layer): ``W_Q``, ``W_K`` [n_k_heads,
d_model, d_k], ``W_V`` [n_v_heads, d_model, d_v] (before the convolution, which mixes each channel
with its ``conv_kernel - 1`` predecessors), ``W_Z`` [n_v_heads, d_model, d_v], ``W_O`` [n_v_heads, d_v,
d_model]. Hook points: ``hook_q``, ``hook_k`` [batch, seq, n_k_heads, d_k] and ``hook_v`` [batch, seq,
n_v_heads, d_v] (after the convolution, before the L2 norm), ``hook_gate`` (g, the log decay) and
``hook_beta`` [batch, seq, n_v_heads], ``hook_state`` [batch, n_v_heads, d_k, d_v] (the state after the
last position), ``hook_o`` [batch, seq, n_v_heads, d_v] (the rule's output), ``hook_z`` (the gated norm's,
the input of W_O) and ``hook_result`` [batch, seq, n_v_heads, d_model] (``z_h W_O[h]``, fired only while
watched): direct logit attribution per head is exact through ``hook_result``.

Decoding keeps a :class:`DeltaNetCache` (the convolution's last inputs and the state) instead of keys
and values.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.delta_spec import DeltaNetSpec
from ..nn.hooks import HookPoint
from ..nn.kv_cache import KVCache
from .delta_rule import chunk_rule, recurrent_rule


def causal_depthwise_conv(x: Tensor, weight: Tensor) -> Tensor:
    """The causal depthwise convolution of x [B, S, C] (channels last) by ``weight`` [C, K]: ``out[:, t]
    = sum_j weight[:, j] * x[:, t - K + 1 + j]``, summed in order of j, with zeros before the first
    position: [B, S, C] fresh, what ``F.conv1d`` computes with ``K - 1`` zeros of padding in front (bit
    for bit on the CPU), without moving x to channels first: K multiply-adds over shifted slices, in
    place (no autograd graph)."""
    K = weight.shape[1]
    S = x.shape[1]
    taps = weight.t().contiguous()  # (K, C): each tap's weights, contiguous
    out = torch.empty_like(x)  # (B, S, C)
    out[:, : min(K - 1, S)].zero_()  # the positions the first tap does not reach start from zero
    if S > K - 1:
        torch.mul(x[:, : S - K + 1], taps[0], out=out[:, K - 1 :])
    for j in range(1, K):  # tap j reaches back K - 1 - j positions: it adds to positions K - 1 - j ..
        back = K - 1 - j
        if back < S:
            out[:, back:].addcmul_(x[:, : S - back], taps[j])
    return out


class DeltaNetCache(KVCache):
    """A Gated DeltaNet layer's decoding state: ``conv`` [batch, conv_dim, conv_kernel - 1] (the last
    inputs of the convolution) and ``state`` [batch, n_v_heads, d_k, d_v]; ``length`` positions seen,
    at most ``capacity``. A :class:`KVCache` for the model's bookkeeping; its ``k`` / ``v`` are unused."""

    def __init__(
        self, spec: DeltaNetSpec, batch: int, capacity: int, *, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__(batch, 1, 1, 1, dtype=dtype, device=device)
        self._capacity = capacity
        self.conv = torch.zeros(batch, spec.conv_dim, spec.conv_kernel - 1, dtype=dtype, device=device)
        self.state = torch.zeros(
            batch, spec.n_v_heads, spec.d_k, spec.d_v, dtype=torch.float32, device=device
        )

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def held(self) -> int:
        return self.length

    def reset(self) -> None:
        super().reset()
        self.conv.zero_()
        self.state.zero_()


def refuse_linear_attention(module: nn.Module, what: str) -> None:
    """Raise a one-line ``ValueError`` where ``module`` is a Gated DeltaNet layer: ``what`` (an analysis
    that needs a softmax pattern) cannot be exact there."""
    if isinstance(module, GatedDeltaNet):
        raise ValueError(
            f"{what} needs a softmax attention pattern; this layer is a Gated DeltaNet (the block field "
            "'mixer' is 'gated_deltanet': linear attention has no pattern)"
        )


def refuse_linear_attention_model(module: nn.Module, what: str) -> None:
    """:func:`refuse_linear_attention` for a whole model: one line naming the Gated DeltaNet blocks of
    ``module`` (an Encoder/Decoder) where ``what`` needs a softmax pattern (or every layer's heads)."""
    blocks = [i for i, b in enumerate(getattr(module, "blocks", ())) if isinstance(b.attn, GatedDeltaNet)]
    if blocks:
        raise ValueError(
            f"{what} needs a softmax attention pattern in every layer; blocks {blocks} are Gated DeltaNet "
            "(the block field 'mixer' is 'gated_deltanet': linear attention has no pattern)"
        )


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet layer from its :class:`~headspace.nn.delta_spec.DeltaNetSpec` (module docstring)."""

    #: head pruning does not apply (the value heads share the convolution and the gated norm)
    prunable: bool = False
    fused = False
    check_finite = False

    def __init__(self, spec: DeltaNetSpec) -> None:
        super().__init__()
        if not isinstance(spec, DeltaNetSpec):
            raise TypeError(f"GatedDeltaNet expects a DeltaNetSpec; got {type(spec).__name__}")
        self.spec = spec
        d, Hv, dv = spec.d_model, spec.n_v_heads, spec.d_v
        self.in_qkv = nn.Linear(d, spec.conv_dim, bias=False)
        self.in_z = nn.Linear(d, Hv * dv, bias=False)
        self.in_b = nn.Linear(d, Hv, bias=False)
        self.in_a = nn.Linear(d, Hv, bias=False)
        bound = 1.0 / math.sqrt(spec.conv_kernel)
        self.conv_weight = nn.Parameter(torch.empty(spec.conv_dim, spec.conv_kernel).uniform_(-bound, bound))
        self.dt_bias = nn.Parameter(torch.ones(Hv))
        self.A_log = nn.Parameter(torch.empty(Hv).uniform_(1.0, 16.0).log_())
        self.norm_weight = nn.Parameter(torch.ones(dv))
        self.out_proj = nn.Linear(Hv * dv, d, bias=False)
        self.register_module("rotary", None)  # no positions: the model passes none
        for name in ("q", "k", "v", "gate", "beta", "state", "o", "z", "result"):
            setattr(self, f"hook_{name}", HookPoint())

    # ------------------------------------------------------------------ views
    def _rows(self, start: int, heads: int, width: int, weight: Tensor) -> Tensor:
        d = self.spec.d_model
        return (
            weight[start : start + heads * width].view(heads, width, d).transpose(1, 2)
        )  # (heads, d, width)

    @property
    def W_Q(self) -> Tensor:
        """[n_k_heads, d_model, d_k] view of ``in_qkv.weight`` (before the convolution)."""
        s = self.spec
        return self._rows(0, s.n_k_heads, s.d_k, self.in_qkv.weight)

    @property
    def W_K(self) -> Tensor:
        """[n_k_heads, d_model, d_k] view of ``in_qkv.weight`` (before the convolution)."""
        s = self.spec
        return self._rows(s.n_k_heads * s.d_k, s.n_k_heads, s.d_k, self.in_qkv.weight)

    @property
    def W_V(self) -> Tensor:
        """[n_v_heads, d_model, d_v] view of ``in_qkv.weight`` (before the convolution)."""
        s = self.spec
        return self._rows(2 * s.n_k_heads * s.d_k, s.n_v_heads, s.d_v, self.in_qkv.weight)

    @property
    def W_Z(self) -> Tensor:
        """[n_v_heads, d_model, d_v] view of ``in_z.weight``: the gated norm's gate, ``silu(x W_Z[h])``."""
        return self._rows(0, self.spec.n_v_heads, self.spec.d_v, self.in_z.weight)

    @property
    def W_O(self) -> Tensor:
        """[n_v_heads, d_v, d_model] view of ``out_proj.weight``: ``out = sum_h z_h W_O[h]``."""
        s = self.spec
        return self.out_proj.weight.view(s.d_model, s.n_v_heads, s.d_v).permute(1, 2, 0)

    @property
    def n_heads(self) -> int:
        """The value heads (each with its own state)."""
        return self.spec.n_v_heads

    def make_kv_cache(self, batch: int, capacity: int) -> DeltaNetCache:
        """The decoding state for ``batch`` rows and up to ``capacity`` positions (:class:`DeltaNetCache`)."""
        w = self.out_proj.weight
        return DeltaNetCache(self.spec, batch, capacity, dtype=w.dtype, device=w.device)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        x: Tensor,
        *,
        key_padding: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = True,
        need_weights: bool = False,
        kv_cache: KVCache | None = None,
    ) -> Tensor:
        """x [batch, seq, d_model] -> [batch, seq, d_model] (module docstring); causal whatever
        ``is_causal`` says. ``key_padding`` (bool [batch, seq_k], True = real token; its last ``seq``
        columns are this call's): padded positions' inputs are zeroed, as transformers does.
        ``kv_cache``: a :class:`DeltaNetCache` from :meth:`make_kv_cache`, read and advanced."""
        if need_weights or attn_mask is not None:
            name = "need_weights" if need_weights else "attn_mask"
            raise ValueError(
                f"a Gated DeltaNet layer has no softmax pattern and takes no mask: {name} was given"
            )
        if kv_cache is not None and not isinstance(kv_cache, DeltaNetCache):
            raise TypeError(
                f"kv_cache must be a DeltaNetCache (make_kv_cache); got {type(kv_cache).__name__}"
            )
        B, S, _ = x.shape
        if kv_cache is not None:
            kv_cache.check(B, S, x.dtype, x.device)
        if key_padding is not None and S > 1:
            x = x * key_padding[:, -S:, None].to(x.dtype)  # (B, S, d_model)
        q, k, v = self._conv_qkv(x, kv_cache)
        beta = self.hook_beta(torch.sigmoid(self.in_b(x)))  # (B, S, Hv)
        g = -self.A_log.float().exp() * F.softplus(self.in_a(x).float() + self.dt_bias)  # (B, S, Hv)
        g = self.hook_gate(g)
        state = kv_cache.state if kv_cache is not None and kv_cache.length > 0 else None
        rule = recurrent_rule if state is not None and S == 1 else chunk_rule
        o, final = rule(q, k, v, g, beta, state)  # (B, S, Hv, dv), (B, Hv, dk, dv)
        final = self.hook_state(final)
        if kv_cache is not None:
            kv_cache.state.copy_(final)
            kv_cache.length += S
        return self._output(self.hook_o(o), x)

    def _conv_qkv(self, x: Tensor, cache: DeltaNetCache | None) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, S, Hk, dk], k [B, S, Hk, dk], v [B, S, Hv, dv] after the causal convolution and silu
        (the cache's last inputs in front of the call's; zeros without one), through their hook points."""
        s = self.spec
        B, S, _ = x.shape
        mixed = self.in_qkv(x)  # (B, S, conv_dim)
        weight = self.conv_weight
        if cache is None and not (torch.is_grad_enabled() and (mixed.requires_grad or weight.requires_grad)):
            out = F.silu(causal_depthwise_conv(mixed, weight), inplace=True)  # (B, S, conv_dim), fresh
        else:
            mixed = mixed.transpose(1, 2)  # (B, conv_dim, S), channels first
            if cache is None:  # zeros in front: the convolution's own padding (no copy of the input)
                conv = F.conv1d(mixed, weight.unsqueeze(1), padding=s.conv_kernel - 1, groups=s.conv_dim)
                conv = conv[..., :S]  # (B, conv_dim, S)
            else:
                full = torch.cat([cache.conv, mixed], dim=-1)  # (B, conv_dim, K - 1 + S)
                cache.conv.copy_(full[:, :, full.shape[-1] - (s.conv_kernel - 1) :])
                conv = F.conv1d(full, weight.unsqueeze(1), groups=s.conv_dim)  # (B, conv_dim, S)
            out = F.silu(conv).transpose(1, 2)  # (B, S, conv_dim)
        kd = s.n_k_heads * s.d_k
        q = out[..., :kd].reshape(B, S, s.n_k_heads, s.d_k)  # (B, S, Hk, dk)
        k = out[..., kd : 2 * kd].reshape(B, S, s.n_k_heads, s.d_k)  # (B, S, Hk, dk)
        v = out[..., 2 * kd :].reshape(B, S, s.n_v_heads, s.d_v)  # (B, S, Hv, dv)
        return self.hook_q(q), self.hook_k(k), self.hook_v(v)

    def _output(self, o: Tensor, x: Tensor) -> Tensor:
        """The gated RMSNorm of o [B, S, Hv, dv] (float32, as transformers), ``hook_z``, then W_O."""
        s = self.spec
        B, S = o.shape[:2]
        gate = self.in_z(x).reshape(B, S, s.n_v_heads, s.d_v)  # (B, S, Hv, dv)
        h = o.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + s.norm_eps)  # (B, S, Hv, dv), fresh
        w = self.norm_weight
        if (
            type(self.in_z) is nn.Linear
            and o.dtype == gate.dtype == w.dtype == torch.float32
            and not (torch.is_grad_enabled() and (h.requires_grad or gate.requires_grad or w.requires_grad))
        ):  # the same products, written over the fresh h and gate (no graph needs them)
            z = h.mul_(w).mul_(F.silu(gate, inplace=True))  # (B, S, Hv, dv)
        else:
            z = w * h.to(o.dtype)
            z = (z * F.silu(gate.to(torch.float32))).to(o.dtype)  # (B, S, Hv, dv)
        z = self.hook_z(z)
        if self.hook_result.active:
            result = self.hook_result(torch.einsum("bshd,hdm->bshm", z, self.W_O))  # (B, S, Hv, d_model)
            return result.sum(dim=2)  # (B, S, d_model)
        return self.out_proj(z.reshape(B, S, s.n_v_heads * s.d_v))  # (B, S, d_model)
