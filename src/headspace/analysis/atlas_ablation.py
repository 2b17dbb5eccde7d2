"""The atlas's ``ablation``: the corpus loss with each head mean-ablated, every head of a layer at once.

The batched patching engine's scheme (:mod:`headspace.analysis.patching`): an ablation at layer ``l``
leaves the layers below ``l`` as in the clean run, so each ablated run starts at block ``l`` from the
clean residual stream (``hook_resid_pre``) and the heads of one layer travel up the stack together, one
copy of the batch per head (copy ``r`` has head ``r``'s z replaced by its corpus mean, the
``hook_z`` function of :func:`headspace.analysis.ablation.head_importance`). The loss is the
next-token cross-entropy over pairs of real tokens, unembedded one sequence at a time (no
[copies x batch, seq, vocab] logits). The numbers are those of ``ablate(model, {(l, h): "mean"},
means=...)`` and a full forward per head.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .ablation import _replica_hook, _replicate
from .atlas_state import AtlasState
from .causal_inputs import last_resid
from .trace import hooked, trace

UNEMBED_POSITIONS = 2048
"""Positions unembedded at once by the loss (bounds the [positions, vocab] logits)."""


def _pair_loss_sums(module: nn.Module, hidden: Tensor, tokens: Tensor, real: Tensor) -> tuple[Tensor, int]:
    """Cross-entropy sums [rows] of final streams ``hidden`` [rows, S, d] (before ``ln_final``) over pairs
    of real tokens of ``tokens``/``real`` [rows, S], unembedded :data:`UNEMBED_POSITIONS` positions at a
    time; and the number of pairs."""
    pair = real[:, :-1] & real[:, 1:]  # (rows, S - 1)
    rows, S = tokens.shape
    sums = torch.zeros(rows, dtype=torch.float64, device=hidden.device)
    step = max(1, UNEMBED_POSITIONS // S)
    lm_head = getattr(module, "lm_head", None)
    for r in range(0, rows, step):
        h = hidden[r : r + step]  # (n, S, d)
        if module.ln_final is not None:
            h = module.ln_final(h)
        logits = F.linear(h, module.tok_embed.weight) if lm_head is None else lm_head(h)  # (n, S, vocab)
        ce = F.cross_entropy(
            logits[:, :-1].flatten(0, 1), tokens[r : r + step, 1:].flatten(), reduction="none"
        ).view(h.shape[0], S - 1)  # (n, S - 1): float32 per pair, summed in float64
        sums[r : r + step] = (ce.double() * pair[r : r + step]).sum(-1)
    return sums.cpu(), int(pair.sum())


@torch.no_grad()
def ablate_batch(
    module: nn.Module, state: AtlasState, tokens: Tensor, real: Tensor, means: Tensor, max_rows: int = 64
) -> None:
    """Add one batch's clean and per-head mean-ablated loss sums to ``state`` (a decoder).

    ``means`` float64 [n_layers, max_heads, d_head]: every head's corpus mean z. ``max_rows``: copies x
    sequences per pass up the stack.
    """
    B, S = tokens.shape
    kp = None if bool(real.all()) else real
    final = last_resid(module)
    with trace(module, names=["blocks.*.hook_resid_pre", final]) as t:
        module.hidden_states(tokens, kp)
    resid = [t[f"blocks.{i}.hook_resid_pre"] for i in range(len(module.blocks))]  # (B, S, d) each
    x = t[final]  # (B, S, d): the clean final stream
    blocks = list(module.blocks)
    clean, n_pairs = _pair_loss_sums(module, x, tokens, real)
    state.clean_sum += float(clean.sum())
    state.n_pairs += n_pairs
    for layer, block in enumerate(blocks):
        H = block.attn.n_heads
        layer_means = means[layer, :H].to(block.attn.o_weight.dtype)  # (H, dh)
        per = max(1, max_rows // B)
        for start in range(0, H, per):
            heads = list(range(start, min(H, start + per)))
            R = len(heads)
            xr = _replicate(resid[layer], R)  # (R B, S, d)
            kpr = None if kp is None else _replicate(kp, R)
            fn = _replica_hook(heads, "mean", layer_means, B)
            with hooked(module, {f"blocks.{layer}.attn.hook_z": fn}):
                for b in blocks[layer:]:
                    xr = b(xr, key_padding=kpr, is_causal=True, **_positions(module, S, tokens.device))
            sums, _ = _pair_loss_sums(module, xr, _replicate(tokens, R), _replicate(real, R))
            state.ablation_sum[layer, heads] += sums.view(R, B).sum(1)  # (R, B) -> (R,)


def _positions(module: nn.Module, S: int, device: torch.device) -> dict[str, Any]:
    """The keyword a block needs for rotary positions (as :meth:`headspace.Decoder.hidden_states`)."""
    if getattr(module, "rotary", None) is None:
        return {}
    return {"positions": torch.arange(S, device=device)}  # (S,)
