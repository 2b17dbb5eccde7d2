"""How W_O weighs the heads: each head's share of the attention output, per token and statically.

The attention output is ``out = sum_h r_h + b_O`` with ``r_h = z_h W_O[h]`` (``hook_result``,
[batch, seq, n_heads, d_model]). Two per-token measures of head ``h``'s part in it:

* ``share``: ``||r_h|| / sum_h' ||r_h'||``, in [0, 1], summing to 1 over heads (0 for all heads when
  every ``r_h`` is 0): how much each head writes, whatever the direction.
* ``projection``: ``<r_h, s> / ||s||^2`` with ``s = sum_h' r_h'``, summing to exactly 1 over heads,
  negative for a head that cancels others: how much of the heads' sum each head accounts for.

The static weight of a head is the Frobenius norm of its block ``W_O[h]`` [d_head, d_model]: a head
whose block is zero writes nothing, whatever its pattern.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...core.checks import check_tensor_dims
from .._common import JsonResult, eval_mode, layer_head_table, make_batches, pad_heads
from ..trace.trace import as_module, attention_layers, trace


@dataclass
class HeadMixing(JsonResult):
    """Per-token head shares for one batch of inputs.

    Shapes (``max_heads`` = largest head count; NaN-padded where a pruned layer has fewer):

    * ``share``, ``projection``: [n_layers, batch, seq, max_heads] (see the module docstring);
    * ``mean_share``: [n_layers, max_heads], ``share`` averaged over real tokens;
    * ``wo_norm``: [n_layers, max_heads], ``||W_O[h]||_F``;
    * ``key_padding``: bool [batch, seq], True for real tokens;
    * ``tokens``: int64 [batch, seq] token ids, or None for activation inputs.
    """

    kind = "head_mixing"

    share: Tensor
    projection: Tensor
    mean_share: Tensor
    wo_norm: Tensor
    key_padding: Tensor
    tokens: Tensor | None

    def _html_parts(self) -> list[str]:
        n_real = int(self.key_padding.sum())
        return [
            layer_head_table(
                self.mean_share, f"mean share of the attention output over {n_real} real tokens"
            ),
            layer_head_table(self.wo_norm, "|W_O[h]|_F, the static weight of each head's block"),
        ]


def shares_from_result(result: Tensor) -> tuple[Tensor, Tensor]:
    """(share, projection), each [batch, seq, n_heads], from hook_result [batch, seq, n_heads, d_model]."""
    check_tensor_dims(result, 4, "result must be hook_result [batch, seq, n_heads, d_model]")
    r = result.detach().to(torch.float64)
    norms = r.norm(dim=-1)  # (batch, seq, n_heads)
    total = norms.sum(-1, keepdim=True)  # (batch, seq, 1)
    share = torch.where(total > 0, norms / total.clamp_min(1e-300), torch.zeros_like(norms))
    s = r.sum(dim=2, keepdim=True)  # (batch, seq, 1, d_model)
    s2 = (s * s).sum(-1)  # (batch, seq, 1)
    dots = (r * s).sum(-1)  # (batch, seq, n_heads)
    projection = torch.where(s2 > 0, dots / s2.clamp_min(1e-300), torch.zeros_like(dots))
    return share.to(result.dtype), projection.to(result.dtype)


def wo_norms(model: Any) -> Tensor:
    """[n_layers, max_heads]: the Frobenius norm of each head's ``W_O[h]`` block (NaN-padded). No inputs."""
    layers = attention_layers(model)
    if not layers:
        raise ValueError(f"model has no MultiHeadAttention layer; got {type(model).__name__}")
    return pad_heads([attn.W_O.detach().norm(dim=(1, 2)) for _, attn in layers])  # (n_layers, max_heads)


def head_mixing(model: Any, inputs: Any, *, key_padding: Tensor | None = None) -> HeadMixing:
    """Run ``model`` once on ``inputs`` (one batch) and measure each head's share of each attention output.

    ``inputs``: sentences (pretrained wrapper, tokenized as one padded batch), token ids [batch, seq] or
    activations [batch, seq, d_model]; ``key_padding`` bool [batch, seq] with a tensor input.
    Only ``hook_result`` is traced; eval mode, no autograd (the model's mode is restored).
    """
    layers = attention_layers(model)
    if not layers:
        raise ValueError(f"model has no MultiHeadAttention layer; got {type(model).__name__}")
    n_inputs = len(inputs) if isinstance(inputs, (list, tuple)) else 1
    batches = make_batches(model, inputs, key_padding, batch_size=max(1, n_inputs))
    if len(batches) != 1:
        raise ValueError(f"head_mixing takes one batch of inputs; got {len(batches)} tensors")
    batch = batches[0]
    module = as_module(model)
    with eval_mode(module), trace(model, "*hook_result") as t:
        batch.run(module)
    shares, projections = [], []
    for i in range(len(layers)):
        share, proj = shares_from_result(t.result(i))  # (batch, seq, n_heads) x 2
        shares.append(share.permute(2, 0, 1))  # (n_heads, batch, seq)
        projections.append(proj.permute(2, 0, 1))  # (n_heads, batch, seq)
    share = pad_heads(shares).permute(0, 2, 3, 1)  # (n_layers, batch, seq, max_heads)
    projection = pad_heads(projections).permute(0, 2, 3, 1)  # (n_layers, batch, seq, max_heads)
    real = batch.real.cpu()  # (batch, seq)
    w = real.to(share.dtype)[None, :, :, None]  # (1, batch, seq, 1)
    mean_share = (share * w).sum(dim=(1, 2)) / w.sum()  # (n_layers, max_heads)
    tokens = None if batch.tokens is None else batch.tokens.cpu()
    return HeadMixing(
        share=share,
        projection=projection,
        mean_share=mean_share,
        wo_norm=wo_norms(model),
        key_padding=real,
        tokens=tokens,
    )
