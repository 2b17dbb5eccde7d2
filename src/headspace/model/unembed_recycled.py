"""The decoder's logits written into recycled memory: the unembedding without the page faults.

A forward's logits are its largest tensor (batch 4 x 128 tokens over a 32,000-word vocabulary: 65 MB).
glibc maps every block of 32 MiB or more afresh and unmaps it on free, so every forward of a loop
(an evaluation, an analysis over many prompts, a benchmark) faults the logits in page by page again: one
fault per 4 KiB page, each page zeroed by the kernel, in the middle of the unembedding GEMM.
:func:`recycled_logits` writes the product into :func:`~headspace.kernels.workspace.recycled_empty`
memory instead: once the caller has dropped every view of the previous logits, the next forward of a
similar size writes into pages already faulted in.

The product is the one ``F.linear`` makes for a contiguous input (``torch.mm`` of the rows by
``weight^T``, ``torch.addmm`` with a bias): the same kernel on the same operands, the same logits bit
for bit. Taken only where nothing can tell the difference but the memory: a CPU float32 product of plain
weights (an int8 / bfloat16 carrier runs its own kernel), no autograd graph to record, no compilation,
an output of at least :data:`~headspace.kernels.workspace.THREAD_SCRATCH_MIN_BYTES`. The logits then
live in an anonymous mapping: they cannot be resized in place (``resize_``), like any tensor made by
``torch.frombuffer``. :func:`~headspace.kernels.workspace.release_thread_workspace` drops the idle
mapping this thread keeps.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..kernels import workspace


def _plain(t: Tensor | None) -> bool:
    """A plain float32 CPU tensor or parameter (not a carrier subclass), or None."""
    return t is None or (
        type(t) in (nn.Parameter, Tensor) and t.dtype == torch.float32 and t.device.type == "cpu"
    )


def recycled_logits(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor | None:
    """``F.linear(h, weight, bias)`` written into recycled memory, or None where it may not be.

    Shapes: h [..., d_model] (contiguous), weight [vocab_size, d_model], bias [vocab_size] or None ->
    logits [..., vocab_size], bit for bit ``F.linear``'s. None (the caller runs ``F.linear``) unless
    every operand is a plain float32 CPU tensor, no operand needs a gradient while grad mode is on,
    nothing is being compiled, and the logits take at least ``THREAD_SCRATCH_MIN_BYTES``.
    """
    if torch.compiler.is_compiling() or not (_plain(h) and _plain(weight) and _plain(bias)):
        return None
    if h.dim() < 2 or weight.dim() != 2 or not h.is_contiguous() or h.shape[-1] != weight.shape[1]:
        return None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (h, weight, bias)):
        return None
    vocab = weight.shape[0]
    rows = h.numel() // h.shape[-1]
    if rows * vocab * h.element_size() < workspace.THREAD_SCRATCH_MIN_BYTES:
        return None
    h2 = h.view(rows, h.shape[-1])  # (rows, d_model): the leading dims flattened, as F.linear does
    out = workspace.recycled_empty((rows, vocab), h.dtype, h.device)  # (rows, vocab_size)
    if bias is None:
        torch.mm(h2, weight.t(), out=out)
    else:
        torch.addmm(bias, h2, weight.t(), out=out)
    return out.view(*h.shape[:-1], vocab)  # (..., vocab_size)
