"""Soft-capping (Gemma 2's attention scores and final logits): ``cap * tanh(x / cap)``.

Computed with transformers' three roundings in its order (``x / cap``, then ``tanh``, then ``* cap``), so
the values are bit for bit those of ``torch.tanh(x / cap) * cap``, whether in place or not.

In place (on a tensor nobody else holds, outside any autograd graph) the three passes run on blocks of
rows of at most :data:`SOFTCAP_BLOCK_BYTES`, so that each block is read from memory once and its three
passes stay in the cache; out of place they are plain autograd ops.

Notation used for tensor shapes:
    ...: any leading dims; n: the last dim (keys of a score row, or the vocabulary of a logit row).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module

#: In place, the three passes run on blocks of whole rows (last dim) of at most this many bytes (at
#: least one row): a block stays in a core's cache between the passes.
SOFTCAP_BLOCK_BYTES = 1 << 19


def soft_cap(x: Tensor, cap: float, *, in_place: bool = False) -> Tensor:
    """``cap * tanh(x / cap)`` of ``x`` [..., n]: returns [..., n], bit for bit ``torch.tanh(x / cap) * cap``.

    ``in_place=True``: ``x`` itself is overwritten and returned; the caller guarantees that nothing else
    holds ``x`` (a fresh result that no hook has seen) and that no autograd graph needs it. Contiguous
    tensors are capped a block of rows at a time (:data:`SOFTCAP_BLOCK_BYTES`); others whole.
    """
    if not in_place:
        return torch.tanh(x / cap) * cap
    if x.dim() == 0 or not x.is_contiguous() or x.numel() == 0:
        return x.div_(cap).tanh_().mul_(cap)
    n = x.shape[-1]
    rows = x.view(-1, n)  # (rows, n): a view of x's storage, written in place
    per_block = max(1, SOFTCAP_BLOCK_BYTES // max(1, n * x.element_size()))
    for block in rows.split(per_block):  # (<= per_block, n) each
        block.div_(cap).tanh_().mul_(cap)
    return x


def owns_output(module: nn.Module | None) -> bool:
    """Whether what ``module(...)`` returns is held by nobody else once it returns: no forward hook on
    ``module`` and no global forward hook (a hook may keep the output). ``None`` (no module: the caller
    computed the value itself) owns it."""
    if module is None:
        return True
    return not (module._forward_hooks or _module._global_forward_hooks)
