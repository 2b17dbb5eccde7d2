"""The attention layer's traced path as :func:`headspace.trace` records it: the trace's executor of the
attention, kept out of the layer's maths (``attention/layer.py``).

* :func:`traced_attention`: the reference attention with ``hook_scores``, ``hook_pattern`` and
  ``hook_z`` fired; where only recorders watch the scores and the pattern and no one asked for the
  pattern, they are handed a :class:`~headspace.attention.functional.DeferredAttention` of q and k
  (or of values that compute q and k again) and z is computed a block of query rows at a time.
* :func:`output_from_heads`: ``hook_result``; recorders alone get a
  :class:`~headspace.attention.functional.DeferredResult` (z and a copy of ``W_O``), not the
  [batch, seq_q, n_heads, d_model] result.
* :func:`project_stages` with :class:`QKVOps`: q, k and v and every stage a hook point shows, computed
  from the layer's input by the ops of the traced forward: what a fully recorded block
  (:mod:`headspace.model.recorded`) hands the stage hook points as
  :class:`~headspace.nn.hooks.Recomputed` values.

Every value here is bit for bit what the layer's traced forward computes: the same ops on the same
tensors, in the same order.

Notation used for tensor shapes:
    B batch, S / Sq / Sk sequence (query / key), H n_heads, Hkv n_kv_heads, dh d_head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.hooks import Deferred, HookPoint
from ..nn.masks import CanonicalMask
from ..nn.norms import rms_norm
from ..nn.positions import Rotary, rotate_fused
from .functional import DeferredAttention, DeferredResult, reference_parts, reference_rows


@dataclass
class QKVOps:
    """What a fused self-attention layer's traced path computes q, k and v with (:func:`project_stages`):
    the layer's own tensors during its forward, copies of them in a deferred hook value.

    ``q_norm`` / ``k_norm``: (weight, eps, offset) of the QK-norms, or None; ``cos`` / ``sin``: the
    rotary tables of the call (:func:`~headspace.positions.rotary_tables`), or None.
    """

    weight: Tensor
    bias: Tensor | None
    n_heads: int
    n_kv_heads: int
    d_head: int
    qk_norm: str | None = None
    q_norm: tuple[Tensor, float, float] | None = None
    k_norm: tuple[Tensor, float, float] | None = None
    rotary: Rotary | None = None
    cos: Tensor | None = None
    sin: Tensor | None = None


def norm_params(norm: nn.Module | None, copy: bool) -> tuple[Tensor, float, float] | None:
    """(weight, eps, offset) of an :class:`~headspace.norms.RMSNorm` (a copy of the weight with
    ``copy``), or None without a norm."""
    if norm is None:
        return None
    w = norm.weight.detach()
    return (w.clone() if copy else w, norm.eps, norm.offset)


def project_stages(x: Tensor, ops: QKVOps) -> dict[str, Tensor]:
    """The traced path's q, k and v from the layer's input x [B, S, d_model], with every stage a hook
    point shows, all [B, heads, S, d_head]: ``"q"``, ``"k"``, ``"v"`` (views of the one projection),
    ``"q_normed"``, ``"k_normed"`` (QK-norm layers), ``"rot_q"``, ``"rot_k"`` (rotary layers), and
    ``"q_att"``, ``"k_att"``, the q and k the scores use. The ops are :meth:`MultiHeadAttention.
    project_qkv`'s, :meth:`~MultiHeadAttention.normed_qk`'s and :func:`~headspace.positions.rotate_fused`,
    in that order, so the values are bit for bit the traced forward's."""
    B, S, _ = x.shape
    H, Hkv, dh = ops.n_heads, ops.n_kv_heads, ops.d_head
    qkv = F.linear(x, ops.weight, ops.bias)  # (B, S, (H + 2 Hkv) dh)
    qkv = qkv.view(B, S, H + 2 * Hkv, dh).transpose(1, 2)  # (B, H + 2 Hkv, S, dh)
    q, k, v = qkv.split([H, Hkv, Hkv], dim=1)  # (B, H, S, dh), (B, Hkv, S, dh) x 2
    stages = {"q": q, "k": k, "v": v}
    if ops.qk_norm is not None:
        assert ops.q_norm is not None and ops.k_norm is not None
        if ops.qk_norm == "head":
            q, k = rms_norm(q, *ops.q_norm), rms_norm(k, *ops.k_norm)  # (B, H, S, dh), (B, Hkv, S, dh)
        else:
            q = rms_norm(q.transpose(1, 2).reshape(B, S, H * dh), *ops.q_norm)  # (B, S, H dh)
            q = q.view(B, S, H, dh).transpose(1, 2)  # (B, H, S, dh)
            k = rms_norm(k.transpose(1, 2).reshape(B, S, Hkv * dh), *ops.k_norm)  # (B, S, Hkv dh)
            k = k.view(B, S, Hkv, dh).transpose(1, 2)  # (B, Hkv, S, dh)
        stages["q_normed"], stages["k_normed"] = q, k
    if ops.rotary is not None:
        assert ops.cos is not None and ops.sin is not None
        q = rotate_fused(q, ops.cos, ops.sin, ops.rotary)  # (B, H, S, dh)
        k = rotate_fused(k, ops.cos, ops.sin, ops.rotary)  # (B, Hkv, S, dh)
        stages["rot_q"], stages["rot_k"] = q, k
    stages["q_att"], stages["k_att"] = q, k
    return stages


def stage(stages: dict[str, Tensor], name: str) -> Tensor:
    """One stage of :func:`project_stages` [B, heads, S, dh]."""
    return stages[name]


def hook_view(stages: dict[str, Tensor], name: str) -> Tensor:
    """One stage of :func:`project_stages` as its hook point shows it."""
    return stages[name].transpose(1, 2)  # (B, S, heads, dh): the hook point's layout


def output_sum(result: Tensor, bias: Tensor | None) -> Tensor:
    """The attention output as the sum of the heads' results [B, Sq, H, d_model] (plus ``b_O``)."""
    out = result.sum(dim=2)  # (B, Sq, d_model)
    return out if bias is None else out + bias


def output_of_heads(z: Tensor, W_O: Tensor, bias: Tensor | None) -> Tensor:
    """``sum_h z_h W_O[h] + b_O`` from z [B, Sq, H, dh] and W_O [H, dh, d_model], by the ops of
    :func:`output_from_heads`: [B, Sq, d_model]."""
    return output_sum(torch.einsum("bshd,hdm->bshm", z, W_O), bias)  # (B, Sq, d_model)


def copied(t: Tensor | None) -> Tensor | None:
    """A detached copy of ``t`` (None stays None): what a recorded value keeps of a weight."""
    return None if t is None else t.detach().clone()


def traced_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: CanonicalMask,
    dropout_p: float,
    points: tuple[HookPoint, HookPoint, HookPoint],
    *,
    scale: float,
    softcap: float | None,
    need_pattern: bool = True,
    qk_sources: tuple[Deferred, Deferred] | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The reference attention with its hook points ``points`` = (``hook_scores``, ``hook_pattern``,
    ``hook_z``) fired: q [B, H, Sq, dh], k, v [B, Hkv, Sk, dh] -> (z [B, Sq, H, dh] after ``hook_z``,
    pattern [B, H, Sq, Sk], weights after dropout).

    ``need_pattern=False`` lets the layer skip the pattern when nothing can replace it (every function
    on ``hook_scores`` and ``hook_pattern`` only records, :attr:`HookPoint.defers`): the recorders get
    a :class:`~headspace.functional.DeferredAttention` of q and k, z is
    :func:`~headspace.functional.reference_rows` (the same values, a block of queries at a time), and
    pattern and weights are None. Soft-capped layers and layers with ``sinks`` [n_heads] keep the pattern
    (the deferred forms have neither).
    ``qk_sources``: values that compute q and k again (a fully recorded block's,
    :class:`~headspace.hooks.Recomputed`), kept by the deferred scores and pattern instead of q and k.
    """
    on_scores, on_pattern, on_z = points
    keep = need_pattern or softcap is not None or sinks is not None
    if keep or not (on_scores.defers and on_pattern.defers):
        z, pattern, weights = reference_parts(
            q, k, v, mask, scale=scale, dropout_p=dropout_p,
            on_scores=on_scores, on_pattern=on_pattern, softcap=softcap, sinks=sinks,
        )  # fmt: skip
        return on_z(z.transpose(1, 2)), pattern, weights  # (B, Sq, H, dh), ...
    q_kept, k_kept = (q.detach(), k.detach()) if qk_sources is None else qk_sources
    for point, which in ((on_scores, "scores"), (on_pattern, "pattern")):
        if point.active:
            point.fire_deferred(DeferredAttention(q_kept, k_kept, mask, scale, which))
    z = reference_rows(q, k, v, mask, scale=scale, dropout_p=dropout_p)  # (B, H, Sq, dh)
    return on_z(z.transpose(1, 2)), None, None  # (B, Sq, H, dh)


def output_from_heads(
    z: Tensor, W_O: Tensor, bias: Tensor | None, on_result: HookPoint
) -> tuple[Tensor, Tensor | None]:
    """``out = sum_h z_h W_O[h] + b_O`` [B, Sq, d_model] from z [B, Sq, H, dh] and W_O [H, dh, d_model]
    (the layer's view), firing ``on_result`` (``hook_result``, active) with each head's part ``z_h
    W_O[h]`` [B, Sq, H, d_model]. Where only recorders watch it, they get a
    :class:`~headspace.functional.DeferredResult` of z and a copy of W_O instead of the result.

    Returns (out, the copy of W_O the recorders keep, or None where the result was fired itself).
    """
    result = torch.einsum("bshd,hdm->bshm", z, W_O)  # (B, Sq, H, d_model)
    if on_result.defers:  # only recorders: they keep z and W_O, not the [.., H, d_model] result
        kept = W_O.detach().clone()
        on_result.fire_deferred(DeferredResult(z.detach(), kept))
        return output_sum(result, bias), kept  # (B, Sq, d_model)
    return output_sum(on_result(result), bias), None  # (B, Sq, d_model)
