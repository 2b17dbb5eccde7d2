"""Gemma 4's one-token cached step without the module calls: the same operations as
:meth:`~headspace.model.gemma4_model.Gemma4Decoder.hidden_states` on one new position, bit for bit.

A decoding step (one new token per row, KV caches, no padding, no explicit positions, eval mode) runs the
blocks' maths directly: every RMSNorm as :func:`~headspace.nn.norms.rms_norm`, the attention as
:meth:`~headspace.model.gemma_extras.GemmaAttention.forward` computes it (fused projection, QK-norms, the
value norm, rotation, cache append, shared keys and values, sdpa), the sandwich residual, the MLP module,
the per-layer input and the layer scalar. What it skips is only Python: module calls, hook-point tests,
argument checks that the first layer's call made, and a mask and rotary tables rebuilt per layer (each is
built once per step here and shared by the layers that ask for the same one).

It is taken only while no hook point of the model has a function in the calling thread
(:func:`headspace.nn.hooks.all_idle`), so no hook misses an intermediate it would observe; otherwise, and
for every other input, the module path runs (:func:`takes`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention.functional import get_backend
from ..nn.hooks import HookPoint, all_idle
from ..nn.kv_cache import KVCache
from ..nn.masks import CanonicalMask, canonical_mask
from ..nn.norms import RMSNorm, rms_norm
from ..nn.positions import rotary_tables, rotate_fused
from .block import TransformerBlock
from .gemma_extras import GemmaAttention


def norm(module: nn.Module, x: Tensor) -> Tensor:
    """``module(x)``: an :class:`RMSNorm`'s maths without its call and checks, any other module called."""
    if type(module) is RMSNorm:
        return rms_norm(x, module.weight, module.eps, module.offset)
    return module(x)


def hook_points(model: nn.Module) -> list[HookPoint]:
    """Every hook point of ``model``, read once and remembered until the next call that is not a
    one-token step (:func:`takes` forgets them there: a prefill, or any other forward, reads them
    again, so a module swapped in between two generations is seen), as a decoding step reads its hook
    points once per generation."""
    points = model.__dict__.get("_step_hook_points")
    if points is None:
        points = [m for m in model.modules() if isinstance(m, HookPoint)]
        model.__dict__["_step_hook_points"] = points
    return points


def _lean_blocks(blocks: nn.ModuleList) -> bool:
    """Whether every block is an eval-mode sandwich :class:`~headspace.TransformerBlock` whose attention
    is a :class:`GemmaAttention` without softcap (what :func:`attend` and :func:`hidden_states` compute)."""
    return all(
        type(b) is TransformerBlock
        and not b.training
        and b.spec.layout == "sandwich"
        and isinstance(b.attn, GemmaAttention)
        and b.attn.softcap is None
        for b in blocks
    )


def takes(
    model: Any,
    tokens: Tensor,
    key_padding: Tensor | None,
    kv_caches: list[KVCache] | None,
    positions: Tensor | None,
) -> bool:
    """Whether this call is a step the lean path runs (module docstring): one new position per row with
    caches, no ``key_padding`` or ``positions``, eval mode, every block as :func:`_lean_blocks` says,
    and no hook point of the model active in this thread."""
    one = kv_caches is not None and tokens.dim() == 2 and tokens.shape[1] == 1
    if not one or key_padding is not None or positions is not None or model.training:
        model.__dict__.pop("_step_hook_points", None)  # (read again at the next step)
        return False
    return _lean_blocks(model.blocks) and all_idle(hook_points(model))


class Shared:
    """What the layers of one step share: rotary tables per Rotary module, masks per (keys, window)."""

    def __init__(self, positions: Tensor) -> None:
        self.positions = positions
        self.tables: dict[int, tuple[Tensor, Tensor]] = {}
        self.masks: dict[tuple[int, int | None], CanonicalMask] = {}

    def rotary(self, rotary: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
        t = self.tables.get(id(rotary))
        if t is None:
            t = self.tables[id(rotary)] = rotary_tables(rotary, self.positions, x.dtype, x.device)
        return t

    def mask(self, batch: int, n_heads: int, seq_k: int, window: int | None, x: Tensor) -> CanonicalMask:
        key = (seq_k, window)
        m = self.masks.get(key)
        if m is None:  # one query after the cached keys: only a window masks (as the forward builds it)
            m = canonical_mask(
                batch=batch, n_heads=n_heads, seq_q=1, seq_k=seq_k, is_causal=False, dtype=x.dtype,
                device=x.device, window=window,
            )  # fmt: skip
            self.masks[key] = m
        return m


def attend(attn: GemmaAttention, x: Tensor, cache: KVCache, shared: Shared) -> Tensor:
    """The attention's output [B, 1, d_model] of its normed input x [B, 1, d_model] (one new position):
    :meth:`GemmaAttention.forward`'s operations in its order, the cache appended (an owner) or the
    owner's keys read from the store (``kv_source``)."""
    B = x.shape[0]
    H, Hkv, dh = attn.n_heads, attn.n_kv_heads, attn.d_head
    spec = attn._spec
    source = spec.kv_source
    out = F.linear(x, attn.qkv_weight, attn.qkv_bias)  # (B, 1, rows)
    q = out[..., : H * dh].reshape(B, 1, H, dh)  # (B, 1, H, dh)
    k = v = None
    if source is None:
        k = out[..., H * dh : (H + Hkv) * dh].reshape(B, 1, Hkv, dh)  # (B, 1, Hkv, dh)
        v = k if spec.k_eq_v else out[..., (H + Hkv) * dh :].reshape(B, 1, Hkv, dh)
    if attn.q_norm is not None:
        q = norm(attn.q_norm, q)  # (B, 1, H, dh)
        if k is not None:
            k = norm(attn.k_norm, k)  # (B, 1, Hkv, dh)
    if v is not None and spec.v_norm:
        vf = v.float()
        v = (vf * torch.pow(vf.pow(2).mean(-1, keepdim=True) + spec.qk_norm_eps, -0.5)).to(v.dtype)
    q = q.transpose(1, 2)  # (B, H, 1, dh)
    rotary = attn._modules.get("rotary")
    if rotary is not None:
        cos, sin = shared.rotary(rotary, x)  # (1, 1, 1, dh) x 2
        q = rotate_fused(q, cos, sin, rotary)  # (B, H, 1, dh)
    if source is None:
        assert k is not None and v is not None
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, Hkv, 1, dh) x 2
        if rotary is not None:
            k = rotate_fused(k, cos, sin, rotary)  # (B, Hkv, 1, dh)
        cache.check(B, 1, attn.o_weight.dtype, attn.o_weight.device)
        k, v = cache.append(k, v)  # (B, Hkv, Sk, dh) x 2
        attn.kv_store[attn.layer_index] = (k, v)
    else:
        k, v = attn.kv_store[source]  # (B, Hkv, Sk, dh) x 2: the owner's of this step
    mask = shared.mask(B, H, k.shape[2], attn.window, x)
    z, _ = get_backend("sdpa")(q, k, v, mask, scale=attn.scale, dropout_p=0.0)  # (B, H, 1, dh)
    z = z.transpose(1, 2).reshape(B, 1, H * dh)  # (B, 1, H dh): heads concatenated
    return F.linear(z, attn.o_weight, attn.o_bias)  # (B, 1, d_model)


def hidden_states(model: Any, x: Tensor, P: Tensor | None, kv_caches: list[KVCache], pos: Tensor) -> Tensor:
    """The final normed residual [B, 1, d_model] of the embedded new position x [B, 1, d_model] and its
    per-layer inputs P [B, 1, L, p] (or None), ``pos`` [1] its position: the blocks, per-layer inputs
    and layer scalars of :meth:`Gemma4Decoder.hidden_states`, inside the model's open key store."""
    shared = Shared(pos)
    store = model._kv_store
    store.open()
    try:
        for i, block in enumerate(model.blocks):
            a = attend(block.attn, norm(block.ln1, x), kv_caches[i], shared)  # (B, 1, d_model)
            h = x + norm(block.ln_attn_out, a)  # (B, 1, d_model)
            m = block.mlp(norm(block.ln2, h))  # (B, 1, d_model)
            x = h + norm(block.ln_mlp_out, m)  # (B, 1, d_model)
            if P is not None:
                ple = model.ple[i]
                g = ple.act(F.linear(x, ple.gate.weight))  # (B, 1, p)
                x = x + norm(ple.norm, F.linear(g * P[:, :, i], ple.proj.weight))  # (B, 1, d_model)
            x = x * model.layer_scalars[i]
    finally:
        store.close()
    return model.final_norm(x)


__all__ = ["Shared", "attend", "hidden_states", "hook_points", "norm", "takes"]
