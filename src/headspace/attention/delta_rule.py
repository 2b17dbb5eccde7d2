"""The gated delta rule (Gated DeltaNet's token mixing) in plain torch, as transformers' torch fallback
computes it (``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` of
``modeling_qwen3_next``): the same ops in the same order, so the two agree to float32 rounding.

Per value head, with ``q_t``, ``k_t`` L2-normalised (eps 1e-6) and ``q_t`` scaled by ``1 / sqrt(d_k)``,
the state ``S`` [d_k, d_v] runs::

    S_t = exp(g_t) S_{t-1} + k_t^T (beta_t (v_t - k_t exp(g_t) S_{t-1}))       (the delta rule)
    o_t = q_t S_t

``g_t`` <= 0 is the log decay, ``beta_t`` in (0, 1) the write strength. :func:`recurrent_rule` runs it a
position at a time; :func:`chunk_rule` in chunks of 64 positions (a triangular solve per chunk), the
same maths up to rounding. Each query/key head serves ``n_v_heads / n_k_heads`` consecutive value heads.

Notation used for tensor shapes:
    batch, seq, n_k_heads, n_v_heads, d_k, d_v.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .delta_chunk import fast_chunk_rule


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum x^2 + eps)`` over the last axis (FLA's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> list[Tensor]:
    """q, k [B, S, Hk, dk], v [B, S, Hv, dv], g, beta [B, S, Hv] -> heads first in float32, q and k
    repeated to the value heads and L2-normalised, q scaled: [B, Hv, S, ...] each."""
    n_v, n_k = v.shape[2], k.shape[2]
    if n_k != n_v:
        q = q.repeat_interleave(n_v // n_k, dim=2)  # (B, S, Hv, dk)
        k = k.repeat_interleave(n_v // n_k, dim=2)  # (B, S, Hv, dk)
    q, k, v, beta, g = [
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for x in (q, k, v, beta, g)
    ]
    q, k = l2norm(q), l2norm(k)
    return [q, k, v, g, beta]


def recurrent_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The rule a position at a time: q, k [B, S, Hk, dk], v [B, S, Hv, dv], g, beta [B, S, Hv], state
    [B, Hv, dk, dv] or None (zeros) -> (o [B, S, Hv, dv] in v's dtype, the final state [B, Hv, dk, dv])."""
    dtype = q.dtype
    B, S, _, dk = k.shape
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    q = q / (q.shape[-1] ** 0.5)
    Hv, dv = v.shape[1], v.shape[-1]
    s = torch.zeros(B, Hv, dk, dv, dtype=v.dtype, device=v.device) if state is None else state.to(v)
    out = torch.zeros_like(v)  # (B, Hv, S, dv)
    for i in range(S):
        q_t, k_t, v_t = q[:, :, i], k[:, :, i], v[:, :, i]
        s = s * g[:, :, i].exp()[..., None, None]  # (B, Hv, dk, dv)
        kv_mem = (s * k_t.unsqueeze(-1)).sum(dim=-2)  # (B, Hv, dv)
        delta = (v_t - kv_mem) * beta[:, :, i].unsqueeze(-1)  # (B, Hv, dv)
        s = s + k_t.unsqueeze(-1) * delta.unsqueeze(-2)  # (B, Hv, dk, dv)
        out[:, :, i] = (s * q_t.unsqueeze(-1)).sum(dim=-2)
    return out.transpose(1, 2).contiguous().to(dtype), s  # (B, S, Hv, dv), (B, Hv, dk, dv)


def chunk_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None = None, chunk: int = 64
) -> tuple[Tensor, Tensor]:
    """The rule in chunks of ``chunk`` positions (transformers' ``torch_chunk_gated_delta_rule``): the
    same arguments and results as :func:`recurrent_rule`. Where no autograd graph is recorded (grad
    disabled, or no argument requires grad) it runs :func:`~headspace.attention.delta_chunk.
    fast_chunk_rule` (the same maths with fewer passes over memory); else :func:`reference_chunk_rule`."""
    if not (
        torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, g, beta, state))
    ):
        return fast_chunk_rule(q, k, v, g, beta, state, chunk)
    return reference_chunk_rule(q, k, v, g, beta, state, chunk)


def reference_chunk_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None = None, chunk: int = 64
) -> tuple[Tensor, Tensor]:
    """:func:`chunk_rule` as transformers' ``torch_chunk_gated_delta_rule`` computes it, op for op (one
    triangular solve for both right-hand sides); differentiable."""
    dtype = q.dtype
    B, S, _, dk = k.shape
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    q = q * q.shape[-1] ** -0.5
    Hv, dv = v.shape[1], v.shape[-1]
    pad = (chunk - S % chunk) % chunk
    if pad:  # (no copies where the positions fill whole chunks)
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))  # (B, Hv, S + pad, d)
        beta, g = (F.pad(x, (0, pad)) for x in (beta, g))  # (B, Hv, S + pad)
    n = (S + pad) // chunk
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = [x.reshape(B, Hv, n, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta)]
    g = g.reshape(B, Hv, n, chunk)  # (B, Hv, n, chunk)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=3)  # (B, Hv, n, chunk): log decay since the chunk's start
    # (B, Hv, n, chunk, chunk): the decay from each position to each later one in its chunk
    pair = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill_(upper, float("-inf")).exp_()
    system = (k_beta @ k.transpose(-1, -2)).mul_(pair)  # (the products are fresh: scaled in place)
    intra = (q @ k.transpose(-1, -2)).mul_(pair)
    decay = cum.exp().unsqueeze(-1)  # (B, Hv, n, chunk, 1)
    decayed_k_beta = k_beta * decay
    both = torch.cat([v_beta, decayed_k_beta], dim=-1)  # (B, Hv, n, chunk, dv + dk): one solve for both
    solved = torch.linalg.solve_triangular(system, both, upper=False, unitriangular=True)
    new_v, k_cum = solved[..., :dv], solved[..., dv:]  # (B, Hv, n, chunk, dv), (.., dk)
    s = (
        torch.zeros(B, Hv, dk, dv, dtype=new_v.dtype, device=new_v.device)
        if state is None
        else state.to(new_v)
    )
    out = torch.empty_like(new_v)  # (B, Hv, n, chunk, dv): every chunk written below
    q = q * decay
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]  # (B, Hv, n, 1, 1)
    for i in range(n):
        v_new = new_v[:, :, i] - k_cum[:, :, i] @ s  # (B, Hv, chunk, dv)
        out[:, :, i] = q[:, :, i] @ s + intra[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new  # (B, Hv, dk, dv)
    out = out.reshape(B, Hv, -1, dv)[:, :, :S]  # (B, Hv, S, dv)
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), s  # (B, S, Hv, dv), state
