"""One batch of the head atlas: every head's statistics from one forward pass, block by block.

For a batch of right-padded sequences (tokens [batch, seq], ``real`` bool [batch, seq]), the model runs
once; at each attention layer its rotated q and k (:func:`~headspace.analysis.chunked.each_layer_qk`)
and its v (the layer's own :meth:`~headspace.MultiHeadAttention.project_qkv` of the same input) are
taken, and the pattern is computed a block of queries at a time
(:func:`~headspace.analysis.chunked.iter_pattern_blocks`, float32 softmax with the layer's masks); no
[seq, seq] pattern outlives its block. Per block, per head, with ``p = pattern[i, :]`` of a real query
``i`` and ``t`` the tokens:

* ``previous`` ``p[i-1]`` and ``first`` ``p[0]`` (queries ``i >= 1``), ``self`` ``p[i]``, ``entropy``
  ``-sum_j p_j log p_j`` (every query);
* ``duplicate`` ``sum_{j < i, t_j = t_i} p_j`` and ``induction`` ``sum_{1 <= j <= i, t_{j-1} = t_i} p_j``
  (every query; 0 where the token has not occurred before);
* ``z_i = sum_j p_j v_j`` (the head's output before W_O, what ``hook_z`` holds) and the top key
  ``j*_i = argmax_{j >= 1} p_j`` (``j* = 0`` for query 0), the example candidate ``(p[j*], seq, i, j*)``.

After the forward, with the final norm frozen at the last residual stream (as
:func:`~headspace.analysis.attribution.direct_logit_attribution` does) and ``r_i = z_i W_O[h]``:

* ``direct_effect``: ``(center(r_i) * scale_i) . W_U[:, t_{i+1}]``, the head's direct logit attribution
  to the actual next token (queries with a real next token); candidates ranked by its absolute value;
* ``copying``: ``(center(r_i) * scale_i) . W_U[:, t_{j*_i}]``, its direct effect on the logit of the
  token it attends to most (positive: raises it, a copying head; negative: suppresses it).

Encoders (no unembedding) get no ``direct_effect``/``copying`` (their counts stay 0: NaN in the atlas).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..nn.masks import RowMasks
from .atlas_state import AtlasState, Candidate
from .causal_inputs import centered, frozen_norm, is_decoder, last_resid
from .chunked import LayerQK, each_layer_qk, iter_pattern_blocks
from .trace import trace


def _grouped_z(p: Tensor, v: Tensor) -> Tensor:
    """p [B, H, rows, W] (normalised), v [B, Hkv, W, dh] -> z rows [B, H, rows, dh] (query head h reads
    key/value head h // (H / Hkv))."""
    B, H, n, W = p.shape
    Hkv = v.shape[1]
    zg = torch.matmul(p.reshape(B, Hkv, (H // Hkv) * n, W), v.to(p.dtype))  # (B, Hkv, g rows, dh)
    return zg.view(B, H, n, v.shape[-1])  # (B, H, rows, dh)


def _top_candidates(
    values: Tensor,
    ok: Tensor,
    seq_ids: Tensor,
    query: Tensor,
    key: Tensor,
    k: int,
    signed: Tensor | None = None,
) -> list[list[Candidate]]:
    """Per head, the ``k`` best of ``values`` [B, H, n] where ``ok`` [B, n]: candidate tuples.

    ``query`` [n], ``key`` [B, H, n], ``seq_ids`` [B]; ``signed`` (same shape as values) is the value
    reported (default: ``values``)."""
    B, H, n = values.shape
    score = values.masked_fill(~ok[:, None], float("-inf")).permute(1, 0, 2).reshape(H, B * n)  # (H, B n)
    kk = min(k, B * n)
    best, where = score.topk(kk, dim=-1)  # (H, kk)
    shown = (values if signed is None else signed).permute(1, 0, 2).reshape(H, B * n)  # (H, B n)
    keys = key.permute(1, 0, 2).reshape(H, B * n)  # (H, B n)
    out: list[list[Candidate]] = []
    for h in range(H):
        row = []
        for s, w in zip(best[h].tolist(), where[h].tolist()):
            if s == float("-inf"):
                break
            b, i = divmod(w, n)
            row.append((float(s), int(seq_ids[b]), int(query[i]), int(keys[h, w]), float(shown[h, w])))
        out.append(row)
    return out


class BatchMeasure:
    """The per-layer measurement of one batch (see the module docstring): fills ``state`` and keeps each
    layer's z [B, S, H, dh] and top keys [B, H, S] for the direct effects computed after the forward."""

    def __init__(self, state: AtlasState, tokens: Tensor, real: Tensor, seq_ids: Tensor) -> None:
        self.state, self.tokens, self.real, self.seq_ids = state, tokens, real, seq_ids
        self.inputs: dict[int, Tensor] = {}
        self.z: dict[int, Tensor] = {}
        self.top_key: dict[int, Tensor] = {}

    def stash(self, layer: int) -> Any:
        """A forward pre-hook keeping the attention layer's input (for v)."""

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self.inputs[layer] = args[0] if args else kwargs["query"]

        return hook

    def layer(self, call: LayerQK) -> None:
        """Reduce one layer's pattern block by block into the state (called inside the forward)."""
        st, tok, real = self.state, self.tokens, self.real
        attn, i = call.attn, call.layer
        _, _, v = attn.project_qkv(self.inputs.pop(i))  # (B, Hkv, S, dh)
        q4, k4 = call.q.transpose(1, 2), call.k.transpose(1, 2)  # (B, H, S, dh), (B, Hkv, S, dh)
        B, H, S, dh = q4.shape
        masks = RowMasks(
            batch=B, n_heads=H, seq_q=S, seq_k=S, key_padding=call.key_padding, attn_mask=call.attn_mask,
            is_causal=call.is_causal, dtype=torch.float32, device=q4.device, window=call.window,
        )  # fmt: skip
        z = torch.zeros(B, H, S, dh, dtype=torch.float32, device=q4.device)  # (B, H, S, dh)
        top_key = torch.zeros(B, H, S, dtype=torch.int64, device=q4.device)  # (B, H, S)
        # rows: previous, first, self, entropy, duplicate, induction
        sums = torch.zeros(6, H, dtype=torch.float64, device=q4.device)  # (6, H)
        prev_tok = torch.cat([torch.full_like(tok[:, :1], -1), tok[:, :-1]], dim=1)  # (B, S): t_{j-1}
        for block in iter_pattern_blocks(q4, k4, masks, scale=call.scale):
            idx = block.index  # (n,)
            W = block.width
            p = block.pattern()  # (B, H, n, W)
            z[:, :, idx] = _grouped_z(p, v[:, :, :W])
            rq = real[:, idx]  # (B, n)
            later = idx[None, :, None] >= 1  # (1, n, 1)
            keys = torch.stack([(idx - 1).clamp(min=0), torch.zeros_like(idx), idx], dim=-1)[
                None
            ]  # (1, n, 3)
            g = block.gather(keys)  # (B, H, n, 3)
            j = torch.arange(W, device=idx.device)  # (W,)
            same = tok[:, idx, None] == tok[:, None, :W]  # (B, n, W)
            dup = same & (j[None, None] < idx[None, :, None]) & real[:, None, :W]  # (B, n, W)
            after = prev_tok[:, None, :W] == tok[:, idx, None]  # (B, n, W): t_{j-1} = t_i
            ind = after & (j[None, None] >= 1) & (j[None, None] <= idx[None, :, None]) & real[:, None, :W]
            dmass = torch.einsum("bhnw,bnw->bhn", p, dup.to(p.dtype))  # (B, H, n)
            imass = torch.einsum("bhnw,bnw->bhn", p, ind.to(p.dtype))  # (B, H, n)
            w_rq = rq.to(torch.float64)[:, None]  # (B, 1, n)
            w_later = (rq & later[..., 0]).to(torch.float64)[:, None]  # (B, 1, n)
            sums[0] += (g[..., 0].double() * w_later).sum((0, 2))
            sums[1] += (g[..., 1].double() * w_later).sum((0, 2))
            sums[2] += (g[..., 2].double() * w_rq).sum((0, 2))
            sums[3] += (block.entropy.double() * w_rq).sum((0, 2))
            sums[4] += (dmass.double() * w_rq).sum((0, 2))
            sums[5] += (imass.double() * w_rq).sum((0, 2))
            if W > 1:
                best, arg = p[..., 1:].max(dim=-1)  # (B, H, n): the top key after the first token
                arg = arg + 1
            else:
                best = torch.zeros_like(p[..., 0])
                arg = torch.zeros_like(best, dtype=torch.int64)
            arg = torch.where(idx[None, None] >= 1, arg, torch.zeros_like(arg))
            top_key[:, :, idx] = arg
            ok = rq & (idx[None] >= 1)  # (B, n)
            found = _top_candidates(best, ok, self.seq_ids, idx, arg, st.top_k)
            for h, cands in enumerate(found):
                st.add_candidates("attention", i, h, cands)
        n_real = int(real.sum())
        n_later = int((real & (torch.arange(S, device=real.device)[None] >= 1)).sum())
        for name, row, count in zip(
            ("previous", "first", "self", "entropy", "duplicate", "induction"),
            sums,
            (n_later, n_later, n_real, n_real, n_real, n_real),
        ):
            st.add_sum(name, i, row, count)
        st.z_sum[i, :H] += (z.transpose(1, 2).double() * real[:, :, None, None]).sum((0, 1)).cpu()
        self.z[i] = z.transpose(1, 2)  # (B, S, H, dh)
        self.top_key[i] = top_key


def _direct_effects(module: nn.Module, m: BatchMeasure, final: Tensor, layers: list[Any]) -> None:
    """``direct_effect`` and ``copying`` of every head from the kept z (see the module docstring)."""
    st, tok, real = m.state, m.tokens, m.real
    norm = module.ln_final
    scale, _ = frozen_norm(norm, final)  # (B, S, d_model) x 2
    W_U = module.W_U  # (d_model, vocab)
    B, S = tok.shape
    has_next = torch.zeros_like(real)
    has_next[:, :-1] = real[:, :-1] & real[:, 1:]  # (B, S)
    nxt = torch.cat([tok[:, 1:], tok[:, -1:]], dim=1)  # (B, S): t_{i+1} (last column unused)
    u_next = W_U.T[nxt] * scale  # (B, S, d_model)
    pos = torch.arange(S, device=tok.device)
    for i, (_, attn) in enumerate(layers):
        z = m.z.pop(i)  # (B, S, H, dh)
        H = z.shape[2]
        r = centered(norm, torch.einsum("bshd,hdm->bshm", z.to(attn.W_O.dtype), attn.W_O))  # (B, S, H, d)
        de = torch.einsum("bshm,bsm->bsh", r, u_next).double()  # (B, S, H)
        key = m.top_key.pop(i).transpose(1, 2)  # (B, S, H)
        key_tok = tok.gather(1, key.reshape(B, S * H)).view(B, S, H)  # (B, S, H)
        u_key = W_U.T[key_tok]  # (B, S, H, d_model)
        cp = torch.einsum("bshm,bsm,bshm->bsh", r, scale, u_key).double()  # (B, S, H)
        st.add_sum("direct_effect", i, (de * has_next[..., None]).sum((0, 1)), int(has_next.sum()))
        st.add_sum("copying", i, (cp * real[..., None]).sum((0, 1)), int(real.sum()))
        found = _top_candidates(
            de.abs().permute(0, 2, 1).float(), has_next, m.seq_ids, pos, key.permute(0, 2, 1), st.top_k,
            signed=de.permute(0, 2, 1).float(),
        )  # fmt: skip
        for h, cands in enumerate(found):
            st.add_candidates("direct_effect", i, h, cands)
        del r, u_key


@torch.no_grad()
def measure_batch(
    model: Any,
    module: nn.Module,
    layers: list[Any],
    state: AtlasState,
    tokens: Tensor,
    real: Tensor,
    seq_ids: Tensor,
) -> None:
    """Add one batch (tokens int64 [B, S], right-padded, ``real`` bool [B, S], ``seq_ids`` int64 [B]) to
    ``state``: every statistic of the module docstring, one forward pass."""
    m = BatchMeasure(state, tokens, real, seq_ids)
    decoder = is_decoder(module)
    handles = [
        attn.register_forward_pre_hook(m.stash(i), with_kwargs=True) for i, (_, attn) in enumerate(layers)
    ]
    kp = None if bool(real.all()) else real
    try:
        if decoder:
            last = last_resid(module)
            with trace(module, names=[last]) as t:
                each_layer_qk(model, lambda: module(tokens, kp), m.layer, stop_early=False)
            _direct_effects(module, m, t[last], layers)
        else:
            each_layer_qk(model, lambda: module(tokens, kp), m.layer, stop_early=True)
    finally:
        for h in handles:
            h.remove()
    state.n_queries += int(real.sum())
    state.n_tokens += int(real.sum())
    state.n_sequences += int(tokens.shape[0])
