"""The lesson's steps for the attention mechanisms of 2025-26 (issue 39), with the explained layer's numbers.

Each step reads the layer's description (``attn.spec``) and, where it needs them, the layer's recorded
values (:attr:`SchemeContext.values`: ``q``, ``k``, ``v`` before their norms, ``pattern`` ...; batch 1);
a layer without the mechanism gets no step. Registered on import (:mod:`.explain` imports this module):

* ``"chunk"`` (Llama 4's chunked layers, ``spec.chunk = C``): query ``i`` sits in the chunk
  ``[C floor(i / C), C floor(i / C) + C)`` and sees the keys ``C floor(i / C) .. i`` only
  (:func:`headspace.nn.masks.chunk_mask`);
* ``"temperature"`` (Llama 4's NoPE layers, ``spec.temperature = (F, a)``): query ``p`` is multiplied by
  ``t(p) = 1 + a log1p(floor((p + 1) / F))`` (:mod:`headspace.attention.temperature`), so its scores are
  ``t(p)`` times the untempered ``scale q . k_j`` (shown for the top keys on a layer without rotary);
* ``"l2_norm"`` (``spec.qk_norm == "l2"``): q and each top key's k before and after the weightless norm
  ``x / sqrt(mean(x^2) + eps)``: the RMS ``|x| / sqrt(d_head)`` becomes 1 (``|x|`` becomes
  ``sqrt(d_head)``), the direction is kept;
* ``"v_norm"`` (Gemma 3n / 4, ``spec.v_norm``): each top key's ``|v_j|`` before and after the scaleless
  RMSNorm ``v / sqrt(mean(v^2) + eps)``;
* ``"k_eq_v"`` (Gemma 4's global layers, ``spec.k_eq_v``): the values are the key projection before its
  norm (``W_V`` is ``W_K``): ``max |v_j - k_j|`` over the sentence (0).

Latent attention (DeepSeek MLA), differential attention (DiffLlama) and ``kv_source`` (Gemma 3n / 4
layers that reuse an earlier layer's keys and values) have their steps in :mod:`.walk_steps`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .scheme_steps import SchemeContext, SchemeStep, register_scheme_step

__all__ = [
    "chunk_step",
    "k_eq_v_step",
    "l2_norm_step",
    "temperature_step",
    "v_norm_step",
]


def _spec(c: SchemeContext) -> Any:
    return getattr(c.attn, "spec", None)


def _value(c: SchemeContext, name: str) -> Tensor | None:
    """The layer's recorded ``name`` for batch row 0, or None where the caller recorded none."""
    values = c.values or {}
    v = values.get(name)
    return None if v is None else v[0].detach()


def _rms_normed(x: Tensor, eps: float) -> Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last dimension, in float32 (x [..., d] -> [..., d])."""
    xf = x.float()
    return xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)


def chunk_step(c: SchemeContext) -> SchemeStep | None:
    """Chunked attention: the explained query's chunk ``[start, end)`` and the keys it sees."""
    spec = _spec(c)
    chunk = getattr(spec, "chunk", None)
    if chunk is None or c.index is None:
        return None
    i, size = int(c.index), int(chunk)
    start = (i // size) * size
    end = start + size
    visible = list(range(start, i + 1))
    return SchemeStep(
        "chunk",
        f"chunked attention: query {i} sees only keys {start}..{i} of its chunk [{start}, {end})",
        [
            f"the sentence is cut into chunks of {size} positions: [0, {size}), [{size}, {2 * size}), ...;",
            f"query {i} is in chunk [{start}, {end}) and sees keys {start}..{i} (causal within its chunk);",
            f"keys 0..{start - 1} get no weight, however close" if start else "no earlier chunk to hide",
        ],
        {"chunk": size, "query": i, "start": start, "end": end, "visible": visible},
    )


def temperature_step(c: SchemeContext) -> SchemeStep | None:
    """The NoPE layers' per-position query temperature ``t(p)`` and the scores it scales."""
    temp = getattr(_spec(c), "temperature", None)
    if temp is None or c.index is None:
        return None
    floor_scale, a = float(temp[0]), float(temp[1])
    p = int(c.index)
    floored = math.floor((p + 1) / floor_scale)
    t = 1.0 + a * math.log1p(floored)
    lines = [
        f"this layer has no positions (NoPE); query {p} is multiplied by its temperature",
        f"t(p) = 1 + {a:g} x log1p(floor((p + 1) / {floor_scale:g}))",
        f"     = 1 + {a:g} x log1p({floored}) = {t:.6g}",
    ]
    numbers: dict[str, Any] = {"position": p, "floor_scale": floor_scale, "attn_scale": a,
                               "floor": floored, "factor": t}  # fmt: skip
    q, k = _value(c, "q"), _value(c, "k")
    if q is not None and k is not None and c.scores is not None and getattr(c.attn, "rotary", None) is None:
        kv = c.head // c.attn.group_size
        keys = [int(j) for j in c.keys if math.isfinite(float(c.scores[j]))]
        before = [float(c.attn.scale * (q[p, c.head].float() @ k[j, kv].float())) for j in keys]
        after = [float(c.scores[j]) for j in keys]
        lines.append(f"so every score of query {p} is t(p) times the untempered scale q . k_j:")
        lines += [f"key {j}: {s0:.4f} x {t:.4f} -> {s1:.4f}" for j, s0, s1 in zip(keys, before, after)]
        numbers.update(keys=keys, before=before, after=after)
    return SchemeStep("temperature", f"query temperature: t({p}) = {t:.6g} (NoPE layer)", lines, numbers)


def l2_norm_step(c: SchemeContext) -> SchemeStep | None:
    """The weightless L2 QK-norm: q's and the top keys' RMS (``|x| / sqrt(d_head)``) before and after."""
    spec = _spec(c)
    q, k = _value(c, "q"), _value(c, "k")
    if getattr(spec, "qk_norm", None) != "l2" or c.index is None or q is None or k is None:
        return None
    eps, i, kv, root = (
        float(spec.qk_norm_eps),
        int(c.index),
        c.head // c.attn.group_size,
        math.sqrt(c.attn.d_head),
    )
    keys = [int(j) for j in c.keys if c.scores is None or math.isfinite(float(c.scores[j]))]  # visible
    q0 = q[i, c.head]  # (d_head,)
    k0 = k[keys, kv]  # (n_keys, d_head)
    q_before, q_after = float(q0.float().norm()), float(_rms_normed(q0, eps).norm())
    k_before = [float(v) for v in k0.float().norm(dim=-1)]
    k_after = [float(v) for v in _rms_normed(k0, eps).norm(dim=-1)]
    lines = [
        f"q and k are divided by their RMS, sqrt(mean(x^2) + {eps:g}), with no weight after it:",
        f"each head's q and k keep their direction and get RMS 1 (|x| = sqrt({c.attn.d_head}) = {root:.4g})",
        f"q (query {i}): |q| = {q_before:.4f} -> {q_after:.4f}",
    ]
    lines += [f"k (key {j}): |k| = {b:.4f} -> {a:.4f}" for j, b, a in zip(keys, k_before, k_after)]
    numbers = {"query": i, "keys": keys, "q_before": q_before, "q_after": q_after,
               "k_before": k_before, "k_after": k_after, "eps": eps}  # fmt: skip
    return SchemeStep(
        "l2_norm", f"L2 QK-norm without weights: q and k to RMS 1 (|x| = {root:.4g})", lines, numbers
    )


def v_norm_step(c: SchemeContext) -> SchemeStep | None:
    """Gemma 3n / 4's value norm: each top key's ``|v_j|`` before and after (no scale)."""
    spec = _spec(c)
    v = _value(c, "v")
    if not getattr(spec, "v_norm", False) or v is None:
        return None
    kv, eps, keys = c.head // c.attn.group_size, float(spec.qk_norm_eps), list(c.keys)
    v0 = v[keys, kv]  # (n_keys, d_head)
    before = [float(x) for x in v0.float().norm(dim=-1)]
    after = [float(x) for x in _rms_normed(v0, eps).norm(dim=-1)]
    root = math.sqrt(c.attn.d_head)
    lines = [
        f"each value is divided by its RMS, sqrt(mean(v^2) + {eps:g}), with no scale after it: every",
        f"v_j gets |v_j| = sqrt({c.attn.d_head}) = {root:.4g}, so only the pattern weighs the keys' values",
    ]
    lines += [f"v (key {j}): |v| = {b:.4f} -> {a:.4f}" for j, b, a in zip(keys, before, after)]
    numbers = {"keys": keys, "before": before, "after": after, "eps": eps}
    return SchemeStep("v_norm", f"value norm without scale: every |v_j| -> {root:.4g}", lines, numbers)


def k_eq_v_step(c: SchemeContext) -> SchemeStep | None:
    """``attention_k_eq_v``: the values are the key projection (before the key's norm)."""
    v, k = _value(c, "v"), _value(c, "k")
    if not getattr(_spec(c), "k_eq_v", False) or v is None or k is None:
        return None
    gap = float((v.float() - k.float()).abs().max())
    same = c.attn.W_V.data_ptr() == c.attn.W_K.data_ptr()
    lines = [
        "values are the key projection: v_j = x_j W_K before k's norm and rotation",
        f"(W_V is W_K, {'one storage' if same else 'equal'}); then v is normed without a scale,",
        "k with its own norm and rotary;",
        f"max |v_j - k_j| over the sentence before the norms = {gap:.3g}",
    ]
    return SchemeStep("k_eq_v", "values are the key projection (W_V is W_K)", lines,
                      {"max_gap": gap, "shared_storage": same})  # fmt: skip


register_scheme_step("chunk", chunk_step)
register_scheme_step("temperature", temperature_step)
register_scheme_step("l2_norm", l2_norm_step)
register_scheme_step("v_norm", v_norm_step)
register_scheme_step("k_eq_v", k_eq_v_step)
