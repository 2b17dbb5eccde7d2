"""One patched run of the circuit graph, as its :class:`~.plan.RunPlan` says.

**A run with edges patched** (:func:`run_graph` with ``corrupt`` and ``missing``). Each receiver reads its
own copy of the residual stream, ``x_v = sum_u a_u + c`` (``c``: the constant biases), and an edge left out
of a circuit carries the sender's *corrupt* activation instead::

    x_v = sum_u a_u + c - sum_u missing[u, v] (a_u - a_u^corrupt)
        = resid^corrupt_v + sum_u kept[u, v] (a_u - a_u^corrupt)

``a_u`` being this run's own activation, ``resid^corrupt_v`` the corrupt run's stream where ``v`` reads;
only senders whose activation differs from the corrupt one count. The run computes a head or MLP only
where that can change the logits (given the corrupt :class:`GraphRun`, with its streams): where one of
its receivers keeps an edge from a sender that differs (else it reads the corrupt stream and its output
is the corrupt run's, taken rather than recomputed), and where it keeps an edge into the logits or into
a node that is computed (else its output is read by no one but through missing edges, and it carries
the corrupt one). Each receiver starts from the side that reads fewer senders' deltas, per receiver or
per block, the deltas of a layer's receivers summed by one product per layer (its q/k/v inputs and its
MLP's part from earlier senders together); the logits' only at the last positions. A block whose
receivers all read the same tensor is normalised once and projected by the fused weights; otherwise its
inputs are [n + 2 n_kv, batch, seq, d_model] for the ``n`` heads computed, each receiver projected by its
own head's ``W_Q``/``W_K``/``W_V`` (under RMSNorm the norm's scale is applied after the projection, the
same maths without writing the normalised copies). With no edge missing the run is the model's forward
(to float rounding: the same maths, a different order of products); with every edge missing it is the
corrupt run.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .head_maths import RotaryTables, head_outputs, mixed_of, per_receiver, summed
from .nodes import Graph
from .plan import LayerPlan, RunPlan

__all__ = ["patched_run"]


def patched_run(
    module: nn.Module, graph: Graph, x: Tensor, last: Tensor, acts_c: Tensor, resids_c: list[Tensor] | None,
    zs_c: list[Tensor] | None, plan: RunPlan, keep_acts: bool, keep_inputs: bool,
) -> tuple[Tensor, list[Tensor], list[Tensor], list[Tensor]]:  # fmt: skip
    """The patched run of ``plan``: the final-norm input rows [B, d] at ``last``; with ``keep_acts`` the
    senders' activations and this run's residual streams; with ``keep_inputs`` the receivers' inputs.

    Given the corrupt run's mixed values ``zs_c``, a head's delta is ``(z_h - z_h^corrupt) W_O[h]``,
    written straight into the delta buffer, and this run's stream adds the heads by one fused product;
    else the heads' outputs are computed and the corrupt ones taken from them."""
    B, S, d = x.shape
    per = graph.per_layer
    tables = RotaryTables(torch.arange(S, device=x.device))  # positions (S,)
    delta = x.new_empty(plan.n_slots, B, S, d)  # (n computed senders, B, S, d): a_u - a_u^corrupt
    torch.sub(x, acts_c[0], out=delta[0])
    own = x  # this run's residual stream, where a receiver starts from it (or it is returned)
    track = plan.own or keep_acts
    acts, inputs, resids = [x[None]], [], []
    far: Tensor | None = None  # the current block's part from the senders before it
    for lay, (block, lp) in enumerate(zip(module.blocks, plan.layers)):
        attn = block.attn
        n, H = graph.attn_senders(lay), attn.n_heads
        if lp.far is not None:  # a block's first layer: the block's part from the senders before it
            far = lp.far.product(delta)  # (n_cols of the block, B, S, d) or None
        patch = None if far is None else far[lp.far_cols]  # (n_cols, B, S, d): a view
        near = lp.near.product(delta)  # (n_cols, B, S, d) or None
        if near is not None:
            patch = near if patch is None else patch.add_(near)
        if keep_acts:
            resids.append(own)
        heads = acts_c[n : n + H]  # (H, B, S, d): the corrupt run's, where not computed
        if lp.sel is not None:
            inp = lp.attn_side.inputs(
                None if patch is None else patch[: lp.n_attn], resids_c[2 * lay] if resids_c else None, own
            )  # (B, S, d) or (n_attn, B, S, d)
            if keep_inputs:
                inputs.append(per_receiver(inp, per - 1))
            z = mixed_of(attn, block.ln1, inp, lp.sel, tables)  # (B, n heads, S, dh)
            z_c_all = None if zs_c is None else zs_c[lay]  # (B, H, S, dh)
            heads, z_all = _head_deltas(lp, z, z_c_all, delta, heads, keep_acts=keep_acts, track=track)
        elif zs_c is not None:
            z_all = zs_c[lay]  # (B, H, S, dh)
        if track:
            own = own + (summed(attn, z_all) if zs_c is not None else heads.sum(0))
            if attn.b_O is not None:
                own = own + attn.b_O
        if keep_acts:
            resids.append(own)
        if lp.mlp_slot is not None:
            corrupt_in = resids_c[2 * lay + 1] if resids_c else None
            m = _mlp_delta(
                block, lp, patch, delta, corrupt_in, own, acts_c[n + H], inputs if keep_inputs else None
            )
        else:
            m = acts_c[n + H]  # (B, S, d)
        if track:
            own = own + m
        if keep_acts:
            acts += [heads, m[None]]
    if keep_acts:
        resids.append(own)
    corrupt_last = resids_c[-1] if resids_c else None
    rows = _logit_rows(plan, delta, own, track, corrupt_last, last, inputs if keep_inputs else None)
    return rows, acts, inputs, resids


def _head_deltas(
    lp: LayerPlan,
    z: Tensor,
    z_c_all: Tensor | None,
    delta: Tensor,
    heads: Tensor,
    *,
    keep_acts: bool,
    track: bool,
) -> tuple[Tensor, Tensor | None]:
    """Write the computed heads' deltas ``a_h - a_h^corrupt`` [n heads, B, S, d] into their rows of ``delta``
    from their mixed values z [B, n heads, S, dh]. Returns the layer's head outputs ``heads`` [H, B, S, d]
    (the corrupt run's, as given, with this run's where they are kept) and, given the corrupt run's mixed
    values ``z_c_all`` [B, H, S, dh], this run's [B, H, S, dh] where ``track`` (else None)."""
    assert lp.sel is not None
    _, B, S, d = delta.shape
    k, idx = lp.sel.n_heads, lp.sel.heads
    rows_d = delta[lp.head_slot : lp.head_slot + k]  # (n heads, B, S, d)
    z_all = None
    if z_c_all is not None:
        z_c = z_c_all if idx is None else z_c_all.index_select(1, idx)  # (B, n heads, S, dh)
        dz = (z - z_c).transpose(0, 1).reshape(k, B * S, -1)  # (n heads, B S, dh)
        torch.bmm(dz, lp.sel.W_O, out=rows_d.view(k, B * S, d))
        if keep_acts:
            heads = heads + rows_d if idx is None else heads.index_add(0, idx, rows_d)  # (H, B, S, d)
        if track:
            z_all = z if idx is None else z_c_all.index_copy(1, idx, z)  # (B, H, S, dh)
    else:
        out = head_outputs(lp.sel, z)  # (n heads, B, S, d)
        if idx is None:
            torch.sub(out, heads, out=rows_d)
            heads = out
        else:
            torch.sub(out, heads.index_select(0, idx), out=rows_d)
            if track:
                heads = heads.index_copy(0, idx, out)  # (H, B, S, d)
    return heads, z_all


def _mlp_delta(
    block: nn.Module, lp: LayerPlan, patch: Tensor | None, delta: Tensor, corrupt_in: Tensor | None,
    own: Tensor, m_c: Tensor, inputs: list[Tensor] | None,
) -> Tensor:  # fmt: skip
    """The MLP's output m [B, S, d] from its input (the side of ``lp.mlp_side`` plus the ``patch`` rows past
    the attention's and this layer's heads' deltas); its delta ``m - m_c`` written into its row of
    ``delta``; its input appended to ``inputs`` where given."""
    _, B, S, d = delta.shape
    pm = None if patch is None else patch[lp.n_attn :]  # (1, B, S, d) or None
    if lp.mlp_heads is not None:
        assert lp.sel is not None
        k = lp.sel.n_heads
        hp = lp.mlp_heads.T @ delta[lp.head_slot : lp.head_slot + k].reshape(k, -1)  # (1, B S d)
        pm = hp.view(1, B, S, d) if pm is None else pm.add_(hp.view(1, B, S, d))
    assert lp.mlp_side is not None and lp.mlp_slot is not None
    mlp_in = per_receiver(lp.mlp_side.inputs(pm, corrupt_in, own), 1)  # (1, B, S, d)
    if inputs is not None:
        inputs.append(mlp_in)
    m = block.mlp(block.ln2(mlp_in[0]))  # (B, S, d)
    torch.sub(m, m_c, out=delta[lp.mlp_slot])
    return m


def _logit_rows(
    plan: RunPlan, delta: Tensor, own: Tensor, track: bool, corrupt_last: Tensor | None, last: Tensor,
    inputs: list[Tensor] | None,
) -> Tensor:  # fmt: skip
    """The final norm's input rows [B, d] at ``last``: the logits' side plus their patch (this run's
    stream ``own`` read only where ``track``), at the last positions only unless ``inputs`` is given
    (then the whole input is appended to it)."""
    B = delta.shape[1]
    at = torch.arange(B, device=delta.device)
    if inputs is not None:
        final = per_receiver(plan.logits_side.inputs(plan.logits.product(delta), corrupt_last, own), 1)
        inputs.append(final)  # (1, B, S, d)
        return final[0][at, last]  # (B, d)
    # the logits read the last positions only
    patch = None if plan.logits.coef is None else plan.logits.product(delta[:, at, last])  # (1, B, d)
    rows = plan.logits_side.inputs(
        patch,
        None if corrupt_last is None else corrupt_last[at, last],
        own[at, last] if track else None,
    )  # (B, d) or (1, B, d)
    return rows if rows.dim() == 2 else rows[0]
