"""The chunked gated delta rule without autograd: the maths of :func:`headspace.attention.delta_rule.
chunk_rule` (transformers' ``torch_chunk_gated_delta_rule``) with fewer passes over memory.

Per chunk of ``C`` positions and value head (``k_beta = beta k``, ``v_beta = beta v``, ``c`` the
cumulative log decay inside the chunk, ``P_ij = exp(c_i - c_j)`` for ``j <= i``, 0 above)::

    T       = I + strictly_lower((k_beta k^T) * P)                    the UT system [C, C]
    [U, W]  = T^-1 [v_beta, k_beta exp(c)]                           one solve for both
    V_new   = U - W S;   o = (q exp(c)) S + ((q k^T) * P) V_new
    S      <- exp(c_last) S + (k exp(c_last - c))^T V_new

What differs from the reference (the same operations on the same values, in the same order: bit for bit
equal to it and to transformers but for denormal floats, below; tested against both in
tests/attention/test_delta_fast_paths.py):

* q and k are L2-normalised at the key heads (each row alone: the same rows as after the repeat to the
  value heads), q's ``1 / sqrt(d_k)`` joins the norm's factor where it is a power of two (exact), and
  the normalised rows are written once, heads first and repeated, in one pass (the reference: repeat,
  transpose, normalise, scale);
* ``v_beta`` and the decayed ``k_beta`` are written straight into the right-hand side of the one solve,
  laid out column-major, which LAPACK solves in place (no concatenation, no copy in and out);
* the chunk loop fuses its adds into the matrix products (``baddbmm``) and writes its output in the
  [batch, seq, n_v_heads, d_v] layout the layer wants (no transpose at the end).

* denormal floats (magnitudes below 2^-126) are 0: the CPU's flush-to-zero mode is on in the calling
  thread while the rule runs (:func:`headspace.kernels.denormals.flushed_denormals`), and decays whose
  exp would be denormal are 0 on every thread (:data:`LOG_DECAY_FLOOR`). Strong decays make them by
  the thousand, and x86 CPUs multiply them tens of times slower.

It writes into fresh buffers (``out=``, in-place ops): callers take it only where no autograd graph is
recorded (:func:`headspace.attention.delta_rule.chunk_rule` decides).

Notation used for tensor shapes:
    batch, seq, n_k_heads, n_v_heads, d_k, d_v; ``n`` chunks of ``C`` positions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels.denormals import flushed_denormals

#: Log decays below this give a decay of 0: ``log(2^-126)``, where the exp would be a denormal float,
#: which is what the CPU's flush-to-zero mode makes of it (:mod:`headspace.kernels.denormals`), on any
#: thread (the flush mode holds in the calling thread only).
LOG_DECAY_FLOOR = math.log(torch.finfo(torch.float32).tiny)


def decay_exp(log_decay: Tensor) -> Tensor:
    """``exp(log_decay)``, 0 where ``log_decay < LOG_DECAY_FLOOR`` (no denormal floats); a fresh tensor."""
    return log_decay.masked_fill(log_decay < LOG_DECAY_FLOOR, float("-inf")).exp_()


def heads_first_normalised(x: Tensor, repeat: int, scale: float | None = None) -> Tensor:
    """x [B, S, Hk, d] -> ``x / sqrt(sum x^2 + 1e-6)`` (times ``scale`` where given) in float32,
    [B, Hk * repeat, S, d] contiguous, each head repeated ``repeat`` times (consecutive copies)."""
    x = x.to(torch.float32)
    B, S, H, d = x.shape
    inv = torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)  # (B, S, H, 1)
    folded = scale is not None and math.frexp(scale)[0] == 0.5  # a power of two: (x inv) s == x (inv s)
    if folded:
        inv = inv * scale
    out = x.new_empty(B, H, repeat, S, d)  # (B, Hk, repeat, S, d)
    src = x.transpose(1, 2).unsqueeze(2).expand(B, H, repeat, S, d)  # (B, Hk, repeat, S, d): a view
    factor = inv.transpose(1, 2).unsqueeze(2).expand(B, H, repeat, S, 1)  # (B, Hk, repeat, S, 1)
    torch.mul(src, factor, out=out)
    if scale is not None and not folded:
        out.mul_(scale)
    return out.view(B, H * repeat, S, d)  # (B, Hv, S, d)


def _solve_chunks(
    k: Tensor, v: Tensor, beta: Tensor, cum: Tensor, pair: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """k [B, Hv, n, C, dk] (normalised), v [B, Hv, n, C, dv] (any strides), beta, cum [B, Hv, n, C],
    pair [B, Hv, n, C, C] -> (``U`` [.., C, dv], ``W`` [.., C, dk], both views of one solved buffer,
    ``k_beta`` [.., C, dk])."""
    B, Hv, n, C, dk = k.shape
    dv = v.shape[-1]
    k_beta = k * beta.unsqueeze(-1)  # (B, Hv, n, C, dk)
    system = torch.matmul(k_beta, k.transpose(-1, -2)).mul_(pair)  # (B, Hv, n, C, C), fresh
    # the right-hand side [v_beta, k_beta exp(c)] [.., C, dv + dk], column-major as LAPACK solves in place
    both = k.new_empty(B, Hv, n, dv + dk, C).transpose(-1, -2)  # (B, Hv, n, C, dv + dk)
    torch.mul(v, beta.unsqueeze(-1), out=both[..., :dv])
    torch.mul(k_beta, decay_exp(cum).unsqueeze(-1), out=both[..., dv:])
    torch.linalg.solve_triangular(system, both, upper=False, unitriangular=True, out=both)
    return both[..., :dv], both[..., dv:], k_beta


def fast_chunk_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None = None, chunk: int = 64
) -> tuple[Tensor, Tensor]:
    """q, k [B, S, Hk, dk], v [B, S, Hv, dv], g, beta [B, S, Hv], state [B, Hv, dk, dv] or None ->
    (o [B, S, Hv, dv] in q's dtype, the final state [B, Hv, dk, dv] float32): the chunked rule (module
    docstring), no autograd. Denormal floats are flushed to zero (in this thread) while it runs:
    :func:`headspace.kernels.denormals.flushed_denormals`."""
    with flushed_denormals():
        return _chunks(q, k, v, g, beta, state, chunk)


def _chunks(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None, chunk: int
) -> tuple[Tensor, Tensor]:
    """:func:`fast_chunk_rule`'s body."""
    dtype = q.dtype
    B, S, Hk, dk = k.shape
    Hv, dv = v.shape[2], v.shape[3]
    pad = (chunk - S % chunk) % chunk
    if pad:  # zeros after the last position, as the reference pads (beta 0: nothing written)
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))  # (B, S + pad, H, d)
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))  # (B, S + pad, Hv)
    L = S + pad
    n = L // chunk
    qn = heads_first_normalised(q, Hv // Hk, dk**-0.5).view(B, Hv, n, chunk, dk)  # (B, Hv, n, C, dk)
    kn = heads_first_normalised(k, Hv // Hk).view(B, Hv, n, chunk, dk)  # (B, Hv, n, C, dk)
    v5 = v.to(torch.float32).transpose(1, 2).reshape(B, Hv, n, chunk, dv)  # (B, Hv, n, C, dv)
    g4 = g.to(torch.float32).transpose(1, 2).reshape(B, Hv, n, chunk)  # (B, Hv, n, C)
    beta4 = beta.to(torch.float32).transpose(1, 2).reshape(B, Hv, n, chunk)  # (B, Hv, n, C)
    cum = g4.cumsum(dim=3)  # (B, Hv, n, C): log decay since the chunk's start
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    # (B, Hv, n, C, C): the decay from each position to each later one in its chunk
    pair = cum.unsqueeze(4) - cum.unsqueeze(3)
    pair = pair.masked_fill_(upper, float("-inf")).masked_fill_(pair < LOG_DECAY_FLOOR, float("-inf")).exp_()
    new_v, k_cum, _ = _solve_chunks(kn, v5, beta4, cum, pair)  # (.., C, dv), (.., C, dk)
    intra = torch.matmul(qn, kn.transpose(-1, -2)).mul_(pair)  # (B, Hv, n, C, C)
    q_dec = qn.mul_(decay_exp(cum).unsqueeze(-1))  # (B, Hv, n, C, dk): qn is not needed undecayed again
    k_dec = kn.mul_(decay_exp(cum[..., -1:] - cum).unsqueeze(-1))  # (B, Hv, n, C, dk)
    chunk_decay = decay_exp(cum[..., -1]).reshape(B * Hv, n, 1, 1)  # (B Hv, n, 1, 1)
    s = (
        torch.zeros(B * Hv, dk, dv, dtype=torch.float32, device=q.device)
        if state is None
        else state.to(torch.float32).reshape(B * Hv, dk, dv).clone()
    )  # (B Hv, dk, dv)
    out = torch.empty(B, n, chunk, Hv, dv, dtype=torch.float32, device=q.device)  # the layer's layout
    for i in range(n):
        v_new = torch.baddbmm(new_v[:, :, i].flatten(0, 1), k_cum[:, :, i].flatten(0, 1), s, alpha=-1)
        o = torch.baddbmm(
            torch.bmm(q_dec[:, :, i].flatten(0, 1), s), intra[:, :, i].flatten(0, 1), v_new
        )  # (B Hv, C, dv)
        out[:, i].copy_(o.view(B, Hv, chunk, dv).transpose(1, 2))  # (B, C, Hv, dv)
        s = torch.baddbmm(s.mul_(chunk_decay[:, i]), k_dec[:, :, i].flatten(0, 1).transpose(1, 2), v_new)
    o = out.view(B, L, Hv, dv)[:, :S]  # (B, S, Hv, dv)
    return o.to(dtype).contiguous(), s.view(B, Hv, dk, dv)
