"""One norm for both sublayers of a parallel block whose two norms are the same (issue 38, speed).

A one-norm parallel family (Falcon, GPT-J, Phi, GPT-NeoX without ``ln_mlp``...) is loaded with its
block's ``ln2`` a copy of ``ln1`` (both sublayers read the same norm of the block's input), so that
each keeps its own weights to edit. While the two are equal, ``ln2(x)`` is ``ln1(x)`` bit for bit (the
same kernel on the same operands), and :func:`shared_norm` hands the block ``ln1(x)`` to use for both.

Taken only where nobody can tell: the norms are the same class (``nn.LayerNorm`` or
:class:`~headspace.nn.norms.RMSNorm`) with equal shapes, eps, offset, weights and biases; no module hook
on either norm (skipping ``ln2`` would skip its hooks) and no function on ``hook_attn_in`` /
``hook_mlp_in`` (each sees its own value); no autograd graph to record (``ln2``'s parameters would get
no gradient); and the block's sublayers are the library's own attention and MLP, which never write into
their input.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module

from ..nn.norms import RMSNorm


def _hooked(norm: nn.Module) -> bool:
    return bool(
        norm._forward_hooks
        or norm._forward_pre_hooks
        or _module._global_forward_hooks
        or _module._global_forward_pre_hooks
    )


def same_norm(n1: nn.Module, n2: nn.Module) -> bool:
    """Whether ``n2(x)`` is ``n1(x)`` for every x: the same norm class with equal settings and parameters."""
    if type(n1) is not type(n2) or type(n1) not in (nn.LayerNorm, RMSNorm):
        return False
    if n1.eps != n2.eps or getattr(n1, "offset", 0.0) != getattr(n2, "offset", 0.0):
        return False
    if isinstance(n1, nn.LayerNorm) and n1.normalized_shape != n2.normalized_shape:
        return False
    for name in ("weight", "bias"):
        p1, p2 = getattr(n1, name, None), getattr(n2, name, None)
        if (p1 is None) != (p2 is None):
            return False
        if p1 is not None and p1 is not p2:
            if p1.shape != p2.shape or p1.dtype != p2.dtype or not torch.equal(p1, p2):
                return False
    return True


def shared_norm(block: Any, x: Tensor, attention: type, mlps: tuple[type, ...]) -> Tensor | None:
    """``block.ln1(x)`` [batch, seq, d_model] where the parallel block's ``ln2(x)`` would be the same
    tensor of values and nothing watches either (module docstring), else None (the block computes both).

    ``attention`` / ``mlps``: the sublayer classes whose own forwards never write into their input."""
    ln1, ln2 = block.ln1, block.ln2
    if block.hook_attn_in.fns or block.hook_mlp_in.fns or _hooked(ln1) or _hooked(ln2):
        return None
    if type(block.attn).forward is not attention.forward or type(block.mlp) not in mlps:
        return None
    if torch.is_grad_enabled() and (
        x.requires_grad or any(p.requires_grad for n in (ln1, ln2) for p in n.parameters())
    ):
        return None
    if not same_norm(ln1, ln2):
        return None
    return ln1(x)  # (batch, seq, d_model)
