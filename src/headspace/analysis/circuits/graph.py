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

from ...attention.layer import MultiHeadAttention
from ...model.block import FeedForward, GatedFeedForward, TransformerBlock
from ...nn.masks import window_mask
from ...nn.norms import RMSNorm, rms_inverse
from ...nn.positions import rotary_tables, rotate_fused
from ...nn.spec import refuse_unsupported
from ..causal.causal_inputs import is_decoder, stack_of

__all__ = [
    "Graph",
    "GraphGrads",
    "GraphRun",
    "RotaryTables",
    "frozen_parameters",
    "graph_grads",
    "graph_of",
    "project_qkv",
    "run_graph",
]


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
    """Refuse (one line) a block the circuit runner cannot run: not a pre-norm :class:`TransformerBlock`
    with fused self-attention and this package's MLPs, or a spec field it does not compute (by name)."""
    ok = (
        type(block) is TransformerBlock
        and block.spec.layout == "pre"
        and isinstance(block.attn, MultiHeadAttention)
        and block.attn.fused
        and isinstance(block.mlp, (FeedForward, GatedFeedForward))
    )
    if not ok:
        layout = block.spec.layout if isinstance(block, TransformerBlock) else None
        raise TypeError(
            f"circuits need pre-norm decoder blocks (GPT-2, Llama-family), fused self-attention; block {i} "
            f"is {type(block).__name__} (layout={layout!r})"
        )
    refuse_unsupported(block.spec, f"the circuit runner (block {i})", GRAPH_FEATURES)


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


class _Sel:
    """The query heads of one layer that a patched run computes, and the key/value heads they read."""

    def __init__(self, attn: MultiHeadAttention, heads: Tensor | None, groups: Tensor | None) -> None:
        self.heads, self.groups = heads, groups  # int64 (n,), (n_groups,); None: all of them
        if heads is None:
            self.W_Q, self.W_K, self.W_V, self.W_O = attn.W_Q, attn.W_K, attn.W_V, attn.W_O
            self.kv = None
            return
        assert groups is not None
        self.W_Q, self.W_O = attn.W_Q[heads], attn.W_O[heads]  # (n, d, dh), (n, dh, d)
        self.W_K, self.W_V = attn.W_K[groups], attn.W_V[groups]  # (n_groups, d, dh) x 2
        # each computed query head's key/value head among the computed ones (None: the same order)
        kv = torch.searchsorted(groups, heads // (attn.n_heads // attn.n_kv_heads))  # (n,)
        self.kv = None if torch.equal(kv, torch.arange(groups.numel(), device=kv.device)) else kv

    @property
    def n_heads(self) -> int:
        return self.W_Q.shape[0]


def _project(attn: Any, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q [B, H, S, dh], k and v [B, Hkv, S, dh] without biases, from normalised inputs: x [B, S, d] read
    by every receiver of the layer, or x [H + 2 Hkv, B, S, d], each receiver its own (``attn``: the
    layer, or a :class:`_Sel` of some of its heads, H and Hkv then counting those)."""
    if x.dim() == 3:
        q = torch.einsum("bsd,hde->bhse", x, attn.W_Q)  # (B, H, S, dh)
        k = torch.einsum("bsd,gde->bgse", x, attn.W_K)  # (B, Hkv, S, dh)
        v = torch.einsum("bsd,gde->bgse", x, attn.W_V)  # (B, Hkv, S, dh)
        return q, k, v
    H, Hkv = attn.W_Q.shape[0], attn.W_K.shape[0]
    xq, xk, xv = x.split([H, Hkv, Hkv], dim=0)  # (H, B, S, d), (Hkv, B, S, d) x 2
    q = torch.einsum("hbsd,hde->bhse", xq, attn.W_Q)  # (B, H, S, dh)
    k = torch.einsum("gbsd,gde->bgse", xk, attn.W_K)  # (B, Hkv, S, dh)
    v = torch.einsum("gbsd,gde->bgse", xv, attn.W_V)  # (B, Hkv, S, dh)
    return q, k, v


def _foldable(norm: nn.Module, x: Tensor) -> bool:
    return (
        isinstance(norm, RMSNorm)
        and x.dtype in (torch.float32, torch.float64)
        and norm.weight.dtype == x.dtype
    )


def _project_folded(sel: _Sel, norm: RMSNorm, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_project` of ``norm(x)`` for per-receiver raw inputs x [H + 2 Hkv, B, S, d] (float32 or
    float64), RMSNorm's scale moved past the projection: ``RMSNorm(x) W = rsqrt(mean(x^2) + eps) (x ((offset
    + w) W))``, so the normalised copies of the inputs are never written (the same maths, a different
    order of roundings)."""
    H, Hkv = sel.W_Q.shape[0], sel.W_K.shape[0]
    s = (norm.offset + norm.weight)[:, None]  # (d, 1)
    r = rms_inverse(x, norm.eps).transpose(0, 1)  # (B, n, S, 1)
    xq, xk, xv = x.split([H, Hkv, Hkv], dim=0)  # (H, B, S, d), (Hkv, B, S, d) x 2
    q = torch.einsum("hbsd,hde->bhse", xq, sel.W_Q * s) * r[:, :H]  # (B, H, S, dh)
    k = torch.einsum("gbsd,gde->bgse", xk, sel.W_K * s) * r[:, H : H + Hkv]  # (B, Hkv, S, dh)
    v = torch.einsum("gbsd,gde->bgse", xv, sel.W_V * s) * r[:, H + Hkv :]  # (B, Hkv, S, dh)
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


#: Public names of the projection and the rotary tables above, for modules that write their own forward
#: through the same maths (:mod:`.atp_star`, which needs the attention pattern itself).
project_qkv = _project
RotaryTables = _Tables


def _mix(
    attn: MultiHeadAttention, q: Tensor, k: Tensor, v: Tensor, tables: _Tables, sel: _Sel | None = None
) -> Tensor:
    """Each head's mixed values ``z_h`` [B, H, S, dh] from :func:`_project`'s q, k, v (of the heads of
    ``sel`` where given, H and Hkv then counting those)."""
    H, Hkv = attn.n_heads, attn.n_kv_heads
    part = sel is not None and sel.heads is not None
    if attn.b_Q is not None:
        b_Q, b_K, b_V = attn.b_Q, attn.b_K, attn.b_V
        if part:
            b_Q, b_K, b_V = b_Q[sel.heads], b_K[sel.groups], b_V[sel.groups]
        q = q + b_Q[None, :, None, :]  # (B, H, S, dh)
        k = k + b_K[None, :, None, :]  # (B, Hkv, S, dh)
        v = v + b_V[None, :, None, :]  # (B, Hkv, S, dh)
    if attn.rotary is not None:
        q, k = tables.rotate(attn, q, k)  # (B, H, S, dh), (B, Hkv, S, dh)
    if part:
        if sel.kv is not None:
            k, v = k.index_select(1, sel.kv), v.index_select(1, sel.kv)  # (B, H, S, dh) x 2
    elif Hkv != H:
        k = k.repeat_interleave(H // Hkv, dim=1)  # (B, H, S, dh)
        v = v.repeat_interleave(H // Hkv, dim=1)  # (B, H, S, dh)
    spec = attn.spec  # the layer's description, read at run time: its scale and window
    scale = spec.score_scale
    if spec.window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)  # (B, H, S, dh)
    S = q.shape[-2]
    band = window_mask(S, S, spec.window, q.device)  # (S, S): causal and within the window
    return F.scaled_dot_product_attention(q, k, v, attn_mask=band, scale=scale)  # (B, H, S, dh)


def _heads(attn: Any, z: Tensor) -> Tensor:
    """Each head's output ``z_h W_O[h]`` [H, B, S, d_model] from z [B, H, S, dh]."""
    return torch.einsum("bhse,hem->hbsm", z, attn.W_O)  # (H, B, S, d_model)


def _mixed_of(attn: MultiHeadAttention, norm: nn.Module, x: Tensor, sel: _Sel, tables: _Tables) -> Tensor:
    """The mixed values z [B, n, S, dh] of ``sel``'s heads from raw (not yet normalised) inputs: x [B, S, d]
    read by all of them, or [n + 2 n_groups, B, S, d] (their queries', then their key/value heads' keys and
    values), each receiver its own."""
    if x.dim() == 4 and _foldable(norm, x):
        q, k, v = _project_folded(sel, norm, x)
    else:
        q, k, v = _project(sel, norm(x))
    return _mix(attn, q, k, v, tables, sel)


def _summed(attn: MultiHeadAttention, z: Tensor) -> Tensor:
    """The heads' outputs summed, ``sum_h z_h W_O[h]`` [B, S, d_model] from z [B, H, S, dh], by one fused
    product."""
    return z.transpose(1, 2).flatten(2) @ attn.W_O.flatten(0, 1)  # (B, S, H dh) @ (H dh, d)


# ------------------------------------------------------------------------------------ patched runs
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
class _LayerPlan:
    sel: _Sel | None  # the heads computed (None: none, their outputs the corrupt run's)
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
class _Plan:
    """What a patched run computes (see :func:`_plan`): a function of the masks alone, so one plan serves
    every batch of a task."""

    missing: Tensor
    resids: bool
    n_slots: int
    layers: list[_LayerPlan]
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


def _plan(
    module: nn.Module, graph: Graph, missing: Tensor, *, resids: bool, prune: bool, full: bool,
    dtype: torch.dtype, device: torch.device, block: int = _BLOCK_LAYERS,
) -> _Plan:  # fmt: skip
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
    H, G, L, per = graph.n_heads, graph.n_kv_heads, graph.n_layers, graph.per_layer
    group = H // G
    n_s = len(graph.senders)
    active = torch.ones(n_s, dtype=torch.bool)
    if resids and not full:
        for lay in range(L):
            n, base = graph.attn_senders(lay), lay * per
            hit = (kept[:n, base : base + per - 1] & active[:n, None]).any(0)  # (H + 2 G,)
            kv = (hit[H : H + G] | hit[H + G :]).repeat_interleave(group)  # (H,)
            active[n : n + H] = hit[:H] | kv
            active[n + H] = bool((kept[: n + H, base + per - 1] & active[: n + H]).any())
    computed = active.clone()
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
    slot = torch.cumsum(computed, 0) - 1  # (n_senders,): each computed sender's row in the delta buffer
    layers: list[_LayerPlan] = []
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
            sel = _Sel(
                layer.attn, None if all_heads else heads.to(device), None if all_heads else groups.to(device)
            )
        coefs.append(_coef(k_pre, m_pre, side, dtype))  # (n_pre, n_cols)
        layers.append(
            _LayerPlan(
                sel=sel, head_slot=int(slot[n + heads[0]]) if heads.numel() else -1,
                mlp_slot=int(slot[n + H]) if mlp else None, far=None, far_cols=slice(0), near=_Rows(None),
                n_attn=n_attn, attn_side=_side_of(side[:n_attn], device),
                mlp_side=_side_of(side[n_attn:], device) if mlp else None, mlp_heads=mlp_heads,
            )
        )  # fmt: skip
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
    done = computed.nonzero()[:, 0]
    k_l, m_l = kept[done][:, -1:], missing[done][:, -1:]  # (n_slots, 1) x 2
    zero = torch.zeros(1, dtype=torch.long)
    side = _choose(k_l, m_l, (zero, zero), resids)
    sides = [lp.attn_side for lp in layers] + [lp.mlp_side for lp in layers if lp.mlp_side is not None]
    logits_side = _side_of(side, device)
    own = any(s.kind != "corrupt" for s in [*sides, logits_side])
    return _Plan(
        missing=missing, resids=resids, n_slots=int(computed.sum()), layers=layers,
        logits=_rows_of(_coef(k_l, m_l, side, dtype), 0, device), logits_side=logits_side, own=own,
    )  # fmt: skip


def _per_receiver(x: Tensor, n: int) -> Tensor:
    """x [B, S, d] or [n, B, S, d] -> [n, B, S, d] (a view where every receiver reads the same x)."""
    return x if x.dim() == 4 else x.unsqueeze(0).expand(n, *x.shape)  # (n, B, S, d)


@dataclass
class _Rowsrun:
    """:func:`_run_rows`' result: ``rows`` [B, d_model], the final norm's output at each row's last
    position (the logits are ``rows @ W_U``), and the rest as :class:`GraphRun`'s."""

    rows: Tensor
    acts: Tensor | None
    inputs: list[Tensor]
    resids: list[Tensor] | None
    zs: list[Tensor] | None = None  # with keep_acts, unpatched: per layer the mixed values [B, H, S, dh]


def _patched(
    module: nn.Module, graph: Graph, x: Tensor, last: Tensor, acts_c: Tensor, resids_c: list[Tensor] | None,
    zs_c: list[Tensor] | None, plan: _Plan, keep_acts: bool, keep_inputs: bool,
) -> tuple[Tensor, list[Tensor], list[Tensor], list[Tensor]]:  # fmt: skip
    """The patched run of ``plan``: the final-norm input rows [B, d] at ``last``; with ``keep_acts`` the
    senders' activations and this run's residual streams; with ``keep_inputs`` the receivers' inputs.

    Given the corrupt run's mixed values ``zs_c``, a head's delta is ``(z_h - z_h^corrupt) W_O[h]``,
    written straight into the delta buffer, and this run's stream adds the heads by one fused product;
    else the heads' outputs are computed and the corrupt ones taken from them."""
    B, S, d = x.shape
    per = graph.per_layer
    tables = _Tables(torch.arange(S, device=x.device))  # positions (S,)
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
                inputs.append(_per_receiver(inp, per - 1))
            z = _mixed_of(attn, block.ln1, inp, lp.sel, tables)  # (B, n heads, S, dh)
            k, idx = lp.sel.n_heads, lp.sel.heads
            rows_d = delta[lp.head_slot : lp.head_slot + k]  # (n heads, B, S, d)
            if zs_c is not None:
                z_c = zs_c[lay] if idx is None else zs_c[lay].index_select(1, idx)  # (B, n heads, S, dh)
                dz = (z - z_c).transpose(0, 1).reshape(k, B * S, -1)  # (n heads, B S, dh)
                torch.bmm(dz, lp.sel.W_O, out=rows_d.view(k, B * S, d))
                if keep_acts:
                    heads = heads + rows_d if idx is None else heads.index_add(0, idx, rows_d)  # (H, B, S, d)
                if track:
                    z_all = z if idx is None else zs_c[lay].index_copy(1, idx, z)  # (B, H, S, dh)
            else:
                out = _heads(lp.sel, z)  # (n heads, B, S, d)
                if idx is None:
                    torch.sub(out, heads, out=rows_d)
                    heads = out
                else:
                    torch.sub(out, heads.index_select(0, idx), out=rows_d)
                    if track:
                        heads = heads.index_copy(0, idx, out)  # (H, B, S, d)
        elif zs_c is not None:
            z_all = zs_c[lay]  # (B, H, S, dh)
        if track:
            own = own + (_summed(attn, z_all) if zs_c is not None else heads.sum(0))
            if attn.b_O is not None:
                own = own + attn.b_O
        if keep_acts:
            resids.append(own)
        if lp.mlp_slot is not None:
            pm = None if patch is None else patch[lp.n_attn :]  # (1, B, S, d) or None
            if lp.mlp_heads is not None:
                assert lp.sel is not None
                k = lp.sel.n_heads
                hp = lp.mlp_heads.T @ delta[lp.head_slot : lp.head_slot + k].reshape(k, -1)  # (1, B S d)
                pm = hp.view(1, B, S, d) if pm is None else pm.add_(hp.view(1, B, S, d))
            assert lp.mlp_side is not None
            mlp_in = _per_receiver(
                lp.mlp_side.inputs(pm, resids_c[2 * lay + 1] if resids_c else None, own), 1
            )  # (1, B, S, d)
            if keep_inputs:
                inputs.append(mlp_in)
            m = block.mlp(block.ln2(mlp_in[0]))  # (B, S, d)
            torch.sub(m, acts_c[n + H], out=delta[lp.mlp_slot])
        else:
            m = acts_c[n + H]  # (B, S, d)
        if track:
            own = own + m
        if keep_acts:
            acts += [heads, m[None]]
    if keep_acts:
        resids.append(own)
    at = torch.arange(B, device=x.device)
    corrupt_last = resids_c[-1] if resids_c else None
    if keep_inputs:
        final = _per_receiver(plan.logits_side.inputs(plan.logits.product(delta), corrupt_last, own), 1)
        inputs.append(final)  # (1, B, S, d)
        rows = final[0][at, last]  # (B, d)
    else:  # the logits read the last positions only
        patch = None if plan.logits.coef is None else plan.logits.product(delta[:, at, last])  # (1, B, d)
        rows = plan.logits_side.inputs(
            patch,
            None if corrupt_last is None else corrupt_last[at, last],
            own[at, last] if track else None,
        )  # (B, d) or (1, B, d)
        rows = rows if rows.dim() == 2 else rows[0]
    return rows, acts, inputs, resids


def _run_rows(
    module: nn.Module, graph: Graph, x: Tensor, last: Tensor, *,
    corrupt: Tensor | GraphRun | _Rowsrun | None = None, missing: Tensor | None = None,
    keep_acts: bool = False, keep_inputs: bool = False, plan: _Plan | None = None,
) -> _Rowsrun:  # fmt: skip
    """:func:`run_graph` up to the final norm (the same arguments; ``plan``: a :func:`_plan` of
    ``missing`` made earlier, for ``corrupt`` a GraphRun with its resids)."""
    if missing is not None and torch.is_grad_enabled():
        raise RuntimeError("run_graph patches edges without autograd; call it under torch.no_grad()")
    resids_c = zs_c = None
    if isinstance(corrupt, (GraphRun, _Rowsrun)):
        if corrupt.acts is None:
            raise ValueError("run_graph's corrupt run must have its acts: run it with keep_acts=True")
        zs_c = corrupt.zs if isinstance(corrupt, _Rowsrun) else None
        corrupt, resids_c = corrupt.acts, corrupt.resids
    B, S, _ = x.shape
    at = torch.arange(B, device=x.device)
    if corrupt is not None and missing is not None and bool(missing.any()):
        if plan is None:
            plan = _plan(
                module, graph, missing, resids=resids_c is not None, prune=not (keep_acts or keep_inputs),
                full=keep_inputs, dtype=x.dtype, device=x.device,
            )  # fmt: skip
        elif plan.resids and resids_c is None:
            raise ValueError("this plan starts blocks from the corrupt stream: give the corrupt GraphRun")
        rows, acts, inputs, resids = _patched(
            module, graph, x, last, corrupt, resids_c, zs_c, plan, keep_acts, keep_inputs
        )
        zs = None
    else:
        tables = _Tables(torch.arange(S, device=x.device))  # positions (S,)
        acts, inputs, resids, zs = [x[None]], [], [], []
        resid, n_qkv = x, graph.per_layer - 1
        for block in module.blocks:
            attn = block.attn
            if keep_acts:
                resids.append(resid)
            inp = resid  # (B, S, d), or one view per receiver (for gradients)
            if keep_inputs:
                inp = _per_receiver(inp, n_qkv)  # (H + 2 Hkv, B, S, d)
                inputs.append(inp)
            z = _mix(attn, *_project(attn, block.ln1(inp)), tables)  # (B, H, S, dh)
            if keep_acts or keep_inputs:  # each head's own output
                heads = _heads(attn, z)  # (H, B, S, d)
                resid = resid + heads.sum(0)
                zs.append(z)
            else:
                resid = resid + _summed(attn, z)
            if attn.b_O is not None:
                resid = resid + attn.b_O
            if keep_acts:
                resids.append(resid)
            mlp_in = _per_receiver(resid, 1)  # (1, B, S, d)
            if keep_inputs:
                inputs.append(mlp_in)
            m = block.mlp(block.ln2(mlp_in[0]))  # (B, S, d)
            resid = resid + m
            if keep_acts:
                acts += [heads, m[None]]
        if keep_acts:
            resids.append(resid)
        final = _per_receiver(resid, 1)  # (1, B, S, d)
        if keep_inputs:
            inputs.append(final)
        rows = final[0][at, last]  # (B, d_model)
    if module.ln_final is not None:
        rows = module.ln_final(rows)
    return _Rowsrun(
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
    run = _run_rows(
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
