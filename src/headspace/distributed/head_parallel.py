"""Head-parallel attention on torch.distributed: one layer's heads spread over several ranks.

Heads are independent until ``W_O`` mixes them, so each rank keeps the ``W_Q``/``W_K``/``W_V`` of its heads
and the matching rows of ``W_O``; one all-reduce after ``W_O`` sums the ranks' partial outputs (see
:class:`HeadParallelAttention`). The process group (:func:`setup_distributed`, :class:`DistInfo`) lives
in :mod:`headspace.core.process_group` and is re-exported here; the data-parallel training helpers are in
:mod:`headspace.distributed.data_parallel`. Old paths: ``headspace.model.parallel``, ``headspace.parallel``.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..attention.layer import KVCache, MultiHeadAttention
from ..core.checks import is_int
from ..core.process_group import (
    DistInfo,
    all_gather_bytes,
    barrier,
    compare_configs,
    setup_distributed,
    teardown,
)

__all__ = [
    "DistInfo",
    "HeadParallelAttention",
    "HeadParallelFeedForward",
    "attention_shard",
    "barrier",
    "feed_forward_shard",
    "gather_model",
    "setup_distributed",
    "shard_model",
    "teardown",
]


# ---------------------------------------------------------------------------------------------- head parallel
def _group_rank_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank in ``group``, size of ``group``); (0, 1) when no process group is initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("group was given but no process group is initialised; call setup_distributed()")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _agree_across_group(record: dict[str, Any], what: str, device: torch.device, group: Any) -> None:
    """Raise on every rank of ``group`` if the ranks' records differ.

    A record is ``{"config": {...}}`` or ``{"error": message, "kind": "TypeError"|"ValueError"}``.

    When every rank has the same error it is raised as its own kind (``TypeError`` or ``ValueError``).
    """
    _, world = _group_rank_world(group)
    payload = json.dumps(record, sort_keys=True).encode()
    records = [record] if world == 1 else [json.loads(p) for p in all_gather_bytes(payload, device, group)]
    first = records[0]
    if "error" in first and all(r == first for r in records):
        kind = TypeError if first.get("kind") == "TypeError" else ValueError
        raise kind(first["error"])
    compare_configs(records, what)


def _broadcast_from_first_rank(module: nn.Module, group: Any) -> None:
    """Overwrite ``module``'s parameters and buffers with those of the group's first rank (in place)."""
    _, world = _group_rank_world(group)
    if world == 1:
        return
    src = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=src, group=group)


class _CopyToShards(torch.autograd.Function):
    """Identity forward; backward sums the input gradient over the ranks (Megatron's ``f``).

    The input is replicated on every rank and each rank's shard uses it, so its gradient is the sum of
    the shards' contributions.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


class _SumOverShards(torch.autograd.Function):
    """Forward sums the ranks' partial outputs (one all-reduce); identity backward (Megatron's ``g``).

    Every rank holds the whole summed output and computes the same loss on it, so the gradient that
    arrives is already the gradient of each rank's partial output.
    """

    @staticmethod
    def forward(ctx: Any, partial: Tensor, group: Any) -> Tensor:
        out = partial.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _GatherShards(torch.autograd.Function):
    """Concatenate the ranks' equal-sized pieces along ``dim``; backward keeps this rank's piece."""

    @staticmethod
    def forward(ctx: Any, piece: Tensor, group: Any, dim: int) -> Tensor:
        rank, world = _group_rank_world(group)
        piece = piece.contiguous()
        pieces = [torch.empty_like(piece) for _ in range(world)]
        dist.all_gather(pieces, piece, group=group)
        ctx.dim, ctx.start, ctx.size = dim, rank * piece.shape[dim], piece.shape[dim]
        return torch.cat(pieces, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return grad.narrow(ctx.dim, ctx.start, ctx.size), None, None


def _gather_cat(piece: Tensor, dim: int, group: Any) -> Tensor:
    """All ranks' ``piece`` concatenated along ``dim`` (no autograd; used to rebuild whole layers)."""
    _, world = _group_rank_world(group)
    if world == 1:
        return piece.detach().clone()
    piece = piece.detach().contiguous()
    pieces = [torch.empty_like(piece) for _ in range(world)]
    dist.all_gather(pieces, piece, group=group)
    return torch.cat(pieces, dim=dim)


def _attention_record(attn: Any) -> dict[str, Any]:
    if not isinstance(attn, MultiHeadAttention):
        return {
            "error": f"attn must be a headspace.MultiHeadAttention; got {type(attn).__name__}",
            "kind": "TypeError",
        }
    w = attn.o_weight
    return {
        "config": {
            "d_model": attn.d_model,
            "n_heads": attn.n_heads,
            "d_head": attn.d_head,
            "n_kv_heads": attn.n_kv_heads,
            "kdim": attn.kdim,
            "vdim": attn.vdim,
            "bias": attn.qkv_bias is not None,
            "out_bias": attn.o_bias is not None,
            "rotary": None if attn.rotary is None else repr(attn.rotary),
            "dropout": attn.dropout,
            "scale": attn.scale,
            "dtype": str(w.dtype),
            "device_type": w.device.type,
        }
    }


def _check_divisible(name: str, n: int, world_size: int) -> None:
    """Every rank gets the same number of heads (hidden units): ``n`` must be a multiple of the world size."""
    if n % world_size != 0:
        raise ValueError(
            f"{name}={n} is not divisible by the world size {world_size}; every rank takes the same number "
            f"of them, so use a number of ranks that divides {name} "
            f"(divisors: {[d for d in range(1, n + 1) if n % d == 0]})"
        )


def _check_rank(rank: int, world_size: int) -> None:
    ok = all(is_int(v) for v in (rank, world_size))
    if not ok or world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(
            f"need integers 0 <= rank < world_size; got rank={rank!r}, world_size={world_size!r}"
        )


def _head_range(n: int, rank: int, world: int) -> slice:
    per_rank = n // world
    return slice(rank * per_rank, (rank + 1) * per_rank)


#: The constructor arguments a shard or a gathered layer takes over unchanged, read off the layer by name.
_KEPT_SETTINGS = ("d_head", "kdim", "vdim", "dropout", "scale", "check_finite", "rotary", "window", "softcap")


def _attention_like(
    attn: MultiHeadAttention, n_heads: int, n_kv_heads: int, *, out_bias: bool
) -> MultiHeadAttention:
    """A new MultiHeadAttention with ``n_heads`` / ``n_kv_heads`` heads and otherwise ``attn``'s settings.

    The same d_model, d_head, kdim, vdim, q/k/v bias, dropout, scale, finiteness checks, rotary positions
    (rotation acts per head: a shard rotates its own heads as the whole layer does), device and dtype;
    an output bias if ``out_bias``. Its weights are freshly initialised.
    """
    if getattr(attn, "qk_norm", None) is not None:
        raise ValueError(
            f"head-parallel attention does not split QK-norm layers yet (qk_norm={attn.qk_norm!r}); "
            "run this model unsharded"
        )
    if attn.spec.bias is not None:  # each head its own slope: a shard would need its heads' share
        raise ValueError(
            f"head-parallel attention does not split the attention field 'bias' ({attn.spec.bias!r}) yet; "
            "run this model unsharded"
        )
    w = attn.o_weight
    kept = {name: getattr(attn, name) for name in _KEPT_SETTINGS}
    return MultiHeadAttention(
        attn.d_model,
        n_heads,
        n_kv_heads=n_kv_heads,
        qkv_bias=attn.qkv_bias is not None,
        out_bias=out_bias,
        device=w.device,
        dtype=w.dtype,
        **kept,
    )


def _replicated_bias(bias: Tensor | None) -> nn.Parameter | None:
    """A copy of the layer's output ``bias`` as a new Parameter with its ``requires_grad`` (None stays None).

    Every rank holds it whole and adds it once, after the all-reduce.
    """
    if bias is None:
        return None
    return nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)


def attention_shard(attn: MultiHeadAttention, rank: int, world_size: int) -> MultiHeadAttention:
    """Rank ``rank``'s shard of ``attn`` out of ``world_size``: a MultiHeadAttention, no communication.

    It holds query heads ``[rank H/p, (rank+1) H/p)`` and key/value heads ``[rank H_kv/p, (rank+1)
    H_kv/p)`` (copies of their W_Q, W_K, W_V, W_O and biases) and no output bias, so that
    ``sum_r attention_shard(attn, r, p)(x) + attn.b_O == attn(x)``.
    """
    if not isinstance(attn, MultiHeadAttention):
        raise TypeError(f"attn must be a headspace.MultiHeadAttention; got {type(attn).__name__}")
    _check_rank(rank, world_size)
    _check_divisible("n_heads", attn.n_heads, world_size)
    _check_divisible("n_kv_heads", attn.n_kv_heads, world_size)
    hs = _head_range(attn.n_heads, rank, world_size)
    ks = _head_range(attn.n_kv_heads, rank, world_size)
    # no output bias: the caller adds b_O once
    shard = _attention_like(attn, attn.n_heads // world_size, attn.n_kv_heads // world_size, out_bias=False)
    with torch.no_grad():
        # per-head views of both layers: W_Q [heads, d_model, d_head], W_O [heads, d_head, d_model] ...
        shard.W_Q.copy_(attn.W_Q[hs])
        shard.W_K.copy_(attn.W_K[ks])
        shard.W_V.copy_(attn.W_V[ks])
        shard.W_O.copy_(attn.W_O[hs])
        if attn.qkv_bias is not None:
            shard.b_Q.copy_(attn.b_Q[hs])
            shard.b_K.copy_(attn.b_K[ks])
            shard.b_V.copy_(attn.b_V[ks])
    for name, p in shard.named_parameters():
        p.requires_grad_(getattr(attn, name).requires_grad)
    shard.train(attn.training)
    return shard


class HeadParallelAttention(nn.Module):
    r"""A :class:`~headspace.MultiHeadAttention` split by heads over the ranks of a process group.

    With ``p`` ranks, rank ``r`` owns query heads ``[r H/p, (r+1) H/p)`` and key/value heads
    ``[r H_kv/p, (r+1) H_kv/p)`` (with grouped-query attention these are exactly the key/value heads its
    query heads read). It keeps their ``W_Q``/``W_K``/``W_V`` (column-parallel: its slice of the output
    features of the fused QKV projection) and their rows ``W_O[h]`` of the output projection
    (row-parallel: its slice of ``o_weight``'s input features)::

        partial_r = sum_{h owned by r} z_h W_O[h]          (computed locally by ``self.local``)
        out       = all_reduce_sum_r(partial_r) + b_O      (one all-reduce per forward)

    ``self.local`` is itself a :class:`~headspace.MultiHeadAttention` with ``H/p`` heads (and ``H_kv/p``
    key/value heads), without output bias; ``b_O`` (``self.o_bias``) is replicated on every rank and
    added once, **after** the all-reduce, so its gradient equals the single-process one on every rank.

    Gradients follow Megatron-LM's conjugate pair: the input is passed through an identity whose backward
    all-reduces the input gradient (each rank's heads contribute part of it), and the all-reduce after
    ``W_O`` has an identity backward. The convention is that every rank computes the same loss on the
    (replicated) output; then input gradients, ``b_O``'s gradient and each shard's weight gradients equal
    those of the single-process layer. (``torch.distributed.nn.functional.all_reduce`` all-reduces in
    backward as well, which would count the replicated loss once per rank, hence the pair here.)

    Build with :meth:`from_module`; :meth:`gather` returns the whole layer again on every rank.
    """

    def __init__(
        self, attn: MultiHeadAttention, group: dist.ProcessGroup | None = None, *, sync_weights: bool = True
    ) -> None:
        super().__init__()
        rank, world = _group_rank_world(group)
        record = _attention_record(attn)
        device = attn.o_weight.device if "config" in record else torch.device("cpu")
        _agree_across_group(record, "the attention configuration", device, group)
        _check_divisible("n_heads", attn.n_heads, world)
        _check_divisible("n_kv_heads", attn.n_kv_heads, world)
        if sync_weights:
            _broadcast_from_first_rank(attn, group)

        self.group = group
        self.rank, self.world_size = rank, world
        self.d_model, self.d_head = attn.d_model, attn.d_head
        self.n_heads, self.n_kv_heads = attn.n_heads, attn.n_kv_heads
        self.kdim, self.vdim = attn.kdim, attn.vdim
        self.n_local_heads, self.n_local_kv_heads = attn.n_heads // world, attn.n_kv_heads // world
        self.head_slice = slice(rank * self.n_local_heads, (rank + 1) * self.n_local_heads)
        self.kv_head_slice = slice(rank * self.n_local_kv_heads, (rank + 1) * self.n_local_kv_heads)
        self.local = attention_shard(attn, rank, world)  # no output bias: b_O is added after the reduce
        self.o_bias = _replicated_bias(attn.o_bias)
        self.train(attn.training)

    @classmethod
    def from_module(
        cls, attn: MultiHeadAttention, group: dist.ProcessGroup | None = None, *, sync_weights: bool = True
    ) -> HeadParallelAttention:
        """Shard ``attn`` by heads over ``group`` (the default group when None); call on every rank.

        Checks first, on every rank and with the same error everywhere, that all ranks passed the same
        configuration (d_model, n_heads, d_head, n_kv_heads, kdim, vdim, bias, dropout, scale, dtype),
        then that ``n_heads`` and ``n_kv_heads`` are divisible by the group size. With
        ``sync_weights=True`` (default) ``attn``'s parameters are first overwritten in place by those of
        the group's first rank, so every rank shards the same layer. Without a process group this is a
        world of one: one shard with every head, and no communication.
        """
        return cls(attn, group, sync_weights=sync_weights)

    @property
    def rotary(self) -> Any:
        """The layer's :class:`~headspace.positions.Rotary` (None without rotary positions): the shard's."""
        return self.local.rotary

    def make_kv_cache(self, batch: int, capacity: int) -> KVCache:
        """A KV cache for this rank's key/value heads (self-attention decoding)."""
        return self.local.make_kv_cache(batch, capacity)

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        key_padding: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        kv_cache: KVCache | None = None,
        positions: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend with this rank's heads, then sum the ranks' outputs; same arguments as MultiHeadAttention.

        Notation used for tensor shapes:
            batch, seq_q, seq_k, d_model, kdim, vdim, n_heads (all ranks), n_local_heads (this rank).

        Args:
            query: [batch, seq_q, d_model], the same on every rank.
            key, value: [batch, seq_k, kdim|vdim] or None (self-attention), the same on every rank.
            key_padding: bool [batch, seq_k], True for real tokens.
            attn_mask: [seq_q, seq_k], [batch, seq_q, seq_k] or [batch, n_heads|1, seq_q, seq_k]; a
                per-head mask is cut to this rank's heads.
            is_causal: causal mask aligned bottom-right, combined with any other mask.
            need_weights: also return the whole pattern [batch, n_heads, seq_q, seq_k] (gathered from
                every rank: one all-gather more).
            kv_cache: a cache from :meth:`make_kv_cache` (this rank's key/value heads).
            positions: int [seq_q] or [batch, seq_q], for rotary layers (see MultiHeadAttention).

        Returns:
            out [batch, seq_q, d_model] (the same on every rank), or (out, pattern).
        """
        if isinstance(attn_mask, Tensor) and attn_mask.dim() == 4:
            if attn_mask.shape[1] not in (1, self.n_heads):
                raise ValueError(
                    f"attn_mask has shape {list(attn_mask.shape)}; a 4-D mask must be [batch, n_heads, "
                    f"seq_q, seq_k] with n_heads={self.n_heads} or 1 (to broadcast)"
                )
            if attn_mask.shape[1] == self.n_heads and self.world_size > 1:
                attn_mask = attn_mask[:, self.head_slice]  # (batch, n_local_heads, seq_q, seq_k)
        distributed = self.world_size > 1
        if distributed:
            same_kv = value is None or value is key
            query = _CopyToShards.apply(query, self.group)
            if key is not None:
                key = _CopyToShards.apply(key, self.group)
                value = key if same_kv else _CopyToShards.apply(value, self.group)
        result = self.local(
            query,
            key,
            value,
            key_padding=key_padding,
            attn_mask=attn_mask,
            is_causal=is_causal,
            need_weights=need_weights,
            kv_cache=kv_cache,
            **({} if positions is None else {"positions": positions}),
        )
        partial, pattern = result if need_weights else (result, None)  # (batch, seq_q, d_model)
        out = _SumOverShards.apply(partial, self.group) if distributed else partial  # (batch, seq_q, d_model)
        if self.o_bias is not None:
            out = out + self.o_bias
        if not need_weights:
            return out
        if distributed:
            pattern = _GatherShards.apply(pattern, self.group, 1)  # (batch, n_heads, seq_q, seq_k)
        return out, pattern

    @torch.no_grad()
    def gather(self) -> MultiHeadAttention:
        """The whole single-process :class:`~headspace.MultiHeadAttention`, rebuilt on every rank.

        A collective: call it on every rank of the group. The result owns fresh copies of the weights
        (changing it does not change the shards) and is in this module's train/eval mode.
        """
        loc = self.local
        full = _attention_like(loc, self.n_heads, self.n_kv_heads, out_bias=self.o_bias is not None)
        full.W_Q.copy_(_gather_cat(loc.W_Q, 0, self.group))  # (n_heads, d_model, d_head)
        full.W_K.copy_(_gather_cat(loc.W_K, 0, self.group))  # (n_kv_heads, kdim, d_head)
        full.W_V.copy_(_gather_cat(loc.W_V, 0, self.group))  # (n_kv_heads, vdim, d_head)
        full.W_O.copy_(_gather_cat(loc.W_O, 0, self.group))  # (n_heads, d_head, d_model)
        if loc.qkv_bias is not None:
            full.b_Q.copy_(_gather_cat(loc.b_Q, 0, self.group))  # (n_heads, d_head)
            full.b_K.copy_(_gather_cat(loc.b_K, 0, self.group))  # (n_kv_heads, d_head)
            full.b_V.copy_(_gather_cat(loc.b_V, 0, self.group))  # (n_kv_heads, d_head)
        if self.o_bias is not None:
            full.o_bias.copy_(self.o_bias)
        full.train(self.training)
        return full

    def extra_repr(self) -> str:
        return (
            f"n_heads={self.n_heads} (local {self.head_slice.start}:{self.head_slice.stop}), "
            f"n_kv_heads={self.n_kv_heads} (local {self.kv_head_slice.start}:{self.kv_head_slice.stop}), "
            f"rank={self.rank}/{self.world_size}"
        )


def _is_feed_forward(module: Any) -> bool:
    """A feed-forward layer we can shard: an ``nn.Module`` with ``fc_in`` and ``fc_out`` ``nn.Linear``."""
    return (
        isinstance(module, nn.Module)
        and isinstance(getattr(module, "fc_in", None), nn.Linear)
        and isinstance(getattr(module, "fc_out", None), nn.Linear)
    )


def _feed_forward_record(ff: Any) -> dict[str, Any]:
    if not _is_feed_forward(ff):
        got = type(ff).__name__
        return {
            "error": f"ff must be a feed-forward module with nn.Linear .fc_in and .fc_out (headspace.block."
            f"FeedForward); got {got}",
            "kind": "TypeError",
        }
    fc_in, fc_out = ff.fc_in, ff.fc_out
    return {
        "config": {
            "class": type(ff).__qualname__,
            "d_model": fc_in.in_features,
            "d_mlp": fc_in.out_features,
            "fc_out": [fc_out.in_features, fc_out.out_features],
            "bias_in": fc_in.bias is not None,
            "bias_out": fc_out.bias is not None,
            "act": repr(getattr(ff, "act", None)),
            "dtype": str(fc_in.weight.dtype),
            "device_type": fc_in.weight.device.type,
        }
    }


def feed_forward_shard(ff: nn.Module, rank: int, world_size: int) -> nn.Module:
    """Rank ``rank``'s shard of a feed-forward layer out of ``world_size``; no communication.

    A copy of ``ff`` (same class, activation, hook points) whose ``fc_in`` keeps the hidden units
    ``[rank d_mlp/p, (rank+1) d_mlp/p)`` and whose ``fc_out`` keeps their input columns, without bias,
    so that ``sum_r feed_forward_shard(ff, r, p)(x) + ff.fc_out.bias == ff(x)``.
    """
    if not _is_feed_forward(ff):
        raise TypeError(_feed_forward_record(ff)["error"])
    _check_rank(rank, world_size)
    fc_in, fc_out = ff.fc_in, ff.fc_out
    d_model, d_mlp = fc_in.in_features, fc_in.out_features
    if fc_out.in_features != d_mlp:
        raise ValueError(
            f"ff.fc_out must take d_mlp={d_mlp} features (fc_in's output); got "
            f"in_features={fc_out.in_features}"
        )
    _check_divisible("d_mlp", d_mlp, world_size)
    units = _head_range(d_mlp, rank, world_size)
    n = d_mlp // world_size
    f = {"device": fc_in.weight.device, "dtype": fc_in.weight.dtype}
    local_in = nn.Linear(d_model, n, bias=fc_in.bias is not None, **f)
    local_out = nn.Linear(n, fc_out.out_features, bias=False, **f)
    with torch.no_grad():
        local_in.weight.copy_(fc_in.weight[units])  # (n, d_model)
        if fc_in.bias is not None:
            local_in.bias.copy_(fc_in.bias[units])  # (n,)
        local_out.weight.copy_(fc_out.weight[:, units])  # (d_model, n)
    local_in.weight.requires_grad_(fc_in.weight.requires_grad)
    if fc_in.bias is not None:
        local_in.bias.requires_grad_(fc_in.bias.requires_grad)
    local_out.weight.requires_grad_(fc_out.weight.requires_grad)
    # a copy of ff holding the slices instead of fc_in / fc_out
    return copy.deepcopy(ff, memo={id(fc_in): local_in, id(fc_out): local_out})


class HeadParallelFeedForward(nn.Module):
    r"""A feed-forward layer ``act(x W_in + b_in) W_out + b_out`` split over the ranks of a process group.

    With ``p`` ranks, rank ``r`` owns the hidden units ``[r d_mlp/p, (r+1) d_mlp/p)``: their columns of
    ``W_in`` and ``b_in`` (column-parallel ``fc_in``) and their rows of ``W_out`` (row-parallel
    ``fc_out``). The activation acts unit by unit, so::

        partial_r = act(x W_in[:, units_r] + b_in[units_r]) W_out[units_r, :]
        out       = all_reduce_sum_r(partial_r) + b_out      (one all-reduce per forward)

    ``self.local`` is a copy of the given module (same class, activation and hook points) whose
    ``fc_in``/``fc_out`` are this rank's slices; its ``fc_out`` has no bias: ``b_out``
    (``self.out_bias``) is replicated and added once, after the all-reduce. Gradients follow the same
    conjugate pair as :class:`HeadParallelAttention`.
    """

    def __init__(
        self, ff: nn.Module, group: dist.ProcessGroup | None = None, *, sync_weights: bool = True
    ) -> None:
        super().__init__()
        rank, world = _group_rank_world(group)
        record = _feed_forward_record(ff)
        device = ff.fc_in.weight.device if "config" in record else torch.device("cpu")
        _agree_across_group(record, "the feed-forward configuration", device, group)
        fc_in, fc_out = ff.fc_in, ff.fc_out
        d_model, d_mlp = fc_in.in_features, fc_in.out_features
        _check_divisible("d_mlp", d_mlp, world)
        if sync_weights:
            _broadcast_from_first_rank(ff, group)
        self.group = group
        self.rank, self.world_size = rank, world
        self.d_model, self.d_mlp = d_model, d_mlp
        self.unit_slice = _head_range(d_mlp, rank, world)
        # fc_out of the shard has no bias: b_out is added after the reduce
        self.local = feed_forward_shard(ff, rank, world)
        self.out_bias = _replicated_bias(fc_out.bias)
        self.train(ff.training)

    @classmethod
    def from_module(
        cls, ff: nn.Module, group: dist.ProcessGroup | None = None, *, sync_weights: bool = True
    ) -> HeadParallelFeedForward:
        """Shard a block's feed-forward layer (``block.mlp``) over ``group``; call on every rank.

        The same checks as :meth:`HeadParallelAttention.from_module`: identical configuration on every
        rank, then ``d_mlp`` divisible by the group size; ``sync_weights`` broadcasts the first rank's
        weights into ``ff`` first.
        """
        return cls(ff, group, sync_weights=sync_weights)

    def forward(self, x: Tensor) -> Tensor:
        """This rank's hidden units, then the sum over ranks.

        Notation used for tensor shapes:
            batch, seq, d_model, d_mlp (all ranks; this rank holds d_mlp / world_size units).

        Args:
            x: [batch, seq, d_model], the same on every rank.

        Returns:
            [batch, seq, d_model], the same on every rank.
        """
        distributed = self.world_size > 1
        if distributed:
            x = _CopyToShards.apply(x, self.group)
        partial = self.local(x)  # (batch, seq, d_model)
        out = _SumOverShards.apply(partial, self.group) if distributed else partial  # (batch, seq, d_model)
        if self.out_bias is not None:
            out = out + self.out_bias
        return out

    @torch.no_grad()
    def gather(self) -> nn.Module:
        """The whole feed-forward layer (the original class), rebuilt on every rank; a collective."""
        loc_in, loc_out = self.local.fc_in, self.local.fc_out
        f = {"device": loc_in.weight.device, "dtype": loc_in.weight.dtype}
        full_in = nn.Linear(self.d_model, self.d_mlp, bias=loc_in.bias is not None, **f)
        full_out = nn.Linear(self.d_mlp, loc_out.out_features, bias=self.out_bias is not None, **f)
        full_in.weight.copy_(_gather_cat(loc_in.weight, 0, self.group))  # (d_mlp, d_model)
        if loc_in.bias is not None:
            full_in.bias.copy_(_gather_cat(loc_in.bias, 0, self.group))  # (d_mlp,)
        full_out.weight.copy_(_gather_cat(loc_out.weight, 1, self.group))  # (d_model, d_mlp)
        if self.out_bias is not None:
            full_out.bias.copy_(self.out_bias)
        full = copy.deepcopy(self.local, memo={id(loc_in): full_in, id(loc_out): full_out})
        full.train(self.training)
        return full

    def extra_repr(self) -> str:
        s = self.unit_slice
        return f"d_mlp={self.d_mlp} (local {s.start}:{s.stop}), rank={self.rank}/{self.world_size}"


# ---------------------------------------------------------------------------------------------- whole models
def _structure_record(model: Any) -> dict[str, Any]:
    if not isinstance(model, nn.Module):
        return {"error": f"model must be a torch.nn.Module; got {type(model).__name__}", "kind": "TypeError"}
    params = {name: [list(t.shape), str(t.dtype)] for name, t in model.state_dict().items()}
    return {"config": {"class": type(model).__qualname__, "tensors": params}}


def shard_model(
    model: nn.Module, group: dist.ProcessGroup | None = None, *, sync_weights: bool = True
) -> nn.Module:
    """Make ``model`` head-parallel in place: every MultiHeadAttention and feed-forward layer is sharded.

    Each :class:`~headspace.MultiHeadAttention` becomes a :class:`HeadParallelAttention` and each
    feed-forward module (``.fc_in``/``.fc_out`` linears, e.g. ``block.mlp``) a
    :class:`HeadParallelFeedForward`; everything else (embeddings, LayerNorms) stays replicated. Checks
    first that every rank holds a model of the same structure (names, shapes and dtypes of its
    tensors); ``sync_weights`` broadcasts the first rank's parameters and buffers, so every rank starts
    from the same model. Call on every rank, before making the optimizer. Returns ``model``.
    """
    record = _structure_record(model)
    device = torch.device("cpu")
    if "config" in record:
        first = next(iter(model.parameters()), None)
        device = first.device if first is not None else device
    _agree_across_group(record, "the model structure", device, group)
    if sync_weights:
        _broadcast_from_first_rank(model, group)
    for parent in list(model.modules()):
        if isinstance(parent, (HeadParallelAttention, HeadParallelFeedForward)):
            continue
        for name, child in list(parent.named_children()):
            if isinstance(child, MultiHeadAttention):
                setattr(parent, name, HeadParallelAttention(child, group, sync_weights=False))
            elif _is_feed_forward(child) and not isinstance(child, HeadParallelFeedForward):
                setattr(parent, name, HeadParallelFeedForward(child, group, sync_weights=False))
    return model


def gather_model(model: nn.Module) -> nn.Module:
    """An ordinary single-process copy of a head-parallel ``model``, on every rank (a collective).

    Every :class:`HeadParallelAttention` / :class:`HeadParallelFeedForward` inside is replaced by its
    :meth:`~HeadParallelAttention.gather` (all heads again); the rest is deep-copied. The per-head tools
    (``headspace.trace``, ``headspace.analysis``) then see every head, exactly as on one process.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if isinstance(model, (HeadParallelAttention, HeadParallelFeedForward)):
        return model.gather()
    memo: dict[int, Any] = {}
    for module in model.modules():
        if isinstance(module, (HeadParallelAttention, HeadParallelFeedForward)) and id(module) not in memo:
            memo[id(module)] = module.gather()
    return copy.deepcopy(model, memo)
