"""The graph of a pre-norm decoder for circuits: heads and MLPs as nodes, the edges between them.

**Nodes.** Senders (in order): ``"embed"``, then per layer ``l`` its heads ``"L{l}H{h}"`` (each head's
``hook_result``, ``z_h W_O[h]``) and ``"mlp{l}"`` (the MLP's output). Receivers (in order): per layer ``l``
each query head's query input ``"L{l}H{h}.q"``, each key/value head's key and value inputs
``"L{l}H{g}.k"`` / ``"L{l}H{g}.v"`` (under grouped-query attention ``g`` indexes the *shared* key/value
heads and the names read ``"L{l}KV{g}.k"``), the MLP's input ``"mlp{l}.in"``; last ``"logits"`` (the final
norm's input at the last position). An edge ``u -> v`` exists where ``u`` is computed before ``v`` reads the
residual stream: the embeddings feed everything, a head of layer ``l`` feeds layer ``l``'s MLP and every
later receiver, an MLP of layer ``l`` every receiver of later layers and the logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...attention.layer import MultiHeadAttention
from ...model.block import FeedForward, GatedFeedForward, TransformerBlock
from ...nn.spec import refuse_unsupported
from ..causal.causal_inputs import is_decoder, stack_of

__all__ = ["GRAPH_FEATURES", "Graph", "graph_of"]


@dataclass(frozen=True)
class Graph:
    """The sender/receiver graph of one model (see the module docstring).

    ``valid`` bool [n_senders, n_receivers]: True where the edge exists. ``kinds[r]`` is ``"q"``,
    ``"k"``, ``"v"``, ``"mlp"`` or ``"logits"``; ``receiver_layer[r]`` its layer (``n_layers`` for the
    logits); ``sender_layer[u]`` (-1 for the embeddings).
    """

    n_layers: int
    n_heads: int
    n_kv_heads: int
    senders: list[str]
    receivers: list[str]
    kinds: list[str]
    sender_layer: list[int]
    receiver_layer: list[int]
    valid: Tensor

    @property
    def per_layer(self) -> int:
        """Receivers per layer: ``n_heads + 2 n_kv_heads + 1``."""
        return self.n_heads + 2 * self.n_kv_heads + 1

    def attn_senders(self, layer: int) -> int:
        """Senders computed before layer ``layer``'s attention reads: ``1 + layer (n_heads + 1)``."""
        return 1 + layer * (self.n_heads + 1)

    @property
    def n_edges(self) -> int:
        return int(self.valid.sum())


#: The block features (:func:`~headspace.nn.spec.features_of`) the circuit runner computes: sliding
#: windows (read from each block's spec at run time); QK-norm, soft-capping and the rest are refused.
GRAPH_FEATURES = ("window",)


def _check_block(i: int, block: Any) -> None:
    """Refuse (one line) a block the circuit runner cannot run: a spec field it does not compute, by the
    field's name (a mixture of experts, latent attention, soft-capping, any layout but ``"pre"``, ...),
    else anything that is not a :class:`TransformerBlock` with fused self-attention and this package's
    MLPs."""
    executor = f"the circuit runner (block {i})"
    if isinstance(block, TransformerBlock):
        refuse_unsupported(block.spec, executor, GRAPH_FEATURES)
        if block.spec.layout != "pre":
            raise ValueError(
                f"{executor} does not support the block field 'layout' ({block.spec.layout!r}): circuits "
                "need pre-norm blocks"
            )
    ok = (
        type(block) is TransformerBlock
        and isinstance(block.attn, MultiHeadAttention)
        and block.attn.fused
        and isinstance(block.mlp, (FeedForward, GatedFeedForward))
    )
    if not ok:
        raise TypeError(
            f"circuits need pre-norm decoder blocks (GPT-2, Llama-family), fused self-attention; block {i} "
            f"is {type(block).__name__} with {type(getattr(block, 'attn', None)).__name__} attention and "
            f"{type(getattr(block, 'mlp', None)).__name__} MLP"
        )


def graph_of(model: Any) -> Graph:
    """The :class:`Graph` of a pre-norm decoder (every layer with the same head counts)."""
    module = stack_of(model, "circuits")
    if not is_decoder(module):
        raise TypeError(
            f"circuits read logits, so they need a decoder (GPT-2 or Llama-family, e.g. smollm2); this "
            f"model is an {module.config.arch}"
        )
    for i, block in enumerate(module.blocks):
        _check_block(i, block)
    heads = {(b.attn.n_heads, b.attn.n_kv_heads) for b in module.blocks}
    if len(heads) != 1:
        raise ValueError(
            f"circuits need the same head counts in every layer (no pruned heads); got {sorted(heads)}"
        )
    (H, Hkv), L = heads.pop(), len(module.blocks)
    kv = "H" if H == Hkv else "KV"
    senders, s_layer = ["embed"], [-1]
    receivers, kinds, r_layer = [], [], []
    for lay in range(L):
        senders += [f"L{lay}H{h}" for h in range(H)] + [f"mlp{lay}"]
        s_layer += [lay] * (H + 1)
        receivers += [f"L{lay}H{h}.q" for h in range(H)]
        receivers += [f"L{lay}{kv}{g}.k" for g in range(Hkv)] + [f"L{lay}{kv}{g}.v" for g in range(Hkv)]
        receivers.append(f"mlp{lay}.in")
        kinds += ["q"] * H + ["k"] * Hkv + ["v"] * Hkv + ["mlp"]
        r_layer += [lay] * (H + 2 * Hkv + 1)
    receivers.append("logits")
    kinds.append("logits")
    r_layer.append(L)
    valid = torch.zeros(len(senders), len(receivers), dtype=torch.bool)
    per = H + 2 * Hkv + 1
    for lay in range(L):
        n_attn = 1 + lay * (H + 1)
        valid[:n_attn, lay * per : lay * per + per - 1] = True
        valid[: n_attn + H, lay * per + per - 1] = True  # the MLP reads this layer's heads too
    valid[:, -1] = True
    return Graph(L, H, Hkv, senders, receivers, kinds, s_layer, r_layer, valid)
