"""One greedy decoding step of the decoder without hook dispatch: :func:`fast_step`.

The step computes what :meth:`DecoderStack.forward` computes for one new position with the caches (the
same weights, norms, MLP modules and the same cached cross keys and values), written as direct calls:
no hook point is called, no mask is built (one query sees every cached key: the causal row is all
True), the fused QKV projection is split by views, and the new key and value are written into the
preallocated :class:`~headspace.nn.kv_cache.KVCache` in place. Its output equals the traced step's to
float32 rounding (torch's attention may take another kernel without a mask). It is taken only while no
hook point of the decoder has a function (:func:`fast_step_usable`): a registered hook always sees its
values through the ordinary path.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from ...nn.hooks import HookPoint
from ...nn.kv_cache import KVCache
from .blocks import DecoderBlock
from .stacks import DecoderStack


def fast_step_usable(decoder: DecoderStack) -> bool:
    """Whether :func:`fast_step` computes this decoder's step: no hook point of it has a function, no
    T5 bucket bias (its score bias goes through the ordinary path), and plain multi-head self-attention
    (no rotation, window, QK-norm, soft-capping, sinks or gates)."""
    if decoder.rel_bias is not None:
        return False
    for block in decoder.blocks:
        a = block.attn
        plain = a.fused and a.n_kv_heads == a.n_heads and a.window is None and a.qk_norm is None
        extras = (a.softcap, getattr(a, "sinks", None), a._spec.gate, a._spec.bias, a._spec.chunk)
        if not plain or a._modules.get("rotary") is not None or any(e is not None for e in extras):
            return False
    return not any(m.active for m in decoder.modules() if isinstance(m, HookPoint))


def _residual(pre: bool, norm: nn.Module, x: Tensor, out: Tensor) -> Tensor:
    """``x + out`` (pre-LN: ``out`` was computed from ``norm(x)``), or ``norm(x + out)`` (post-LN)."""
    return x + out if pre else norm(x + out)


def _self_attention(block: DecoderBlock, h: Tensor, cache: KVCache) -> Tensor:
    """Causal self-attention of one new position ``h`` [batch, 1, d_model] on the cache -> [batch, 1,
    d_model]; the new key and value are appended to ``cache``."""
    a = block.attn
    B = h.shape[0]
    H, dh = a.n_heads, a.d_head
    qkv = F.linear(h, a.qkv_weight, a.qkv_bias)  # (B, 1, 3 H dh)
    q, k, v = qkv.view(B, 3, H, 1, dh).unbind(1)  # (B, H, 1, dh) x 3: one position, so no transpose
    keys, values = cache.append(k, v)  # (B, H, cached + 1, dh) x 2
    z = F.scaled_dot_product_attention(q, keys, values, scale=a.scale)  # (B, H, 1, dh)
    return F.linear(z.reshape(B, 1, H * dh), a.o_weight, a.o_bias)  # (B, 1, d_model)


def fast_step(
    decoder: DecoderStack,
    ids: Tensor,
    caches: list[KVCache],
    cross: list[tuple[Tensor, Tensor]],
    cross_mask: Tensor | None,
) -> Tensor:
    """The decoder's final stream [batch, 1, d_model] of one new token per row, ``ids`` [batch, 1], after
    the cached positions (module docstring); ``cross``: each layer's (k, v) [batch, n_heads, seq_k, d_head]
    from :meth:`EncDecAttention.cross_kv`, ``cross_mask`` additive [batch, 1, 1, seq_k] or None."""
    x = decoder.embed(ids, caches[0].length)  # (B, 1, d_model)
    for block, cache, (k, v) in zip(decoder.blocks, caches, cross, strict=True):
        pre = block.pre
        h = block.ln1(x) if pre else x
        x = _residual(pre, block.ln1, x, _self_attention(block, h, cache))  # (B, 1, d_model)
        h = block.ln_cross(x) if pre else x
        out = block.cross_attn.attend_cached(h, k, v, cross_mask)  # (B, 1, d_model)
        x = _residual(pre, block.ln_cross, x, out)
        h = block.ln2(x) if pre else x
        x = _residual(pre, block.ln2, x, block.mlp(h))
    return x if decoder.final_ln is None else decoder.final_ln(x)


__all__ = ["fast_step", "fast_step_usable"]
