"""The ``"python"`` backend: a :class:`~headspace.decode.step.DecodeStep` run from Python, op by op.

:func:`prepare` resolves the description once into plain callables (each product a ``torch.mm`` on a
transposed view, ``F.linear`` or MKL's packed linear; each norm :func:`headspace.norms.rms_norm` or
``F.layer_norm``; the activation in place), so that a step looks nothing up through ``nn.Module``
attributes. A step makes the same ATen calls on tensors of the same shapes, strides and alignment as
:meth:`headspace.Decoder.forward` on one new position with the KV caches, so its logits are
``forward``'s bit for bit (with packed weights, to float32 rounding).

Notation used for tensor shapes:
    B (batch), H (n_heads), Hkv (n_kv_heads), dh (d_head), Sk (cached positions + 1), d_model, d_mlp.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels.prepack import packed_linear_fn
from ..nn.norms import rms_norm
from ..nn.positions import Rotary, rotate_fused
from .kv_cache import KVCache
from .step import DecodeStep, LayerStep, Norm, Product

Rows = Callable[[Tensor], Tensor]


class _Layer(NamedTuple):
    """A :class:`~headspace.decode.step.LayerStep` resolved into callables of the rows."""

    norm1: Rows
    qkv: Rows
    n_heads: int
    n_kv_heads: int
    d_head: int
    gqa: bool
    scale: float
    rotary: Rotary | None
    o: Rows
    norm2: Rows
    gate: Rows | None
    act_: Rows
    fc_in: Rows
    fc_out: Rows


def norm_fn(norm: Norm) -> Rows:
    """A :class:`~headspace.decode.step.Norm` as a callable of the rows."""
    if norm.kind == "rmsnorm":
        assert norm.weight is not None
        return functools.partial(rms_norm, weight=norm.weight, eps=norm.eps)
    if norm.kind == "layernorm":
        shape, weight, bias, eps = (norm.weight.shape[0],), norm.weight, norm.bias, norm.eps  # type: ignore[union-attr]
        return lambda x: F.layer_norm(x, shape, weight, bias, eps)
    assert norm.module is not None
    return norm.module


def linear_fn(p: Product) -> Rows:
    """A :class:`~headspace.decode.step.Product` as a callable of the rows x [n, in] -> [n, out]: ``torch.mm``
    on a transposed view of a float32 weight without bias (the product ``F.linear`` runs, without its
    dispatch layers), MKL's packed linear for ``"packed"``, ``F.linear`` otherwise (biases, and the
    carriers whose ``F.linear`` runs their own kernels)."""
    if p.kind == "packed":
        return packed_linear_fn(p.weight, p.bias, p.rows, p.packed)
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


def _resolve(layer: LayerStep) -> _Layer:
    return _Layer(
        norm1=norm_fn(layer.norm1),
        qkv=linear_fn(layer.qkv),
        n_heads=layer.n_heads,
        n_kv_heads=layer.n_kv_heads,
        d_head=layer.d_head,
        gqa=layer.n_kv_heads != layer.n_heads,
        scale=layer.scale,
        rotary=layer.rotary,
        o=linear_fn(layer.o),
        norm2=norm_fn(layer.norm2),
        gate=None if layer.gate is None else linear_fn(layer.gate),
        act_=activation_fn_(layer.activation, layer.act_module),
        fc_in=linear_fn(layer.fc_in),
        fc_out=linear_fn(layer.fc_out),
    )


def layer_rows(
    layer: _Layer,
    x: Tensor,
    kv: tuple[Tensor, Tensor, Tensor, Tensor],
    cos: Tensor | None,
    sin: Tensor | None,
) -> Tensor:
    """One block's step on the rows ``x`` [B, d_model] -> [B, d_model]; ``kv`` the new position's cache
    slots [B, Hkv, 1, dh] (k, v) and the filled positions [B, Hkv, Sk, dh] (k, v) including it;
    ``cos``/``sin`` [1, 1, rotary_dim] (:func:`headspace.positions.rotary_tables`), None without
    rotary. :meth:`~headspace.TransformerBlock.forward` on one new position, bit for bit: each product
    one 2-D call, q and k rotated as [B, heads, 1, dh] rows of the fused projection, the activation
    and the gate's product in place on the fresh gate output."""
    B = x.shape[0]
    H, Hkv, dh = layer.n_heads, layer.n_kv_heads, layer.d_head
    qkv = layer.qkv(layer.norm1(x)).view(B, H + 2 * Hkv, 1, dh)  # (B, H + 2 Hkv, 1, dh)
    qk, v_new = qkv.split_with_sizes([H + Hkv, Hkv], 1)  # (B, H + Hkv, 1, dh), (B, Hkv, 1, dh)
    if cos is not None and sin is not None and layer.rotary is not None:
        qk = rotate_fused(qk, cos, sin, layer.rotary)  # (B, H + Hkv, 1, dh), fresh
    q, k_new = qk.split_with_sizes([H, Hkv], 1)  # (B, H, 1, dh), (B, Hkv, 1, dh)
    k_slot, v_slot, k, v = kv  # (B, Hkv, 1, dh) x 2, (B, Hkv, Sk, dh) x 2
    k_slot.copy_(k_new)
    v_slot.copy_(v_new)
    # one query after its cached keys: every key may be attended (no mask)
    z = F.scaled_dot_product_attention(q, k, v, scale=layer.scale, enable_gqa=layer.gqa)  # (B, H, 1, dh)
    h = x + layer.o(z.reshape(B, H * dh))  # (B, d_model): heads concatenated
    m = layer.norm2(h)  # (B, d_model)
    if layer.gate is not None:
        m = layer.act_(layer.gate(m)).mul_(layer.fc_in(m))  # (B, d_mlp): act(gate) * up
    else:
        m = layer.act_(layer.fc_in(m))  # (B, d_mlp)
    return h + layer.fc_out(m)  # (B, d_model)


def cache_views(caches: Sequence[KVCache], start: int) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """Per cache, the new position ``start``'s slots [B, Hkv, 1, dh] and the filled positions [B, Hkv,
    start + 1, dh] of k and v: for every slice of one :meth:`~headspace.KVCache.stacked` pair in order
    four calls in all, else four per cache."""
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
        (
            c.k.narrow(2, start, 1),
            c.v.narrow(2, start, 1),
            c.k.narrow(2, 0, start + 1),
            c.v.narrow(2, 0, start + 1),
        )
        for c in caches
    ]


def prepare(step: DecodeStep) -> Callable[..., Tensor]:
    """The ``"python"`` backend: ``run(x, caches, start, cos, sin)`` -> the rows after every block and
    the final norm (see :mod:`headspace.decode.backends` for the signature). Runs any description."""
    layers = [_resolve(layer) for layer in step.layers]
    final = None if step.final_norm is None else norm_fn(step.final_norm)

    def run(
        x: Tensor, caches: Sequence[KVCache], start: int, cos: Tensor | None, sin: Tensor | None
    ) -> Tensor:
        for layer, kv in zip(layers, cache_views(caches, start)):
            x = layer_rows(layer, x, kv, cos, sin)  # (B, d_model)
        return x if final is None else final(x)

    return run
