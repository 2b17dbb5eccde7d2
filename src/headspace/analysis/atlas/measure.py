"""One batch of the head atlas: every head's statistics from one forward pass, block by block.

For a batch of right-padded sequences (tokens [batch, seq], ``real`` bool [batch, seq]), the model runs
once (decoders: :meth:`~headspace.Decoder.hidden_states`, no logits); at each attention layer its
rotated q and k and its v, from one projection (:func:`~headspace.analysis.chunked.each_layer_qk`),
are taken, and the pattern is computed a block of queries at a time
(:func:`~headspace.analysis.chunked.iter_pattern_blocks`, float32 softmax with the layer's masks); no
[seq, seq] pattern outlives its block, and each block is read unnormalised (its row sums divide what is
read). Per block, per head, with ``p = pattern[i, :]`` of a real query ``i`` and ``t`` the tokens:

* ``previous`` ``p[i-1]`` and ``first`` ``p[0]`` (queries ``i >= 1``), ``self`` ``p[i]``, ``entropy``
  ``-sum_j p_j log p_j`` (every query);
* ``duplicate`` ``sum_{j < i, t_j = t_i} p_j`` and ``induction`` ``sum_{1 <= j <= i, t_{j-1} = t_i} p_j``
  (every query; 0 where the token has not occurred before), gathered at the (few) matching key
  positions, which are found once per batch and block of queries and shared by every layer;
* ``z_i = sum_j p_j v_j`` (the head's output before W_O, what ``hook_z`` holds) and the top key
  ``j*_i = argmax_{j >= 1} p_j`` (``j* = 0`` for query 0), the example candidate ``(p[j*], seq, i, j*)``.

With the final norm frozen at the last residual stream (as
:func:`~headspace.analysis.attribution.direct_logit_attribution` does: ``scale_i = w * c_i``, ``w`` the
norm's weight, ``c_i`` the per-position ``1 / sigma_i`` of a LayerNorm or ``1 / rms_i`` of an RMSNorm)
and ``r_i = z_i W_O[h]``:

* ``direct_effect``: ``(center(r_i) * scale_i) . W_U[:, t_{i+1}]``, the head's direct logit attribution
  to the actual next token (queries with a real next token); candidates ranked by its absolute value;
* ``copying``: ``(center(r_i) * scale_i) . W_U[:, t_{j*_i}]``, its direct effect on the logit of the
  token it attends to most (positive: raises it, a copying head; negative: suppresses it).

Both are ``c_i`` times ``z_i . (W_O[h] center(w * W_U[:, t]))``: that dot product is taken in each
layer as the forward goes (one [batch x seq, d_model] x [d_model, n_heads x d_head] product per layer),
kept as [batch, seq, heads], and scaled by ``c_i`` once the last residual stream is known; no layer's z
outlives its layer. Where a norm sits between the attention output and the residual add (Gemma's
sandwich ``ln_attn_out``, OLMo 2's post-sublayer norm), ``r_i`` passes it frozen at the layer's output,
as in :func:`~headspace.analysis.attribution.direct_logit_attribution`: its weight joins the unembedding
row (``W_U`` -> ``center'(w' * center(w * W_U))``) and its per-position factor ``c'_i`` (taken from the
norm's input in the forward) joins ``c_i``.

Encoders (no unembedding) and decoders of the ``post`` layout (a norm after each residual add rescales
the whole stream: no fixed direct path) get no ``direct_effect``/``copying`` (their counts stay 0: NaN in
the atlas).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ...nn.hooks import on_call
from ...nn.masks import RowMasks
from ...nn.norms import rms_inverse
from ..causal.causal_inputs import is_decoder, post_attention_norm
from ..lesson.chunked import LayerQK, each_layer_qk, iter_pattern_blocks
from .sinks import SinkRows, layer_sinks
from .state import AtlasState, Candidate


def _grouped_z(w: Tensor, v: Tensor) -> Tensor:
    """w [B, H, rows, W] (pattern rows, normalised or not), v [B, Hkv, W, dh] -> w @ v [B, H, rows, dh]
    (query head h reads key/value head h // (H / Hkv))."""
    B, H, n, W = w.shape
    Hkv = v.shape[1]
    zg = torch.matmul(w.reshape(B, Hkv, (H // Hkv) * n, W), v.to(w.dtype))  # (B, Hkv, g rows, dh)
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
    shown_best = shown.gather(1, where).tolist()  # (H, kk)
    keys_best = keys.gather(1, where).tolist()  # (H, kk)
    seqs, queries = seq_ids.tolist(), query.tolist()
    out: list[list[Candidate]] = []
    for h in range(H):
        row = []
        for s, w, value, key_at in zip(best[h].tolist(), where[h].tolist(), shown_best[h], keys_best[h]):
            if s == float("-inf"):
                break
            b, i = divmod(w, n)
            row.append((float(s), int(seqs[b]), int(queries[i]), int(key_at), float(value)))
        out.append(row)
    return out


def norm_split(norm: nn.Module | None, x: Tensor) -> tuple[Tensor, Tensor]:
    """The final norm's frozen scale at ``x`` [..., d_model] as (``weight`` [d_model], ``c`` [...]).

    ``weight[None] * c[..., None]`` is the ``scale`` of
    :func:`~headspace.analysis.causal_inputs.frozen_norm` (float32 rounding apart): the norm's weight
    (ones without one; ``weight + offset`` for an RMSNorm with an offset) and the per-position factor
    ``1 / sigma`` of a LayerNorm or ``1 / rms`` of an RMSNorm (1 without a norm). float32.
    """
    d = x.shape[-1]
    if norm is None:
        return torch.ones(d, device=x.device), torch.ones(x.shape[:-1], device=x.device)
    xf = x.float()
    if isinstance(norm, nn.LayerNorm):
        sigma = torch.sqrt(xf.var(dim=-1, unbiased=False) + norm.eps)  # (...)
        w = norm.weight if norm.weight is not None else torch.ones(d, device=x.device)
        return w.float(), sigma.reciprocal()
    eps = getattr(norm, "eps", None)
    weight = getattr(norm, "weight", None)
    if eps is None or weight is None:
        raise TypeError(f"cannot freeze a final norm of type {type(norm).__name__}")
    return (weight + getattr(norm, "offset", 0.0)).float(), rms_inverse(xf, eps)[..., 0]  # (d,), (...)


Pairs = tuple[Tensor, Tensor, Tensor]  # (batch, query row in the block, offset in the block), [nnz] each


class _KeyPairs:
    """The (query, key) pairs that ``duplicate`` and ``induction`` sum over, per block of queries.

    Found once per batch and block (every layer of a batch cuts the same blocks when it has the same
    number of heads) as flat offsets into a block's weights [B, H, rows, width]: a few percent of the
    block on text, so the sums are gathers instead of passes over the block."""

    def __init__(self, tokens: Tensor, real: Tensor) -> None:
        self.tokens, self.real = tokens, real
        self.prev = torch.cat([torch.full_like(tokens[:, :1], -1), tokens[:, :-1]], dim=1)  # (B, S): t_{j-1}
        self.cache: dict[tuple[int, int, int], list[Pairs]] = {}

    def of(self, lo: int, hi: int, W: int) -> list[Pairs]:
        """[``duplicate``'s pairs, ``induction``'s] for queries ``lo .. hi - 1`` against keys
        ``0 .. W - 1``, each (batch, query row in the block, offset into the block viewed
        [B, H, rows W]), int64 [nnz] each. Only real queries and real keys."""
        key = (lo, hi, W)
        if key not in self.cache:
            tok, real = self.tokens, self.real
            idx = torch.arange(lo, hi, device=tok.device)  # (n,)
            j = torch.arange(W, device=tok.device)  # (W,)
            seen = real[:, lo:hi, None] & real[:, None, :W]  # (B, n, W): real query, real key
            same = (tok[:, lo:hi, None] == tok[:, None, :W]) & (
                j[None, None] < idx[None, :, None]
            )  # (B, n, W)
            after = (self.prev[:, None, :W] == tok[:, lo:hi, None]) & (j[None, None] >= 1)  # (B, n, W)
            after &= j[None, None] <= idx[None, :, None]
            pairs = []
            for m in (same & seen, after & seen):
                b, i, k = m.nonzero(as_tuple=True)  # (nnz,) x 3
                pairs.append((b, i, i * W + k))
            self.cache[key] = pairs
        return self.cache[key]


class BatchMeasure:
    """The per-layer measurement of one batch (see the module docstring): fills ``state`` and keeps, per
    layer, the heads' direct effects before the final norm's factor ([B, S, H] x 2, float32) and their
    top keys [B, H, S], for the direct effects finished after the forward (:func:`_direct_effects`).

    ``unembed`` [B, S, d_model]: ``center(w * W_U[:, t_j])`` at every position ``j`` (``w`` the final
    norm's weight, :func:`norm_split`), or None (an encoder: no direct effects); ``norm`` the final
    norm (None: none)."""

    def __init__(
        self,
        state: AtlasState,
        tokens: Tensor,
        real: Tensor,
        seq_ids: Tensor,
        unembed: Tensor | None = None,
        norm: nn.Module | None = None,
    ) -> None:
        self.state, self.tokens, self.real, self.seq_ids = state, tokens, real, seq_ids
        self.unembed, self.norm = unembed, norm
        self.pairs = _KeyPairs(tokens, real)
        self.direct: dict[int, tuple[Tensor, Tensor]] = {}
        self.top_key: dict[int, Tensor] = {}
        #: layer -> the norm after its attention (sandwich, post-sublayer blocks), and its factor [B, S]
        self.post: dict[int, nn.Module] = {}
        self.post_scale: dict[int, Tensor] = {}

    def layer(self, call: LayerQK) -> None:
        """Reduce one layer's pattern block by block into the state (called inside the forward)."""
        st, real = self.state, self.real
        attn, i = call.attn, call.layer
        if call.v is None:
            raise ValueError(
                f"layer {i}: the atlas needs the values of the layer's projection; got LayerQK.v None"
            )
        q4, k4, v = call.q.transpose(1, 2), call.k.transpose(1, 2), call.v.transpose(1, 2)
        # (B, H, S, dh), (B, Hkv, S, dh) x 2
        B, H, S, dh = q4.shape
        masks = RowMasks(
            batch=B, n_heads=H, seq_q=S, seq_k=S, key_padding=call.key_padding, attn_mask=call.attn_mask,
            is_causal=call.is_causal, dtype=torch.float32, device=q4.device, window=call.window,
        )  # fmt: skip
        z = torch.empty(B, H, S, dh, dtype=torch.float32, device=q4.device)  # (B, H, S, dh)
        top_key = torch.zeros(B, H, S, dtype=torch.int64, device=q4.device)  # (B, H, S)
        top_weight = torch.zeros(B, H, S, dtype=torch.float32, device=q4.device)  # (B, H, S)
        # rows: previous, first, self, entropy, duplicate, induction, sink (learned sinks: .sinks)
        sums = torch.zeros(7, H, dtype=torch.float64, device=q4.device)  # (7, H)
        s_h = layer_sinks(attn)
        sink_rows = None if s_h is None else SinkRows(q4, k4, s_h, call.scale)
        for block in iter_pattern_blocks(q4, k4, masks, scale=call.scale):
            idx = block.index  # (n,)
            lo, hi, W = int(idx[0]), int(idx[-1]) + 1, block.width
            w = block.weights  # (B, H, n, W): unnormalised
            rq = real[:, lo:hi]  # (B, n)
            if sink_rows is not None:  # the sink's term joins block.norm; its mass per row is summed
                sums[6] += (sink_rows.apply(block).double() * rq.double()[:, None]).sum((0, 2))
            inv = block.norm.reciprocal()  # (B, H, n): 0 on dead rows
            z[:, :, lo:hi] = _grouped_z(w, v[:, :, :W]) * inv[..., None]
            keys = torch.stack([(idx - 1).clamp(min=0), torch.zeros_like(idx), idx], dim=-1)[
                None
            ]  # (1, n, 3)
            g = block.gather(keys)  # (B, H, n, 3)
            w_rq = rq.to(torch.float64)[:, None]  # (B, 1, n)
            w_later = (rq & (idx >= 1)[None]).to(torch.float64)[:, None]  # (B, 1, n)
            sums[0] += (g[..., 0].double() * w_later).sum((0, 2))
            sums[1] += (g[..., 1].double() * w_later).sum((0, 2))
            sums[2] += (g[..., 2].double() * w_rq).sum((0, 2))
            sums[3] += (block.entropy.double() * w_rq).sum((0, 2))
            heads = torch.arange(H, device=w.device)  # (H,)
            for row, (b, q, off) in zip((4, 5), self.pairs.of(lo, hi, W)):
                at = heads[:, None] + (b * H)[None]  # (H, nnz): head by head, the pairs in memory order
                weight = w.reshape(-1).take(at * ((hi - lo) * W) + off[None])  # (H, nnz)
                sums[row] += (weight.double() * inv.reshape(-1).take(at * (hi - lo) + q[None])).sum(1)
            if W > 1:
                best, arg = w[..., 1:].max(dim=-1)  # (B, H, n): the top key after the first token
                top_weight[:, :, lo:hi] = best * inv
                top_key[:, :, lo:hi] = arg + 1
        top_key[:, :, 0] = 0
        top_weight[:, :, 0] = 0.0
        pos = torch.arange(S, device=real.device)  # (S,)
        ok = real & (pos[None] >= 1)  # (B, S)
        for h, cands in enumerate(_top_candidates(top_weight, ok, self.seq_ids, pos, top_key, st.top_k)):
            st.add_candidates("attention", i, h, cands)
        n_real = int(real.sum())
        n_later = int(ok.sum())
        for name, row, count in zip(
            ("previous", "first", "self", "entropy", "duplicate", "induction", "sink"),
            sums,
            (n_later, n_later, n_real, n_real, n_real, n_real, n_real if s_h is not None else 0),
        ):
            st.add_sum(name, i, row, count)
        st.z_sum[i, :H] += torch.einsum("bhsd,bs->hd", z.double(), real.double()).cpu()
        if self.unembed is not None:
            post = self.post.get(i)
            unembed = self.unembed if post is None else _weighted(post, self.unembed)  # (B, S, d_model)
            self.direct[i] = _layer_direct(z, top_key, unembed, attn.o_weight)
            self.top_key[i] = top_key


def _layer_direct(z: Tensor, top_key: Tensor, unembed: Tensor, o_weight: Tensor) -> tuple[Tensor, Tensor]:
    """One layer's direct effects before the final norm's factor ``c``: (next token, top key's token),
    float32 [B, S, H] each (the next-token one is 0 in the last column).

    z [B, H, S, dh], top_key [B, H, S], ``unembed`` [B, S, d_model] (see :class:`BatchMeasure`),
    ``o_weight`` [d_model, H dh]: ``z_i . (W_O[h] unembed_j)`` at ``j = i + 1`` and ``j = j*_i``."""
    B, H, S, dh = z.shape
    y = (unembed.reshape(B * S, -1) @ o_weight.to(unembed.dtype)).view(B, S, H, dh)  # (B, S, H, dh)
    zt = z.transpose(1, 2)  # (B, S, H, dh)
    de = torch.zeros(B, S, H, dtype=torch.float32, device=z.device)  # (B, S, H)
    de[:, :-1] = (zt[:, :-1] * y[:, 1:]).sum(-1)  # (not einsum: it runs as [B S H] 1 x 1 products)
    at = top_key.transpose(1, 2)  # (B, S, H)
    yk = y.gather(1, at[..., None].expand(B, S, H, dh))  # (B, S, H, dh): y at each head's top key
    cp = (zt * yk).sum(-1)  # (B, S, H)
    return de, cp


def _weighted(norm: nn.Module | None, u: Tensor) -> Tensor:
    """``center(w * u)`` for rows ``u`` [..., d_model] read back through ``norm`` (weight ``w``;
    ``center`` subtracts the mean for a LayerNorm, nothing for an RMSNorm)."""
    w, _ = norm_split(norm, u[:1, :1])
    u = u * w
    if isinstance(norm, nn.LayerNorm):
        u = u - u.mean(dim=-1, keepdim=True)
    return u


def _unembed_rows(module: nn.Module, tokens: Tensor) -> Tensor:
    """``center(w * W_U[:, t_j])`` [B, S, d_model] float32 at every position (see :class:`BatchMeasure`)."""
    return _weighted(module.ln_final, module.W_U.T[tokens].float())  # (B, S, d_model)


def _direct_effects(m: BatchMeasure, final: Tensor) -> None:
    """``direct_effect`` and ``copying`` of every head from each layer's kept dot products, scaled by the
    final norm's factor at ``final`` [B, S, d_model], the last residual stream (see the module docstring)."""
    st, tok, real = m.state, m.tokens, m.real
    S = tok.shape[1]
    _, c = norm_split(m.norm, final)  # (B, S)
    c = c.double()[..., None]  # (B, S, 1)
    has_next = torch.zeros_like(real)
    has_next[:, :-1] = real[:, :-1] & real[:, 1:]  # (B, S)
    pos = torch.arange(S, device=tok.device)
    for i in sorted(m.direct):
        de_raw, cp_raw = m.direct.pop(i)  # (B, S, H) x 2
        ci = c if i not in m.post_scale else c * m.post_scale.pop(i).double()[..., None]  # (B, S, 1)
        de, cp = de_raw.double() * ci, cp_raw.double() * ci  # (B, S, H) x 2
        key = m.top_key.pop(i)  # (B, H, S)
        st.add_sum("direct_effect", i, (de * has_next[..., None]).sum((0, 1)), int(has_next.sum()))
        st.add_sum("copying", i, (cp * real[..., None]).sum((0, 1)), int(real.sum()))
        found = _top_candidates(
            de.abs().permute(0, 2, 1).float(), has_next, m.seq_ids, pos, key, st.top_k,
            signed=de.permute(0, 2, 1).float(),
        )  # fmt: skip
        for h, cands in enumerate(found):
            st.add_candidates("direct_effect", i, h, cands)


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
    ``state``: every statistic of the module docstring, one forward pass (decoders: without the logits)."""
    # a post-layout decoder (OPT-350m): each residual add's norm rescales the whole stream, no direct path
    decoder = is_decoder(module) and all(block.spec.layout != "post" for block in module.blocks)
    kp = None if bool(real.all()) else real
    if not decoder:
        m = BatchMeasure(state, tokens, real, seq_ids)
        each_layer_qk(model, lambda: module(tokens, kp), m.layer, stop_early=True)
    else:
        m = BatchMeasure(state, tokens, real, seq_ids, _unembed_rows(module, tokens), module.ln_final)
        final: list[Tensor] = []  # the final norm's input, as hook_resid_final sees it
        removers: list[Callable[[], None]] = []
        if module.ln_final is not None:
            removers.append(module.hook_resid_final.add(lambda v, _hp: final.append(v)))
        for i, block in enumerate(module.blocks):
            post = post_attention_norm(block)
            if post is not None:  # its factor at the layer's output, kept as [B, S] (not the output)
                m.post[i] = post

                def scale(norm: nn.Module, args: tuple[Any, ...], _kw: Any, i: int = i) -> None:
                    m.post_scale[i] = norm_split(norm, args[0])[1]  # (B, S)

                # no hook point holds the attention's output before this norm (hook_attn_out is after
                # it): the norm's call input, through the hook machinery's on_call
                removers.append(on_call(post, scale))
        try:
            out = []
            each_layer_qk(
                model, lambda: out.append(module.hidden_states(tokens, kp)), m.layer, stop_early=False
            )
        finally:
            for remove in removers:
                remove()
        _direct_effects(m, final[-1] if final else out[0])
    state.n_queries += int(real.sum())
    state.n_tokens += int(real.sum())
    state.n_sequences += int(tokens.shape[0])
