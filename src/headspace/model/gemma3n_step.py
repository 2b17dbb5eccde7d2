"""Gemma 3n's one-token cached step without the blocks' module calls: one layer of
:meth:`~headspace.model.gemma3n_model.Gemma3nDecoder._layer`, the same operations in the same order
(AltUp predict and correct, the attention of :func:`~headspace.model.gemma4_step.attend`, LAuReL, the
sandwich norms, the MLP module, the per-layer input), bit for bit. Taken where
:func:`~headspace.model.gemma4_step.takes` says (no hook point active, one new position, eval mode).
"""

from __future__ import annotations

import math
from typing import Any

import torch.nn.functional as F
from torch import Tensor

from .gemma4_step import Shared, attend, norm


def layer(model: Any, i: int, X: Tensor, P: Tensor, cache: Any, shared: Shared) -> Tensor:
    """Layer ``i`` on the streams X [K, B, 1, d] with its per-layer input P [B, 1, p] -> [K, B, 1, d]."""
    block, alt, laurel = model.blocks[i], model.altup[i], model.laurel[i]
    Xp = alt.predict(X)  # (K, B, 1, d)
    x = Xp[alt.active]  # (B, 1, d)
    n = norm(block.ln1, x)  # (B, 1, d)
    attn = norm(block.ln_attn_out, attend(block.attn, n, cache, shared))  # (B, 1, d)
    lau = n + norm(laurel.norm, F.linear(F.linear(n, laurel.left.weight), laurel.right.weight))
    h = ((x + attn) + lau) / math.sqrt(2)  # (B, 1, d)
    m = norm(block.ln_mlp_out, block.mlp(norm(block.ln2, h)))  # (B, 1, d)
    C = alt.correct(Xp, h + m)  # (K, B, 1, d)
    first = C[alt.active].clone()  # (B, 1, d)
    if model.config.extra["gemma3n"]["altup"]["correct_scale"]:
        first = (first.type_as(alt.correct_output_scale) * alt.correct_output_scale).type_as(first)
    C[1:] += model.ple[i].term(first, P)
    return C


__all__ = ["layer"]
