"""The lesson on hybrid models (Qwen3-Next, Qwen3.5): softmax layers among Gated DeltaNet layers.

A Gated DeltaNet layer has no softmax pattern: :func:`explain` of a hybrid ranks its softmax
(full-attention) layers' heads only, and walks a DeltaNet ``layer`` by the delta rule's exact effective
weights (:mod:`.delta_walk`); a model without a softmax layer is refused by name (the block field
``'mixer'``). The recorded values of a hybrid are kept per block: a DeltaNet block's entries are
None, so ``rec[name][layer]`` is block ``layer``'s value for every softmax layer.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ...attention.delta_net import GatedDeltaNet, refuse_linear_attention


def softmax_indices(model: nn.Module) -> list[int | None]:
    """For each block of ``model``, its index among the softmax attention layers (the layer index of
    :class:`~headspace.analysis.trace.Trace`), or None for a Gated DeltaNet block."""
    out: list[int | None] = []
    j = 0
    for block in getattr(model, "blocks", ()):
        if isinstance(block.attn, GatedDeltaNet):
            out.append(None)
        else:
            out.append(j)
            j += 1
    return out


def is_deltanet(attn: Any) -> bool:
    """Whether ``attn`` (a block's mixer) is a Gated DeltaNet layer."""
    return isinstance(attn, GatedDeltaNet)


def refuse_deltanet_layer(model: nn.Module, layer: int | None, what: str) -> None:
    """One-line ``ValueError`` where block ``layer`` of ``model`` is a Gated DeltaNet layer (``what``
    needs its softmax pattern), or where ``layer`` is None and no block has a softmax layer."""
    blocks = getattr(model, "blocks", ())
    if layer is not None and -len(blocks) <= layer < len(blocks):
        refuse_linear_attention(blocks[layer].attn, f"{what} of layer {layer}")
    elif layer is None and blocks and all(is_deltanet(b.attn) for b in blocks):
        refuse_linear_attention(blocks[0].attn, what)
