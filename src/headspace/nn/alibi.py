"""ALiBi (Press et al. 2022): a per-head linear bias in the key distance, added to the scaled scores.

Query head ``h`` at position ``i`` scoring the key at position ``j`` (``delta = i - j >= 0`` for a
causal model) gets::

    s_hij = q_h(i) k_h(j)^T * scale  -  m_h * (i - j)

with one slope ``m_h > 0`` per head. Softmax is blind to a constant per row, so transformers' BLOOM
and Falcon add ``m_h * j`` and MPT ``m_h * (j - (L - 1))`` instead: the same pattern; this module's
``-m_h * delta`` form is the one that depends on the distance alone, as :meth:`headspace.Head.qk`
states it (:func:`alibi_bias`). The slopes (the ``AttentionSpec.alibi_slopes`` of a block with
``bias="alibi"``):

* :func:`bloom_slopes` (BLOOM, Falcon's alibi variant): ``m_h = 2^(-8 (h + 1) / n)`` for ``n`` a power of
  two; otherwise those of the largest power of two below ``n``, then every other slope of twice that
  count, exactly as transformers computes them (float32).
* :func:`mpt_slopes` (MPT): ``m_h = 2^(-alibi_bias_max (h + 1) / n')`` for ``n'`` the power of two at
  or above ``n``, reordered (odd ones first) and cut to ``n`` where ``n`` is not a power of two.

Falcon divides its bias by ``sqrt(d_head)`` too (``(q k^T + m_h j) / sqrt(d_head)``): its slopes are
:func:`bloom_slopes` times the score scale, rounded to bfloat16 first as transformers does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .masks import CanonicalMask, causal_mask


def bloom_slopes(n_heads: int) -> list[float]:
    """BLOOM's slopes, as ``transformers.models.bloom.modeling_bloom._get_alibi_slopes`` computes
    them (a float32 power of a float32 base): [n_heads] Python floats (float32 values)."""
    power = 2 ** math.floor(math.log2(n_heads))
    base = torch.full((), 2 ** (-(2 ** -(math.log2(power) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + power, dtype=torch.int32))  # (power,)
    if power != n_heads:
        extra = torch.full((), 2 ** (-(2 ** -(math.log2(2 * power) - 3))), dtype=torch.float32)
        rest = min(power, n_heads - power)
        odd = torch.arange(1, 1 + 2 * rest, 2, dtype=torch.int32)  # (rest,)
        slopes = torch.cat([slopes, torch.pow(extra, odd)])  # (n_heads,)
    return [float(s) for s in slopes]


def mpt_slopes(n_heads: int, alibi_bias_max: float = 8.0) -> list[float]:
    """MPT's slopes, as ``transformers.models.mpt.modeling_mpt.build_mpt_alibi_tensor`` computes them:
    [n_heads] Python floats (float32 values)."""
    power = 2 ** math.ceil(math.log2(n_heads))
    base = torch.arange(1, power + 1, dtype=torch.int64).float() * (alibi_bias_max / power)  # (power,)
    slopes = 1.0 / torch.pow(2, base)  # (power,)
    if power != n_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:n_heads]  # (n_heads,)
    return [float(s) for s in slopes]


def check_slopes(owner: str, slopes: object, n_heads: int) -> tuple[float, ...]:
    """``slopes`` as a tuple of ``n_heads`` finite floats, or a one-line ``ValueError`` naming
    ``owner`` (e.g. ``"AttentionSpec.alibi_slopes"``), what it expects and what came."""
    ok = isinstance(slopes, (list, tuple)) and len(slopes) == n_heads
    ok = ok and all(
        isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s)
        for s in slopes  # type: ignore[union-attr]
    )
    if not ok:
        raise ValueError(f"{owner} must be {n_heads} finite floats, one per head; got {slopes!r:.120}")
    return tuple(float(s) for s in slopes)  # type: ignore[union-attr]


def alibi_bias(
    slopes: Tensor | Sequence[float], seq_q: int, seq_k: int, *, device: torch.device | None = None
) -> Tensor:
    """The bias ``-m_h * (i - j)`` [n_heads, seq_q, seq_k] (float32), the queries aligned bottom-right
    (query ``a`` sits at key position ``a + seq_k - seq_q``, as with a KV cache). Keys after a query get
    a positive bias; a causal mask hides them."""
    m = torch.as_tensor(slopes, dtype=torch.float32, device=device)  # (n_heads,)
    query = torch.arange(seq_q, device=device) + (seq_k - seq_q)  # (seq_q,)
    keys = torch.arange(seq_k, device=device)  # (seq_k,)
    delta = (query[:, None] - keys[None, :]).to(torch.float32)  # (seq_q, seq_k)
    return -m[:, None, None] * delta[None]  # (n_heads, seq_q, seq_k)


def head_bias(slope: float, delta: int | Tensor) -> float | Tensor:
    """One head's bias at query-key offset ``delta = i - j``: ``-slope * delta`` (what the head's QK
    circuit at that offset is summed with, :meth:`headspace.Head.alibi_bias`)."""
    return -slope * delta


def with_alibi(mask: CanonicalMask, slopes: Sequence[float], seq_q: int, seq_k: int, dtype: torch.dtype,
               device: torch.device) -> CanonicalMask:  # fmt: skip
    """``mask`` with the ALiBi bias (:func:`alibi_bias`) added: a float mask [batch|1, n_heads, seq_q,
    seq_k] that every backend adds to the scaled scores (``-inf`` kept where ``mask`` blocks; the dead
    rows ``mask`` opened stay open and reported). A causal-only mask becomes explicit."""
    bias = alibi_bias(slopes, seq_q, seq_k, device=device).to(dtype)[None]  # (1, n_heads, seq_q, seq_k)
    m = mask.mask
    if mask.is_causal:
        m = causal_mask(seq_q, seq_k, device)[None, None]  # (1, 1, seq_q, seq_k)
    if m is None:
        merged = bias
    elif m.dtype == torch.bool:
        merged = bias.masked_fill(~m, float("-inf"))  # (batch|1, n_heads, seq_q, seq_k)
    else:
        merged = m + bias  # (batch|1, n_heads, seq_q, seq_k)
    return CanonicalMask(mask=merged, is_causal=False, dead_rows=mask.dead_rows)
