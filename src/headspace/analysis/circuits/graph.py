"""The computational graph of a pre-norm decoder, heads and MLPs as nodes, and one batched run of it.

The graph itself is :mod:`.nodes` (:class:`Graph`, :func:`graph_of`, re-exported here); the attention
maths the runs share is :mod:`.head_maths`; a patched run's plan and the run itself are :mod:`.plan` and
:mod:`.patched`. This module runs the graph (:func:`run_graph`, unpatched or patched) and takes its
gradients (:func:`graph_grads`).

**A run with edges patched** (:func:`run_graph` with ``corrupt`` and ``missing``): an edge left out of a
circuit carries the sender's corrupt activation; what the run computes, and what it takes from the corrupt
run, is written in :mod:`.patched`.

**Gradients** (:func:`graph_grads`). Unpatched, every receiver reads the same stream, so ``dM/dx_v`` for
all receivers comes from the model's own forward and one backward: the gradient at each head's query /
key / value projection, pulled back through that projection and LN1 alone (closed form for RMSNorm and
LayerNorm); an MLP's and the logits' are the gradients at a zero added to their inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ...nn.norms import RMSNorm, rms_inverse
from .head_maths import RotaryTables, head_outputs, mix, per_receiver, project, summed
from .nodes import GRAPH_FEATURES, Graph, graph_of
from .patched import patched_run
from .plan import RunPlan, plan_run

__all__ = [
    "GRAPH_FEATURES",
    "Graph",
    "GraphGrads",
    "GraphRun",
    "RotaryTables",
    "RowsRun",
    "frozen_parameters",
    "graph_grads",
    "graph_of",
    "project_qkv",
    "run_graph",
    "run_rows",
]

#: The projection's public name here, for modules that write their own forward through the same maths
#: (:mod:`~headspace.analysis.circuits.atp_star`, which needs the attention pattern itself).
project_qkv = project


@dataclass
class GraphRun:
    """One run: ``logits`` [batch, vocab] at each row's last position; ``acts`` [n_senders, batch, seq,
    d_model] every sender's activation (None unless asked); ``inputs``: per receiver block the tensor each
    receiver reads ([n, batch, seq, d_model], kept for gradients, only with ``keep_inputs``); ``resids``:
    with ``keep_acts``, the residual stream [batch, seq, d_model] each receiver block reads unpatched
    (per layer the attention's, the MLP's; last the logits'), which a patched run starts from for the
    receivers that add their kept edges (and which tells it that a node reading only the corrupt stream
    has the corrupt output)."""

    logits: Tensor
    acts: Tensor | None
    inputs: list[Tensor]
    resids: list[Tensor] | None = None


@dataclass
class RowsRun:
    """:func:`run_rows`' result: ``rows`` [B, d_model], the final norm's output at each row's last
    position (the logits are ``rows @ W_U``), and the rest as :class:`GraphRun`'s."""

    rows: Tensor
    acts: Tensor | None
    inputs: list[Tensor]
    resids: list[Tensor] | None
    zs: list[Tensor] | None = None  # with keep_acts, unpatched: per layer the mixed values [B, H, S, dh]


def run_rows(
    module: nn.Module, graph: Graph, x: Tensor, last: Tensor, *,
    corrupt: Tensor | GraphRun | RowsRun | None = None, missing: Tensor | None = None,
    keep_acts: bool = False, keep_inputs: bool = False, plan: RunPlan | None = None,
) -> RowsRun:  # fmt: skip
    """:func:`run_graph` up to the final norm (the same arguments; ``plan``: a :func:`plan_run` of
    ``missing`` made earlier, for ``corrupt`` a GraphRun with its resids)."""
    if missing is not None and torch.is_grad_enabled():
        raise RuntimeError("run_graph patches edges without autograd; call it under torch.no_grad()")
    resids_c = zs_c = None
    if isinstance(corrupt, (GraphRun, RowsRun)):
        if corrupt.acts is None:
            raise ValueError("run_graph's corrupt run must have its acts: run it with keep_acts=True")
        zs_c = corrupt.zs if isinstance(corrupt, RowsRun) else None
        corrupt, resids_c = corrupt.acts, corrupt.resids
    B, S, _ = x.shape
    at = torch.arange(B, device=x.device)
    if corrupt is not None and missing is not None and bool(missing.any()):
        if plan is None:
            plan = plan_run(
                module, graph, missing, resids=resids_c is not None, prune=not (keep_acts or keep_inputs),
                full=keep_inputs, dtype=x.dtype, device=x.device,
            )  # fmt: skip
        elif plan.resids and resids_c is None:
            raise ValueError("this plan starts blocks from the corrupt stream: give the corrupt GraphRun")
        rows, acts, inputs, resids = patched_run(
            module, graph, x, last, corrupt, resids_c, zs_c, plan, keep_acts, keep_inputs
        )
        zs = None
    else:
        tables = RotaryTables(torch.arange(S, device=x.device))  # positions (S,)
        acts, inputs, resids, zs = [x[None]], [], [], []
        resid, n_qkv = x, graph.per_layer - 1
        for block in module.blocks:
            attn = block.attn
            if keep_acts:
                resids.append(resid)
            inp = resid  # (B, S, d), or one view per receiver (for gradients)
            if keep_inputs:
                inp = per_receiver(inp, n_qkv)  # (H + 2 Hkv, B, S, d)
                inputs.append(inp)
            z = mix(attn, *project(attn, block.ln1(inp)), tables)  # (B, H, S, dh)
            if keep_acts or keep_inputs:  # each head's own output
                heads = head_outputs(attn, z)  # (H, B, S, d)
                resid = resid + heads.sum(0)
                zs.append(z)
            else:
                resid = resid + summed(attn, z)
            if attn.b_O is not None:
                resid = resid + attn.b_O
            if keep_acts:
                resids.append(resid)
            mlp_in = per_receiver(resid, 1)  # (1, B, S, d)
            if keep_inputs:
                inputs.append(mlp_in)
            m = block.mlp(block.ln2(mlp_in[0]))  # (B, S, d)
            resid = resid + m
            if keep_acts:
                acts += [heads, m[None]]
        if keep_acts:
            resids.append(resid)
        final = per_receiver(resid, 1)  # (1, B, S, d)
        if keep_inputs:
            inputs.append(final)
        rows = final[0][at, last]  # (B, d_model)
    if module.ln_final is not None:
        rows = module.ln_final(rows)
    return RowsRun(
        rows,
        torch.cat(acts, 0) if keep_acts else None,
        inputs,
        resids if keep_acts else None,
        zs if keep_acts and zs else None,
    )


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
        keep_acts: return every sender's activation and the residual streams (a patched run then also
            computes the nodes that the logits do not read); keep_inputs: each receiver's input as its
            own tensor (for gradients; a patched run then computes every node).

    Returns:
        :class:`GraphRun`.
    """
    run = run_rows(
        module, graph, x, last, corrupt=corrupt, missing=missing, keep_acts=keep_acts, keep_inputs=keep_inputs
    )
    return GraphRun(run.rows @ module.W_U, run.acts, run.inputs, run.resids)


def _norm_pullback(norm: nn.Module, x: Tensor, g: Tensor) -> Tensor:
    """``J_norm(x)^T g`` for x [B, S, d] and each g [n, B, S, d] -> [n, B, S, d]: RMSNorm and LayerNorm in
    closed form (x's statistics once for all n), any other norm by autograd on n copies of x."""
    if isinstance(norm, RMSNorm) or (
        isinstance(norm, nn.LayerNorm) and norm.normalized_shape == x.shape[-1:]
    ):
        dt = torch.promote_types(x.dtype, torch.float32)
        xf, gf = x.to(dt), g.to(dt)
        if isinstance(norm, RMSNorm):
            r = rms_inverse(xf, norm.eps)  # (B, S, 1)
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


def _receiver_grads(block: nn.Module, stream: Tensor, gq: Tensor, gk: Tensor, gv: Tensor) -> Tensor:
    """``dM/dx_v`` [H + 2 Hkv, B, S, d] of a layer's q, k, v receivers reading ``stream`` [B, S, d], from
    the gradients at its projections gq [B, H, S, dh], gk and gv [B, Hkv, S, dh]: each pulled back through
    its own head's projection, then through LN1 (all of them at once)."""
    attn = block.attn
    pulled = torch.cat(
        [
            torch.einsum("bhse,hde->hbsd", gq, attn.W_Q),  # (H, B, S, d)
            torch.einsum("bgse,gde->gbsd", gk, attn.W_K),  # (Hkv, B, S, d)
            torch.einsum("bgse,gde->gbsd", gv, attn.W_V),  # (Hkv, B, S, d)
        ]
    )  # (H + 2 Hkv, B, S, d): dM at each receiver's normalised input
    return _norm_pullback(block.ln1, stream, pulled)  # (H + 2 Hkv, B, S, d)


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

    tables = RotaryTables(torch.arange(S, device=x.device))  # positions (S,)
    acts: list[Tensor] = [x.detach()[None]] if keep_acts else []
    streams: list[Tensor] = []  # each layer's attention input
    projections: list[Tensor] = []  # per layer q, k, v
    with torch.enable_grad(), frozen_parameters(module):
        zeros = [torch.zeros_like(x, requires_grad=True) for _ in range(graph.n_layers + 1)]  # (B, S, d)
        resid = x.detach().requires_grad_(True)  # so that layer 0's projections are in the graph
        for lay, block in enumerate(module.blocks):
            attn = block.attn
            streams.append(resid)
            q, k, v = project(attn, block.ln1(resid))  # (B, H, S, dh), (B, Hkv, S, dh) x 2
            projections += [q, k, v]
            z = mix(attn, q, k, v, tables)  # (B, H, S, dh)
            # the residual update by one fused product; each head's own output only for acts
            concat = z.transpose(1, 2).flatten(2)  # (B, S, H dh)
            resid = resid + concat @ attn.W_O.flatten(0, 1)  # (B, S, d) = (B, S, H dh) @ (H dh, d)
            if attn.b_O is not None:
                resid = resid + attn.b_O
            m = block.mlp(block.ln2(resid + zeros[lay]))  # (B, S, d)
            resid = resid + m
            if keep_acts:
                with torch.no_grad():
                    acts += [head_outputs(attn, z), m.detach()[None]]
        rows = (resid + zeros[-1])[torch.arange(B, device=x.device), last]  # (B, d_model)
        if module.ln_final is not None:
            rows = module.ln_final(rows)
        logits = rows @ module.W_U  # (B, vocab)
        got = torch.autograd.grad(metric(logits), projections + zeros, allow_unused=True)
        got = [torch.zeros_like(t) if g is None else g for t, g in zip(projections + zeros, got)]
        for lay, block in enumerate(module.blocks):
            g_in = _receiver_grads(block, streams[lay].detach(), *got[3 * lay : 3 * lay + 3])
            store(slice(lay * per, lay * per + per - 1), g_in)
            store(slice(lay * per + per - 1, lay * per + per), got[3 * graph.n_layers + lay][None])
        store(slice(n_r - 1, n_r), got[-1][None])
    return GraphGrads(logits.detach(), torch.cat(acts, 0) if keep_acts else None, out)
