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
        = resid^corrupt_v + sum_u kept[u, v] (a_u - a_u^corrupt)

``a_u`` being this run's own activation, ``resid^corrupt_v`` the corrupt run's stream where ``v`` reads.
Each receiver block (a layer's q/k/v inputs, its MLP's, the logits') takes the side with fewer edges,
and a block whose receivers all read the same tensor (nothing patched, or nothing kept) is normalised
once and projected by the fused weights; otherwise its inputs are [n_heads + 2 n_kv_heads, batch, seq,
d_model], normalised by LN1 each, projected by its own head's ``W_Q``/``W_K``/``W_V``. A block that keeps
no edge reads the corrupt stream, so its outputs are the corrupt run's, taken rather than recomputed.
With no edge missing the run is the model's forward (to float rounding: the same maths, a different
order of products); with every edge missing it is the corrupt run.

**Gradients** (:func:`graph_grads`). Unpatched, every receiver reads the same stream, so ``dM/dx_v`` for
all receivers comes from the model's own forward and one backward: the gradient at each head's query /
key / value projection, pulled back through that projection and LN1 alone (closed form for RMSNorm and
LayerNorm); an MLP's and the logits' are the gradients at a zero added to their inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention.layer import MultiHeadAttention
from ..model.block import FeedForward, GatedFeedForward, TransformerBlock
from ..nn.norms import RMSNorm
from ..nn.positions import rotary_tables, rotate_fused
from .causal_inputs import is_decoder, stack_of

__all__ = ["Graph", "GraphGrads", "GraphRun", "graph_grads", "graph_of", "run_graph"]


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
    receiver reads ([n, batch, seq, d_model], kept for gradients, only with ``keep_inputs``); ``resids``:
    with ``keep_acts``, the residual stream [batch, seq, d_model] each receiver block reads unpatched
    (per layer the attention's, the MLP's; last the logits'), which a patched run starts from where a
    circuit keeps fewer edges than it leaves out."""

    logits: Tensor
    acts: Tensor | None
    inputs: list[Tensor]
    resids: list[Tensor] | None = None


def _project(attn: MultiHeadAttention, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q [B, H, S, dh], k and v [B, Hkv, S, dh] without biases, from normalised inputs: x [B, S, d] read
    by every receiver of the layer, or x [H + 2 Hkv, B, S, d], each receiver its own."""
    if x.dim() == 3:
        q = torch.einsum("bsd,hde->bhse", x, attn.W_Q)  # (B, H, S, dh)
        k = torch.einsum("bsd,gde->bgse", x, attn.W_K)  # (B, Hkv, S, dh)
        v = torch.einsum("bsd,gde->bgse", x, attn.W_V)  # (B, Hkv, S, dh)
        return q, k, v
    H, Hkv = attn.n_heads, attn.n_kv_heads
    xq, xk, xv = x.split([H, Hkv, Hkv], dim=0)  # (H, B, S, d), (Hkv, B, S, d) x 2
    q = torch.einsum("hbsd,hde->bhse", xq, attn.W_Q)  # (B, H, S, dh)
    k = torch.einsum("gbsd,gde->bgse", xk, attn.W_K)  # (B, Hkv, S, dh)
    v = torch.einsum("gbsd,gde->bgse", xv, attn.W_V)  # (B, Hkv, S, dh)
    return q, k, v


class _Tables:
    """Rotary cos/sin tables of one run, computed once per Rotary module (the layers share positions)."""

    def __init__(self, positions: Tensor) -> None:
        self.positions = positions
        self.memo: dict[int, tuple[Tensor, Tensor]] = {}

    def rotate(self, attn: MultiHeadAttention, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        key = id(attn.rotary)
        if key not in self.memo:
            self.memo[key] = rotary_tables(attn.rotary, self.positions, q.dtype, q.device)
        cos, sin = self.memo[key]  # each (1, 1, S, rotary_dim)
        return rotate_fused(q, cos, sin, attn.rotary), rotate_fused(k, cos, sin, attn.rotary)


def _mix(attn: MultiHeadAttention, q: Tensor, k: Tensor, v: Tensor, tables: _Tables) -> Tensor:
    """Each head's mixed values ``z_h`` [B, H, S, dh] from :func:`_project`'s q, k, v."""
    H, Hkv = attn.n_heads, attn.n_kv_heads
    if attn.b_Q is not None:
        q = q + attn.b_Q[None, :, None, :]  # (B, H, S, dh)
        k = k + attn.b_K[None, :, None, :]  # (B, Hkv, S, dh)
        v = v + attn.b_V[None, :, None, :]  # (B, Hkv, S, dh)
    if attn.rotary is not None:
        q, k = tables.rotate(attn, q, k)  # (B, H, S, dh), (B, Hkv, S, dh)
    if Hkv != H:
        k = k.repeat_interleave(H // Hkv, dim=1)  # (B, H, S, dh)
        v = v.repeat_interleave(H // Hkv, dim=1)  # (B, H, S, dh)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale)  # (B, H, S, dh)


def _heads(attn: MultiHeadAttention, z: Tensor) -> Tensor:
    """Each head's output ``z_h W_O[h]`` [H, B, S, d_model] from z [B, H, S, dh]."""
    return torch.einsum("bhse,hem->hbsm", z, attn.W_O)  # (H, B, S, d_model)


def _attention(attn: MultiHeadAttention, x: Tensor, tables: _Tables) -> Tensor:
    """Heads' outputs [H, B, S, d_model] from normalised inputs (shared [B, S, d] or per receiver)."""
    return _heads(attn, _mix(attn, *_project(attn, x), tables))


class _Patch:
    """The patched receivers' inputs. With ``a_u`` this run's activations, ``delta_u = a_u - a_u^corrupt``::

        x_v = resid - sum_{u missing} delta_u  =  resid^corrupt + sum_{u kept} delta_u

    (``resid``: this run's residual stream, ``resid^corrupt``: the corrupt run's). Each receiver block
    takes the side with fewer edges (the second needs the corrupt run's ``resids``), and of that side's
    mask only the senders with an edge in the block: a small circuit costs its own edges, not the
    edges it leaves out. A block that keeps no edge reads the corrupt stream, so its outputs are the
    corrupt run's (:meth:`corrupt_outputs`) and are not computed."""

    def __init__(self, corrupt: Tensor | GraphRun | None, missing: Tensor | None, valid: Tensor) -> None:
        resids = None
        if isinstance(corrupt, GraphRun):
            if corrupt.acts is None:
                raise ValueError("run_graph's corrupt run must have its acts: run it with keep_acts=True")
            corrupt, resids = corrupt.acts, corrupt.resids
        self.on = corrupt is not None and missing is not None and bool(missing.any())
        self.corrupt, self.resids = corrupt, resids
        if self.on:
            self.missing = missing & valid  # (n_senders, n_receivers)
            self.kept = valid & ~missing  # (n_senders, n_receivers)
        self.delta = None if not self.on else torch.empty_like(corrupt)  # (n_senders, B, S, d)
        self.n = 0

    def add(self, acts: Tensor) -> None:
        if self.on:
            n = acts.shape[0]
            torch.sub(acts, self.corrupt[self.n : self.n + n], out=self.delta[self.n : self.n + n])
            self.n += n

    def corrupt_outputs(self, cols: slice, n_out: int) -> Tensor | None:
        """The corrupt run's activations of the next ``n_out`` senders [n_out, B, S, d] where every
        receiver of ``cols`` reads the corrupt stream (the block keeps no edge), so that their outputs
        are the corrupt run's and need not be computed; else None."""
        if not self.on or self.resids is None or bool(self.kept[: self.n, cols].any()):
            return None
        return self.corrupt[self.n : self.n + n_out]  # (n_out, B, S, d)

    def __call__(self, x: Tensor, cols: slice, block: int) -> Tensor:
        """x [B, S, d] -> the inputs of receivers ``cols``: [B, S, d] where all of them read the same
        tensor, else [n_cols, B, S, d]. ``block``: the receiver block's index in ``resids``."""
        if not self.on:
            return x
        missing, kept = self.missing[: self.n, cols], self.kept[: self.n, cols]  # (n, n_cols) x 2
        n_missing, n_kept = int(missing.sum()), int(kept.sum())
        if n_missing == 0:
            return x
        if self.resids is not None and n_kept < n_missing:
            base, mask, sign = self.resids[block], kept, 1.0
        else:
            base, mask, sign = x, missing, -1.0
        rows = mask.any(1).nonzero()[:, 0]  # senders with an edge of this side in the block
        if rows.numel() == 0:
            return base
        n_cols = cols.stop - cols.start
        if 2 * rows.numel() > self.n:  # most senders: the zero rows cost less than a gather
            delta, m = self.delta[: self.n], mask
        else:
            delta, m = self.delta[rows], mask[rows]  # (n_rows, B, S, d), (n_rows, n_cols)
        flat = delta.reshape(delta.shape[0], -1)  # (n_rows, B S d)
        patch = (m.T.to(flat.dtype) @ flat).view(n_cols, *x.shape)  # (n_cols, B, S, d)
        return base.unsqueeze(0) + patch if sign > 0 else base.unsqueeze(0) - patch


def _per_receiver(x: Tensor, n: int) -> Tensor:
    """x [B, S, d] or [n, B, S, d] -> [n, B, S, d] (a view where every receiver reads the same x)."""
    return x if x.dim() == 4 else x.unsqueeze(0).expand(n, *x.shape)  # (n, B, S, d)


def run_graph(
    module: nn.Module, graph: Graph, x: Tensor, last: Tensor, *, corrupt: Tensor | GraphRun | None = None,
    missing: Tensor | None = None, keep_acts: bool = False, keep_inputs: bool = False,
) -> GraphRun:  # fmt: skip
    """Run the decoder through its graph from the embeddings ``x`` [B, S, d_model] (``module.embed``).

    Args:
        module, graph: the decoder and its :func:`graph_of`.
        x: embeddings [B, S, d_model]; ``last``: int64 [B], each row's last real position (right padding).
        corrupt: the corrupt run (a :class:`GraphRun` with ``keep_acts``), or only its sender activations
            [n_senders, B, S, d_model].
        missing: bool [n_senders, n_receivers], edges that carry the corrupt activation (no-grad only).
        keep_acts: return every sender's activation and the residual streams; keep_inputs: each
            receiver's input as its own tensor (for gradients).

    Returns:
        :class:`GraphRun`.
    """
    if missing is not None and torch.is_grad_enabled():
        raise RuntimeError("run_graph patches edges without autograd; call it under torch.no_grad()")
    B, S, _ = x.shape
    patch = _Patch(corrupt, missing, graph.valid.to(x.device))
    tables = _Tables(torch.arange(S, device=x.device))  # positions (S,)
    acts, inputs, resids = [x[None]] if keep_acts else [], [], []
    patch.add(x[None])
    resid, per = x, graph.per_layer
    n_qkv = per - 1
    for lay, block in enumerate(module.blocks):
        attn = block.attn
        base = lay * per
        if keep_acts:
            resids.append(resid)
        heads = patch.corrupt_outputs(slice(base, base + n_qkv), attn.n_heads)  # (H, B, S, d) or None
        if heads is None:
            inp = patch(resid, slice(base, base + n_qkv), 2 * lay)  # (B, S, d) or (H + 2 Hkv, B, S, d)
            if keep_inputs:
                inp = _per_receiver(inp, n_qkv)  # (H + 2 Hkv, B, S, d)
                inputs.append(inp)
            heads = _attention(attn, block.ln1(inp), tables)  # (H, B, S, d)
        patch.add(heads)
        resid = resid + heads.sum(0)
        if attn.b_O is not None:
            resid = resid + attn.b_O
        if keep_acts:
            resids.append(resid)
        corrupt_m = patch.corrupt_outputs(slice(base + n_qkv, base + per), 1)  # (1, B, S, d) or None
        if corrupt_m is None:
            mlp_in = _per_receiver(
                patch(resid, slice(base + n_qkv, base + per), 2 * lay + 1), 1
            )  # (1, B, S, d)
            if keep_inputs:
                inputs.append(mlp_in)
            m = block.mlp(block.ln2(mlp_in[0]))  # (B, S, d)
        else:
            m = corrupt_m[0]  # (B, S, d)
        patch.add(m[None])
        resid = resid + m
        if keep_acts:
            acts += [heads, m[None]]
    n_r = len(graph.receivers)
    if keep_acts:
        resids.append(resid)
    final = _per_receiver(patch(resid, slice(n_r - 1, n_r), 2 * graph.n_layers), 1)  # (1, B, S, d)
    if keep_inputs:
        inputs.append(final)
    rows = final[0][torch.arange(B, device=x.device), last]  # (B, d_model)
    if module.ln_final is not None:
        rows = module.ln_final(rows)
    logits = rows @ module.W_U  # (B, vocab)
    return GraphRun(logits, torch.cat(acts, 0) if keep_acts else None, inputs, resids if keep_acts else None)


def _norm_pullback(norm: nn.Module, x: Tensor, g: Tensor) -> Tensor:
    """``J_norm(x)^T g`` for x [B, S, d] and each g [n, B, S, d] -> [n, B, S, d]: RMSNorm and LayerNorm in
    closed form (x's statistics once for all n), any other norm by autograd on n copies of x."""
    if isinstance(norm, RMSNorm) or (
        isinstance(norm, nn.LayerNorm) and norm.normalized_shape == x.shape[-1:]
    ):
        dt = torch.promote_types(x.dtype, torch.float32)
        xf, gf = x.to(dt), g.to(dt)
        if isinstance(norm, RMSNorm):
            r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)  # (B, S, 1)
            xh = xf * r  # (B, S, d)
            G = gf * (norm.offset + norm.weight.to(dt))  # (n, B, S, d)
            return ((G - xh * (G * xh).mean(-1, keepdim=True)) * r).to(x.dtype)  # (n, B, S, d)
        mu = xf.mean(-1, keepdim=True)  # (B, S, 1)
        r = torch.rsqrt((xf - mu).pow(2).mean(-1, keepdim=True) + norm.eps)  # (B, S, 1)
        xh = (xf - mu) * r  # (B, S, d)
        G = gf if norm.weight is None else gf * norm.weight.to(dt)  # (n, B, S, d)
        G = G - G.mean(-1, keepdim=True) - xh * (G * xh).mean(-1, keepdim=True)  # (n, B, S, d)
        return (G * r).to(x.dtype)
    with torch.enable_grad():
        r = x.expand(g.shape).clone().requires_grad_(True)  # (n, B, S, d)
        (out,) = torch.autograd.grad(norm(r), r, g)
    return out


@dataclass
class GraphGrads:
    """:func:`graph_grads`' result: ``logits`` [batch, vocab] (detached), ``acts`` [n_senders, batch, seq,
    d_model] (None unless asked), ``grads`` [n_receivers, batch, seq, d_model], ``dM/dx_v`` per receiver."""

    logits: Tensor
    acts: Tensor | None
    grads: Tensor


@contextmanager
def frozen_parameters(module: nn.Module) -> Iterator[None]:
    """Parameters out of autograd for the block (only inputs need gradients: a backward that also had to
    keep what the weight gradients need costs about 2.5x); the flags are restored after."""
    flags = [(p, p.requires_grad) for p in module.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def graph_grads(
    module: nn.Module, graph: Graph, x: Tensor, last: Tensor, metric: Callable[[Tensor], Tensor], *,
    keep_acts: bool = False, out: Tensor | None = None,
) -> GraphGrads:  # fmt: skip
    """``dM/dx_v`` for every receiver ``v`` of the unpatched run from the embeddings ``x`` [B, S, d_model].

    With no edge patched every receiver of a block reads the same residual stream ``r``, so the run is
    the model's forward: ``LN1(r)`` once, the fused projections. One backward gives ``dM`` at each head's
    query / key / value projection ``g`` [B, S, d_head]; the receiver's own gradient is that pulled back
    through its projection and its copy of LN1 only, ``J_LN1(r)^T (g W^T)`` (LN1's pullback taken for all
    of a layer's q/k/v receivers at once); an MLP's and the logits' are the gradients at a zero added to
    their input. The same derivatives as :func:`run_graph` with ``keep_inputs``, without its per-receiver
    copies of the stream.

    Args:
        module, graph, x, last: as for :func:`run_graph`.
        metric: logits [B, vocab] -> a scalar ``M``.
        keep_acts: also return every sender's activation. out: [n_receivers, B, S, d_model], the gradients
            are added to it (else a new tensor is returned).

    Returns:
        :class:`GraphGrads`.
    """
    B, S, d = x.shape
    n_r, per = len(graph.receivers), graph.per_layer
    fresh = out is None
    if out is None:
        out = torch.empty(n_r, B, S, d, dtype=x.dtype, device=x.device)  # (n_receivers, B, S, d)
    elif tuple(out.shape) != (n_r, B, S, d):
        raise ValueError(f"graph_grads: out must be [{n_r}, {B}, {S}, {d}]; got {list(out.shape)}")

    def store(rows: slice, g: Tensor) -> None:
        if fresh:
            out[rows].copy_(g)
        else:
            out[rows] += g

    tables = _Tables(torch.arange(S, device=x.device))  # positions (S,)
    acts: list[Tensor] = [x.detach()[None]] if keep_acts else []
    streams: list[Tensor] = []  # each layer's attention input
    projections: list[Tensor] = []  # per layer q, k, v
    with torch.enable_grad(), frozen_parameters(module):
        zeros = [torch.zeros_like(x, requires_grad=True) for _ in range(graph.n_layers + 1)]  # (B, S, d)
        resid = x.detach().requires_grad_(True)  # so that layer 0's projections are in the graph
        for lay, block in enumerate(module.blocks):
            attn = block.attn
            streams.append(resid)
            q, k, v = _project(attn, block.ln1(resid))  # (B, H, S, dh), (B, Hkv, S, dh) x 2
            projections += [q, k, v]
            z = _mix(attn, q, k, v, tables)  # (B, H, S, dh)
            # the residual update by one fused product; each head's own output only for acts
            concat = z.transpose(1, 2).flatten(2)  # (B, S, H dh)
            resid = resid + concat @ attn.W_O.flatten(0, 1)  # (B, S, d) = (B, S, H dh) @ (H dh, d)
            if attn.b_O is not None:
                resid = resid + attn.b_O
            m = block.mlp(block.ln2(resid + zeros[lay]))  # (B, S, d)
            resid = resid + m
            if keep_acts:
                with torch.no_grad():
                    acts += [_heads(attn, z), m.detach()[None]]
        rows = (resid + zeros[-1])[torch.arange(B, device=x.device), last]  # (B, d_model)
        if module.ln_final is not None:
            rows = module.ln_final(rows)
        logits = rows @ module.W_U  # (B, vocab)
        got = torch.autograd.grad(metric(logits), projections + zeros, allow_unused=True)
        got = [torch.zeros_like(t) if g is None else g for t, g in zip(projections + zeros, got)]
        for lay, block in enumerate(module.blocks):
            attn = block.attn
            gq, gk, gv = got[3 * lay : 3 * lay + 3]  # (B, H, S, dh), (B, Hkv, S, dh) x 2
            pulled = torch.cat(
                [
                    torch.einsum("bhse,hde->hbsd", gq, attn.W_Q),  # (H, B, S, d)
                    torch.einsum("bgse,gde->gbsd", gk, attn.W_K),  # (Hkv, B, S, d)
                    torch.einsum("bgse,gde->gbsd", gv, attn.W_V),  # (Hkv, B, S, d)
                ]
            )  # (H + 2 Hkv, B, S, d): dM at each receiver's normalised input
            g_in = _norm_pullback(block.ln1, streams[lay].detach(), pulled)  # (H + 2 Hkv, B, S, d)
            store(slice(lay * per, lay * per + per - 1), g_in)
            store(slice(lay * per + per - 1, lay * per + per), got[3 * graph.n_layers + lay][None])
        store(slice(n_r - 1, n_r), got[-1][None])
    return GraphGrads(logits.detach(), torch.cat(acts, 0) if keep_acts else None, out)
