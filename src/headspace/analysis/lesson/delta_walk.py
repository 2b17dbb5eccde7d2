"""The lesson on a Gated DeltaNet layer (Qwen3-Next, Qwen3.5): one token through one value head, exactly.

A DeltaNet head has no softmax, but from a zero state its rule output is a weighted sum of the earlier
values (:mod:`headspace.attention.delta_weights`)::

    o_t = sum_{j <= t} w_tj v_j,     w_tj = beta_j (q_t A_t ... A_{j+1}) . k_j,
    A_i = exp(g_i) (I - beta_i k_i^T k_i)

with ``q``, ``k`` L2-normalised and ``q`` scaled by ``1 / sqrt(d_k)``. :func:`walk_delta` records the
layer's hook points (``hook_q``, ``hook_k``, ``hook_v``, ``hook_gate`` (g), ``hook_beta``, ``hook_o``,
``hook_z``, ``hook_result``) in one forward pass, computes the head's row ``w_t`` and fills the fields of
an :class:`~headspace.analysis.lesson.explain.Explanation`:

* ``q`` the token's q (after the convolution and silu, before the norm) [d_k], ``k`` and ``v`` every
  token's [seq, d_k] / [seq, d_v] (``kv_head`` is the query/key head the value head reads);
* ``scores`` ``q_t . k_j`` of the normalised, scaled q and k (None above the diagonal) and ``pattern``
  the effective weights ``w_tj`` (0 above the diagonal): not normalised, and signed;
* ``top`` the earlier tokens with the largest ``|w_tj|``;
* ``gate`` the gated norm's gate ``silu(x W_Z[h])`` [d_v] and ``z = RMSNorm(o_t) * w_norm * gate`` (the
  layer's ``hook_z``, the input of W_O), ``out`` ``sum_h z_h W_O[h]``, ``head_contributions`` the
  ``|z_h W_O[h]|``;
* ``scheme_steps`` one step, ``"delta_rule"``: the recurrence with the model's numbers: g_t, beta_t and,
  for each top token, the decay product ``D_tj = exp(g_{j+1} + ... + g_t)``, the write strength
  ``beta_j``, the weight without erasures ``beta_j D_tj (q_t . k_j)`` and ``w_tj`` (``numbers``:
  ``top``, and ``decays``, ``betas``, ``no_erase`` for every token up to t); ``o_t`` from the weights
  (``o_from_weights``) and the recorded ``hook_o`` (``o``: they agree to float32 rounding, ``o_gap``);
  the norm's ``rms``.

``explain`` dispatches here for a DeltaNet ``layer``; its head ranking (no ``layer``) still ranks the
softmax layers only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...attention.delta_net import GatedDeltaNet
from ...attention.delta_weights import delta_parts, delta_weights
from .scheme_steps import SchemeStep

__all__ = ["DELTA_STEP", "delta_layer", "delta_step", "is_delta_walk", "record_delta", "walk_delta"]

#: The name of the lesson step of a DeltaNet head (``SchemeStep.scheme``).
DELTA_STEP = "delta_rule"
#: The layer's hook points the walk reads.
RECORDED = ("q", "k", "v", "gate", "beta", "o", "z", "result")


def delta_layer(model: nn.Module, layer: int | None) -> bool:
    """Whether block ``layer`` of ``model`` is a Gated DeltaNet layer (False for None or out of range)."""
    blocks = getattr(model, "blocks", ())
    return layer is not None and 0 <= layer < len(blocks) and isinstance(blocks[layer].attn, GatedDeltaNet)


def is_delta_walk(e: Any) -> bool:
    """Whether the :class:`~headspace.analysis.lesson.explain.Explanation` ``e`` walks a DeltaNet head."""
    return any(getattr(s, "scheme", None) == DELTA_STEP for s in getattr(e, "scheme_steps", ()))


def record_delta(model: nn.Module, layer: int, ids: Tensor, key_padding: Tensor | None) -> dict[str, Tensor]:
    """One forward pass of ``ids`` [1, seq] (inference mode) with block ``layer``'s Gated DeltaNet hook
    points recording: :data:`RECORDED` by name (shapes as in :mod:`headspace.attention.delta_net`) and
    ``input``, the layer's input [1, seq, d_model] (after the block's norm)."""
    block = model.blocks[layer]
    got: dict[str, Tensor] = {}

    def keeper(name: str) -> Callable[[Tensor, Any], None]:
        def keep(value: Tensor, _point: Any) -> None:
            got[name] = value.detach().clone()

        return keep

    points = [(n, getattr(block.attn, f"hook_{n}")) for n in RECORDED] + [("input", block.hook_attn_in)]
    removers = [point.add(keeper(n), this_thread=True) for n, point in points]
    try:
        with torch.inference_mode():
            model(ids) if key_padding is None else model(ids, key_padding)
    finally:
        for remove in removers:
            remove()
    return got


def walk_delta(
    model: nn.Module,
    layer: int,
    head: int | None,
    index: int,
    tokens: list[str],
    ids: Tensor,
    key_padding: Tensor | None,
    attended: Callable[[int, str, float], Any],
) -> tuple[int, dict[str, Any]]:
    """Token ``index`` through value head ``head`` of block ``layer`` (a :class:`GatedDeltaNet`) of
    ``model``, run on ``ids`` [1, seq] (``tokens`` its strings): ``(head, fields)``, the fields of an
    ``Explanation`` but its sentence, tokens, layer and head (module docstring). ``head`` None: the head
    with the largest ``|z_h W_O[h]|`` at the token. ``attended(j, token, weight)`` makes an entry of
    ``top``."""
    attn = model.blocks[layer].attn
    if not isinstance(attn, GatedDeltaNet):
        raise TypeError(f"walk_delta needs a Gated DeltaNet layer; layer {layer} is {type(attn).__name__}")
    rec = record_delta(model, layer, ids, key_padding)
    result = rec["result"][0, index]  # (Hv, d_model)
    contributions = result.norm(dim=-1)  # (Hv,)
    if head is None:
        head = int(contributions.argmax())
    s = attn.spec
    kv = head // (s.n_v_heads // s.n_k_heads)
    seen, seq = index + 1, rec["q"].shape[1]
    kv_slice, v_slice = slice(kv, kv + 1), slice(head, head + 1)  # this head and its query/key head only
    one = [rec[n][:, :seen, kv_slice] for n in ("q", "k")] + [
        rec[n][:, :seen, v_slice] for n in ("gate", "beta")
    ]
    w = F.pad(delta_weights(*one)[0, 0, index], (0, seq - seen))  # (seq,): 0 after the token
    parts = {n: F.pad(p[0, 0, index], (0, seq - seen)) for n, p in delta_parts(*one).items()}  # (seq,) each
    order = w[:seen].abs().argsort(descending=True, stable=True)[:5].tolist()
    x = rec["input"][0, index]  # (d_model,)
    with torch.inference_mode():  # the layer's own gate: silu(x W_Z[h]) in float32
        gate = F.silu(attn.in_z(x).float()).view(s.n_v_heads, s.d_v)[head]  # (d_v,)
    fields: dict[str, Any] = dict(
        kv_head=kv, d_model=s.d_model, n_heads=s.n_v_heads, n_kv_heads=s.n_k_heads, d_head=s.d_k,
        scale=s.d_k**-0.5, x=_floats(x), q=_floats(rec["q"][0, index, kv]),
        k=[_floats(r) for r in rec["k"][0, :, kv]], v=[_floats(r) for r in rec["v"][0, :, head]],
        scores=[float(d) if j < seen else None for j, d in enumerate(parts["dot"].tolist())],
        pattern=_floats(w), top=[attended(j, tokens[j], float(w[j])) for j in order],
        z=_floats(rec["z"][0, index, head]), concat=_floats(rec["z"][0, index]),
        out=_floats(result.sum(dim=0)), head_contributions=_floats(contributions),
        head_shares=_floats(contributions / contributions.sum().clamp(min=1e-30)),
        bias=False, out_bias=False, gate=_floats(gate),
        scheme_steps=[delta_step(attn, rec, head, index, w, parts, order, tokens)],
    )  # fmt: skip
    return head, fields


def delta_step(
    attn: GatedDeltaNet,
    rec: dict[str, Tensor],
    head: int,
    index: int,
    w: Tensor,
    parts: dict[str, Tensor],
    keys: list[int],
    tokens: list[str],
) -> SchemeStep:
    """The lesson step ``"delta_rule"`` for value head ``head`` at token ``index``: ``w`` [seq] the
    head's effective weights, ``parts`` its ``decay``, ``linear`` and ``dot`` rows [seq]
    (:func:`~headspace.attention.delta_weights.delta_parts`), ``keys`` the top positions by ``|w|``."""
    t, s = index, attn.spec
    g_t, b_t = float(rec["gate"][0, t, head]), float(rec["beta"][0, t, head])
    v = rec["v"][0, : t + 1, head].double()  # (t + 1, d_v)
    o_w = (w[: t + 1].double().unsqueeze(-1) * v).sum(0)  # (d_v,): sum_j w_tj v_j
    o_rec = rec["o"][0, t, head].double()  # (d_v,): the layer's own rule output
    gap = float((o_w - o_rec).abs().max())
    rms = float(o_rec.pow(2).mean().add(s.norm_eps).sqrt())
    rows = [
        {"j": j, "token": tokens[j], "w": float(w[j]), "decay": float(parts["decay"][j]),
         "beta": float(rec["beta"][0, j, head]), "linear": float(parts["linear"][j]),
         "dot": float(parts["dot"][j])}
        for j in keys
    ]  # fmt: skip
    numbers: dict[str, Any] = {
        "index": t, "head": head, "g": g_t, "decay_step": float(torch.tensor(g_t).exp()), "beta": b_t,
        "weights_sum": float(w[: t + 1].sum()), "abs_sum": float(w[: t + 1].abs().sum()), "top": rows,
        "o_from_weights": [float(a) for a in o_w.tolist()], "o": [float(a) for a in o_rec.tolist()],
        "o_gap": gap, "rms": rms, "d_k": s.d_k, "d_v": s.d_v,
        "decays": [float(d) for d in parts["decay"][: t + 1].tolist()],
        "betas": [float(b) for b in rec["beta"][0, : t + 1, head].tolist()],
        "no_erase": [float(a) for a in parts["linear"][: t + 1].tolist()],
    }  # fmt: skip
    lines = [
        f"no softmax: a state S [d_k={s.d_k}, d_v={s.d_v}] per value head, updated at every token i:",
        "S_i = A_i S_(i-1) + beta_i k_i^T v_i,  A_i = exp(g_i) (I - beta_i k_i^T k_i)  (q, k unit length,",
        f"q / sqrt({s.d_k})); exp(g_i) decays the old state, beta_i writes v_i and erases what k_i held",
        f"token {t}: exp(g_t) = {numbers['decay_step']:.4f}, beta_t = {b_t:.4f}; unrolled, o_t = q_t S_t =",
        "sum_j w_tj v_j exactly, w_tj = beta_j (q_t A_t ... A_(j+1)) . k_j: a pattern that is not a",
        f"softmax (here sum_j w_tj = {numbers['weights_sum']:+.4f}, sum_j |w_tj| = {numbers['abs_sum']:.4f})",
        "the decay product D_tj = exp(g_(j+1) + ... + g_t); without the erasures w_tj would be",
        "beta_j D_tj (q_t . k_j), linear attention with a decay:",
    ]
    for r in rows:
        lines.append(
            f"  j={r['j']:<3} {r['token'][:12]:<12} D={r['decay']:.3e} beta={r['beta']:.4f} "
            f"q.k={r['dot']:+.4f} no-erase={r['linear']:+.3e} w={r['w']:+.3e}"
        )
    lines.append(f"o_t = sum_j w_tj v_j equals the layer's rule output to {gap:.1e}; rms(o_t) = {rms:.4f}")
    title = f"the delta rule: o_t = sum_j w_tj v_j over {t + 1} tokens, w not a softmax"
    return SchemeStep(DELTA_STEP, title, lines, numbers)


def _floats(t: Tensor) -> list[float]:
    return [float(v) for v in t.flatten().tolist()]
