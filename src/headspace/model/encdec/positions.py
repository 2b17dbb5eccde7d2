"""Positions of an encoder-decoder: Marian's sinusoidal table and T5's relative-position buckets.

T5 (Raffel et al. 2020) adds to every score a learned per-head bias read by the bucket of the offset
between the query at position ``i`` and the key at position ``j``; the table ``weight`` [num_buckets,
n_heads] belongs to the stack's first layer and is shared by all its layers. With ``n = j - i`` (the key
relative to the query) the bucket is::

    bidirectional (encoder):  half = num_buckets / 2;  b = half * (n > 0) + small(|n|, half)
    causal (decoder):         b = small(max(-n, 0), num_buckets)
    small(r, N) = r                                        where r < N / 2
                = min(N / 2 + floor(log(r / (N/2)) / log(max_distance / (N/2)) * (N - N/2)), N - 1)

``bias(i, j)[h] = weight[bucket(j - i), h]``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def sinusoidal_table(n_positions: int, d_model: int) -> Tensor:
    """Marian's fixed positions [n_positions, d_model]: ``angle(p, j) = p / 10000^(2 floor(j/2) / d_model)``,
    ``table[p, :d/2] = sin(angle(p, 0::2))``, ``table[p, d/2:] = cos(angle(p, 1::2))`` (not interleaved)."""
    pos = torch.arange(n_positions, dtype=torch.float64)[:, None]  # (P, 1)
    j = torch.arange(d_model, dtype=torch.float64)  # (d,)
    angle = pos / torch.pow(10000.0, 2 * torch.div(j, 2, rounding_mode="floor") / d_model)  # (P, d)
    half = d_model // 2
    out = torch.empty(n_positions, d_model, dtype=torch.float64)
    out[:, :half] = torch.sin(angle[:, 0::2])
    out[:, half:] = torch.cos(angle[:, 1::2])
    return out.float()


def relative_bucket(relative: Tensor, *, bidirectional: bool, num_buckets: int, max_distance: int) -> Tensor:
    """The T5 bucket (int64, same shape) of each key-minus-query offset ``relative`` (module docstring)."""
    buckets = torch.zeros_like(relative, dtype=torch.long)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative > 0).long() * num_buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)
    exact = num_buckets // 2
    is_small = distance < exact
    large = (
        exact
        + (
            torch.log(distance.float().clamp(min=1e-30) / exact)
            / math.log(max_distance / exact)
            * (num_buckets - exact)
        ).long()
    )
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


class RelativeBias(nn.Module):
    """T5's score bias by relative-position bucket: ``weight`` [num_buckets, n_heads], one per stack.

    ``bidirectional``: the encoder's buckets (both directions) or the decoder's (causal, past only).
    """

    def __init__(self, num_buckets: int, n_heads: int, max_distance: int, *, bidirectional: bool) -> None:
        super().__init__()
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.bidirectional = bidirectional
        self.weight = nn.Parameter(torch.zeros(num_buckets, n_heads))

    def bucket(self, delta: Tensor) -> Tensor:
        """The bucket of each query-minus-key offset ``delta = i - j`` (int64, same shape)."""
        return relative_bucket(
            -delta,
            bidirectional=self.bidirectional,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )

    def at(self, delta: Tensor) -> Tensor:
        """The bias of every head at each offset ``delta = i - j``: [*delta.shape, n_heads]."""
        return self.weight[self.bucket(delta)]  # (*delta, H)

    def forward(self, seq_q: int, seq_k: int, start: int = 0) -> Tensor:
        """The bias [1, n_heads, seq_q, seq_k] of queries at ``start + arange(seq_q)`` on keys at
        ``arange(seq_k)`` (a decoding step's queries start after the cached keys)."""
        dev = self.weight.device
        i = torch.arange(start, start + seq_q, device=dev)[:, None]  # (Sq, 1)
        j = torch.arange(seq_k, device=dev)[None, :]  # (1, Sk)
        return self.at(i - j).permute(2, 0, 1).unsqueeze(0)  # (1, H, Sq, Sk)

    def extra_repr(self) -> str:
        kind = "bidirectional" if self.bidirectional else "causal"
        return f"num_buckets={self.num_buckets}, max_distance={self.max_distance}, {kind}"
