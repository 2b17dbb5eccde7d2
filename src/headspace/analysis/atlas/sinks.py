"""The atlas on layers with learned sinks (gpt-oss; :mod:`headspace.attention.sinks`).

A sink logit ``s_h`` joins every row's softmax, ``p_ij = exp(a_ij) / (sum_k exp(a_ik) + exp(s_h))``. The
atlas reads its pattern a block of queries at a time as unnormalised weights ``w_ij = exp(a_ij - m_i)``
(``m_i = max_j a_ij`` over the visible keys) and their sum ``norm_i`` (:class:`PatternBlock`); with a
sink the row's true denominator is ``norm_i + exp(s_h - m_i)``. :meth:`SinkRows.apply` adds that term to
the block's ``norm`` in place, so every statistic read through it (``previous``, ``first``, ``self``,
``duplicate``, ``induction``, z and its direct effects, the examples) is the model's own key weight,
and returns the sink's mass per row, ``sink_i = exp(s_h - m_i) / (norm_i + exp(s_h - m_i))`` (what
``hook_sink`` gives). ``m_i`` is recomputed as ``q_i . k_{j*} * scale`` at the row's top key ``j*``
(where ``w = 1``), in float32 as the block's scores. ``entropy`` stays that of the key weights
renormalised to 1 (the sink's own share is the ``sink`` statistic).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..lesson.pattern_blocks import PatternBlock

__all__ = ["SinkRows", "has_sinks", "layer_sinks"]


def layer_sinks(attn: Any) -> Tensor | None:
    """The layer's sink logits, float32 [n_heads] (detached), or None for a layer without sinks."""
    sinks = getattr(attn, "sinks", None)
    return None if sinks is None else sinks.detach().float()


def has_sinks(module: Any) -> bool:
    """Whether any attention layer of ``module`` has learned sinks (then ``induction_repeated``, which
    recomputes patterns without them, is NaN in the atlas)."""
    return any(getattr(m, "sinks", None) is not None for m in module.modules())


class SinkRows:
    """One layer's sinks for the atlas: q4 [B, H, S, dh], k4 [B, Hkv, S, dh] (rotated, as the blocks
    were computed from), ``sinks`` float32 [H], ``scale`` the score scale."""

    def __init__(self, q4: Tensor, k4: Tensor, sinks: Tensor, scale: float) -> None:
        H, Hkv = q4.shape[1], k4.shape[1]
        self.q4, self.scale = q4, float(scale)
        heads = torch.arange(H, device=k4.device) // (H // Hkv)  # (H,): each query head's kv head
        self.k = k4.index_select(1, heads)  # (B, H, S, dh)
        self.sinks = sinks.to(q4.device).reshape(1, H, 1)  # (1, H, 1)

    def apply(self, block: PatternBlock) -> Tensor:
        """Add the sink's term to ``block.norm`` (in place on the block) and return the sink's mass per
        row, float32 [B, H, rows] (0 on dead rows, whose norm is inf)."""
        lo, hi = int(block.index[0]), int(block.index[-1]) + 1
        B, H, n, _ = block.weights.shape
        top = block.weights.argmax(dim=-1)  # (B, H, rows): the key of weight 1, the row's max score
        dh = self.k.shape[-1]
        k_top = self.k.gather(2, top[..., None].expand(B, H, n, dh))  # (B, H, rows, dh)
        q = self.q4[:, :, lo:hi].float() * self.scale  # (B, H, rows, dh)
        m = (q * k_top.float()).sum(-1)  # (B, H, rows): m_i
        extra = torch.exp(self.sinks - m)  # (B, H, rows): exp(s_h - m_i)
        block.norm = block.norm + extra
        return extra / block.norm
