"""The language-model loss per position, in float64, without a float64 copy of the logits or the logits
themselves: what head importance (:mod:`.ablation`) and the atlas sum.

* :func:`next_token_loss`: ``logsumexp(logits) - logits[target]`` from given logits, the exponentials
  summed in float32 blocks and float64 partial sums.
* :func:`unembedded_loss`: the same from the final states and the unembedding, vocabulary tile by tile.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...core.checks import is_int

__all__ = ["LOSS_ROWS", "LOSS_SUM_BLOCK", "LOSS_VOCAB_TILE", "next_token_loss", "unembedded_loss"]


#: The engine's :func:`next_token_loss` sums the exponentials this many at a time in float32.
LOSS_SUM_BLOCK = 128


def next_token_loss(
    logits: Tensor, targets: Tensor, *, overwrite: bool = False, block: int | None = None
) -> Tensor:
    """Cross-entropy ``logsumexp(logits) - logits[target]`` per position, float64 [rows, seq].

    logits float [rows, seq, vocab], targets int64 [rows, seq]. The max and the exponentials are taken in
    the logits' dtype and summed in float64 (``log`` of that sum in float64): within a few float32
    rounding steps of ``F.cross_entropy(logits.double(), ...)`` (tested), without a float64 copy of the
    logits. ``block=n``: the exponentials are summed ``n`` at a time in float32 and those partial sums in
    float64 (within float32 rounding of the float64 sum, and many times faster). ``overwrite=True``:
    the exponentials are computed in the logits' own memory (the logits are lost; the same numbers, no
    [rows, seq, vocab] allocation).
    """
    if block is not None and (not is_int(block) or block <= 0):
        raise ValueError(f"block must be a positive int or None; got {block!r}")
    top = logits.amax(dim=-1, keepdim=True)  # (rows, seq, 1)
    picked = logits.gather(-1, targets[..., None])[..., 0].to(torch.float64)  # (rows, seq)
    e = (logits.sub_(top) if overwrite else torch.sub(logits, top)).exp_()  # (rows, seq, vocab)
    vocab = e.shape[-1]
    whole = 0 if block is None or e.dtype != torch.float32 else vocab - vocab % block
    total = torch.zeros(e.shape[:-1], dtype=torch.float64, device=e.device)  # (rows, seq)
    if whole:
        parts = e[..., :whole].unflatten(-1, (-1, block)).sum(dim=-1)  # (rows, seq, whole // block)
        total += parts.sum(dim=-1, dtype=torch.float64)
    if whole < vocab:
        total += e[..., whole:].sum(dim=-1, dtype=torch.float64)
    lse = top[..., 0].to(torch.float64) + torch.log(total)  # (rows, seq)
    return lse - picked


#: The engine's fused unembedding and loss (:func:`unembedded_loss`): vocabulary tiles of this many
#: words, for up to this many rows at a time (logits of at most 64 MB in float32; large calls: on a
#: shared machine every elementwise pass is a wait for both threads, so fewer passes beat a tile in cache).
LOSS_VOCAB_TILE = 4096
LOSS_ROWS = 4096


def unembedded_loss(
    h: Tensor, weight: Tensor, targets: Tensor, *, tile: int = LOSS_VOCAB_TILE, rows: int = LOSS_ROWS
) -> Tensor:
    """Cross-entropy ``logsumexp(logits) - logits[target]`` per row of ``logits = h @ weight.T``, float64
    [n], without the [n, vocab] logits.

    h float [n, d_model] (final states after LN_f), weight [vocab, d_model] of h's dtype, targets int64
    [n]. The logits are computed ``rows`` x ``tile`` at a time (the products of ``F.linear``, to
    float32 rounding); per tile the max and the sum of the exponentials are kept in h's dtype and
    combined in float64: within float32 rounding of :func:`next_token_loss` on the whole logits
    (tested). The target logit is read from the tile that holds it (the value the exponentials saw).
    """
    for name, v in (("tile", tile), ("rows", rows)):
        if not is_int(v) or v <= 0:
            raise ValueError(f"{name} must be a positive int; got {v!r}")
    n, vocab = h.shape[0], weight.shape[0]
    out = torch.empty(n, dtype=torch.float64, device=h.device)
    if n == 0:
        return out
    if int(targets.min()) < 0 or int(targets.max()) >= vocab:
        raise ValueError(
            f"targets must be word ids in [0, {vocab}); got {int(targets.min())}..{int(targets.max())}"
        )
    n_tiles = -(-vocab // tile)
    scratch = torch.empty(min(rows, n) * min(tile, vocab), dtype=h.dtype, device=h.device)
    for r0 in range(0, n, rows):
        x, t = h[r0 : r0 + rows], targets[r0 : r0 + rows]  # (m, d_model), (m,)
        m = x.shape[0]
        tops = torch.empty(n_tiles, m, dtype=h.dtype, device=h.device)  # each tile's max logit
        sums = torch.empty(n_tiles, m, dtype=h.dtype, device=h.device)  # each tile's sum of exp(l - max)
        picked = torch.empty(m, dtype=h.dtype, device=h.device)  # (m,): the target logits
        which = torch.div(t, tile, rounding_mode="floor")  # (m,): the tile of each row's target
        counts = torch.bincount(which, minlength=n_tiles).tolist()
        by_tile = torch.split(torch.argsort(which), counts)  # the rows whose target lies in tile j
        for j in range(n_tiles):
            v0 = j * tile
            w = weight[v0 : v0 + tile]  # (k, d_model)
            logits = scratch[: m * w.shape[0]].view(m, w.shape[0])
            torch.mm(x, w.t(), out=logits)  # (m, k)
            if counts[j]:
                r = by_tile[j]
                picked[r] = logits[r, t[r] - v0]
            top = tops[j]  # (m,)
            torch.amax(logits, dim=1, out=top)
            torch.sum(logits.sub_(top[:, None]).exp_(), dim=1, out=sums[j])
        best = tops.amax(dim=0).to(torch.float64)  # (m,)
        total = (sums.to(torch.float64) * (tops.to(torch.float64) - best).exp()).sum(dim=0)  # (m,)
        out[r0 : r0 + m] = best + torch.log(total) - picked.to(torch.float64)
    return out
