"""The computational graph of a pre-norm decoder, heads and MLPs as nodes, and one batched run of it.

**Nodes.** Senders (in order): ``"embed"``, then per layer ``l`` its heads ``"L{l}H{h}"`` (each head's
``hook_result``, ``z_h W_O[h]``) and ``"mlp{l}"`` (the MLP's output). Receivers (in order): per layer ``l``
each query head's query input ``"L{l}H{h}.q"``, each key/value head's key and value inputs
``"L{l}H{g}.k"`` / ``"L{l}H{g}.v"`` (under grouped-query attention ``g`` indexes the *shared* key/value
heads and the names read ``"L{l}KV{g}.k"``), the MLP's input ``"mlp{l}.in"``; last ``"logits"`` (the final
norm's input at the last position). An edge ``u -> v`` exists where ``u`` is computed before ``v`` reads the
residual stream: the embeddings feed everything, a head of layer ``l`` feeds layer ``l``'s MLP and every
later receiver, an MLP of layer ``l`` every receiver of later layers and the logits.

**A run with edges patched** (:func:`run_graph` with ``corrupt`` and ``missing``). Each receiver reads its
own copy of the residual stream, ``x_v = sum_u a_u + c`` (``c``: the constant biases), and an edge left out
of a circuit carries the sender's *corrupt* activation instead::

    x_v = sum_u a_u + c - sum_u missing[u, v] (a_u - a_u^corrupt)

``a_u`` being this run's own activation. Every receiver of a layer reads at once: the layer's q/k/v inputs
are [n_heads + 2 n_kv_heads, batch, seq, d_model], normalised by LN1 each, projected by its own head's
``W_Q``/``W_K``/``W_V``. With no edge missing the run is the model's forward (to float rounding: the same
maths, a different order of products); with every edge missing it is the corrupt run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention.layer import MultiHeadAttention
from ..model.block import FeedForward, GatedFeedForward, TransformerBlock
from .causal_inputs import is_decoder, stack_of

__all__ = ["Graph", "GraphRun", "graph_of", "run_graph"]


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


def _check_block(i: int, block: Any) -> None:
    ok = (
        type(block) is TransformerBlock
        and block.pre_ln
        and isinstance(block.attn, MultiHeadAttention)
        and block.attn.fused
        and isinstance(block.mlp, (FeedForward, GatedFeedForward))
    )
    if not ok:
        raise TypeError(
            f"circuits need pre-norm decoder blocks (GPT-2, Llama-family), fused self-attention; block {i} "
            f"is {type(block).__name__} (pre_ln={getattr(block, 'pre_ln', None)})"
        )


def graph_of(model: Any) -> Graph:
    """The :class:`Graph` of a pre-norm decoder (every layer with the same head counts)."""
    module = stack_of(model, "circuits")
    if not is_decoder(module):
        raise TypeError(
            f"circuits read logits, so they need a decoder; this model is an {module.config.arch}"
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


@dataclass
class GraphRun:
    """One run: ``logits`` [batch, vocab] at each row's last position; ``acts`` [n_senders, batch, seq,
    d_model] every sender's activation (None unless asked); ``inputs``: per receiver block the tensor each
    receiver reads ([n, batch, seq, d_model], kept for gradients, only with ``keep_inputs``)."""

    logits: Tensor
    acts: Tensor | None
    inputs: list[Tensor]


def _attention(attn: MultiHeadAttention, x: Tensor, positions: Tensor) -> Tensor:
    """Heads' outputs from per-receiver normalised inputs x [H + 2 Hkv, B, S, d] -> [H, B, S, d_model]."""
    H, Hkv = attn.n_heads, attn.n_kv_heads
    xq, xk, xv = x.split([H, Hkv, Hkv], dim=0)  # (H, B, S, d), (Hkv, B, S, d) x 2
    q = torch.einsum("hbsd,hde->bhse", xq, attn.W_Q)  # (B, H, S, dh)
    k = torch.einsum("gbsd,gde->bgse", xk, attn.W_K)  # (B, Hkv, S, dh)
    v = torch.einsum("gbsd,gde->bgse", xv, attn.W_V)  # (B, Hkv, S, dh)
    for name, t in (("b_Q", q), ("b_K", k), ("b_V", v)):
        b = getattr(attn, name)
        if b is not None:
            t.add_(b[None, :, None, :])
    if attn.rotary is not None:
        q, k = attn.rotary.rotate(q, positions), attn.rotary.rotate(k, positions)
    if Hkv != H:
        k = k.repeat_interleave(H // Hkv, dim=1)  # (B, H, S, dh)
        v = v.repeat_interleave(H // Hkv, dim=1)  # (B, H, S, dh)
    z = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale)  # (B, H, S, dh)
    return torch.einsum("bhse,hem->hbsm", z, attn.W_O)  # (H, B, S, d_model)


class _Patch:
    """The patched part of each receiver's input: ``sum_u missing[u, v] (a_u - a_u^corrupt)``."""

    def __init__(self, corrupt: Tensor | None, missing: Tensor | None) -> None:
        self.on = corrupt is not None and missing is not None and bool(missing.any())
        self.corrupt, self.missing = corrupt, missing
        self.delta = None if not self.on else torch.zeros_like(corrupt)  # (n_senders, B, S, d)
        self.n = 0

    def add(self, acts: Tensor) -> None:
        if self.on:
            n = acts.shape[0]
            torch.sub(acts, self.corrupt[self.n : self.n + n], out=self.delta[self.n : self.n + n])
            self.n += n

    def __call__(self, x: Tensor, cols: slice) -> Tensor:
        """x [B, S, d] -> each receiver of ``cols``'s input [n_cols, B, S, d]."""
        n_cols = cols.stop - cols.start
        if not self.on:
            return x.unsqueeze(0).expand(n_cols, *x.shape)  # (n_cols, B, S, d)
        m = self.missing[: self.n, cols].to(x.dtype)  # (n, n_cols)
        if not m.any():
            return x.unsqueeze(0).expand(n_cols, *x.shape)
        return x.unsqueeze(0) - torch.einsum("ur,ubsd->rbsd", m, self.delta[: self.n])  # (n_cols, B, S, d)


def run_graph(
    module: nn.Module, graph: Graph, x: Tensor, last: Tensor, *, corrupt: Tensor | None = None,
    missing: Tensor | None = None, keep_acts: bool = False, keep_inputs: bool = False,
) -> GraphRun:  # fmt: skip
    """Run the decoder through its graph from the embeddings ``x`` [B, S, d_model] (``module.embed``).

    Args:
        module, graph: the decoder and its :func:`graph_of`.
        x: embeddings [B, S, d_model]; ``last``: int64 [B], each row's last real position (right padding).
        corrupt: [n_senders, B, S, d_model], the corrupt run's sender activations (``keep_acts`` of it).
        missing: bool [n_senders, n_receivers], edges that carry the corrupt activation (no-grad only).
        keep_acts: return every sender's activation; keep_inputs: the receivers' inputs (for gradients).

    Returns:
        :class:`GraphRun`.
    """
    if missing is not None and torch.is_grad_enabled():
        raise RuntimeError("run_graph patches edges without autograd; call it under torch.no_grad()")
    B, S, _ = x.shape
    patch = _Patch(corrupt, missing)
    positions = torch.arange(S, device=x.device)  # (S,)
    acts, inputs = [x[None]] if keep_acts else [], []
    patch.add(x[None])
    resid, per = x, graph.per_layer
    for lay, block in enumerate(module.blocks):
        attn = block.attn
        base = lay * per
        inp = patch(resid, slice(base, base + per - 1))  # (H + 2 Hkv, B, S, d)
        if keep_inputs:
            inputs.append(inp)
        heads = _attention(attn, block.ln1(inp), positions)  # (H, B, S, d)
        patch.add(heads)
        resid = resid + heads.sum(0)
        if attn.b_O is not None:
            resid = resid + attn.b_O
        mlp_in = patch(resid, slice(base + per - 1, base + per))  # (1, B, S, d)
        if keep_inputs:
            inputs.append(mlp_in)
        m = block.mlp(block.ln2(mlp_in[0]))  # (B, S, d)
        patch.add(m[None])
        resid = resid + m
        if keep_acts:
            acts += [heads, m[None]]
    n_r = len(graph.receivers)
    final = patch(resid, slice(n_r - 1, n_r))  # (1, B, S, d)
    if keep_inputs:
        inputs.append(final)
    rows = final[0][torch.arange(B, device=x.device), last]  # (B, d_model)
    if module.ln_final is not None:
        rows = module.ln_final(rows)
    logits = rows @ module.W_U  # (B, vocab)
    return GraphRun(logits, torch.cat(acts, 0) if keep_acts else None, inputs)
