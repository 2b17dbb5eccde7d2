"""Attention statistics of long inputs in bounded memory: pattern rows and per-query summaries from q and k.

A layer's full pattern is [batch, n_heads, seq, seq]: at 8,192 tokens that is 2.4 GB for SmolLM2's 9
heads, per layer. Every statistic here is computed a *block of queries* at a time instead: the block's
scores against all keys (``q_block k^T * scale``, masked), their softmax row by row, the reductions
wanted (mass on chosen keys, entropy, top key, mass received), and the block is freed. Peak extra
memory is a few blocks of [batch, n_heads, chunk_size, seq_k] float32, whatever seq_q.

* :func:`pattern_rows`: the pattern rows of chosen queries (explain's row for one token): the
  layer's ``hook_pattern`` there, in float32.
* :func:`summaries`: per-query statistics of every query ([batch, n_heads, seq_q] each) and the mass
  each key receives, as a :class:`PatternSummary` (the explorer's summaries; head roles).
* :func:`each_layer_qk`: run a model and hand each attention layer's rotated q and k (and the mask
  it applies) to a function, one layer at a time, without the layers ever materialising a pattern.

Numerics: scores and softmax in float32 whatever the model's dtype (bfloat16 q and k are upcast
block by block); grouped-query attention (query head ``h`` reads key/value head ``h // group``);
masks with the layer's exact rules (:class:`headspace.masks.RowMasks`: ``key_padding`` True for real
tokens, bool True = may attend, float additive, ``is_causal`` aligned bottom-right and combined by AND);
a query with nothing to attend to (a dead row) has an all-zero row, entropy 0 and top weight 0,
never NaN. The entropy is ``log Z - sum_j p_j t_j`` with ``t`` the max-shifted scores and ``Z`` their
exp-sum, which equals ``-sum_j p_j log p_j`` without a logarithm per element. Max-shifted scores are
floored at -87 before ``exp`` (:data:`_EXP_FLOOR`: below it torch's CPU exp takes a slow path); masked
keys get exactly 0.

Cost: one block is a [batch, n_kv_heads, group x rows, d_head] x [d_head, width] GEMM and about seven
passes over [batch, n_heads, rows, width] (mask, max, shift, floor, exp, sum, sum of w t), into two
buffers reused from block to block; with a causal mask ``width`` stops at the block's last visible
key (half the work on average) and, causality alone, only the block's diagonal square is masked.
How that compares with a plain forward on long inputs is measured by ``benchmarks/long_inputs.py``
(docs/benchmarks.md, "Long inputs").

Layout of q and k: as the hook points show them, ``q`` [batch, seq_q, n_heads, d_head] and ``k``
[batch, seq_k, n_kv_heads, d_head], *after* rotation on rotary layers (``hook_rot_q`` / ``hook_rot_k``;
``hook_q`` / ``hook_k`` otherwise); :class:`LayerQK` holds them so.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...attention.layer import MultiHeadAttention, check_input_tensor, rotary_tables, rotate_fused
from ...core.checks import is_int
from ...nn.hooks import on_call
from ..causal.targets import TargetMasses
from ..trace.trace import attention_layers
from .pattern_blocks import (
    BLOCK_BYTES,
    MIN_CHUNK,
    PatternBlock,
    default_chunk_size,
    iter_pattern_blocks,
    prepared,
    softmax_block,
)

#: the pattern-block machinery lives in :mod:`.pattern_blocks`; its names stay importable from here
__all__ = [
    "BLOCK_BYTES",
    "MIN_CHUNK",
    "LayerQK",
    "PatternBlock",
    "PatternSummary",
    "default_chunk_size",
    "each_layer_qk",
    "iter_pattern_blocks",
    "pattern_rows",
    "role_values",
    "softmax_block",
    "summaries",
    "supports_qk_capture",
]


def _query_index(query_positions: Any, seq_q: int, device: torch.device) -> Tensor:
    if isinstance(query_positions, bool) or query_positions is None:
        raise TypeError(
            f"query_positions must be an int, a list of ints or a 1-D int tensor; got {query_positions!r}"
        )
    if is_int(query_positions):
        query_positions = [query_positions]
    if isinstance(query_positions, Tensor):
        if query_positions.dtype in (torch.bool,) or query_positions.is_floating_point():
            raise TypeError(f"query_positions must be integers; got dtype {query_positions.dtype}")
        index = query_positions.reshape(-1).to(device=device, dtype=torch.int64)
    elif isinstance(query_positions, Sequence) and all(is_int(i) for i in query_positions):
        index = torch.tensor(list(query_positions), dtype=torch.int64, device=device)
    else:
        raise TypeError(
            f"query_positions must be an int, a list of ints or a 1-D int tensor; got {query_positions!r}"
        )
    if index.numel() and (int(index.min()) < -seq_q or int(index.max()) >= seq_q):
        raise ValueError(
            f"query_positions must be in [-{seq_q}, {seq_q}) (seq_q={seq_q}); got {index.tolist()}"
        )
    return index % max(1, seq_q)


def pattern_rows(
    q: Tensor,
    k: Tensor,
    query_positions: Any = None,
    *,
    key_padding: Tensor | None = None,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    chunk_size: int | None = None,
    window: int | None = None,
) -> Tensor:
    """The attention pattern rows of chosen queries, without the full pattern.

    Notation used for tensor shapes:
        batch, seq_q, seq_k, n_heads, n_kv_heads, d_head; rows: the chosen queries.

    Args:
        q: [batch, seq_q, n_heads, d_head], rotated on rotary layers (``hook_rot_q``, else ``hook_q``).
        k: [batch, seq_k, n_kv_heads, d_head] (``hook_rot_k``, else ``hook_k``).
        query_positions: an int, a list of ints or a 1-D int tensor of query indices (negative counts
            from the end); None: every query (then the result is the full pattern: mind its size).
        key_padding, attn_mask, is_causal, window: the layer's masks (``window``: its sliding window),
            with the layer's rules.
        scale: the layer's scale (``attn.scale``; None: 1 / sqrt(d_head)).
        chunk_size: queries per block (None: automatic, :func:`default_chunk_size`).

    Returns:
        float32 [batch, n_heads, rows, seq_k]: the softmax rows (sum 1; dead rows all 0), equal to the
        layer's ``hook_pattern`` at those queries.
    """
    q4, k4, masks, s = prepared(q, k, key_padding, attn_mask, is_causal, window, scale, chunk_size)
    index = None if query_positions is None else _query_index(query_positions, q4.shape[2], q4.device)
    B, H = q4.shape[:2]
    n = q4.shape[2] if index is None else int(index.shape[0])
    out = torch.zeros(B, H, n, k4.shape[2], dtype=torch.float32, device=q4.device)
    done = 0
    for block in iter_pattern_blocks(q4, k4, masks, scale=s, chunk_size=chunk_size, rows=index):
        rows = block.index.shape[0]
        torch.div(block.weights, block.norm.unsqueeze(-1), out=out[:, :, done : done + rows, : block.width])
        done += rows
    return out


@dataclass
class PatternSummary(TargetMasses):
    """Per-query statistics of one layer's pattern, computed block by block (:func:`summaries`).

    Every per-query field is float32 [batch, n_heads, seq_q]: the mass each query puts on the key just
    before it (``previous``), just after it (``next``), on itself (``current``; "itself" is key
    ``i + seq_k - seq_q``, bottom-right as causality), on the first and the last real key (from
    ``key_padding``; keys 0 and seq_k - 1 without it); the row's ``entropy`` (nats); its largest weight
    ``top_weight`` and that key's index ``top_key`` (int64). A key that does not exist (before key 0,
    after the last) has mass 0. ``received`` [batch, n_heads, seq_k] is the mass each key receives,
    summed over the counted queries (``query_mask``). ``targets`` [batch, n_heads, seq_q, n_targets]
    (or None) is the mass on the chosen keys of each query (0 where the index was -1).
    """

    kind = "pattern_summary"

    top_weight: Tensor
    top_key: Tensor
    received: Tensor
    targets: Tensor | None = None


def _first_last(
    key_padding: Tensor | None, batch: int, seq_k: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """(first, last) real key index per row, int64 [batch] (0 and seq_k - 1 without padding; a row with no
    real key gets first = seq_k - 1 clamped and last = 0)."""
    if key_padding is None:
        zeros = torch.zeros(batch, dtype=torch.int64, device=device)
        return zeros, zeros + (seq_k - 1)
    pos = torch.arange(seq_k, device=device)  # (Sk,)
    first = torch.where(key_padding, pos, seq_k).amin(dim=1).clamp(max=seq_k - 1)  # (B,)
    last = torch.where(key_padding, pos, -1).amax(dim=1).clamp(min=0)  # (B,)
    return first, last


def _position_keys(index: Tensor, first: Tensor, last: Tensor, offset: int) -> Tensor:
    """The keys of previous, next, current, first, last per query: int64 [B, rows, 5]."""
    at = index + offset  # (rows,): the query's own key
    B, n = first.shape[0], index.shape[0]
    fixed = torch.stack([at - 1, at + 1, at], dim=-1)[None].expand(B, n, 3)  # (B, rows, 3)
    ends = torch.stack([first, last], dim=-1)[:, None].expand(B, n, 2)  # (B, rows, 2)
    return torch.cat([fixed, ends], dim=-1)  # (B, rows, 5)


def _checked_targets(targets: Any, B: int, Sq: int, dev: torch.device) -> Tensor | None:
    """``summaries``' ``targets`` checked: int64 [B or 1, Sq, n_targets] on ``dev``, or None."""
    if targets is None:
        return None
    if not isinstance(targets, Tensor) or targets.dim() != 3 or targets.is_floating_point():
        got = list(targets.shape) if isinstance(targets, Tensor) else type(targets).__name__
        raise ValueError(f"targets must be an int tensor [batch or 1, seq_q={Sq}, n_targets]; got {got}")
    if targets.shape[0] not in (1, B) or targets.shape[1] != Sq:
        raise ValueError(
            f"targets must be [batch={B} or 1, seq_q={Sq}, n_targets]; got {list(targets.shape)}"
        )
    return targets.to(device=dev, dtype=torch.int64)


def summaries(
    q: Tensor,
    k: Tensor,
    *,
    key_padding: Tensor | None = None,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    chunk_size: int | None = None,
    window: int | None = None,
    targets: Tensor | None = None,
    query_mask: Tensor | None = None,
) -> PatternSummary:
    """Per-query statistics of a layer's pattern from its q and k, a block of queries at a time.

    Notation used for tensor shapes:
        batch, seq_q, seq_k, n_heads, n_kv_heads, d_head, n_targets.

    Args:
        q: [batch, seq_q, n_heads, d_head], rotated on rotary layers (``hook_rot_q``, else ``hook_q``).
        k: [batch, seq_k, n_kv_heads, d_head] (``hook_rot_k``, else ``hook_k``).
        key_padding, attn_mask, is_causal, window: the layer's masks (``window``: its sliding window),
            with the layer's rules.
        scale: the layer's scale (``attn.scale``; None: 1 / sqrt(d_head)).
        chunk_size: queries per block (None: automatic, :func:`default_chunk_size`).
        targets: int [batch or 1, seq_q, n_targets] key indices per query (-1: none), e.g. the token
            after an earlier occurrence (induction) or a chosen token for every query.
        query_mask: bool [batch, seq_q], the queries ``received`` sums over (None: ``key_padding``
            when seq_q == seq_k, else every query).

    Returns:
        A :class:`PatternSummary`. Peak extra memory: a few [batch, n_heads, chunk_size, seq_k] float32
        blocks plus the [batch, n_heads, seq_q] results.
    """
    q4, k4, masks, s = prepared(q, k, key_padding, attn_mask, is_causal, window, scale, chunk_size)
    B, H, Sq, _ = q4.shape
    Sk = k4.shape[2]
    dev = q4.device
    targets = _checked_targets(targets, B, Sq, dev)
    if query_mask is None:
        query_mask = key_padding if (key_padding is not None and Sq == Sk) else None
    elif (
        not isinstance(query_mask, Tensor)
        or query_mask.dtype != torch.bool
        or tuple(query_mask.shape) != (B, Sq)
    ):
        got = list(query_mask.shape) if isinstance(query_mask, Tensor) else type(query_mask).__name__
        raise ValueError(f"query_mask must be a bool tensor [batch, seq_q] = {[B, Sq]}; got {got}")
    counted = None if query_mask is None else query_mask.to(device=dev, dtype=torch.float32)  # (B, Sq)
    first, last = _first_last(key_padding, B, Sk, dev)
    at_keys = torch.empty(B, H, Sq, 5, dtype=torch.float32, device=dev)
    entropy = torch.empty(B, H, Sq, dtype=torch.float32, device=dev)
    top_weight = torch.empty(B, H, Sq, dtype=torch.float32, device=dev)
    top_key = torch.empty(B, H, Sq, dtype=torch.int64, device=dev)
    received = torch.zeros(B, H, Sk, dtype=torch.float32, device=dev)
    chosen = (
        None if targets is None else torch.empty(B, H, Sq, targets.shape[-1], dtype=torch.float32, device=dev)
    )
    for block in iter_pattern_blocks(q4, k4, masks, scale=s, chunk_size=chunk_size):
        lo, hi = int(block.index[0]), int(block.index[-1]) + 1
        K = block.width
        at_keys[:, :, lo:hi] = block.gather(_position_keys(block.index, first, last, Sk - Sq))
        entropy[:, :, lo:hi] = block.entropy
        w, j = block.weights.max(dim=-1)  # (B, H, rows) x 2
        top_weight[:, :, lo:hi] = w / block.norm
        top_key[:, :, lo:hi] = j
        inv = block.norm.reciprocal()  # (B, H, rows): 0 on dead rows
        if counted is not None:
            inv = inv * counted[:, None, lo:hi]
        received[..., :K] += torch.einsum("bhqk,bhq->bhk", block.weights, inv)
        if chosen is not None and targets is not None:
            chosen[:, :, lo:hi] = block.gather(targets[:, lo:hi])
    return PatternSummary(
        previous=at_keys[..., 0], next=at_keys[..., 1], current=at_keys[..., 2], first=at_keys[..., 3],
        last=at_keys[..., 4], entropy=entropy, top_weight=top_weight, top_key=top_key, received=received,
        targets=chosen,
    )  # fmt: skip


def role_values(
    q: Tensor,
    k: Tensor,
    *,
    key_padding: Tensor | None = None,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    chunk_size: int | None = None,
    window: int | None = None,
) -> Tensor:
    """What :func:`headspace.analysis.head_roles` needs, and only that: float32 [batch, n_heads, seq, 6].

    The last axis is the mass on the previous, next, current, first and last (real) key, then the
    entropy, per query (the first five fields of :func:`summaries` and its entropy, stacked; cheaper,
    as no top key or received mass is computed). q and k as in :func:`summaries`; self-attention
    (seq_q == seq_k).
    """
    q4, k4, masks, s = prepared(q, k, key_padding, attn_mask, is_causal, window, scale, chunk_size)
    B, H, Sq, _ = q4.shape
    Sk = k4.shape[2]
    if Sq != Sk:
        raise ValueError(
            f"head roles need self-attention (seq_q == seq_k); got q {list(q.shape)}, k {list(k.shape)}"
        )
    first, last = _first_last(key_padding, B, Sk, q4.device)
    out = torch.empty(B, H, Sq, 6, dtype=torch.float32, device=q4.device)
    for block in iter_pattern_blocks(q4, k4, masks, scale=s, chunk_size=chunk_size):
        lo, hi = int(block.index[0]), int(block.index[-1]) + 1
        out[:, :, lo:hi, :5] = block.gather(_position_keys(block.index, first, last, 0))
        out[:, :, lo:hi, 5] = block.entropy
    return out


# ---------------------------------------------------------------------------------------------- from a model
@dataclass
class LayerQK:
    """One attention call's rotated q and k and the masks it applies, as :func:`each_layer_qk` hands them.

    ``q`` [batch, seq_q, n_heads, d_head] and ``k`` [batch, seq_k, n_kv_heads, d_head] in the layer's
    dtype, after rotation on rotary layers (what ``hook_rot_q`` / ``hook_rot_k`` would show; ``hook_q`` /
    ``hook_k`` otherwise); ``key_padding``, ``attn_mask``, ``is_causal`` as the layer received them and
    ``window`` its sliding window (None: none);
    ``scale`` the layer's; ``layer`` its index (:func:`headspace.trace.attention_layers`), ``name`` its
    module path, ``attn`` the module; ``v`` [batch, seq_k, n_kv_heads, d_head] the values of the same
    projection (what ``hook_v`` would show; None when built without them). Valid during the call of
    ``fn`` only (then freed).
    """

    layer: int
    name: str
    attn: MultiHeadAttention
    q: Tensor
    k: Tensor
    key_padding: Tensor | None
    attn_mask: Tensor | None
    is_causal: bool
    scale: float
    window: int | None = None
    v: Tensor | None = None

    def _masks(self) -> dict[str, Any]:
        return {
            "key_padding": self.key_padding, "attn_mask": self.attn_mask, "is_causal": self.is_causal,
            "scale": self.scale, "window": self.window,
        }  # fmt: skip

    def pattern_rows(self, query_positions: Any = None, *, chunk_size: int | None = None) -> Tensor:
        """:func:`pattern_rows` of this layer: float32 [batch, n_heads, rows, seq_k]."""
        return pattern_rows(self.q, self.k, query_positions, chunk_size=chunk_size, **self._masks())

    def summaries(self, **kwargs: Any) -> PatternSummary:
        """:func:`summaries` of this layer (``chunk_size``, ``targets``, ``query_mask`` as there)."""
        return summaries(self.q, self.k, **self._masks(), **kwargs)

    def role_values(self, *, chunk_size: int | None = None) -> Tensor:
        """:func:`role_values` of this layer: float32 [batch, n_heads, seq, 6]."""
        return role_values(self.q, self.k, chunk_size=chunk_size, **self._masks())


class _Stop(Exception):
    """Raised by the last wanted layer's hook: nothing after it is needed."""


def supports_qk_capture(attn: Any) -> bool:
    """Whether :func:`each_layer_qk` can recompute this layer's q and k from its input (a
    :class:`~headspace.MultiHeadAttention` with the stock ``forward``; subclasses with another calling
    convention, such as the ``torch.nn.MultiheadAttention`` drop-in, are not; nor, yet, layers with
    soft-capped scores or ALiBi's score bias, which the chunked statistics do not apply; a sliding
    window they apply)."""
    return (
        isinstance(attn, MultiHeadAttention)
        and type(attn).forward is MultiHeadAttention.forward
        and getattr(attn, "softcap", None) is None
        and attn.spec.bias is None
    )


def _layer_qkv(
    attn: MultiHeadAttention, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Tensor, Tensor, Tensor]:
    """q [B, H, Sq, dh] and k, v [B, Hkv, Sk, dh] of one call, as the layer computes them (q and k
    rotated), from one projection."""
    names = ("query", "key", "value")
    given = dict(zip(names, args))
    for n in names:
        if n in kwargs:
            given[n] = kwargs[n]
    query, key, value = given.get("query"), given.get("key"), given.get("value")
    if kwargs.get("kv_cache") is not None:
        raise ValueError(
            "each_layer_qk: attention calls with a kv_cache are not supported (run the full sequence)"
        )
    self_attention = key is None and value is None
    w = attn.o_weight
    check_input_tensor("query", query, attn.d_model, "d_model", w)
    if not self_attention:
        k_in = query if key is None else key
        check_input_tensor("key", k_in, attn.kdim, "kdim", w)
        check_input_tensor("value", k_in if value is None else value, attn.vdim, "vdim", w)
    q, k, v = attn.project_qkv(query, key, value)  # (B, H, Sq, dh), (B, Hkv, Sk, dh) x 2
    if getattr(attn, "qk_norm", None) is not None:
        q, k = attn.normed_qk(q, k)  # QK-norm before the rotation, as the layer
    rotary = attn.rotary
    if rotary is not None:
        positions = kwargs.get("positions")
        if positions is None:
            positions = torch.arange(query.shape[1], device=query.device)  # (Sq,)
        cos, sin = rotary_tables(rotary, positions, query.dtype, query.device)  # (B|1, 1, Sq, rd) x 2
        q = rotate_fused(q, cos, sin, rotary)  # (B, H, Sq, dh)
        k = rotate_fused(k, cos, sin, rotary)  # (B, Hkv, Sk, dh)
    return q, k, v


def _chosen_layers(
    all_layers: list[tuple[str, MultiHeadAttention]], layers: Sequence[int] | None
) -> list[int]:
    """The indices ``layers`` (None: all) of ``all_layers``, each checked in range and capturable."""
    chosen = list(range(len(all_layers))) if layers is None else [int(i) for i in layers]
    for i in chosen:
        if not 0 <= i < len(all_layers):
            raise ValueError(
                f"layers: {i} is out of range; this model has {len(all_layers)} attention layers"
            )
        name, attn = all_layers[i]
        if isinstance(attn, MultiHeadAttention) and attn.spec.bias is not None:
            raise ValueError(
                f"layer {i} ({name}): the chunked statistics do not add the attention field 'bias' "
                f"({attn.spec.bias!r}) to the scores; use the traced patterns"
            )
        if not supports_qk_capture(attn):
            raise ValueError(
                f"layer {i} ({name or type(attn).__name__}) is a {type(attn).__name__} with its own forward; "
                "its q and k cannot be recomputed from its input (use the traced hook_rot_q/hook_rot_k)"
            )
    return chosen


def each_layer_qk(
    model: Any,
    run: Callable[[], Any],
    fn: Callable[[LayerQK], None],
    *,
    layers: Sequence[int] | None = None,
    stop_early: bool = True,
) -> None:
    """Call ``run()`` (one forward of ``model``) and ``fn(LayerQK)`` for each attention layer as it runs.

    How q and k are obtained, in bounded memory: a forward *pre-hook* on each chosen attention layer
    sees the layer's input and keyword arguments (the residual stream after the block's norm, the
    masks, the rotary positions) and recomputes q and k with the layer's own fused projection
    (:meth:`~headspace.MultiHeadAttention.project_qkv`) and rotation (the same cos/sin tables and
    operations as the layer), so they equal what ``hook_rot_q`` / ``hook_rot_k`` would record. No hook
    *point* gets a function, so every layer keeps its fused fast path (torch's
    scaled_dot_product_attention, which never builds a pattern), whereas tracing ``hook_q`` would send
    the layer down the traced path, which computes the full reference pattern. ``fn`` runs inside the
    hook; q, k and v (:attr:`LayerQK.v`, from the same projection) are freed when it returns, so at most
    one layer's q, k, v (and whatever ``fn`` builds) are alive at a time.

    With ``stop_early`` (default), the forward is cut short once every chosen layer has been handed
    over (``run`` is interrupted by an exception caught here: the rest of the model, e.g. a 49k-word
    unembedding, is never computed). Functions added to ``hook_q``/``hook_k``/``hook_rot_*`` that
    *replace* values are not seen (q and k are recomputed from the layer's input); everything upstream
    of a layer (ablations, patching of earlier layers) is. Only calls made by this thread are seen.

    Args:
        model: a module (or pretrained wrapper) holding :class:`~headspace.MultiHeadAttention` layers.
        run: runs the model once, e.g. ``lambda: model(tokens)``.
        fn: called with a :class:`LayerQK` per call of a chosen layer, in call order, without autograd.
        layers: the layer indices to hand over (None: all).
        stop_early: stop the forward after the last chosen layer's q and k.

    Raises:
        ValueError: a chosen layer that cannot be handled (a subclass with another ``forward``); a call
            with a KV cache; a chosen layer that ``run`` never called.
    """
    all_layers = attention_layers(model)
    chosen = _chosen_layers(all_layers, layers)
    owner = threading.get_ident()
    pending = set(chosen)
    seen: set[int] = set()

    def make_hook(i: int, name: str) -> Callable[..., None]:
        def hook(module: MultiHeadAttention, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if threading.get_ident() != owner:
                return
            with torch.no_grad():
                q, k, v = _layer_qkv(module, args, kwargs)
                call = LayerQK(
                    layer=i, name=name, attn=module, q=q.transpose(1, 2), k=k.transpose(1, 2),
                    key_padding=kwargs.get("key_padding"), attn_mask=kwargs.get("attn_mask"),
                    is_causal=bool(kwargs.get("is_causal", False)), scale=module.scale,
                    window=getattr(module, "window", None), v=v.transpose(1, 2),
                )  # fmt: skip
                del q, k, v
                fn(call)
                del call
            seen.add(i)
            pending.discard(i)
            if stop_early and not pending:
                raise _Stop

        return hook

    # the call's keywords (masks, positions) are no tensor hook point's: the hook machinery's on_call
    removers = [on_call(all_layers[i][1], make_hook(i, all_layers[i][0])) for i in dict.fromkeys(chosen)]
    try:
        run()
    except _Stop:
        pass
    finally:
        for remove in removers:
            remove()
    missing = [i for i in chosen if i not in seen]
    if missing:
        raise ValueError(f"run() never called the attention layers {missing} of this model")
