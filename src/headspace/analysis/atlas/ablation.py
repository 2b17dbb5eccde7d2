"""The atlas's ``ablation``: the corpus loss with each head mean-ablated, every head of a layer at once.

The batched patching engine's scheme (:mod:`headspace.analysis.patching`): an ablation at layer ``l``
leaves the layers below ``l`` as in the clean run, so each ablated run starts at block ``l`` from the
clean residual stream (``hook_resid_pre``) and the heads of one layer travel up the stack together, one
copy of the batch per head. Copy ``r`` has head ``r``'s z replaced by its corpus mean: where the block
adds the attention output to the stream as it is (pre- and post-norm blocks of
:class:`~headspace.MultiHeadAttention`), as ``out + (mean_h - z_h) W_O[h]`` on ``hook_attn_out``
(``out = sum_h z_h W_O[h] + b_O`` is linear in each z_h; the clean z of that layer comes from one traced
run of its block on the batch), so that every copy keeps the fused attention path; elsewhere as the
``hook_z`` function of :func:`headspace.analysis.ablation.head_importance`. The loss is the next-token
cross-entropy ``logsumexp(logits) - logit[next]`` over pairs of real tokens only, unembedded
:data:`UNEMBED_POSITIONS` positions at a time (no [copies x batch, seq, vocab] logits). The numbers
are those of ``ablate(model, {(l, h): "mean"}, means=...)`` and a full forward per head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...attention.layer import MultiHeadAttention
from ..causal.ablation import replica_hook, replicate
from ..causal.causal_inputs import last_resid
from ..trace.trace import hooked, trace
from .state import AtlasState

UNEMBED_POSITIONS = 512
"""Positions unembedded at once by the loss (bounds the [positions, vocab] logits)."""


def _logits(module: nn.Module, h: Tensor) -> Tensor:
    """Logits [n, vocab] float32 of final streams ``h`` [n, d_model] after ``ln_final``, as
    :meth:`headspace.Decoder.forward` computes them (with its ``final_softcap``)."""
    lm_head = getattr(module, "lm_head", None)
    logits = F.linear(h, module.tok_embed.weight) if lm_head is None else lm_head(h)  # (n, vocab)
    cap = getattr(module.config, "final_softcap", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits.float()


def _pair_loss_sums(module: nn.Module, hidden: Tensor, tokens: Tensor, real: Tensor) -> tuple[Tensor, int]:
    """Cross-entropy sums [rows] of final streams ``hidden`` [rows, S, d] (before ``ln_final``) over pairs
    of real tokens of ``tokens``/``real`` [rows, S], unembedded :data:`UNEMBED_POSITIONS` positions at a
    time (only the positions of a pair); and the number of pairs."""
    pair = real[:, :-1] & real[:, 1:]  # (rows, S - 1)
    rows = tokens.shape[0]
    row, col = pair.nonzero(as_tuple=True)  # (N,) x 2: each pair's row and position
    target = tokens[row, col + 1]  # (N,)
    sums = torch.zeros(rows, dtype=torch.float64, device=hidden.device)
    for a in range(0, row.shape[0], UNEMBED_POSITIONS):
        r, c, t = (
            row[a : a + UNEMBED_POSITIONS],
            col[a : a + UNEMBED_POSITIONS],
            target[a : a + UNEMBED_POSITIONS],
        )
        h = hidden[r, c]  # (n, d)
        if module.ln_final is not None:
            h = module.ln_final(h)
        logits = _logits(module, h)  # (n, vocab)
        ce = torch.logsumexp(logits, dim=-1) - logits.gather(1, t[:, None])[:, 0]  # (n,): float32 per pair
        sums.index_add_(0, r, ce.double())
        del logits
    return sums.cpu(), int(row.shape[0])


def _adds_attention_output(block: nn.Module) -> bool:
    """Whether ``block`` adds its attention's output to the stream as it is (then an ablated head is a
    change of ``hook_attn_out``): a pre- or post-norm block of a stock MultiHeadAttention."""
    attn = getattr(block, "attn", None)
    return (
        getattr(block, "norm", None) not in ("sandwich", "post_sublayer")
        and hasattr(block, "hook_attn_out")
        and isinstance(attn, MultiHeadAttention)
        and type(attn).forward is MultiHeadAttention.forward
    )


def _output_hook(deltas: Tensor) -> Callable[[Tensor, Any], Tensor]:
    """A ``hook_attn_out`` function adding ``deltas[r]`` [b, S, d_model] to copy ``r`` of a replicated
    batch (``deltas`` [R, b, S, d_model])."""

    def fn(out: Tensor, point: Any) -> Tensor:  # out: (R b, S, d_model)
        R = deltas.shape[0]
        return (out.view(R, -1, *out.shape[1:]) + deltas.to(out.dtype)).view(out.shape)  # (R b, S, d_model)

    return fn


def _clean_z(module: nn.Module, layer: int, x: Tensor, kw: dict[str, Any]) -> Tensor:
    """The clean z [B, S, H, dh] of block ``layer`` at its input ``x`` [B, S, d] (one traced block run)."""
    name = f"blocks.{layer}.attn.hook_z"
    with trace(module, names=[name]) as t:
        module.blocks[layer](x, **kw)
    return t[name]


@torch.no_grad()
def ablate_batch(
    module: nn.Module,
    state: AtlasState,
    tokens: Tensor,
    real: Tensor,
    means: Tensor,
    max_rows: int = 64,
    tick: Callable[[float], None] | None = None,
) -> None:
    """Add one batch's clean and per-head mean-ablated loss sums to ``state`` (a decoder).

    ``means`` float64 [n_layers, max_heads, d_head]: every head's corpus mean z. ``max_rows``: copies x
    sequences per pass up the stack. ``tick(fraction)``: called after each layer's heads with the
    fraction of the batch's work that layer was (the fractions sum to 1), for a progress bar.
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
    positions = _positions(module, S, tokens.device)
    for layer, block in enumerate(blocks):
        attn = block.attn
        H = attn.n_heads
        layer_means = means[layer, :H].to(attn.o_weight.dtype)  # (H, dh)
        per = max(1, max_rows // B)
        direct = _adds_attention_output(block)
        if direct:
            kw = {"key_padding": kp, "is_causal": True, **positions}
            z = _clean_z(module, layer, resid[layer], kw)  # (B, S, H, dh)
            W_O = attn.W_O  # (H, dh, d_model)
        for start in range(0, H, per):
            heads = list(range(start, min(H, start + per)))
            R = len(heads)
            xr = replicate(resid[layer], R)  # (R B, S, d)
            kpr = None if kp is None else replicate(kp, R)
            if direct:
                change = layer_means[heads][:, None, None] - z[:, :, heads].permute(
                    2, 0, 1, 3
                )  # (R, B, S, dh)
                deltas = torch.einsum("rbsd,rdm->rbsm", change, W_O[heads])  # (R, B, S, d_model)
                fns = {f"blocks.{layer}.hook_attn_out": _output_hook(deltas)}
            else:
                fns = {f"blocks.{layer}.attn.hook_z": replica_hook(heads, "mean", layer_means, B)}
            with hooked(module, fns):
                for b in blocks[layer:]:
                    xr = b(xr, key_padding=kpr, is_causal=True, **positions)
            sums, _ = _pair_loss_sums(module, xr, replicate(tokens, R), replicate(real, R))
            state.ablation_sum[layer, heads] += sums.view(R, B).sum(1)  # (R, B) -> (R,)
        if tick is not None:  # the work of a layer's runs falls with its depth: blocks layer..L-1
            tick((len(blocks) - layer) / (len(blocks) * (len(blocks) + 1) / 2))


def _positions(module: nn.Module, S: int, device: torch.device) -> dict[str, Any]:
    """The keyword a block needs for rotary positions (as :meth:`headspace.Decoder.hidden_states`)."""
    if getattr(module, "rotary", None) is None:
        return {}
    return {"positions": torch.arange(S, device=device)}  # (S,)
