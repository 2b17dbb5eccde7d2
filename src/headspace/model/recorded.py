"""The trace's executor of a block: what a :class:`~headspace.block.TransformerBlock` runs while only
:func:`headspace.trace`'s recorders watch its hook points.

Two forms, each bit for bit the block's own forward:

* a **fully recorded block** (:func:`takes`, then :func:`run`): every hook point of the block, its
  attention and its MLP is recorded, so the block keeps only its input and the attention's z (and copies
  of the weights); every other value is noted as recomputed from those
  (:class:`~headspace.hooks.Recomputed`, :func:`~headspace.hooks.note_source`) and the hook points get
  those deferred values. The ops are the block's own, in its order, for every residual layout.
* otherwise, ``hook_resid_mid`` where it is ``x + a`` and both terms are recorded (:func:`fire_resid_mid`)
  gets a :class:`DeferredSum` of the two instead of a third tensor.

The block's forward dispatches here once (``forward``) and for ``hook_resid_mid``; its maths stays in
the block (``model/block.py``). Inside a fully recorded block the attention sublayer is run here too
(:func:`attention`), from the layer's description (``attn.spec``) and its weights, by the ops of its
traced forward; the attention's own hook firing is :mod:`headspace.attention.recording`'s.

Notation used for tensor shapes:
    batch, seq, d_model.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention import recording
from ..attention.checks import check_rotary_positions, refuse_non_finite
from ..attention.layer import MultiHeadAttention
from ..attention.recording import (
    QKVOps,
    copied,
    hook_view,
    norm_params,
    output_of_heads,
    project_stages,
    stage,
)
from ..nn.hooks import HookPoint, Memo, Recomputed, note_source, noting_sources, resolve, source_of
from ..nn.kv_cache import KVCache
from ..nn.norms import RMSNorm, rms_norm
from ..nn.positions import rotary_tables
from .mlp import DeferredMLP as DeferredMLP  # formerly block.DeferredMLP (FORMER_BLOCK_NAMES)
from .mlp import FeedForward, GatedFeedForward, _copy, _defers, _plain_linear

#: The names :mod:`headspace.model.block` held before the trace's executor had a module of its own:
#: ``from headspace.model.block import DeferredSum`` keeps working (``block.__getattr__``).
FORMER_BLOCK_NAMES = ("DeferredMLP", "DeferredSum")


def norm_source(norm: nn.Module, source: Any, shape: torch.Size) -> Recomputed | None:
    """``norm`` of a value recomputed from ``source``, as a :class:`~headspace.hooks.Recomputed` with copies
    of the norm's weights and the op its forward runs (:func:`~headspace.norms.rms_norm`,
    ``F.layer_norm``); None for other norms."""
    if type(norm) is RMSNorm:
        return Recomputed(rms_norm, source, _copy(norm.weight), norm.eps, norm.offset, shape=shape)
    if type(norm) is nn.LayerNorm:
        w, b = _copy(norm.weight), _copy(norm.bias)
        return Recomputed(F.layer_norm, source, norm.normalized_shape, w, b, norm.eps, shape=shape)
    return None


class DeferredSum:
    """A block's ``hook_resid_mid`` [batch, seq, d_model] where it is ``x + a`` (pre-norm, sandwich and
    post-sublayer blocks), kept as the two tensors the block added (its recorded ``hook_resid_pre`` and
    ``hook_attn_out``): ``materialize()`` adds them again, bit for bit the block's value."""

    def __init__(self, x: Tensor, a: Tensor) -> None:
        self.x, self.a = x, a
        self.shape = tuple(x.shape)

    def evaluate(self, memo: Memo, head: int | None = None) -> Tensor:
        """:meth:`materialize` (``memo`` resolves deferred terms)."""
        return resolve(self.x, memo) + resolve(self.a, memo)

    def materialize(self, head: int | None = None) -> Tensor:
        """[batch, seq, d_model] (``head`` is not used)."""
        return self.evaluate({})


def fire_resid_mid(block: Any, x: Tensor, a: Tensor, h: Tensor) -> Tensor:
    """``block.hook_resid_mid`` on ``h = x + a``: while only recorders watch it and ``x`` and ``a`` are
    recorded too (``hook_resid_pre``, ``hook_attn_out``), they get a :class:`DeferredSum` of the two
    (no third [batch, seq, d_model] tensor kept); otherwise the hook point fires on ``h``."""
    if (
        _defers((block.hook_resid_mid,))
        and _defers((block.hook_resid_pre,))
        and _defers((block.hook_attn_out,))
    ):
        block.hook_resid_mid.fire_deferred(DeferredSum(x.detach(), a.detach()))
        return h
    return block.hook_resid_mid(h)


def _all_points(block: Any) -> list[HookPoint]:
    """Every hook point of the block, its attention and its MLP."""
    points = [block.hook_resid_pre, block.hook_attn_in, block.hook_attn_out, block.hook_resid_mid]
    points += [block.hook_mlp_in, block.hook_mlp_out]
    points += [block.hook_resid_post, *block.attn._hook_points, *block.mlp._points()]
    return points


def _norms(block: Any) -> list[nn.Module]:
    sandwich = block.norm == "sandwich"
    return [block.ln1, block.ln2] + ([block.ln_attn_out, block.ln_mlp_out] if sandwich else [])


def takes(block: Any, x: Tensor, kv_cache: KVCache | None) -> bool:
    """Whether this call of ``block`` keeps only its input and the attention's z (and copies of the
    weights): every hook point of the block, its attention and its MLP is recorded and nothing
    replaces a value, the parts are the standard ones (this package's MLPs, plain float linears,
    RMSNorm or LayerNorm, no soft-capping), in eval mode without a KV cache, and that keeps fewer
    bytes than the parts' own deferrals (:func:`kept_elements`: not so for short inputs, where the
    copies of the weights outweigh the values)."""
    if block.training or kv_cache is not None or block.reduced_precision or block.norm == "parallel":
        return False
    a, mlp = block.attn, block.mlp
    if type(a).forward is not MultiHeadAttention.forward or not a.fused or a.softcap is not None:
        return False
    if a._parameters.get("gate_weight") is not None:  # (an output gate: the block's own forward runs)
        return False
    if type(mlp) not in (FeedForward, GatedFeedForward) or any(True for _ in mlp.act.parameters()):
        return False
    linears = [mlp.fc_in, mlp.fc_out] + ([mlp.fc_gate] if "fc_gate" in mlp._modules else [])
    if not all(_plain_linear(fc) for fc in linears):
        return False
    if not all(type(n) in (RMSNorm, nn.LayerNorm) for n in _norms(block)):
        return False
    if not all(p.active and p.defers for p in _all_points(block)):
        return False
    rows = x.numel() // max(1, x.shape[-1])
    chained, own = kept_elements(block, rows)
    return chained < own


def kept_elements(block: Any, rows: int) -> tuple[int, int]:
    """What a fully recorded call on ``rows`` positions keeps, in elements, besides
    ``hook_resid_post``: (keeping the input and z, keeping what each part defers on its own)."""
    a, mlp = block.attn, block.mlp
    d, H, Hkv, dh = block.d_model, a.n_heads, a.n_kv_heads, a.d_head
    d_mlp = mlp.fc_in.weight.shape[0]
    mlp_points = len(mlp._points())
    w_o = a.o_weight.numel()
    mlp_in = sum(p.numel() for name, p in mlp.named_parameters() if not name.startswith("fc_out"))
    own = rows * (d + (H + 2 * Hkv) * dh + H * dh + 2 * d) + w_o  # x, q/k/v, z, attn_out, mlp_out
    own += rows * (H + Hkv) * dh * ((a.rotary is not None) + (a.qk_norm is not None))
    own += rows * d * (block.norm == "post")  # a post-LN block's resid_mid
    own += rows * d * (block.norm in ("pre", "sandwich")) * 2  # attn_in and mlp_in, normed copies
    own += min(mlp_points * rows * d_mlp, rows * d + mlp_in)  # the MLP's values, or its input
    copies = sum(p.numel() for p in block.parameters())  # every weight, copied once
    chained = rows * (d + H * dh) + copies
    return chained, own


def _noted_norm(norm: nn.Module, t: Tensor) -> Tensor:
    """``norm(t)``, noted as recomputed from what ``t`` is recomputed from."""
    out = norm(t)
    source = source_of(t)
    if source is not None:
        node = norm_source(norm, source, out.shape)
        if node is not None:
            note_source(out, node)
    return out


def _fire_noted(point: HookPoint, t: Tensor) -> None:
    """Fire ``point`` (only recorders watch it) with ``t``, or with what ``t`` is recomputed from."""
    source = source_of(t)
    if source is not None and not isinstance(source, Tensor):
        point.fire_deferred(source)
    else:
        point(t)


def run(block: Any, x: Tensor, kw: dict[str, Any]) -> Tensor:
    """``block``'s forward (after ``hook_resid_pre``, before ``hook_resid_post``) while every hook point
    is recorded (:func:`takes`), for every layout: each value noted as recomputed from the block's
    input, the attention's z and copies of the weights, and the block's hook points handed those
    deferred values (the attention and the MLP inside defer theirs to them).
    x [batch, seq, d_model] -> [batch, seq, d_model], the block's output bit for bit."""
    with noting_sources():
        note_source(x, x.detach())  # the trace holds x (hook_resid_pre)
        return _run_noted(block, x, kw)


def _run_noted(block: Any, x: Tensor, kw: dict[str, Any]) -> Tensor:
    norm, sandwich = block.norm, block.norm == "sandwich"
    a_in = _noted_norm(block.ln1, x) if norm in ("pre", "sandwich") else x
    if a_in is x:  # the attention reads the block's input itself, which the trace holds
        block.hook_attn_in.fire_deferred(Recomputed(Tensor.detach, x.detach(), shape=x.shape))
    else:
        _fire_noted(block.hook_attn_in, a_in)
    a = attention(block.attn, a_in, kw)
    if sandwich:
        a = _noted_norm(block.ln_attn_out, a)
    elif norm == "post_sublayer":
        a = _noted_norm(block.ln1, a)
    a = block.dropout(a)  # (batch, seq, d_model): eval mode, the tensor itself
    _fire_noted(block.hook_attn_out, a)
    h = x + a  # (batch, seq, d_model)
    sx, sa = source_of(x), source_of(a)
    if sx is not None and sa is not None:
        note_source(h, Recomputed(operator.add, sx, sa, shape=h.shape))
    if norm == "post":
        h = _noted_norm(block.ln1, h)
    _fire_noted(block.hook_resid_mid, h)
    m_in = _noted_norm(block.ln2, h) if norm in ("pre", "sandwich") else h
    _fire_noted(block.hook_mlp_in, m_in)
    m = block.mlp(m_in)
    if sandwich:
        m = _noted_norm(block.ln_mlp_out, m)
    elif norm == "post_sublayer":
        m = _noted_norm(block.ln2, m)
    m = block.dropout(m)
    _fire_noted(block.hook_mlp_out, m)
    out = h + m  # (batch, seq, d_model)
    return block.ln2(out) if norm == "post" else out


# ------------------------------------------------------------------------------- the attention sublayer
def attention(attn: MultiHeadAttention, x: Tensor, kw: dict[str, Any]) -> Tensor:
    """The attention sublayer of a fully recorded block (:func:`takes`: fused self-attention, no KV cache,
    no soft-capping), run from the layer's description (``attn.spec``) and its weights: x [batch, seq,
    d_model] -> [batch, seq, d_model], bit for bit the layer's forward. The stages' hook points (q, k,
    v, the QK-normed and rotated q and k) get values recomputed from what x is recomputed from and
    copies of the weights (:func:`_recorded_qkv`), the scores and the pattern deferred values of those
    (:meth:`MultiHeadAttention.traced_attention`), and the output is noted as recomputed from z and the
    copy of ``W_O`` that ``hook_result`` keeps."""
    positions = kw.get("positions")
    attn._checked_call(x, None, None, kw["attn_mask"], None, positions)
    B, S, _ = x.shape
    if B == 0 or S == 0:
        return attn(x, **kw)  # an empty output: nothing to record
    spec = attn.spec
    mask = attn._call_mask(x, S, kw["key_padding"], kw["attn_mask"], kw["is_causal"], None)
    source = source_of(x)
    qk: tuple[Recomputed, Recomputed] | None = None
    if source is not None and _standard_qk_norms(attn):
        q, k, v, qk = _recorded_qkv(attn, x, source, positions)
    else:  # the layer's own traced stages, each hook point handed its value
        q, k, v = attn._heads_qkv(x, x, x, True, True, None, positions, None)
    dropout_p = spec.dropout if attn.training else 0.0
    z, _, _ = attn.traced_attention(q, k, v, mask, dropout_p, need_pattern=False, qk_sources=qk)
    W_O: Tensor | None = None
    if attn.hook_result.active:
        out, W_O = recording.output_from_heads(z, attn.W_O, attn.o_bias, attn.hook_result)
    else:
        out = attn.output_from_heads(z)  # (batch, seq, d_model)
    if W_O is not None and attn.hook_z.active and attn.hook_z.defers:  # z recorded, W_O copied: out is free
        note_source(out, Recomputed(output_of_heads, z.detach(), W_O, copied(attn.o_bias), shape=out.shape))
    if attn.check_finite:
        refuse_non_finite("attention output (inputs were finite: check the weights)", out)
    return out


def _standard_qk_norms(attn: MultiHeadAttention) -> bool:
    """Whether the QK-norms (if any) are this package's RMSNorm, whose op :func:`project_stages` runs."""
    return attn.qk_norm is None or (type(attn.q_norm) is RMSNorm and type(attn.k_norm) is RMSNorm)


def _stage_points(attn: MultiHeadAttention) -> tuple[tuple[str, HookPoint | None], ...]:
    """The hook points of :func:`project_stages`' stages, by stage name (None: the layer has none)."""
    return (
        ("q", attn.hook_q),
        ("k", attn.hook_k),
        ("v", attn.hook_v),
        ("q_normed", attn.hook_q_normed),
        ("k_normed", attn.hook_k_normed),
        ("rot_q", attn.hook_rot_q),
        ("rot_k", attn.hook_rot_k),
    )


def _qkv_ops(attn: MultiHeadAttention, cos: Tensor | None, sin: Tensor | None, *, copy: bool) -> QKVOps:
    """:class:`QKVOps` of ``attn`` from its description and weights (``copy``: copies of the weights)."""
    spec = attn.spec
    w = attn.qkv_weight.detach()
    b = None if attn.qkv_bias is None else attn.qkv_bias.detach()
    return QKVOps(
        weight=w.clone() if copy else w,
        bias=None if b is None else (b.clone() if copy else b),
        n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads, d_head=spec.d_head,
        qk_norm=spec.qk_norm,
        q_norm=norm_params(attn.q_norm, copy), k_norm=norm_params(attn.k_norm, copy),
        rotary=spec.positions, cos=cos, sin=sin,
    )  # fmt: skip


def _recorded_qkv(
    attn: MultiHeadAttention, x: Tensor, source: Any, positions: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, tuple[Recomputed, Recomputed]]:
    """q [B, H, S, dh], k, v [B, Hkv, S, dh] of the layer on x [B, S, d_model] by :func:`project_stages`,
    each active stage hook point handed a :class:`~headspace.hooks.Recomputed` that computes its value
    again from ``source`` (what x is recomputed from) and copies of the weights; also the recomputed q
    and k the scores use."""
    rotary = attn.spec.positions
    B, S, _ = x.shape
    cos = sin = None
    if rotary is not None:
        if positions is None:
            positions = torch.arange(S, device=x.device)  # (S,)
        else:
            check_rotary_positions(positions, B, S, x.device)
        cos, sin = rotary_tables(rotary, positions, x.dtype, x.device)  # (B|1, 1, S, rd) x 2
    stages = project_stages(x, _qkv_ops(attn, cos, sin, copy=False))
    node = Recomputed(project_stages, source, _qkv_ops(attn, cos, sin, copy=True))
    for name, point in _stage_points(attn):
        if point is not None and point.active:
            shape = stages[name].transpose(1, 2).shape
            point.fire_deferred(Recomputed(hook_view, node, name, shape=shape, head_axis=2))
    q_src = Recomputed(stage, node, "q_att", shape=stages["q_att"].shape, head_axis=1)
    k_src = Recomputed(stage, node, "k_att", shape=stages["k_att"].shape, head_axis=1)
    return stages["q_att"], stages["k_att"], stages["v"], (q_src, k_src)
