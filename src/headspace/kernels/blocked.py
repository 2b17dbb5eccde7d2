"""The blocked CPU kernel behind the explicit backend (:func:`headspace.functional.explicit_attention`).

The maths is :func:`headspace.functional.reference_attention` (scores, softmax, weighted sum); this file
is only the speed machinery that computes it in place, block by block, with a hand-written backward.

Entry point: :func:`blocked_attention` ``(q, k, v, mask, scale) -> (out, pattern)`` with the shapes of
:mod:`headspace.functional` (q [batch, n_heads, seq_q, d_head], k, v [batch, n_kv_heads, seq_k, d_head]).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..nn.masks import CanonicalMask, causal_mask
from .workspace import recycled_empty

# ---------------------------------------------------------------------------------------------------
# The blocked explicit kernel (need_weights=True without dropout).
#
# The pattern [batch, n_heads, seq_q, seq_k] is the one big tensor of the explicit path. Its memory is
# recycled (headspace.workspace.recycled_empty): a pattern the caller has dropped serves the next one,
# so a loop over batches faults its pages in once, not on every call. The kernel
# writes each block of it exactly once, in place: scores (scale inside the GEMM), mask, softmax and
# dead rows, then the block is multiplied by v. The backward pass reuses one block-sized buffer for
# dP -> dS (dS = P * (dP - rowsum(dP * P))), so beyond the pattern and that buffer neither pass
# allocates anything of size seq_q x seq_k. Grouped-query attention needs no repeat_kv copies: the
# G query heads of one key/value head are laid out as G * seq_q rows of one matrix.
#
# Blocks are large on purpose. Small cache-sized blocks bought little (the kernel already runs at the
# sum of its GEMMs and softmax) and cost much on a busy machine, where every parallel region of a
# multi-threaded GEMM may wait for a descheduled thread: a few large GEMMs, not many small ones (the
# figures: docs/benchmarks.md, "Figures formerly in docstrings").
# ---------------------------------------------------------------------------------------------------

#: Forward block size in bytes of the pattern (the forward needs no buffer of its own).
FORWARD_BLOCK_BYTES = 256 << 20
#: Backward block size in bytes: the size of the one dS buffer the backward allocates.
BLOCK_BYTES = 64 << 20
#: Samples are merged into one block (at the price of contiguous copies of q, k, v) only while one
#: sample's pattern is at most this large: beyond it the copies would raise the peak memory.
MERGE_SAMPLES_MAX_BYTES = 8 << 20

Block = tuple[int, int, int, int, int, int]  # (b0, b1, h0, h1, i0, i1)


def _samples_per_block(
    batch: int, n_heads: int, seq_q: int, seq_k: int, itemsize: int, block_bytes: int
) -> int:
    """How many whole samples one block holds (0 or 1: blocks stay inside one sample).

    Blocks of several samples need q, k, v, dO contiguous (samples and heads merge into one batch
    dimension); small problems take that copy to do a few large GEMMs instead of many tiny ones.
    """
    per_sample = n_heads * seq_q * seq_k * itemsize
    if batch < 2 or per_sample > min(block_bytes // 2, MERGE_SAMPLES_MAX_BYTES):
        return 0
    return min(batch, block_bytes // per_sample)


def _blocks(
    batch: int, n_heads: int, n_kv_heads: int, seq_q: int, seq_k: int, itemsize: int, block_bytes: int
):
    """Yield blocks (b0, b1, h0, h1, i0, i1) of about ``block_bytes`` of the pattern.

    A block is either several whole samples (b1 - b0 > 1), or whole key/value groups of one sample
    (h0:h1 a multiple of the group size, all queries), or a band of queries of one head.
    """
    group = n_heads // n_kv_heads
    n_samples = _samples_per_block(batch, n_heads, seq_q, seq_k, itemsize, block_bytes)
    unit = group * seq_q * seq_k * itemsize  # one key/value group of one sample
    if n_samples > 1:
        for b0 in range(0, batch, n_samples):
            yield b0, min(batch, b0 + n_samples), 0, n_heads, 0, seq_q
    elif unit <= block_bytes:
        n_units = max(1, block_bytes // unit)
        for b in range(batch):
            for g0 in range(0, n_kv_heads, n_units):
                g1 = min(n_kv_heads, g0 + n_units)
                yield b, b + 1, g0 * group, g1 * group, 0, seq_q
    else:
        rows = max(1, block_bytes // (seq_k * itemsize))
        for b in range(batch):
            for h in range(n_heads):
                for i0 in range(0, seq_q, rows):
                    yield b, b + 1, h, h + 1, i0, min(seq_q, i0 + rows)


def _block_views(t: Tensor, blk: Block, group: int, seq_q: int) -> Tensor:
    """Block of a [batch, n_heads, seq_q, X] tensor as [kv heads in block, rows, X] (a view, no copy).

    A band of one head, or heads of one sample with ``group == 1``, is plain slicing and works on any
    strides; merging samples, or the ``group`` query heads of a key/value head into ``group * seq_q``
    rows, needs ``t`` contiguous (``.view`` raises otherwise: never a silent copy).
    """
    b0, b1, h0, h1, i0, i1 = blk
    if b1 - b0 > 1:
        return t[b0:b1].view(-1, group * seq_q, t.shape[-1])  # (samples * kv heads, G seq_q, X)
    if group == 1 or h1 - h0 == 1:
        return t[b0, h0:h1, i0:i1]  # (heads, rows, X)
    return t[b0, h0:h1].view((h1 - h0) // group, group * seq_q, t.shape[-1])  # (g, G seq_q, X)


def _kv_block(t: Tensor, blk: Block, group: int) -> Tensor:
    """The key/value heads serving the block's query heads: [kv heads in block, seq_k, d_head]."""
    b0, b1, h0, h1, _, _ = blk
    if b1 - b0 > 1:
        return t[b0:b1].view(-1, t.shape[-2], t.shape[-1])  # (samples * kv heads, seq_k, d_head)
    return t[b0, h0 // group : (h1 - 1) // group + 1]  # (g, seq_k, d_head)


def _mask_parts(mask: CanonicalMask, shape: tuple[int, int, int, int], device: torch.device):
    """(blocked bool, additive float, dead rows), each expanded to ``shape`` or None."""
    m = mask.mask
    if mask.is_causal:
        m = causal_mask(shape[2], shape[3], device)[None, None]  # (1, 1, seq_q, seq_k)
    blocked = additive = dead = None
    if m is not None:
        if m.dtype == torch.bool:
            blocked = (~m).expand(shape)  # (batch, n_heads, seq_q, seq_k), broadcast view
        else:
            additive = m.expand(shape)  # (batch, n_heads, seq_q, seq_k), broadcast view
    if mask.dead_rows is not None:
        dead = mask.dead_rows.expand(*shape[:3], 1)  # (batch, n_heads, seq_q, 1), broadcast view
    return blocked, additive, dead


def _blocked_forward(
    q: Tensor, k: Tensor, v: Tensor, mask: CanonicalMask, scale: float
) -> tuple[Tensor, Tensor]:
    """Forward of the blocked kernel: q [B, H, Sq, dh], k, v [B, Hkv, Sk, dh] (any strides with last
    stride 1; q contiguous when H > Hkv). Returns (out, pattern)."""
    B, H, Sq, _ = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    group = H // Hkv
    pattern = recycled_empty((B, H, Sq, Sk), q.dtype, q.device)  # reused once the caller drops it
    # Contiguous on purpose: torch.bmm(out=) into a strided (heads-last) block takes a slow
    # non-BLAS path with more than one thread (docs/benchmarks.md, "Figures formerly in docstrings").
    out = q.new_empty(B, H, Sq, q.shape[-1])  # (B, H, Sq, dh)
    blocked, additive, dead = _mask_parts(mask, (B, H, Sq, Sk), q.device)
    for blk in _blocks(B, H, Hkv, Sq, Sk, q.element_size(), FORWARD_BLOCK_BYTES):
        p = _block_views(pattern, blk, group, Sq)  # (g, rows, Sk)
        kb, vb = _kv_block(k, blk, group), _kv_block(v, blk, group)  # (g, Sk, dh)
        qb = _block_views(q, blk, group, Sq)  # (g, rows, dh)
        p.baddbmm_(qb, kb.transpose(1, 2), beta=0.0, alpha=scale)  # q k^T * scale, scale inside the GEMM
        b0, b1, h0, h1, i0, i1 = blk
        p4 = pattern[b0:b1, h0:h1, i0:i1]  # (heads, queries, Sk): the same memory, per head
        if blocked is not None:
            p4.masked_fill_(blocked[b0:b1, h0:h1, i0:i1], float("-inf"))
        if additive is not None:
            p4.add_(additive[b0:b1, h0:h1, i0:i1])
        torch._softmax(p, -1, False, out=p)  # in place: the CPU and CUDA kernels read a row before writing it
        if dead is not None:
            p4.masked_fill_(dead[b0:b1, h0:h1, i0:i1], 0.0)
        torch.bmm(p, vb, out=_block_views(out, blk, group, Sq))  # (g, rows, dh)
    return out, pattern


def _blocked_backward(
    grad_out: Tensor,
    grad_pattern: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    pattern: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of the blocked kernel: dq [B, H, Sq, dh], dk, dv [B, Hkv, Sk, dh].

    Softmax backward is ``dS = P * (dP - D)`` with ``D = rowsum(P * dP)``. Since ``out = P v`` and
    ``dP = dO v^T``, ``rowsum(P * dP) = rowsum(dO * out)``: D costs O(seq_q * d_head), not a pass over
    the pattern (plus ``rowsum(P * dPattern)`` when the pattern itself has a gradient). ``dP - D`` is
    formed by the GEMM itself (``baddbmm`` with ``-D`` as its input), so each block of dS takes one
    GEMM and one in-place multiply, in one reused block-sized buffer.
    """
    B, H, Sq, dh = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    group = H // Hkv
    merged = _samples_per_block(B, H, Sq, Sk, q.element_size(), BLOCK_BYTES) > 1
    if group > 1 or merged:  # heads merged into rows, or samples merged: contiguous layouts needed
        grad_out = grad_out.contiguous()
        if grad_pattern is not None:
            grad_pattern = grad_pattern.contiguous()
    neg_d = (grad_out * out).sum(-1, keepdim=True).neg_().contiguous()  # (B, H, Sq, 1): -rowsum(dO * out)
    dq = q.new_empty(B, H, Sq, dh)
    dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)  # (B, Hkv, Sk, dh)
    dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)  # (B, Hkv, Sk, dh)
    buf = None
    for blk in _blocks(B, H, Hkv, Sq, Sk, q.element_size(), BLOCK_BYTES):
        p = _block_views(pattern, blk, group, Sq)  # (g, rows, Sk)
        do = _block_views(grad_out, blk, group, Sq)  # (g, rows, dh)
        qb = _block_views(q, blk, group, Sq)  # (g, rows, dh)
        kb, vb = _kv_block(k, blk, group), _kv_block(v, blk, group)  # (g, Sk, dh)
        nd = _block_views(neg_d, blk, group, Sq)  # (g, rows, 1)
        if buf is None:
            buf = torch.empty(p.numel(), dtype=p.dtype, device=p.device)  # no later block is larger
        ds = buf[: p.numel()].view(p.shape)  # (g, rows, Sk)
        if grad_pattern is not None:
            gp = _block_views(grad_pattern, blk, group, Sq)  # (g, rows, Sk)
            nd = nd - torch.linalg.vecdot(gp, p).unsqueeze(-1)  # (g, rows, 1): - rowsum(P * dPattern)
        torch.baddbmm(nd.expand(p.shape), do, vb.transpose(1, 2), out=ds)  # dP - D
        if grad_pattern is not None:
            ds.add_(gp)
        ds.mul_(p)  # dS = P * (dP - D)
        torch.bmm(ds, kb, out=_block_views(dq, blk, group, Sq))  # dq / scale
        _kv_block(dk, blk, group).baddbmm_(ds.transpose(1, 2), qb, alpha=scale)  # sums the group
        _kv_block(dv, blk, group).baddbmm_(p.transpose(1, 2), do)  # sums the group
    return dq.mul_(scale), dk, dv


class _BlockedExplicitAttention(torch.autograd.Function):
    """Autograd wrapper of the blocked kernel; saves q, k, v, the output and the pattern."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: CanonicalMask, scale: float):  # type: ignore[override]
        out, pattern = _blocked_forward(q, k, v, mask, scale)
        ctx.save_for_backward(q, k, v, out, pattern)
        ctx.scale = scale
        # An output that no loss reaches gets None, not a materialised zero tensor: the pattern is
        # usually only looked at, and a zero [B, H, Sq, Sk] gradient would cost a fresh allocation
        # and two passes over it.
        ctx.set_materialize_grads(False)
        return out, pattern

    @staticmethod
    def backward(ctx, grad_out: Tensor | None, grad_pattern: Tensor | None):  # type: ignore[override]
        q, k, v, out, pattern = ctx.saved_tensors
        if grad_out is None and grad_pattern is None:
            return None, None, None, None, None
        if torch.is_grad_enabled():  # backward(create_graph=True): gradients that are differentiable too
            dq, dk, dv = _differentiable_backward(grad_out, grad_pattern, q, k, v, pattern, ctx.scale)
            return dq, dk, dv, None, None
        if grad_out is None:  # only the pattern reaches the loss
            grad_out = torch.zeros_like(out)  # (B, H, Sq, dh): small next to the pattern
        dq, dk, dv = _blocked_backward(grad_out, grad_pattern, q, k, v, out, pattern, ctx.scale)
        return dq, dk, dv, None, None


def _differentiable_backward(
    grad_out: Tensor | None,
    grad_pattern: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """The blocked kernel's gradients in plain autograd ops, for ``create_graph=True`` (higher orders).

    The same formulas as :func:`_blocked_backward`, on whole tensors: ``dP = dO v^T (+ dPattern)``,
    ``dS = P * (dP - rowsum(P * dP))``, ``dq = scale dS k``, ``dk = scale dS^T q``, ``dv = P^T dO`` (the
    last two summed over each key/value head's group). ``P`` is the saved pattern, an output of the
    kernel, so a gradient that reaches it flows back through the kernel's own backward: every order
    is available. Masked entries and dead rows have ``P = 0`` and so no gradient.
    """
    B, H, _, dh = q.shape  # (B, H, Sq, dh)
    Hkv, Sk = k.shape[1], k.shape[2]
    kr = k.repeat_interleave(H // Hkv, dim=1)  # (B, H, Sk, dh): head h reads kv head h // group
    vr = v.repeat_interleave(H // Hkv, dim=1)  # (B, H, Sk, dh)
    dp = torch.zeros_like(pattern) if grad_out is None else torch.matmul(grad_out, vr.transpose(-1, -2))
    if grad_pattern is not None:
        dp = dp + grad_pattern  # (B, H, Sq, Sk)
    ds = pattern * (dp - (pattern * dp).sum(-1, keepdim=True))  # (B, H, Sq, Sk): softmax backward
    dq = torch.matmul(ds, kr) * scale  # (B, H, Sq, dh)
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale  # (B, H, Sk, dh), one per query head
    dk = dk.view(B, Hkv, H // Hkv, Sk, dh).sum(2)  # (B, Hkv, Sk, dh): the group's sum
    if grad_out is None:
        dv = torch.zeros_like(v)  # (B, Hkv, Sk, dh)
    else:
        dv = torch.matmul(pattern.transpose(-1, -2), grad_out)  # (B, H, Sk, dh)
        dv = dv.view(B, Hkv, H // Hkv, Sk, dh).sum(2)  # (B, Hkv, Sk, dh)
    return dq, dk, dv


def blocked_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: CanonicalMask, scale: float
) -> tuple[Tensor, Tensor]:
    """The blocked kernel: q [B, H, Sq, dh], k, v [B, Hkv, Sk, dh] -> out [B, H, Sq, dh], pattern.

    Lays q, k, v out for large GEMMs (contiguous copies only where a block needs them), then runs the
    autograd-aware kernel when a gradient is needed and the plain forward otherwise.
    """
    big = max(FORWARD_BLOCK_BYTES, BLOCK_BYTES)  # the backward reuses the saved q, k, v
    if _samples_per_block(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.element_size(), big) > 1:
        # small problem: samples and heads merge into one batch of GEMMs (a few large ones, not many tiny)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # (B, H, Sq, dh), (B, Hkv, Sk, dh) x 2
    elif q.shape[1] != k.shape[1]:
        q = q.contiguous()  # (B, H, Sq, dh): G query heads of a group become G * Sq rows of one matrix
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # (B, H|Hkv, S, dh): GEMM-friendly rows
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _BlockedExplicitAttention.apply(q, k, v, mask, scale)
    return _blocked_forward(q, k, v, mask, scale)
