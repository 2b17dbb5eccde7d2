"""What a patched run of the circuit graph computes: a plan made from the edge masks alone.

With ``a_u`` a run's activations and ``delta_u = a_u - a_u^corrupt``, a receiver reads ``x_v =
resid^corrupt_v + sum_{u kept} delta_u = resid_v - sum_{u missing} delta_u``. :func:`plan_run` chooses
which heads and MLPs are computed, which side each receiver starts from, and how the deltas are summed
(one product per block of layers, one per layer); :func:`~.patched.patched_run` carries it out. One plan
serves every batch of a task.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .head_maths import HeadSelection
from .nodes import Graph

__all__ = ["LayerPlan", "RunPlan", "plan_run"]


@dataclass
class _Rows:
    """A product ``sum_r coef[r, c] delta[r]`` over some rows of a patched run's delta buffer: the slots
    ``span`` (a range, read in place) or ``slots`` (gathered first); ``coef`` [n_rows, n_cols] (+1 on a kept
    edge, -1 on a missing one, 0 elsewhere); None where no row has an edge."""

    coef: Tensor | None
    span: tuple[int, int] | None = None
    slots: Tensor | None = None

    def product(self, delta: Tensor) -> Tensor | None:
        """delta [n_slots, ...] -> [n_cols, ...] (None without rows)."""
        if self.coef is None:
            return None
        if self.span is not None:
            rows = delta[self.span[0] : self.span[1]]  # (n_rows, ...)
        else:
            rows = delta.index_select(0, self.slots)  # (n_rows, ...)
        flat = rows.reshape(rows.shape[0], -1)  # (n_rows, B S d)
        return (self.coef.T @ flat).view(self.coef.shape[1], *delta.shape[1:])  # (n_cols, ...)


@dataclass
class _Side:
    """Which stream each receiver of a block starts from: the corrupt run's (``"corrupt"``, plus its kept
    edges), this run's (``"own"``, minus its missing edges), or per receiver (``"mixed"``, ``mask`` True
    where corrupt)."""

    kind: str
    mask: Tensor | None = None

    def inputs(self, patch: Tensor | None, corrupt: Tensor | None, own: Tensor | None) -> Tensor:
        """The receivers' inputs: the shared stream [...] where every receiver reads the same tensor
        (nothing patched), else [n_cols, ...]."""
        if self.kind == "mixed":
            assert self.mask is not None and corrupt is not None and own is not None
            base = torch.where(self.mask.view(-1, *[1] * corrupt.dim()), corrupt, own)  # (n_cols, ...)
        else:
            base = corrupt if self.kind == "corrupt" else own
            assert base is not None
        return base if patch is None else patch.add_(base)


@dataclass
class LayerPlan:
    sel: HeadSelection | None  # the heads computed (None: none, their outputs the corrupt run's)
    head_slot: int  # the delta slot of the first computed head (they are consecutive)
    mlp_slot: int | None  # the MLP's slot; None: not computed
    far: _Rows | None  # on a block's first layer: every layer's part from the senders before the block
    far_cols: slice  # this layer's receivers among the block's
    near: _Rows  # its part from the block's earlier senders
    n_attn: int  # attention receivers computed
    attn_side: _Side
    mlp_side: _Side | None
    mlp_heads: Tensor | None  # (n heads computed, 1): this layer's heads into its MLP


@dataclass
class RunPlan:
    """What a patched run computes (see :func:`plan_run`): a function of the masks alone, so one plan serves
    every batch of a task."""

    missing: Tensor
    resids: bool
    n_slots: int
    layers: list[LayerPlan]
    logits: _Rows
    logits_side: _Side
    own: bool  # some receiver starts from this run's stream, so it is kept


def _choose(kept: Tensor, missing: Tensor, extra: tuple[Tensor, Tensor], can_keep: bool) -> Tensor:
    """Per receiver, True to start from the corrupt stream and add the kept edges, False to start from
    this run's and take away the missing ones; kept/missing [n_rows, n_cols] over the senders computed
    so far, ``extra`` more edges per column (kept, missing) outside those rows. Of the whole block
    on either side and each receiver on its own smaller side, the choice that reads the fewest rows
    (then fewest edges)."""
    n_cols = kept.shape[1]
    nk, nm = kept.sum(0) + extra[0], missing.sum(0) + extra[1]  # (n_cols,) x 2
    own = torch.zeros(n_cols, dtype=torch.bool)
    options = [nk <= nm, torch.ones(n_cols, dtype=torch.bool), own] if can_keep else [own]

    def cost(side: Tensor) -> tuple[int, int]:
        return int(torch.where(side, kept, missing).any(1).sum()), int(torch.where(side, nk, nm).sum())

    return min(options, key=cost)


def _coef(kept: Tensor, missing: Tensor, side: Tensor, dtype: torch.dtype) -> Tensor:
    """+1 on the kept edges of the receivers that start from the corrupt stream, -1 on the missing edges
    of the others: [n_rows, n_cols]."""
    return torch.where(side, kept.to(dtype), -missing.to(dtype))


def _rows_of(coef: Tensor, offset: int, device: torch.device) -> _Rows:
    """The product with ``coef`` [n_rows, n_cols] over the slots ``offset .. offset + n_rows - 1``."""
    used = coef.ne(0).any(1).nonzero()[:, 0]  # (n_used,)
    if used.numel() == 0:
        return _Rows(None)
    lo, hi = int(used[0]), int(used[-1]) + 1
    if hi - lo <= 3 * used.numel():  # a gather reads, writes and reads again each row it keeps
        return _Rows(coef[lo:hi].to(device), span=(offset + lo, offset + hi))
    return _Rows(coef[used].to(device), slots=(offset + used).to(device))


def _side_of(side: Tensor, device: torch.device) -> _Side:
    if bool(side.all()):
        return _Side("corrupt")
    if not bool(side.any()):
        return _Side("own")
    return _Side("mixed", side.to(device))


#: Layers whose receivers share one product of the earlier senders' deltas in a patched run.
_BLOCK_LAYERS = 5
#: What that shared product costs beyond reading its rows, in delta rows per receiver: its output written,
#: read back and added to (weighed against each layer reading the rows itself).
_SHARED_WRITES = 3


def plan_run(
    module: nn.Module, graph: Graph, missing: Tensor, *, resids: bool, prune: bool, full: bool,
    dtype: torch.dtype, device: torch.device, block: int = _BLOCK_LAYERS,
) -> RunPlan:  # fmt: skip
    """What a run with ``missing`` edges computes. With ``a_u`` this run's activations and ``delta_u = a_u
    - a_u^corrupt``, a receiver reads ``x_v = resid^corrupt_v + sum_{u kept} delta_u = resid_v - sum_{u
    missing} delta_u``, and only senders with a nonzero delta count:

    * a node (head, MLP) is computed only where it is *active*: one of its receivers keeps an edge from
      an active sender (the embeddings are), else every receiver of it reads the corrupt stream and its
      output is the corrupt run's (needs the corrupt run's ``resids``);
    * and, with ``prune``, only where it is *needed*: it keeps an edge into a receiver that is read (the
      logits, or one of a computed node); a node that is not needed changes nothing the logits read, so
      it may carry its corrupt output too;
    * each receiver block reads, per receiver, the side with fewer rows (see :func:`_choose`); the delta
      buffer holds the computed senders only, in order, so a product reads a range of it or gathers;
      the receivers of ``block`` layers at a time take their part from the senders before them in one
      product, and each layer its part from the block's earlier senders in another.

    ``full``: compute every node (each receiver's input is returned).
    """
    valid = graph.valid
    missing = missing.cpu() & valid
    kept = valid & ~missing
    computed = _computed(graph, kept, resids=resids, prune=prune, full=full)
    layers, coefs = _layer_plans(module, graph, kept, missing, computed, resids, dtype, device)
    _share_blocks(layers, coefs, block, device)
    done = computed.nonzero()[:, 0]
    k_l, m_l = kept[done][:, -1:], missing[done][:, -1:]  # (n_slots, 1) x 2
    zero = torch.zeros(1, dtype=torch.long)
    side = _choose(k_l, m_l, (zero, zero), resids)
    sides = [lp.attn_side for lp in layers] + [lp.mlp_side for lp in layers if lp.mlp_side is not None]
    logits_side = _side_of(side, device)
    own = any(s.kind != "corrupt" for s in [*sides, logits_side])
    return RunPlan(
        missing=missing, resids=resids, n_slots=int(computed.sum()), layers=layers,
        logits=_rows_of(_coef(k_l, m_l, side, dtype), 0, device), logits_side=logits_side, own=own,
    )  # fmt: skip


def _active(graph: Graph, kept: Tensor) -> Tensor:
    """bool [n_senders]: the senders whose activation can differ from the corrupt run's (the embeddings;
    a head or MLP one of whose receivers keeps an edge from an active sender)."""
    H, G, L, per = graph.n_heads, graph.n_kv_heads, graph.n_layers, graph.per_layer
    group = H // G
    active = torch.ones(len(graph.senders), dtype=torch.bool)
    for lay in range(L):
        n, base = graph.attn_senders(lay), lay * per
        hit = (kept[:n, base : base + per - 1] & active[:n, None]).any(0)  # (H + 2 G,)
        kv = (hit[H : H + G] | hit[H + G :]).repeat_interleave(group)  # (H,)
        active[n : n + H] = hit[:H] | kv
        active[n + H] = bool((kept[: n + H, base + per - 1] & active[: n + H]).any())
    return active


def _computed(graph: Graph, kept: Tensor, *, resids: bool, prune: bool, full: bool) -> Tensor:
    """bool [n_senders]: the senders a run computes (see :func:`plan_run`): active ones (all without the
    corrupt ``resids`` or with ``full``) and, with ``prune``, of those only the ones the logits need."""
    H, G, L, per = graph.n_heads, graph.n_kv_heads, graph.n_layers, graph.per_layer
    group = H // G
    computed = (
        _active(graph, kept) if resids and not full else torch.ones(len(graph.senders), dtype=torch.bool)
    )
    need = torch.zeros(len(graph.receivers), dtype=torch.bool)  # receivers read
    need[-1] = True
    for lay in reversed(range(L)):
        n, base = graph.attn_senders(lay), lay * per
        if prune and not full:  # the MLP first: the layer's heads feed it
            computed[n + H] &= bool((kept[n + H] & need).any())
        need[base + per - 1] = computed[n + H]
        if prune and not full:
            computed[n : n + H] &= (kept[n : n + H] & need).any(1)
        heads = computed[n : n + H]
        groups = heads.view(G, group).any(1)
        need[base : base + H] = heads
        need[base + H : base + H + G] = groups
        need[base + H + G : base + per - 1] = groups
    return computed


def _layer_plans(
    module: nn.Module, graph: Graph, kept: Tensor, missing: Tensor, computed: Tensor, resids: bool,
    dtype: torch.dtype, device: torch.device,
) -> tuple[list[LayerPlan], list[Tensor]]:  # fmt: skip
    """Each layer's plan (its products not yet set, see :func:`_share_blocks`) and its receivers'
    coefficients on the slots of the senders before its attention, [n_pre, n_cols] per layer."""
    H, G, per = graph.n_heads, graph.n_kv_heads, graph.per_layer
    group = H // G
    slot = torch.cumsum(computed, 0) - 1  # (n_senders,): each computed sender's row in the delta buffer
    layers: list[LayerPlan] = []
    coefs: list[Tensor] = []  # per layer (n_pre, n_cols): its receivers' coefficients on the earlier slots
    for lay, layer in enumerate(module.blocks):
        n, base = graph.attn_senders(lay), lay * per
        pre = computed[:n].nonzero()[:, 0]  # (n_pre,): the senders before the attention, by slot
        heads = computed[n : n + H].nonzero()[:, 0]
        groups = computed[n : n + H].view(G, group).any(1).nonzero()[:, 0]
        mlp = bool(computed[n + H])
        cols = torch.cat([base + heads, base + H + groups, base + H + G + groups])
        if mlp:
            cols = torch.cat([cols, torch.tensor([base + per - 1])])
        k_pre, m_pre = kept[pre][:, cols], missing[pre][:, cols]  # (n_pre, n_cols) x 2
        zeros = torch.zeros(cols.numel(), dtype=torch.long)
        extra = (zeros, zeros)
        if mlp:
            k_h, m_h = kept[n + heads, base + per - 1], missing[n + heads, base + per - 1]  # (n heads,) x 2
            extra = (torch.cat([zeros[1:], k_h.sum()[None]]), torch.cat([zeros[1:], m_h.sum()[None]]))
        side = _choose(k_pre, m_pre, extra, resids)  # (n_cols,)
        n_attn = cols.numel() - int(mlp)
        mlp_heads = None
        if mlp and heads.numel():
            c = torch.where(side[-1], k_h.to(dtype), -m_h.to(dtype))  # (n heads,)
            mlp_heads = c[:, None].to(device) if bool(c.ne(0).any()) else None
        sel = None
        if heads.numel():
            all_heads = heads.numel() == H
            sel = HeadSelection(
                layer.attn, None if all_heads else heads.to(device), None if all_heads else groups.to(device)
            )
        coefs.append(_coef(k_pre, m_pre, side, dtype))  # (n_pre, n_cols)
        layers.append(
            LayerPlan(
                sel=sel, head_slot=int(slot[n + heads[0]]) if heads.numel() else -1,
                mlp_slot=int(slot[n + H]) if mlp else None, far=None, far_cols=slice(0), near=_Rows(None),
                n_attn=n_attn, attn_side=_side_of(side[:n_attn], device),
                mlp_side=_side_of(side[n_attn:], device) if mlp else None, mlp_heads=mlp_heads,
            )
        )  # fmt: skip
    return layers, coefs


def _share_blocks(layers: list[LayerPlan], coefs: list[Tensor], block: int, device: torch.device) -> None:
    """Set each layer's products (``far``, ``far_cols``, ``near``) from its coefficients ``coefs``."""
    L = len(layers)
    # per block of layers, one product of the senders before the block for all its receivers, and per
    # layer one of the senders inside the block before it: each delta row is read about once per block
    # rather than once per layer, and the block's product is wide enough to be compute-bound. Where the
    # block's product would write more than it saves reading (few rows before it), each layer reads all
    for start in range(0, L, block):
        lays = range(start, min(L, start + block))
        s0 = coefs[start].shape[0]  # the slots before the block
        widths = [coefs[lay].shape[1] for lay in lays]
        before = torch.cat([coefs[lay][:s0] for lay in lays], 1)  # (s0, n_cols of the block)
        per_layer = sum(int(coefs[lay][:s0].ne(0).any(1).sum()) for lay in lays)  # rows read layer by layer
        shared = int(before.ne(0).any(1).sum()) + _SHARED_WRITES * sum(widths)  # read once; its output
        if shared >= per_layer:
            s0, before = 0, before[:0]
        layers[start].far = _rows_of(before, 0, device)
        offset = 0
        for lay, width in zip(lays, widths):
            layers[lay].far_cols = slice(offset, offset + width)
            layers[lay].near = _rows_of(coefs[lay][s0:], s0, device)
            offset += width
