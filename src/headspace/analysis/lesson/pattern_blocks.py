"""A layer's attention pattern a block of queries at a time, from q and k: the machinery under
:mod:`.chunked`.

:func:`iter_pattern_blocks` yields, for each block of query rows, the block's softmax weights against
all keys (masked, max-shifted, unnormalised) with their row sums and entropies (:class:`PatternBlock`,
from :func:`softmax_block`); :func:`prepared` checks q, k, the masks and the scale every statistic
starts from; :func:`default_chunk_size` keeps a block under :data:`BLOCK_BYTES`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...core.checks import is_int
from ...nn.masks import CanonicalMask, RowMasks

BLOCK_BYTES = 32 * 2**20
"""The automatic ``chunk_size`` keeps one block's scores [batch, n_heads, chunk_size, seq_k] float32 under
this many bytes (a few such buffers live at once: scores, their exp, one temporary)."""

MIN_CHUNK = 16
"""The automatic ``chunk_size`` is a multiple of this, and at least this (unless seq_q is smaller)."""

_NEG = torch.finfo(torch.float32).min  # masked scores, before the max is taken

_EXP_FLOOR = -87.0
"""Max-shifted scores are clamped at this before exp(): torch's vectorised CPU exp falls back to a slow
path for inputs below about -87.3 (where float32 exp underflows), many times slower per element (see
docs/benchmarks.md, "Figures formerly in docstrings"). A key more than 87 nats below its row's best gets
weight e^-87 ~ 1.6e-38 instead of its own (below float32 resolution against the row's 1: the same
numbers); masked keys are then set to exactly 0."""


def default_chunk_size(batch: int, n_heads: int, seq_q: int, seq_k: int, budget: int = BLOCK_BYTES) -> int:
    """Queries per block so that a block's scores [batch, n_heads, rows, seq_k] float32 fit ``budget``.

    A multiple of :data:`MIN_CHUNK` (at least :data:`MIN_CHUNK`), at most ``seq_q``. SmolLM2 (9 heads) at
    8,192 tokens, batch 1: 112 queries per block.
    """
    per_row = max(1, batch * n_heads * seq_k * 4)
    rows = max(MIN_CHUNK, budget // per_row // MIN_CHUNK * MIN_CHUNK)
    return max(1, min(seq_q, rows))


def check_chunk(chunk_size: Any) -> None:
    if chunk_size is not None and (not is_int(chunk_size) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None (automatic) or a positive int; got {chunk_size!r}")


def heads_first(q: Any, k: Any) -> tuple[Tensor, Tensor]:
    """Check q [batch, seq_q, n_heads, d_head] and k [batch, seq_k, n_kv_heads, d_head]; return views
    [batch, n_heads, seq_q, d_head] and [batch, n_kv_heads, seq_k, d_head]."""
    for name, t, heads in (("q", q, "n_heads"), ("k", k, "n_kv_heads")):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor [batch, seq, {heads}, d_head]; got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D [batch, seq, {heads}, d_head] (the hook point's layout); got shape "
                f"{list(t.shape)}"
            )
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor; got dtype {t.dtype}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q [batch, seq_q, n_heads, d_head] and k [batch, seq_k, n_kv_heads, d_head] must agree on batch "
            f"and d_head; got q {list(q.shape)} and k {list(k.shape)}"
        )
    if k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        raise ValueError(
            f"n_kv_heads={k.shape[2]} must divide n_heads={q.shape[2]} (grouped-query attention); got q "
            f"{list(q.shape)} and k {list(k.shape)}"
        )
    if k.shape[1] == 0:
        raise ValueError(f"key length seq_k must be at least 1; got k of shape {list(k.shape)}")
    if q.device != k.device:
        raise ValueError(f"q is on {q.device} but k is on {k.device}")
    return q.transpose(1, 2), k.transpose(1, 2)  # (B, H, Sq, dh), (B, Hkv, Sk, dh): views


def row_masks(
    q: Tensor,
    k: Tensor,
    key_padding: Tensor | None,
    attn_mask: Tensor | None,
    is_causal: bool,
    window: int | None = None,
) -> RowMasks:
    """q [B, H, Sq, dh], k [B, Hkv, Sk, dh]: the masks of blocks of query rows (checked here); ``window``
    a sliding window (query i sees key j iff i - window < j <= i, bottom-right aligned)."""
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool; got {type(is_causal).__name__} {is_causal!r}")
    return RowMasks(
        batch=q.shape[0], n_heads=q.shape[1], seq_q=q.shape[2], seq_k=k.shape[2], key_padding=key_padding,
        attn_mask=attn_mask, is_causal=is_causal, dtype=torch.float32, device=q.device, window=window,
    )  # fmt: skip


def score_scale(scale: Any, d_head: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(d_head)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number (or None for 1/sqrt(d_head)); got {scale!r}")
    return float(scale)


@dataclass
class PatternBlock:
    """One block of pattern rows, as :func:`iter_pattern_blocks` yields it.

    ``index`` int64 [rows]: the block's query indices. ``weights`` float32 [batch, n_heads, rows, width]:
    the *unnormalised* softmax ``exp(t)`` of the keys ``0 .. width - 1`` (with a causal mask, ``width``
    stops at the block's last visible key: every later key has weight 0 in every row of the block);
    ``norm`` [batch, n_heads, rows] their sum (``inf`` on dead rows, so that ``weights / norm`` is 0
    there); ``entropy`` [batch, n_heads, rows] in nats (0 on dead rows). Normalising only what is read
    (a few gathered keys, a max) saves a pass over the block.
    """

    index: Tensor
    weights: Tensor
    norm: Tensor
    entropy: Tensor

    @property
    def width(self) -> int:
        return self.weights.shape[-1]

    def pattern(self) -> Tensor:
        """The normalised rows [batch, n_heads, rows, width] (fresh memory)."""
        return self.weights / self.norm.unsqueeze(-1)

    def gather(self, keys: Tensor) -> Tensor:
        """The mass on ``keys`` int64 [batch|1, rows, n] per row: [batch, n_heads, rows, n].

        A key outside ``0 .. width - 1`` (before the first key, or masked for the whole block) has 0.
        """
        B, H, n, K = self.weights.shape
        valid = (keys >= 0) & (keys < K)  # (B|1, rows, n)
        idx = keys.clamp(0, K - 1)[:, None].expand(B, H, n, keys.shape[-1])  # (B, H, rows, n)
        w = self.weights.gather(-1, idx) * valid[:, None].to(self.weights.dtype)  # (B, H, rows, n)
        return w / self.norm.unsqueeze(-1)


def _buffer(store: list[Tensor], i: int, shape: tuple[int, ...], device: torch.device) -> Tensor:
    """A contiguous float32 tensor of ``shape`` in the reusable flat buffer ``store[i]`` (grown if needed).

    Reusing one buffer per role across blocks matters on the CPU: a fresh multi-MB block is new memory the
    kernel must fault in page by page, which slows the ops that write into it (see docs/benchmarks.md,
    "Figures formerly in docstrings").
    """
    n = math.prod(shape)
    if store[i].numel() < n:
        store[i] = torch.empty(n, dtype=torch.float32, device=device)
    return store[i][:n].view(shape)


def softmax_block(
    q_rows: Tensor,
    k_t: Tensor,
    mask: CanonicalMask,
    scale: float,
    *,
    causal_from: int | None = None,
    buffers: list[Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """One block's unnormalised softmax, its sums and entropies, float32.

    q_rows [batch, n_heads, rows, d_head] (any float dtype), k_t [batch, n_kv_heads, d_head, width]
    float32 (k transposed), ``mask`` the block's :class:`~headspace.masks.CanonicalMask` over those
    ``width`` keys. ``causal_from``: instead of a mask, rows ``i`` of the block see keys
    ``0 .. causal_from + i`` (a causal block with nothing else masked: only the diagonal square
    ``[rows, width - causal_from]`` is filled). ``buffers``: two reusable flat float32 buffers (see
    :func:`_buffer`; None: fresh memory). Returns (weights [batch, n_heads, rows, width], norm [batch,
    n_heads, rows], entropy [batch, n_heads, rows]) as :class:`PatternBlock` holds them. One
    [batch, n_heads, rows, width] buffer for the scores and one for the weights; about six passes.
    """
    B, H, n, dh = q_rows.shape
    Hkv, K = k_t.shape[1], k_t.shape[3]
    g = H // Hkv
    store = buffers if buffers is not None else [q_rows.new_empty(0, dtype=torch.float32)] * 2
    qb = (q_rows.to(torch.float32) * scale).reshape(B, Hkv, g * n, dh)  # (B, Hkv, g rows, dh): heads by group
    t = _buffer(store, 0, (B, Hkv, g * n, K), q_rows.device)
    torch.matmul(qb, k_t, out=t)
    t = t.view(B, H, n, K)  # (B, H, rows, K): scaled scores
    m = mask.mask
    later: Tensor | None = None  # causal_from: the future keys of the diagonal square
    blocked: Tensor | None = None  # otherwise: the masked keys, [b|1, h|1, rows, K]
    if causal_from is not None:
        c = causal_from
        rows = torch.arange(n, device=t.device)  # (rows,)
        later = torch.arange(K - c, device=t.device)[None, :] > rows[:, None]  # (rows, K - c)
        t[..., c:].masked_fill_(later, _NEG)
    elif m is not None:
        if m.dtype == torch.bool:
            blocked = ~m
            t.masked_fill_(blocked, _NEG)  # out of the max below
        else:
            t.add_(m)
            blocked = torch.isneginf(m)
    t.sub_(t.amax(dim=-1, keepdim=True))  # max-shifted; a row's max is finite (dead rows were opened)
    t.clamp_(min=_EXP_FLOOR)  # exp() of anything lower takes torch's slow CPU path (see _EXP_FLOOR)
    w = torch.exp(t, out=_buffer(store, 1, (B, H, n, K), t.device))  # (B, H, rows, K)
    if later is not None:
        w[..., causal_from:].masked_fill_(later, 0.0)  # masked keys: exactly 0
    elif blocked is not None:
        w.masked_fill_(blocked, 0.0)
    z = w.sum(dim=-1)  # (B, H, rows), >= 1
    wt = torch.einsum("bhqk,bhqk->bhq", w, t)  # (B, H, rows): sum_j e^{t_j} t_j
    entropy = z.log() - wt / z  # (B, H, rows)
    if mask.dead_rows is not None and causal_from is None:
        dead = mask.dead_rows[..., 0]  # (b|1, h|1, rows)
        z = z.masked_fill(dead, float("inf"))
        entropy.masked_fill_(dead, 0.0)
    return w, z, entropy


def iter_pattern_blocks(
    q: Tensor,
    k: Tensor,
    masks: RowMasks,
    *,
    scale: float,
    chunk_size: int | None = None,
    rows: Tensor | None = None,
) -> Iterator[PatternBlock]:
    """Blocks of pattern rows of q [B, H, Sq, dh] against k [B, Hkv, Sk, dh] (heads-first layout).

    Yields a :class:`PatternBlock` for consecutive blocks of ``chunk_size`` queries (None:
    :func:`default_chunk_size`), over every query or over the query indices ``rows`` (1-D int64).
    With a causal mask a block is computed against the keys up to its last visible key only (on
    average half the work), and when causality is the only mask (no padding, seq_q <= seq_k) only the
    block's diagonal square is masked. The block's buffers are reused by the next block: read (or
    copy) what you need before asking for it.
    """
    B, H, Sq, _ = q.shape
    Sk = k.shape[2]
    k_t = k.to(torch.float32).transpose(-2, -1)  # (B, Hkv, dh, Sk): one float32 copy when k is not
    total = Sq if rows is None else int(rows.shape[0])
    step = default_chunk_size(B, H, total, Sk) if chunk_size is None else chunk_size
    offset = Sk - Sq  # bottom-right alignment of causality
    kp = masks.key_padding
    causal_only = (
        masks.is_causal
        and masks.window is None
        and masks.attn_mask is None
        and offset >= 0
        and rows is None
        and (kp is None or bool(kp.all()))
    )
    no_mask = CanonicalMask(mask=None, is_causal=False, dead_rows=None)
    buffers = [q.new_empty(0, dtype=torch.float32)] * 2
    for start in range(0, total, step):
        end = min(total, start + step)
        causal_from = None
        if rows is None:
            index = torch.arange(start, end, device=q.device)  # (rows,)
            last_query = end - 1
            mask = no_mask if causal_only else masks.rows(start, end)
            q_rows = q[:, :, start:end]  # (B, H, rows, dh)
            if causal_only:
                causal_from = start + offset
        else:
            index = rows[start:end]  # (rows,)
            last_query = int(index.max())
            mask = masks.rows(index)
            q_rows = q.index_select(2, index)  # (B, H, rows, dh)
        width = Sk
        if masks.is_causal:  # later keys are masked for every row of the block
            width = max(1, min(Sk, last_query + 1 + offset))
        if width < Sk and mask.mask is not None:
            m = mask.mask
            mask = CanonicalMask(
                mask=m if m.shape[-1] == 1 else m[..., :width], is_causal=False, dead_rows=mask.dead_rows
            )
        w, z, entropy = softmax_block(
            q_rows, k_t[..., :width], mask, scale, causal_from=causal_from, buffers=buffers
        )
        yield PatternBlock(index, w, z, entropy)
        del w, z, entropy


def prepared(
    q: Any, k: Any, key_padding: Tensor | None, attn_mask: Tensor | None, is_causal: bool,
    window: int | None, scale: Any, chunk_size: Any,
) -> tuple[Tensor, Tensor, RowMasks, float]:  # fmt: skip
    """What every blockwise statistic starts from, checked: q [B, H, Sq, dh] and k [B, Hkv, Sk, dh] (views
    of the hook points' [batch, seq, heads, d_head]), the masks of blocks of query rows, and the scale."""
    check_chunk(chunk_size)
    q4, k4 = heads_first(q, k)
    masks = row_masks(q4, k4, key_padding, attn_mask, is_causal, window)
    return q4, k4, masks, score_scale(scale, q4.shape[-1])
