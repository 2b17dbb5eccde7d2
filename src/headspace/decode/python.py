"""The ``"python"`` backend: a :class:`~headspace.decode.step.DecodeStep` run from Python, op by op.

:func:`prepare` resolves the description once into plain callables (each product a ``torch.mm`` on a
transposed view, ``F.linear`` or MKL's packed linear; each norm :func:`headspace.norms.rms_norm` or
``F.layer_norm``; the activation in place), so that a step looks nothing up through ``nn.Module``
attributes. A step makes the same ATen calls on tensors of the same shapes, strides and alignment as
:meth:`headspace.Decoder.forward` on one new position with the KV caches, so its logits are
``forward``'s bit for bit (with packed weights, to float32 rounding).

A sliding-window block's cache (:class:`~headspace.nn.kv_cache.KVCache` with ``window``) takes the
new key through its own ``append_one`` and the step passes the window's mask to attention, as
``forward`` does; every other cache is written in place through views (:func:`cache_views`).

Notation used for tensor shapes:
    B (batch), H (n_heads), Hkv (n_kv_heads), dh (d_head), Sk (cached positions + 1, or the held
    window's + 1), d_model, d_mlp.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..attention.functional import repeat_kv
from ..attention.temperature import temper_queries
from ..kernels.prepack import packed_linear_fn
from ..kernels.q8_0 import Q8Blocks, q8_0_linear_fn
from ..nn.alibi import alibi_bias
from ..nn.kv_cache import KVCache
from ..nn.latent_cache import LatentCache
from ..nn.masks import window_mask
from ..nn.norms import rms_norm
from ..nn.positions import Rotary, rotary_tables, rotate_fused
from ..nn.spec import refuse_unsupported
from .step import STEP_FEATURES, DecodeStep, LayerStep, Norm, Product

Rows = Callable[[Tensor], Tensor]


class _Layer(NamedTuple):
    """A :class:`~headspace.decode.step.LayerStep` resolved into callables of the rows."""

    norm1: Rows | None
    qkv: Rows
    n_heads: int
    n_kv_heads: int
    d_head: int
    gqa: bool
    scale: float
    rotary: Rotary | None
    o: Rows
    norm2: Rows | None
    gate: Rows | None
    act_: Rows
    fc_in: Rows | None
    fc_out: Rows | None
    qk_norm: str | None
    q_norm: Rows | None
    k_norm: Rows | None
    window: int | None
    attn_out_norm: Rows | None
    mlp_out_norm: Rows | None
    parallel: bool
    post: bool
    alibi: Tensor | None
    chunk: int | None
    temperature: tuple[float, float] | None
    softcap: float | None = None
    latent: torch.nn.Module | None = None
    moe: torch.nn.Module | None = None


def norm_fn(norm: Norm) -> Rows:
    """A :class:`~headspace.decode.step.Norm` as a callable of the rows."""
    if norm.kind == "rmsnorm":
        assert norm.weight is not None
        return functools.partial(rms_norm, weight=norm.weight, eps=norm.eps, offset=norm.offset)
    if norm.kind == "layernorm":
        shape, weight, bias, eps = (norm.weight.shape[0],), norm.weight, norm.bias, norm.eps  # type: ignore[union-attr]
        return lambda x: F.layer_norm(x, shape, weight, bias, eps)
    assert norm.module is not None
    return norm.module


def linear_fn(p: Product) -> Rows:
    """A :class:`~headspace.decode.step.Product` as a callable of the rows x [n, in] -> [n, out]: ``torch.mm``
    on a transposed view of a float32 weight without bias (the product ``F.linear`` runs, without its
    dispatch layers), MKL's packed linear for ``"packed"``, ``torch.ops.headspace.q8_0_mm`` for
    ``"q8_0"``, ``F.linear`` otherwise (biases, and the carriers whose ``F.linear`` runs their own
    kernels)."""
    if p.kind == "packed":
        return packed_linear_fn(p.weight, p.bias, p.rows, p.packed)
    if p.kind == "q8_0" and p.packed is not None and p.scales is not None:
        return q8_0_linear_fn(Q8Blocks(p.packed, p.scales))
    weight = p.weight if p.carrier is None else p.carrier
    if p.kind == "float32" and p.bias is None:
        weight_t = weight.t()  # (in, out): a view, so in-place edits of the weight show
        return lambda x: torch.mm(x, weight_t)
    bias = p.bias
    return lambda x: F.linear(x, weight, bias)


def activation_fn_(name: str, module: torch.nn.Module | None) -> Rows:
    """The activation ``name`` in place on its (fresh) input; ``"module"`` runs ``module`` itself."""
    if name == "silu":
        return lambda x: F.silu(x, inplace=True)
    if name == "relu":
        return torch.relu_
    if name in ("gelu", "gelu_tanh"):
        approximate = "tanh" if name == "gelu_tanh" else "none"
        return lambda x: torch.ops.aten.gelu_(x, approximate=approximate)
    assert module is not None
    return module


def _norm_or_none(norm: Norm | None) -> Rows | None:
    return None if norm is None else norm_fn(norm)


def _resolve(layer: LayerStep) -> _Layer:
    return _Layer(
        norm1=_norm_or_none(layer.norm1),
        qkv=linear_fn(layer.qkv),
        n_heads=layer.n_heads,
        n_kv_heads=layer.n_kv_heads,
        d_head=layer.d_head,
        gqa=layer.n_kv_heads != layer.n_heads,
        scale=layer.scale,
        rotary=layer.rotary,
        o=linear_fn(layer.o),
        norm2=_norm_or_none(layer.norm2),
        gate=None if layer.gate is None else linear_fn(layer.gate),
        act_=activation_fn_(layer.activation, layer.act_module),
        fc_in=None if layer.fc_in is None else linear_fn(layer.fc_in),
        fc_out=None if layer.fc_out is None else linear_fn(layer.fc_out),
        qk_norm=layer.qk_norm,
        q_norm=_norm_or_none(layer.q_norm),
        k_norm=_norm_or_none(layer.k_norm),
        window=layer.window,
        attn_out_norm=_norm_or_none(layer.attn_out_norm),
        mlp_out_norm=_norm_or_none(layer.mlp_out_norm),
        parallel=bool(layer.parallel),
        post=bool(layer.post),
        alibi=None if layer.alibi_slopes is None else torch.tensor(layer.alibi_slopes),
        latent=layer.latent,
        moe=layer.moe,
        chunk=layer.chunk,
        temperature=layer.temperature,
        softcap=layer.softcap,
    )


KV = tuple[Tensor, Tensor, Tensor, Tensor]
"""A cache's new-position slots [B, Hkv, 1, dh] (k, v) and filled positions [B, Hkv, Sk, dh] (k, v)."""


def layer_rows(
    layer: _Layer,
    x: Tensor,
    kv: KV | KVCache,
    cos: Tensor | None,
    sin: Tensor | None,
) -> Tensor:
    """One block's step on the rows ``x`` [B, d_model] -> [B, d_model]; ``kv`` the new position's cache
    slots and filled positions (:data:`KV`), or a sliding-window block's :class:`KVCache` itself;
    ``cos``/``sin`` [1, 1, rotary_dim] (:func:`headspace.positions.rotary_tables`) of this block's
    rotation, None without one. :meth:`~headspace.TransformerBlock.forward` on one new position, bit
    for bit: each product one 2-D call, q and k rotated as [B, heads, 1, dh] rows of the fused
    projection (one call for both, or one each after a QK-norm, as ``forward``), the activation and the
    gate's product in place on the fresh gate output."""
    B = x.shape[0]
    H, Hkv, dh = layer.n_heads, layer.n_kv_heads, layer.d_head
    n = x if layer.norm1 is None or layer.post else layer.norm1(x)  # (B, d_model)
    if layer.latent is not None:  # latent attention: its forward on the new position, its own cache
        assert isinstance(kv, LatentCache)
        a = layer.latent(n.unsqueeze(1), kv_cache=kv).squeeze(1)  # (B, d_model)
        return _mlp_rows(layer, x, x + a)
    qkv = layer.qkv(n).view(B, H + 2 * Hkv, 1, dh)  # (B, H + 2 Hkv, 1, dh)
    rotate = cos is not None and sin is not None and layer.rotary is not None
    if layer.qk_norm is None:
        qk, v_new = qkv.split_with_sizes([H + Hkv, Hkv], 1)  # (B, H + Hkv, 1, dh), (B, Hkv, 1, dh)
        if rotate:
            qk = rotate_fused(qk, cos, sin, layer.rotary)  # (B, H + Hkv, 1, dh), fresh
        q, k_new = qk.split_with_sizes([H, Hkv], 1)  # (B, H, 1, dh), (B, Hkv, 1, dh)
    else:
        q, k_new, v_new = qkv.split_with_sizes([H, Hkv, Hkv], 1)  # (B, H, 1, dh), (B, Hkv, 1, dh) x 2
        q, k_new = _normed_qk(layer, q, k_new)  # (B, H, 1, dh), (B, Hkv, 1, dh)
        if rotate:
            q = rotate_fused(q, cos, sin, layer.rotary)  # (B, H, 1, dh)
            k_new = rotate_fused(k_new, cos, sin, layer.rotary)  # (B, Hkv, 1, dh)
    mask = None
    position = kv.length if isinstance(kv, KVCache) else kv[2].shape[2] - 1  # the new token's
    if layer.temperature is not None:  # Llama 4's NoPE layers
        q = temper_queries(q, position, layer.temperature)  # (B, H, 1, dh)
    if isinstance(kv, KVCache):  # a sliding window's cache: the held keys, then the new one
        k, v = kv.append_one(k_new, v_new)  # (B, Hkv, Sk, dh) x 2
        assert layer.window is not None
        mask = window_mask(1, k.shape[2], layer.window, x.device)[None, None]  # (1, 1, 1, Sk)
    else:
        k_slot, v_slot, k, v = kv  # (B, Hkv, 1, dh) x 2, (B, Hkv, Sk, dh) x 2
        k_slot.copy_(k_new)
        v_slot.copy_(v_new)
        # one query after its cached keys: every key may be attended (no mask)
    if layer.chunk is not None:  # Llama 4: the keys of the query's own chunk (positions absolute)
        keys = torch.arange(position + 1 - k.shape[2], position + 1, device=x.device)  # (Sk,)
        same = torch.div(keys, layer.chunk, rounding_mode="floor") == position // layer.chunk  # (Sk,)
        mask = same.view(1, 1, 1, -1) if mask is None else mask & same.view(1, 1, 1, -1)  # (1, 1, 1, Sk)
    if layer.alibi is not None:  # ALiBi: -m_h (i - j), the query the last of the Sk positions
        bias = alibi_bias(layer.alibi, 1, k.shape[2], device=x.device).to(x.dtype)[None]  # (1, H, 1, Sk)
        mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))  # (1, H, 1, Sk)
    z = _attend(layer, q, k, v, mask)  # (B, H, 1, dh)
    a = layer.o(z.reshape(B, H * dh))  # (B, d_model): heads concatenated
    h = x + (a if layer.attn_out_norm is None else layer.attn_out_norm(a))  # (B, d_model)
    if layer.post and layer.norm1 is not None:  # the post layout: norm1 after the residual add
        h = layer.norm1(h)  # (B, d_model)
    return _mlp_rows(layer, x, h)


def _attend(layer: _Layer, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """The new query's attention output [B, H, 1, dh] from q [B, H, 1, dh], k and v [B, Hkv, Sk, dh] and
    ``mask`` (None, a boolean [1, 1, 1, Sk] of the keys that may be attended, or an additive float
    [1, H, 1, Sk]): ``F.scaled_dot_product_attention``; with Gemma 2's soft-capping the forward's
    reference maths, ``softmax(cap * tanh((q * scale) k^T / cap), masked) v``
    (:func:`headspace.attention.functional.reference_parts`)."""
    if layer.softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=layer.scale, enable_gqa=layer.gqa
        )
    H = q.shape[1]
    scores = torch.matmul(q * layer.scale, repeat_kv(k, H).transpose(-2, -1))  # (B, H, 1, Sk)
    scores = torch.tanh(scores / layer.softcap) * layer.softcap  # (B, H, 1, Sk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1), repeat_kv(v, H))  # (B, H, 1, dh)


def _mlp_rows(layer: _Layer, x: Tensor, h: Tensor) -> Tensor:
    """The MLP sublayer of :func:`layer_rows` on the block's input x and the stream after attention h,
    each [B, d_model] -> the block's output [B, d_model] (the post layout: ``norm2(h + m)``)."""
    m_in = x if layer.parallel else h  # (B, d_model): a parallel block's MLP reads the block's input
    m = m_in if layer.norm2 is None or layer.post else layer.norm2(m_in)  # (B, d_model)
    if layer.moe is not None:  # a mixture of experts: its forward on the new position
        m = layer.moe(m.unsqueeze(1)).squeeze(1)  # (B, 1, d_model) -> (B, d_model)
    else:
        assert layer.fc_in is not None and layer.fc_out is not None
        if layer.gate is not None:
            m = layer.act_(layer.gate(m)).mul_(layer.fc_in(m))  # (B, d_mlp): act(gate) * up
        else:
            m = layer.act_(layer.fc_in(m))  # (B, d_mlp)
        m = layer.fc_out(m)  # (B, d_model)
    if layer.post and layer.norm2 is not None:  # the post layout: norm2 after the residual add
        return layer.norm2(h + m)  # (B, d_model)
    return h + (m if layer.mlp_out_norm is None else layer.mlp_out_norm(m))  # (B, d_model)


def _normed_qk(layer: _Layer, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """QK-norm of the new q [B, H, 1, dh] and k [B, Hkv, 1, dh]: over each head's d_head (``"head"``)
    or over the concatenated heads (``"all"``), as :meth:`~headspace.MultiHeadAttention.normed_qk`."""
    assert layer.q_norm is not None and layer.k_norm is not None
    if layer.qk_norm in ("head", "head_layernorm", "l2"):
        return layer.q_norm(q), layer.k_norm(k)
    B, H, _, dh = q.shape
    Hkv = k.shape[1]
    q = layer.q_norm(q.reshape(B, 1, H * dh)).view(B, H, 1, dh)  # (B, H, 1, dh)
    k = layer.k_norm(k.reshape(B, 1, Hkv * dh)).view(B, Hkv, 1, dh)  # (B, Hkv, 1, dh)
    return q, k


def cache_views(caches: Sequence[KVCache], start: int) -> list[KV | KVCache]:
    """Per cache, the new position ``start``'s slots [B, Hkv, 1, dh] and the filled positions [B, Hkv,
    start + 1, dh] of k and v (:data:`KV`): for every slice of one :meth:`~headspace.KVCache.stacked`
    pair in order four calls in all, else four per cache; a sliding-window cache is given as itself
    (its buffers hold the window, not every position)."""
    stack = caches[0].stack
    if stack is not None and len(caches) == stack[0].shape[0]:
        k_all, v_all, _ = stack
        if all(c.stack is not None and c.stack[0] is k_all and c.stack[2] == i for i, c in enumerate(caches)):
            return list(
                zip(
                    k_all.narrow(3, start, 1).unbind(0),  # (B, Hkv, 1, dh) per layer
                    v_all.narrow(3, start, 1).unbind(0),
                    k_all.narrow(3, 0, start + 1).unbind(0),  # (B, Hkv, start + 1, dh) per layer
                    v_all.narrow(3, 0, start + 1).unbind(0),
                )
            )
    return [
        c
        if c.window is not None or isinstance(c, LatentCache)  # (a latent layer's forward appends)
        else (
            c.k.narrow(2, start, 1),
            c.v.narrow(2, start, 1),
            c.k.narrow(2, 0, start + 1),
            c.v.narrow(2, 0, start + 1),
        )
        for c in caches
    ]


Tables = tuple["Tensor | None", "Tensor | None"]


class LayerTables:
    """Each layer's rotation tables for one step, both backends': the step's own ``cos``/``sin`` (handed
    to ``run``) where a layer has the step's rotation, the other rotations' (e.g. Gemma 3's full layers'
    base) made once per call, (None, None) on NoPE layers. Each [1, 1, rotary_dim]."""

    def __init__(self, step: DecodeStep) -> None:
        self.step_rotary = step.rotary
        self.rotaries = [layer.rotary for layer in step.layers]
        self.others = list(
            {id(r): r for r in self.rotaries if r is not None and r is not step.rotary}.values()
        )

    def __call__(self, x: Tensor, start: int, cos: Tensor | None, sin: Tensor | None) -> list[Tables]:
        tables: dict[int, Tables] = {id(self.step_rotary): (cos, sin)}
        if self.others:
            positions = torch.arange(start, start + 1, device=x.device)  # (1,)
            for r in self.others:
                c, s = rotary_tables(r, positions, x.dtype, x.device)  # (1, 1, 1, rotary_dim) x 2
                tables[id(r)] = c.squeeze(2), s.squeeze(2)  # (1, 1, rotary_dim): as the step's own
        return [(None, None) if r is None else tables[id(r)] for r in self.rotaries]


def prepare(step: DecodeStep) -> Callable[..., Tensor]:
    """The ``"python"`` backend: ``run(x, caches, start, cos, sin)`` -> the rows after every block and
    the final norm (see :mod:`headspace.decode.backends` for the signature). Runs any description whose
    blocks' specs set only :data:`~headspace.decode.step.STEP_FEATURES` and ``softcap`` (any other field:
    ``ValueError`` naming it)."""
    for layer in step.layers:
        if layer.spec is not None:
            own = {"latent": layer.latent, "moe": layer.moe}  # a spec field the layer's module runs
            known = (*STEP_FEATURES, "softcap", *(f for f, m in own.items() if m is not None))
            refuse_unsupported(layer.spec, "the Python decoding step", known)
    layers = [_resolve(layer) for layer in step.layers]
    final = None if step.final_norm is None else norm_fn(step.final_norm)
    tables = LayerTables(step)

    def run(
        x: Tensor, caches: Sequence[KVCache], start: int, cos: Tensor | None, sin: Tensor | None
    ) -> Tensor:
        per_layer = tables(x, start, cos, sin)
        for layer, kv, (c, s) in zip(layers, cache_views(caches, start), per_layer):
            x = layer_rows(layer, x, kv, c, s)  # (B, d_model)
        return x if final is None else final(x)

    return run
