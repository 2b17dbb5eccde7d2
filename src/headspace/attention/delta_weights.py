"""A Gated DeltaNet head's exact effective weights over earlier tokens (the delta rule, unrolled).

With the conventions of :mod:`headspace.attention.delta_rule` (``q_t``, ``k_t`` L2-normalised, ``q_t``
scaled by ``1 / sqrt(d_k)``, log decay ``g_t``, write strength ``beta_t``; the state ``S`` is
[d_k, d_v], rows of q and k are row vectors), the rule

    S_t = exp(g_t) S_{t-1} + k_t^T beta_t (v_t - k_t exp(g_t) S_{t-1})

is ``S_t = A_t S_{t-1} + beta_t k_t^T v_t`` with ``A_t = exp(g_t) (I - beta_t k_t^T k_t)`` [d_k, d_k].
From a zero state (a prompt), unrolled::

    o_t = q_t S_t = sum_{j <= t} w_tj v_j,     w_tj = beta_j (q_t A_t A_{t-1} ... A_{j+1}) . k_j

a scalar per (query t, key j): an exact "pattern", though not a softmax (rows are not normalised and a
weight can be negative). Split ``A_i = exp(g_i) P_i`` with ``P_i = I - beta_i k_i^T k_i``: ``w_tj =
beta_j D_tj (q_t P_t ... P_{j+1}) . k_j`` with the decay product ``D_tj = exp(g_{j+1} + ... + g_t)``;
without the erasures (every ``P_i = I``) it would be ``beta_j D_tj (q_t . k_j)``, linear attention with
a decay (:func:`delta_parts`).

Notation used for tensor shapes:
    batch, seq, n_k_heads, n_v_heads, d_k.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .delta_rule import l2norm

__all__ = ["delta_parts", "delta_weights", "normalised_qk"]


def normalised_qk(q: Tensor, k: Tensor, n_v_heads: int) -> tuple[Tensor, Tensor]:
    """q, k [batch, seq, n_k_heads, d_k] (the layer's ``hook_q``, ``hook_k``) -> the rule's q and k,
    [batch, n_v_heads, seq, d_k] in float64: repeated to the value heads (each query/key head serves
    ``n_v_heads / n_k_heads`` consecutive value heads), L2-normalised in float32 as the rule does (eps
    1e-6), q scaled by ``1 / sqrt(d_k)``."""
    n_k = q.shape[2]
    if n_v_heads % n_k:
        raise ValueError(f"n_v_heads must be a multiple of the {n_k} query/key heads; got {n_v_heads}")
    q = q.repeat_interleave(n_v_heads // n_k, dim=2).transpose(1, 2).float()  # (batch, Hv, seq, dk)
    k = k.repeat_interleave(n_v_heads // n_k, dim=2).transpose(1, 2).float()  # (batch, Hv, seq, dk)
    q, k = l2norm(q), l2norm(k)
    q = q / (q.shape[-1] ** 0.5)
    return q.double(), k.double()


def _check(q: Tensor, k: Tensor, g: Tensor, beta: Tensor) -> None:
    if q.dim() != 4 or q.shape != k.shape:
        raise ValueError(
            f"q and k must be [batch, seq, n_k_heads, d_k] of one shape; got {list(q.shape)}, {list(k.shape)}"
        )
    if g.dim() != 3 or g.shape != beta.shape or g.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"g and beta must be [batch, seq, n_v_heads] with q's batch and seq {list(q.shape[:2])}; got "
            f"{list(g.shape)}, {list(beta.shape)}"
        )


def delta_weights(q: Tensor, k: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """The effective weights ``w`` [batch, n_v_heads, seq, seq] (float32, lower triangular: ``w[.., t,
    j] = w_tj`` for ``j <= t``, 0 above) with ``o_t = sum_j w_tj v_j`` exactly, from a zero state.

    q, k [batch, seq, n_k_heads, d_k] (``hook_q``, ``hook_k``: after the convolution, before the L2
    norm), g, beta [batch, seq, n_v_heads] (``hook_gate``, the log decay, and ``hook_beta``). Computed in
    float64 from right to left, all queries at once: ``u_t = q_t``; for ``i = seq - 1 .. 0``:
    ``w_ti = beta_i u_t . k_i`` for every ``t >= i``, then ``u_t <- u_t A_i`` (module docstring).
    """
    _check(q, k, g, beta)
    S = q.shape[1]
    qn, kn = normalised_qk(q, k, g.shape[2])  # (batch, Hv, seq, dk)
    g = g.transpose(1, 2).double()  # (batch, Hv, seq)
    beta = beta.transpose(1, 2).double()  # (batch, Hv, seq)
    u = qn.clone()  # (batch, Hv, seq_q, dk): row t is q_t A_t ... A_{i+1}
    w = qn.new_zeros(*qn.shape[:2], S, S)  # (batch, Hv, seq_q, seq_k)
    rows = torch.arange(S, device=q.device)
    for i in range(S - 1, -1, -1):
        k_i = kn[:, :, i]  # (batch, Hv, dk)
        dot = (u * k_i.unsqueeze(2)).sum(-1)  # (batch, Hv, seq_q): u_t . k_i
        w[:, :, :, i] = beta[:, :, i, None] * dot
        erased = u - (beta[:, :, i, None] * dot).unsqueeze(-1) * k_i.unsqueeze(2)  # u (I - beta k^T k)
        started = (rows >= i)[:, None]  # (seq_q, 1): the queries whose product has reached A_i
        u = torch.where(started, erased * g[:, :, i, None, None].exp(), u)  # (batch, Hv, seq_q, dk)
    return w.tril().float()


def delta_parts(q: Tensor, k: Tensor, g: Tensor, beta: Tensor) -> dict[str, Tensor]:
    """What makes each weight, for the lesson: ``decay`` ``D_tj = exp(g_{j+1} + ... + g_t)`` and
    ``linear`` ``beta_j D_tj (q_t . k_j)`` (the weight without the delta rule's erasures), both [batch,
    n_v_heads, seq, seq] float32, lower triangular; ``dot`` ``q_t . k_j`` (normalised, scaled) the same
    shape. Arguments as :func:`delta_weights`."""
    _check(q, k, g, beta)
    qn, kn = normalised_qk(q, k, g.shape[2])  # (batch, Hv, seq, dk)
    cum = g.transpose(1, 2).double().cumsum(-1)  # (batch, Hv, seq): g_0 + ... + g_t
    log_decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).tril()  # (batch, Hv, seq_q, seq_k)
    mask = torch.ones_like(log_decay, dtype=torch.bool).tril()
    decay = torch.where(mask, log_decay.exp(), torch.zeros_like(log_decay))
    dot = (qn @ kn.transpose(-1, -2)).tril()  # (batch, Hv, seq_q, seq_k)
    linear = beta.transpose(1, 2).double().unsqueeze(-2) * decay * dot
    return {"decay": decay.float(), "linear": linear.float(), "dot": dot.float()}
