"""Learned attention sinks (gpt-oss): one logit ``s_h`` per head joins every row's softmax.

    p_ij = exp(a_ij) / (sum_k exp(a_ik) + exp(s_h))         a: the scaled, masked scores

so each row of the pattern sums to ``1 - sink_ij``, the mass the sink took. The pattern is the weights
on the keys (the sink column dropped), as transformers' ``GptOssAttention`` returns it; a row with no
visible key puts all its mass on the sink (pattern 0).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..nn.hooks import HookPoint
from ..nn.masks import CanonicalMask

#: torch's fused CPU attention that also returns each row's logsumexp (None where this torch lacks it:
#: then :func:`sink_attention` declines and the layer runs the reference maths).
_FUSED_WITH_LSE: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FUSED_DTYPES = (torch.float32, torch.float64)


def sink_pattern(scores: Tensor, sinks: Tensor) -> Tensor:
    """The key weights of a softmax with one sink logit per head, as transformers computes them (the
    row maximum subtracted, sink included): scores [batch, n_heads, seq_q, seq_k] (``-inf`` where
    masked), sinks [n_heads] -> [batch, n_heads, seq_q, seq_k].

    In float32 / float64 the explicit subtraction of the row maximum ``M`` is left to the softmax,
    which subtracts it itself: the shifted row's maximum is exactly 0, so both take ``exp(fl(a - M))``
    and the pattern is transformers' bit for bit, one pass and one copy fewer. In a half type
    transformers rounds ``a - M`` to that type before the softmax's float maths, and so does this."""
    b, h, sq, _ = scores.shape
    column = sinks.to(scores.dtype).reshape(1, h, 1, 1).expand(b, h, sq, 1)  # (batch, n_heads, seq_q, 1)
    combined = torch.cat([scores, column], dim=-1)  # (batch, n_heads, seq_q, seq_k + 1)
    if scores.dtype not in (torch.float32, torch.float64):
        combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1)[..., :-1]  # (batch, n_heads, seq_q, seq_k)


def sink_attention(
    layer: nn.Module, q: Tensor, k: Tensor, v: Tensor, mask: CanonicalMask, dropout_p: float
) -> tuple[Tensor, None] | None:
    """The output of the sink softmax without its pattern, by torch's fused CPU kernel, as a backend
    returns it: q [B, H, Sq, dh], k, v [B, Hkv, Sk, dh] -> (z [B, H, Sq, dh], None); None where it does
    not apply (the caller then runs the
    reference maths): no ``layer.sinks``, a soft cap, dropout, a graph to record, dead rows, a float mask
    of another dtype, not float32 / float64 on the CPU, or a torch without the kernel.

    With ``a`` the scaled, masked scores, ``Z_i = sum_j exp(a_ij)`` and ``o_i = sum_j exp(a_ij) v_j / Z_i``
    (the kernel's output, ``log Z_i`` its logsumexp)::

        z_i = sum_j exp(a_ij) v_j / (Z_i + exp(s_h)) = o_i Z_i / (Z_i + exp(s_h))
            = o_i * sigmoid(log Z_i - s_h)

    the same values as :func:`sink_pattern` times v, to float rounding (the kernel sums in blocks)."""
    sinks = layer._parameters.get("sinks")
    if sinks is None or _FUSED_WITH_LSE is None or getattr(layer, "softcap", None) is not None:
        return None
    m = mask.mask
    if (
        dropout_p > 0.0
        or mask.dead_rows is not None
        or q.device.type != "cpu"
        or q.dtype not in _FUSED_DTYPES
        or not (q.dtype == k.dtype == v.dtype)
        or q.numel() == 0
        or k.shape[2] == 0
        or (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, sinks)))
        or (m is not None and m.is_floating_point() and (m.dtype != q.dtype or m.requires_grad))
    ):
        return None
    if m is not None and not m.is_floating_point():  # bool (True = may attend) -> added 0 / -inf
        m = torch.zeros(m.shape, dtype=q.dtype, device=q.device).masked_fill_(~m, float("-inf"))
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)  # (B, H, Sk, dh): each query head's key head
        v = v.repeat_interleave(group, dim=1)  # (B, H, Sk, dh)
    scale = float(layer.scale)  # type: ignore[attr-defined]
    out, lse = _FUSED_WITH_LSE(
        q, k, v, 0.0, mask.is_causal, attn_mask=m, scale=scale
    )  # (B,H,Sq,dh), (B,H,Sq)
    keep = torch.sigmoid(lse - sinks.to(lse.dtype).view(1, -1, 1))  # (B, H, Sq): 1 - the sink's mass
    return out.mul_(keep.unsqueeze(-1).to(out.dtype)), None  # (B, H, Sq, dh)


def sink_mass(pattern: Tensor) -> Tensor:
    """The mass each row gave its sink, ``1 - sum_j p_ij``: [batch, n_heads, seq_q, seq_k] ->
    [batch, n_heads, seq_q]."""
    return 1.0 - pattern.sum(dim=-1)


def add_sinks(layer: nn.Module, sink: str | None, factory: dict[str, Any]) -> tuple[HookPoint, ...]:
    """Register ``layer.sinks`` (an ``nn.Parameter`` [n_heads] of the sink logits ``s_h``, zeros; None
    without ``sink``) and ``layer.hook_sink`` ([batch, n_heads, seq_q]: the mass each row gave its sink;
    None without); returns the new hook points. ``sink``: None or ``"learned"``."""
    n_heads = layer.n_heads  # type: ignore[attr-defined]
    has = sink is not None
    layer.register_parameter("sinks", nn.Parameter(torch.zeros(n_heads, **factory)) if has else None)
    layer.register_module("hook_sink", HookPoint() if has else None)
    return (layer.hook_sink,) if has else ()  # type: ignore[return-value]


def fire_sink(layer: nn.Module, pattern: Tensor | None) -> None:
    """Fire ``layer.hook_sink`` with :func:`sink_mass` of ``pattern`` where the layer has sinks and the
    hook point is active (a value to read: what a hook returns does not change the output)."""
    point = layer._modules.get("hook_sink")
    if point is not None and pattern is not None and point.active:
        point(sink_mass(pattern))  # (batch, n_heads, seq_q)
