"""The blocks of an encoder-decoder: the encoder's (self-attention, MLP) and the decoder's (self-attention,
cross-attention, MLP), each sublayer with its norm placed by the layout::

    pre (T5, Whisper):   h = x + A(N1(x))       [h2 = h + C(N_c(h), e)]       out = h2 + M(N2(h2))
    post (BART, Marian): h = N1(x + A(x))       [h2 = N_c(h + C(h, e))]       out = N2(h2 + M(h2))

``A`` the self-attention (the decoder's causal), ``C`` the cross-attention on the encoder's output ``e``
(queries from the decoder's stream, keys and values from ``e``), ``M`` the MLP.

Hook points of each block, [batch, seq, d_model]: ``hook_resid_pre``, ``hook_attn_in`` / ``hook_attn_out``
(the self-attention's input, after its norm where pre-LN, and output), the decoder's ``hook_cross_in`` /
``hook_cross_out`` (the cross-attention's query input and output), ``hook_mlp_in`` / ``hook_mlp_out``,
``hook_resid_post``; each attention layer has its own (``attn.hook_q``
... ``attn.hook_result``, ``cross_attn.hook_*``).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from ...nn.hooks import HookPoint
from ...nn.kv_cache import KVCache
from ..block import make_norm
from ..mlp import FeedForward, GatedFeedForward
from .attention import EncDecAttention
from .config import EncDecConfig
from .positions import RelativeBias


def _attention(c: EncDecConfig, position_bias: RelativeBias | None) -> EncDecAttention:
    return EncDecAttention(
        c.d_model, c.n_heads, c.d_head, bias=c.bias, scale=c.scale, position_bias=position_bias
    )


def _mlp(c: EncDecConfig) -> nn.Module:
    if c.mlp == "gated":
        return GatedFeedForward(c.d_model, c.d_mlp, c.act, bias=c.bias)
    return FeedForward(c.d_model, c.d_mlp, c.act, bias=c.bias)


def _sublayer(
    pre: bool,
    norm: nn.Module,
    x: Tensor,
    run: Callable[[Tensor], Tensor],
    hook_in: HookPoint,
    hook: HookPoint,
) -> Tensor:
    """One residual sublayer: ``x + hook(run(hook_in(norm(x))))`` (pre) or ``norm(x + hook(run(hook_in(x))))``
    (post): ``hook_in`` sees the sublayer's input, ``hook`` its output."""
    if pre:
        return x + hook(run(hook_in(norm(x))))
    return norm(x + hook(run(hook_in(x))))


class EncoderBlock(nn.Module):
    """Self-attention (``attn``, norm ``ln1``) then the MLP (``mlp``, norm ``ln2``); module docstring."""

    def __init__(self, c: EncDecConfig, position_bias: RelativeBias | None = None) -> None:
        super().__init__()
        self.pre = c.layout == "pre"
        self.attn = _attention(c, position_bias)
        self.ln1 = make_norm(c.norm, c.d_model, c.norm_eps)
        self.mlp = _mlp(c)
        self.ln2 = make_norm(c.norm, c.d_model, c.norm_eps)
        self.hook_resid_pre = HookPoint()  # [batch, seq, d_model]
        self.hook_attn_in = HookPoint()  # [batch, seq, d_model]: the self-attention's input
        self.hook_attn_out = HookPoint()  # [batch, seq, d_model]
        self.hook_mlp_in = HookPoint()  # [batch, seq, d_model]: the MLP's input
        self.hook_mlp_out = HookPoint()  # [batch, seq, d_model]
        self.hook_resid_post = HookPoint()  # [batch, seq, d_model]

    def forward(self, x: Tensor, *, key_padding: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
        """x [batch, seq, d_model] -> [batch, seq, d_model]; ``key_padding`` bool [batch, seq] (True: real
        token), ``bias`` an additive score bias [batch, n_heads, seq, seq] (T5's buckets) or None."""
        x = self.hook_resid_pre(x)

        def attend(h: Tensor) -> Tensor:
            return self.attn(h, key_padding=key_padding, attn_mask=bias)

        h = _sublayer(self.pre, self.ln1, x, attend, self.hook_attn_in, self.hook_attn_out)
        out = _sublayer(self.pre, self.ln2, h, self.mlp, self.hook_mlp_in, self.hook_mlp_out)
        return self.hook_resid_post(out)


class DecoderBlock(nn.Module):
    """Causal self-attention (``attn``, ``ln1``), cross-attention on the encoder's output (``cross_attn``,
    ``ln_cross``), the MLP (``mlp``, ``ln2``); module docstring."""

    def __init__(self, c: EncDecConfig, position_bias: RelativeBias | None = None) -> None:
        super().__init__()
        self.pre = c.layout == "pre"
        self.attn = _attention(c, position_bias)
        self.ln1 = make_norm(c.norm, c.d_model, c.norm_eps)
        self.cross_attn = _attention(c, None)
        self.ln_cross = make_norm(c.norm, c.d_model, c.norm_eps)
        self.mlp = _mlp(c)
        self.ln2 = make_norm(c.norm, c.d_model, c.norm_eps)
        self.hook_resid_pre = HookPoint()  # [batch, seq, d_model]
        self.hook_attn_in = HookPoint()  # [batch, seq, d_model]: the self-attention's input
        self.hook_attn_out = HookPoint()  # [batch, seq, d_model]
        self.hook_cross_in = HookPoint()  # [batch, seq, d_model]: the cross-attention's query input
        self.hook_cross_out = HookPoint()  # [batch, seq, d_model]
        self.hook_mlp_in = HookPoint()  # [batch, seq, d_model]: the MLP's input
        self.hook_mlp_out = HookPoint()  # [batch, seq, d_model]
        self.hook_resid_post = HookPoint()  # [batch, seq, d_model]

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None,
        *,
        memory_padding: Tensor | None = None,
        bias: Tensor | None = None,
        kv_cache: KVCache | None = None,
        cross_kv: tuple[Tensor, Tensor] | None = None,
        cross_mask: Tensor | None = None,
    ) -> Tensor:
        """x [batch, seq, d_model] on the encoder's output ``memory`` [batch, seq_k, d_model] -> [batch, seq,
        d_model]. ``memory_padding`` bool [batch, seq_k] (True: real frame or token); ``bias`` an additive
        self-attention score bias [batch, n_heads, seq, cached + seq] (T5) or None; ``kv_cache``: the
        self-attention's cache while decoding; ``cross_kv``: the cross keys and values computed once
        (:meth:`EncDecAttention.cross_kv`), used with ``cross_mask`` (additive, or None) instead of
        ``memory``."""
        x = self.hook_resid_pre(x)

        def attend(h: Tensor) -> Tensor:
            return self.attn(h, attn_mask=bias, is_causal=True, kv_cache=kv_cache)

        def cross(h: Tensor) -> Tensor:
            if cross_kv is not None:
                return self.cross_attn.attend_cached(h, cross_kv[0], cross_kv[1], cross_mask)
            return self.cross_attn(h, memory, key_padding=memory_padding)

        h = _sublayer(self.pre, self.ln1, x, attend, self.hook_attn_in, self.hook_attn_out)
        h = _sublayer(self.pre, self.ln_cross, h, cross, self.hook_cross_in, self.hook_cross_out)
        out = _sublayer(self.pre, self.ln2, h, self.mlp, self.hook_mlp_in, self.hook_mlp_out)
        return self.hook_resid_post(out)
