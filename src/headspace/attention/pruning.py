"""Removing heads from a layer's fused storage: the arithmetic behind :func:`headspace.prune_heads`.

:func:`kept_kv_heads` is pure arithmetic on head counts (so :class:`~headspace.ModelConfig` can check
``pruned_heads`` before any layer exists); :func:`shrink_attention` rebuilds one layer in place. The
user-facing :func:`~headspace.interventions.prune_heads` (which also records the change in the model's
config) lives in :mod:`headspace.interventions`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from .layer import MultiHeadAttention


def _kept_rows(weight: Tensor, keep: Sequence[int], width: int) -> Tensor:
    """Rows ``[i * width, (i + 1) * width)`` of ``weight`` for each ``i`` in ``keep``, concatenated."""
    if not keep:
        return weight[:0]
    return torch.cat([weight[i * width : (i + 1) * width] for i in keep], dim=0)


def kept_kv_heads(n_heads: int, n_kv_heads: int, keep: Sequence[int], arg: str) -> list[int]:
    """The key/value heads that serve some kept query head; refuses unequal group sizes (GQA).

    Query head ``h`` is served by key/value head ``h // (n_heads // n_kv_heads)``. Pure arithmetic on the
    counts, so :class:`~headspace.ModelConfig` checks ``pruned_heads`` with it before any layer exists.
    """
    g = n_heads // n_kv_heads
    counts = [sum(1 for h in keep if h // g == j) for j in range(n_kv_heads)]
    kept_kv = [j for j in range(n_kv_heads) if counts[j] > 0]
    if len({counts[j] for j in kept_kv}) > 1:
        raise ValueError(
            f"{arg}: pruning would leave key/value heads serving unequal numbers of query heads (kept query "
            f"heads per kv head: {dict(enumerate(counts))}, group size {g}); with grouped-query attention "
            "prune whole groups or the same number of heads from every surviving group"
        )
    return kept_kv


def shrink_attention(attn: MultiHeadAttention, keep: Sequence[int]) -> None:
    """Rebuild ``attn``'s fused storage with only the query heads ``keep`` (in place).

    Grouped-query attention: a key/value head is removed when none of its query heads is kept; every
    surviving key/value head must keep the same number of query heads (the layer's group size), else
    ``ValueError`` lists the counts. Biases of kept heads and ``b_O`` are kept.
    """
    H, Hkv, dh = attn.n_heads, attn.n_kv_heads, attn.d_head
    keep = sorted(set(keep))
    if not keep:
        raise ValueError(
            f"keep: cannot prune all {H} heads of a layer (a layer needs at least one head); zero-ablate "
            "them with headspace.ablate instead, or remove the block"
        )
    if getattr(attn, "qk_norm", None) == "all" and len(keep) < H:
        raise ValueError(
            "keep: this layer's QK-norm normalises all heads' q (and k) together (qk_norm='all', OLMo 2), so "
            "removing a head changes the others' scores; zero-ablate heads with headspace.ablate instead"
        )
    kept_kv = kept_kv_heads(attn.n_heads, attn.n_kv_heads, keep, "keep")
    hq, hkv = H * dh, Hkv * dh

    def param(t: Tensor, like: nn.Parameter) -> nn.Parameter:
        return nn.Parameter(t.detach().clone(), requires_grad=like.requires_grad)

    def split_kept(t: Tensor) -> Tensor:
        """Kept rows of a stacked [q; k; v] tensor (weight or bias)."""
        q, k, v = t[:hq], t[hq : hq + hkv], t[hq + hkv :]
        parts = [_kept_rows(q, keep, dh), _kept_rows(k, kept_kv, dh), _kept_rows(v, kept_kv, dh)]
        return torch.cat(parts, dim=0)  # ((H' + 2 Hkv') dh, ...)

    with torch.no_grad():
        if attn.fused:
            attn.qkv_weight = param(split_kept(attn.qkv_weight), attn.qkv_weight)
        else:
            attn.q_weight = param(_kept_rows(attn.q_weight, keep, dh), attn.q_weight)
            attn.k_weight = param(_kept_rows(attn.k_weight, kept_kv, dh), attn.k_weight)
            attn.v_weight = param(_kept_rows(attn.v_weight, kept_kv, dh), attn.v_weight)
        if attn.qkv_bias is not None:
            attn.qkv_bias = param(split_kept(attn.qkv_bias), attn.qkv_bias)
        if getattr(attn, "qk_norm", None) == "head_layernorm":  # a weight per head: keep the kept rows
            attn.q_norm.weight = param(attn.q_norm.weight[keep], attn.q_norm.weight)  # (H', dh)
            attn.k_norm.weight = param(attn.k_norm.weight[kept_kv], attn.k_norm.weight)  # (Hkv', dh)
        if attn._parameters.get("gate_weight") is not None:  # an output gate: the kept heads' rows
            width = attn.gate_weight.shape[0] // H
            attn.gate_weight = param(_kept_rows(attn.gate_weight, keep, width), attn.gate_weight)
            if attn.gate_bias is not None:
                attn.gate_bias = param(_kept_rows(attn.gate_bias, keep, width), attn.gate_bias)
        o = attn.o_weight  # (d_model, H dh)
        new_o = _kept_rows(o.T, keep, dh).T  # (d_model, H' dh)
        attn.o_weight = param(new_o.contiguous(), o)
    slopes = attn.spec.alibi_slopes  # ALiBi: each kept head keeps its own slope
    kept_slopes = None if slopes is None else [slopes[h] for h in keep]
    attn.spec = dataclasses.replace(
        attn.spec, n_heads=len(keep), n_kv_heads=len(kept_kv), alibi_slopes=kept_slopes
    )
