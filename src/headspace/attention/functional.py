"""Pure attention maths: one function per backend, one signature.

Every backend is a pure function::

    backend(q, k, v, mask, *, scale, dropout_p) -> (out, pattern | None)

Notation used for tensor shapes:
    batch: batch size; n_heads: query heads; n_kv_heads: key/value heads (divides n_heads);
    seq_q / seq_k: query / key length; d_head: per-head width.

    q:        [batch, n_heads, seq_q, d_head]
    k, v:     [batch, n_kv_heads, seq_k, d_head]
    mask:     a :class:`~headspace.masks.CanonicalMask`
    out:      [batch, n_heads, seq_q, d_head]
    pattern:  [batch, n_heads, seq_q, seq_k] (rows sum to 1; dead rows are all 0)

Query head ``h`` reads key/value head ``h // (n_heads // n_kv_heads)`` (grouped-query attention).

Backends:
    ``"sdpa"``     torch's fused ``scaled_dot_product_attention``; returns no pattern.
    ``"explicit"``  scores and softmax written out by a blocked kernel; returns the pattern.
    ``"reference"`` the same maths in plain autograd ops; the reference the others are tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels.blocked import blocked_attention
from ..nn.hooks import Memo, resolve
from ..nn.masks import CanonicalMask, causal_mask
from ..nn.softcap import soft_cap
from .sinks import sink_pattern

AttentionBackend = Callable[..., tuple[Tensor, Tensor | None]]


def repeat_kv(x: Tensor, n_heads: int) -> Tensor:
    """[batch, n_kv_heads, seq, d_head] -> [batch, n_heads, seq, d_head] (each kv head serves a group)."""
    n_kv_heads = x.shape[1]
    if n_kv_heads == n_heads:
        return x
    return x.repeat_interleave(n_heads // n_kv_heads, dim=1)  # (batch, n_heads, seq, d_head)


def attention_scores(
    q: Tensor, k: Tensor, mask: CanonicalMask, *, scale: float, softcap: float | None = None
) -> Tensor:
    """Scaled, masked scores ``q k^T * scale`` with ``-inf`` where a key may not be attended.

    ``softcap`` (Gemma 2's attention logit soft-capping): ``softcap * tanh(q k^T * scale / softcap)``,
    applied before the mask (so masked keys stay ``-inf``).

    Shapes: q [batch, n_heads, seq_q, d_head], k [batch, n_kv_heads, seq_k, d_head]
    -> [batch, n_heads, seq_q, seq_k].
    """
    k = repeat_kv(k, q.shape[1]).contiguous()  # (batch, n_heads, seq_k, d_head): k^T a view, no copy
    scores = torch.matmul(q * scale, k.transpose(-2, -1))  # (batch, n_heads, seq_q, seq_k)
    fresh = not scores.requires_grad  # no graph: the same ops in place on the fresh scores, same values
    if softcap is not None:
        scores = soft_cap(scores, softcap, in_place=fresh)  # (batch, n_heads, seq_q, seq_k)
    m = mask.mask
    if mask.is_causal:
        m = causal_mask(q.shape[-2], k.shape[-2], q.device)  # (seq_q, seq_k)
    if m is None:
        return scores
    in_place = fresh and torch.broadcast_shapes(m.shape, scores.shape) == scores.shape
    if m.dtype == torch.bool:
        return scores.masked_fill_(~m, float("-inf")) if in_place else scores.masked_fill(~m, float("-inf"))
    return scores.add_(m) if in_place and m.dtype == scores.dtype else scores + m


def attention_pattern(scores: Tensor, mask: CanonicalMask) -> Tensor:
    """Softmax over keys, with dead rows (nothing to attend to) set to exactly zero.

    Shapes: scores [batch, n_heads, seq_q, seq_k] -> pattern of the same shape.
    """
    pattern = torch.softmax(scores, dim=-1)  # (batch, n_heads, seq_q, seq_k)
    if mask.dead_rows is not None:
        pattern = pattern.masked_fill(mask.dead_rows, 0.0)
    return pattern


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: CanonicalMask, *, scale: float, dropout_p: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Reference backend: scores, softmax and the weighted sum written out with plain autograd ops.

    The slowest and simplest backend, differentiable to any order; every other backend is tested
    against it. Returns (out, pattern).
    """
    out, pattern, _ = reference_parts(q, k, v, mask, scale=scale, dropout_p=dropout_p)
    return out, pattern


def reference_parts(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: CanonicalMask,
    *,
    scale: float,
    dropout_p: float = 0.0,
    on_scores: Callable[[Tensor], Tensor] | None = None,
    on_pattern: Callable[[Tensor], Tensor] | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The reference maths with its intermediates: returns (out, pattern, weights after dropout).

    ``on_scores`` / ``on_pattern`` see the scores and the pattern and return them, possibly replaced:
    the traced path of every attention layer passes its hook points here, so a traced layer computes
    exactly the reference backend's maths. ``softcap``: as :func:`attention_scores`'s. ``sinks`` [n_heads]:
    learned sink logits in each row's softmax (:func:`headspace.attention.sinks.sink_pattern`).
    """
    scores = attention_scores(q, k, mask, scale=scale, softcap=softcap)  # (batch, n_heads, seq_q, seq_k)
    if on_scores is not None:
        scores = on_scores(scores)
    if sinks is None:
        pattern = attention_pattern(scores, mask)  # (batch, n_heads, seq_q, seq_k)
    else:
        pattern = sink_pattern(scores, sinks)  # (batch, n_heads, seq_q, seq_k): rows sum to 1 - sink
    if on_pattern is not None:
        pattern = on_pattern(pattern)
    weights = F.dropout(pattern, p=dropout_p) if dropout_p > 0.0 else pattern
    out = torch.matmul(weights, repeat_kv(v, q.shape[1]))  # (batch, n_heads, seq_q, d_head)
    return out, pattern, weights


#: The traced path computes a layer's scores a block of query rows at a time once they would exceed this
#: many bytes (smaller layers are computed whole, exactly as :func:`reference_parts`).
TRACED_BLOCK_BYTES = 64 << 20
#: Fewest query rows in one block of the traced path.
TRACED_MIN_ROWS = 64


def mask_rows(
    mask: CanonicalMask,
    seq_q: int,
    seq_k: int,
    start: int,
    end: int,
    device: torch.device | str | None = None,
) -> CanonicalMask:
    """The canonical mask of query rows ``start .. end - 1`` only (causality as an explicit bool mask
    [rows, seq_k], built for those rows alone, on ``device``).

    Used with q's rows ``start:end``, :func:`attention_scores` and :func:`attention_pattern` give the
    rows ``start:end`` of what they give on the whole mask (bottom-right causal alignment kept).
    """
    m = mask.mask
    if mask.is_causal:
        rows = torch.ones(end - start, seq_k, dtype=torch.bool, device=device)
        m = rows.tril(diagonal=seq_k - seq_q + start)  # (rows, seq_k): causal_mask(seq_q, seq_k)[start:end]
    elif m is not None and m.shape[-2] != 1:
        m = m[..., start:end, :]  # (b|1, h|1, rows, seq_k|1)
    dead = mask.dead_rows
    if dead is not None and dead.shape[-2] != 1:
        dead = dead[..., start:end, :]  # (b|1, h|1, rows, 1)
    return CanonicalMask(mask=m, is_causal=False, dead_rows=dead)


def mask_head(mask: CanonicalMask, head: int) -> CanonicalMask:
    """The canonical mask of query head ``head`` only (head axis kept, of size 1)."""
    m, dead = mask.mask, mask.dead_rows
    if m is not None and m.dim() == 4 and m.shape[1] != 1:
        m = m[:, head : head + 1]  # (b|1, 1, seq_q|1, seq_k|1)
    if dead is not None and dead.shape[1] != 1:
        dead = dead[:, head : head + 1]  # (b|1, 1, seq_q|1, 1)
    return CanonicalMask(mask=m, is_causal=mask.is_causal, dead_rows=dead)


def row_blocks(batch_heads: int, seq_q: int, seq_k: int, element_size: int) -> list[tuple[int, int]]:
    """The blocks of query rows (start, end) the traced path computes a layer's scores in: one block of
    every row while [batch_heads, seq_q, seq_k] fits :data:`TRACED_BLOCK_BYTES`, else blocks of at
    least :data:`TRACED_MIN_ROWS` rows that fit it, a short last block joining the one before (so no
    block is a GEMM of a few rows, which may round otherwise: one row is a matrix-vector product)."""
    per_row = max(1, batch_heads * seq_k * element_size)
    rows = max(TRACED_MIN_ROWS, TRACED_BLOCK_BYTES // per_row)
    if rows >= seq_q:
        return [(0, seq_q)]
    blocks = [(start, min(seq_q, start + rows)) for start in range(0, seq_q, rows)]
    if blocks[-1][1] - blocks[-1][0] < TRACED_MIN_ROWS:
        last = blocks.pop()
        blocks[-1] = (blocks[-1][0], last[1])
    return blocks


class _RowBuffers:
    """Two scratch buffers reused by every block of one layer (the scores and the pattern of a block),
    so that the blocks do not allocate, and fault in, fresh block-sized memory one after another."""

    def __init__(self, like: Tensor, numel: int) -> None:
        self.scores = like.new_empty(numel)
        self.pattern = like.new_empty(numel)

    @staticmethod
    def view(buf: Tensor, shape: tuple[int, ...]) -> Tensor:
        n = 1
        for d in shape:
            n *= d
        return buf[:n].view(shape)


def _block_scores(
    q: Tensor, k_t: Tensor, m: CanonicalMask, scale: float, start: int, end: int, buf: Tensor
) -> Tensor:
    """:func:`attention_scores`' rows ``start:end`` (``m`` their :func:`mask_rows`), written into ``buf``:
    the same ops (q times the scale, the GEMM with the repeated k, then the mask), in place where the
    whole-layer function makes a new tensor (the values are the same). k_t [B, H, d_head, seq_k]."""
    B, H = q.shape[0], q.shape[1]
    scores = _RowBuffers.view(buf, (B, H, end - start, k_t.shape[-1]))  # (B, H, rows, Sk)
    torch.matmul(q[:, :, start:end] * scale, k_t, out=scores)
    if m.mask is not None:
        if m.mask.dtype == torch.bool:
            scores.masked_fill_(~m.mask, float("-inf"))
        else:
            scores.add_(m.mask)
    return scores


def _block_pattern(scores: Tensor, m: CanonicalMask, buf: Tensor) -> Tensor:
    """:func:`attention_pattern` of one block's scores, written into ``buf`` (the same values)."""
    pattern = _RowBuffers.view(buf, tuple(scores.shape))
    torch.softmax(scores, dim=-1, out=pattern)
    if m.dead_rows is not None:
        pattern.masked_fill_(m.dead_rows, 0.0)
    return pattern


def reference_rows(
    q: Tensor, k: Tensor, v: Tensor, mask: CanonicalMask, *, scale: float, dropout_p: float = 0.0
) -> Tensor:
    """:func:`reference_parts`'s output alone, in bounded memory: out [batch, n_heads, seq_q, d_head].

    While the layer's scores fit :data:`TRACED_BLOCK_BYTES` (or with dropout) this *is*
    :func:`reference_parts`; beyond, the same ops run on the :func:`row_blocks` of query rows (each at
    least :data:`TRACED_MIN_ROWS`), in two block-sized buffers reused block after block, so no
    [seq_q, seq_k] tensor larger than one block exists. A block's scores and softmax are the whole
    layer's rows bit for bit; its weighted sum is too at d_head 64 (tested), while at tiny widths
    (d_head 5) the GEMM may round otherwise: then z agrees to float32 rounding.
    """
    B, H, Sq, _ = q.shape
    Sk = k.shape[-2]
    blocks = row_blocks(B * H, Sq, Sk, q.element_size())
    if len(blocks) == 1 or dropout_p > 0.0:
        out, _, _ = reference_parts(q, k, v, mask, scale=scale, dropout_p=dropout_p)
        return out
    k_t = repeat_kv(k, H).contiguous().transpose(-2, -1)  # (B, H, dh, Sk): attention_scores' k^T
    v_all = repeat_kv(v, H)  # (B, H, Sk, dh)
    most = max(end - start for start, end in blocks)
    buffers = _RowBuffers(q, B * H * most * Sk)
    out = []
    for start, end in blocks:
        m = mask_rows(mask, Sq, Sk, start, end, q.device)
        scores = _block_scores(q, k_t, m, scale, start, end, buffers.scores)  # (B, H, rows, Sk)
        pattern = _block_pattern(scores, m, buffers.pattern)  # (B, H, rows, Sk)
        out.append(torch.matmul(pattern, v_all))  # (B, H, rows, dh)
    return torch.cat(out, dim=2)  # (B, H, Sq, dh)


def attention_rows(q: Tensor, k: Tensor, mask: CanonicalMask, *, scale: float, which: str) -> Tensor:
    """:func:`attention_scores` (``which="scores"``) or their :func:`attention_pattern` (``"pattern"``)
    [batch, n_heads, seq_q, seq_k], computed on the :func:`row_blocks` of query rows into the result:
    bit for bit the whole-layer values, with no more than one block of scores and one of the pattern
    besides the result itself."""
    B, H, Sq, _ = q.shape
    Sk = k.shape[-2]
    blocks = row_blocks(B * H, Sq, Sk, q.element_size())
    if len(blocks) == 1:
        scores = attention_scores(q, k, mask, scale=scale)  # (B, H, Sq, Sk)
        return scores if which == "scores" else attention_pattern(scores, mask)
    out = q.new_empty(B, H, Sq, Sk)
    k_t = repeat_kv(k, H).contiguous().transpose(-2, -1)  # (B, H, dh, Sk): attention_scores' k^T
    most = max(end - start for start, end in blocks)
    buffers = _RowBuffers(q, B * H * most * Sk)
    for start, end in blocks:
        m = mask_rows(mask, Sq, Sk, start, end, q.device)
        block = _block_scores(q, k_t, m, scale, start, end, buffers.scores)  # (B, H, rows, Sk)
        if which == "pattern":
            block = _block_pattern(block, m, buffers.pattern)
        out[:, :, start:end].copy_(block)
    return out


class DeferredAttention:
    """A traced layer's ``hook_scores`` or ``hook_pattern``, kept as the q and k it was computed from.

    q [batch, n_heads, seq_q, d_head] and k [batch, n_kv_heads, seq_k, d_head] are the tensors the layer
    attended with (after its hooks and rotation, detached), or deferred values that compute them again
    (:class:`~headspace.hooks.Recomputed`: in a fully recorded block, from the block's input), ``mask``
    its canonical mask. ``materialize()`` recomputes :func:`attention_scores` (``which="scores"``) or
    its :func:`attention_pattern` (``"pattern"``) [batch, n_heads, seq_q, seq_k] with the same ops on the
    same tensors, a block of query rows at a time (:func:`attention_rows`): the values the traced path
    computes, bit for bit; ``materialize(h)`` head ``h`` only [batch, 1, seq_q, seq_k].
    """

    def __init__(self, q: Any, k: Any, mask: CanonicalMask, scale: float, which: str) -> None:
        if which not in ("scores", "pattern"):
            raise ValueError(f"which must be 'scores' or 'pattern'; got {which!r}")
        self.q, self.k, self.mask, self.scale, self.which = q, k, mask, scale, which
        B, H, Sq, _ = q.shape
        self.shape = (B, H, Sq, k.shape[-2])

    def evaluate(self, memo: Memo, head: int | None = None) -> Tensor:
        """:meth:`materialize` with the deferred q and k resolved through ``memo``."""
        q, k, mask = resolve(self.q, memo), resolve(self.k, memo), self.mask
        if head is not None:
            g = head // (q.shape[1] // k.shape[1])  # the key/value head query head ``head`` reads
            q, k, mask = q[:, head : head + 1], k[:, g : g + 1], mask_head(mask, head)
        return attention_rows(q, k, mask, scale=self.scale, which=self.which)  # (B, H|1, Sq, Sk)

    def materialize(self, head: int | None = None) -> Tensor:
        """[batch, n_heads, seq_q, seq_k], or [batch, 1, seq_q, seq_k] for query head ``head``."""
        return self.evaluate({}, head)


class DeferredResult:
    """A traced layer's ``hook_result`` [batch, seq_q, n_heads, d_model], kept as z and a copy of W_O.

    ``materialize()`` is ``einsum("bshd,hdm->bshm", z, W_O)``, the traced path's own op on the same
    tensors (so bit for bit its value; the copy of W_O keeps it so after the weights change);
    ``materialize(h)`` head ``h`` only [batch, seq_q, 1, d_model].
    """

    def __init__(self, z: Tensor, W_O: Tensor) -> None:
        self.z, self.W_O = z, W_O
        B, Sq, H, _ = z.shape
        self.shape = (B, Sq, H, W_O.shape[-1])

    def evaluate(self, memo: Memo, head: int | None = None) -> Tensor:
        """:meth:`materialize` (``memo`` resolves a deferred z)."""
        z = resolve(self.z, memo)
        if head is None:
            return torch.einsum("bshd,hdm->bshm", z, self.W_O)  # (B, Sq, H, d_model)
        z, w = z[:, :, head : head + 1], self.W_O[head : head + 1]
        return torch.einsum("bshd,hdm->bshm", z, w)  # (B, Sq, 1, d_model)

    def materialize(self, head: int | None = None) -> Tensor:
        """[batch, seq_q, n_heads, d_model], or [batch, seq_q, 1, d_model] for head ``head``."""
        return self.evaluate({}, head)


def explicit_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: CanonicalMask, *, scale: float, dropout_p: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Explicit backend: the pattern is materialised and returned. Returns (out, pattern).

    Same maths as :func:`reference_attention`, computed by a blocked kernel that writes the pattern
    once in place, reads q, k and v where they lie (views of the fused projection, no copies), and
    whose backward needs only one block-sized buffer (:mod:`headspace.kernels.blocked`).
    Differentiable to any order: ``backward(create_graph=True)`` computes the gradients with plain
    autograd ops on the saved pattern instead of the in-place kernel. The reference path is used
    instead with dropout, a float mask that requires grad, or empty inputs.
    """
    m = mask.mask
    if (
        dropout_p > 0.0
        or (m is not None and m.requires_grad)
        or q.numel() == 0
        or k.numel() == 0
        or q.shape[1] % k.shape[1] != 0
    ):
        return reference_attention(q, k, v, mask, scale=scale, dropout_p=dropout_p)
    return blocked_attention(q, k, v, mask, scale)


def sdpa_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: CanonicalMask, *, scale: float, dropout_p: float = 0.0
) -> tuple[Tensor, None]:
    """Fused backend: torch's ``scaled_dot_product_attention``. Returns (out, None)."""
    n_heads, n_kv_heads = q.shape[1], k.shape[1]
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask.mask,
        dropout_p=dropout_p,
        is_causal=mask.is_causal,
        scale=scale,
        enable_gqa=n_kv_heads != n_heads,
    )  # (batch, n_heads, seq_q, d_head)
    if mask.dead_rows is not None:
        out = out.masked_fill(mask.dead_rows, 0.0)
    return out, None


BACKENDS: dict[str, AttentionBackend] = {
    "sdpa": sdpa_attention,
    "explicit": explicit_attention,
    "reference": reference_attention,
}


def get_backend(name: str) -> AttentionBackend:
    """Look up a backend by name; the error lists the known ones."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known backends: {sorted(BACKENDS)}") from None
