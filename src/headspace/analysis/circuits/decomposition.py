"""Why a head attends where it does, and how heads compose in weight space.

**Score decomposition** (:func:`score_decomposition`). The residual stream entering block ``l`` is a sum
of parts, ``x = e + sum_{l' < l} (sum_h r_{l',h} + m_{l'}) + biases``: the embeddings ``e``
(``hook_embed``), each earlier head's output ``r = z_h W_O[h]`` (``hook_result``), each earlier MLP's output
``m`` (``hook_mlp_out``) and the constant terms (``b_O``, the norms' shifts ``beta``). Every norm the stream
passed through (post-LN: the blocks' LN1 and LN2; pre-LN: the block's own LN1) is frozen at its value in
this run, ``norm(x) = c(x) w / sigma + beta``, so it is linear and sends each part through alone (``c``
subtracts the mean for a LayerNorm, the identity for RMSNorm); ``beta`` joins the ``"bias"`` part. With
``u_a`` the parts of the query input at position ``i`` and ``v_b`` those of the key input at ``j``::

    score(i, j) = scale * [sum_a u_a, 1] Q(i - j) [sum_b v_b, 1]^T
                = sum_{a, b} scale * [u_a, [a = bias]] Q(i - j) [v_b, [b = bias]]^T = sum_{a, b} parts[a, b]

with ``Q(delta) = head.qk(delta, augmented=True).AB`` (:meth:`headspace.Head.qk`: ``W_Q R(delta) W_K^T``
with the rotary rotation of the offset, the q/k biases in the augmented row). With QK-norm (Qwen3, Gemma
3, OLMo 2) ``Q`` has the norms' gains folded in and every part is multiplied by the run's frozen norm
scales of the query and the key (:meth:`MultiHeadAttention.qk_norm_scales`). The ``parts`` add up to the
traced ``hook_scores`` value (up to float rounding; the decomposition itself is computed in float64).
With ALiBi (BLOOM, MPT, Falcon) the head's bias ``-m_h (i - j)`` (:meth:`headspace.Head.alibi_bias`)
depends on the positions alone: it joins the ``("bias", "bias")`` part.

**Composition scores** (:func:`composition_scores`; Elhage et al. 2021, "A Mathematical Framework for
Transformer Circuits"). How much an earlier head ``s``'s OV circuit ``W_OV^s = W_V^s W_O^s`` feeds a later
head ``t``'s query, key or value::

    Q:  ||W_OV^s W_QK^t||_F   / (||W_OV^s||_F ||W_QK^t||_F)        W_QK^t = W_Q^t R(delta) W_K^t^T
    K:  ||W_OV^s W_QK^t^T||_F / (||W_OV^s||_F ||W_QK^t||_F)
    V:  ||W_OV^s W_OV^t||_F   / (||W_OV^s||_F ||W_OV^t||_F)

as TransformerLens's ``all_composition_scores`` computes them (right multiplication: the product is what
``s``'s output becomes once read by ``t``). ``fold_norms=True`` folds the reading block's LN1 weight into
``t``'s reading matrices and, for LayerNorm models, centres ``s``'s writing weights, as TransformerLens's
``fold_ln`` / ``center_writing_weights`` do. The baseline is the mean score of independent Gaussian
matrices with the same factored shapes (a score near it says "no more composition than chance").

Norms inside a head's circuits enter by their gains, always: QK-norm's (Qwen3, Gemma 3, OLMo 2) scale
``W_Q`` and ``W_K``'s columns, and a post-attention norm (Gemma's sandwich ``ln_attn_out``, OLMo 2's
post-sublayer norm) scales ``W_O``'s. What these norms also do, divide by an RMS of the run, multiplies
a whole head's q, k (or a layer's output) by one number per token, which the scores' ratios cancel:
the scores are those of the circuits at any frozen norm scales.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ...attention.delta_net import refuse_linear_attention, refuse_linear_attention_model
from ...core.checks import is_int
from .._common import JsonResult, eval_mode
from ..causal.causal_inputs import (
    centered,
    frozen_norm,
    is_decoder,
    post_attention_norm,
    prompts_of,
    stack_of,
    token_str,
)
from ..trace.trace import trace
from .latent_scores import latent_score_parts

__all__ = ["CompositionScores", "ScoreDecomposition", "composition_scores", "score_decomposition"]


@dataclass
class ScoreDecomposition(JsonResult):
    """One pre-softmax score of one head split over (query-side part) x (key-side part).

    ``parts`` [n_components, n_components]: ``parts[a, b]`` is query-side component ``a`` times key-side
    component ``b``; ``components[a]`` names them: ``"embed"``, ``"L{l}H{h}"`` (an earlier head's
    ``hook_result``), ``"mlp{l}"`` (an earlier MLP's output), ``"bias"`` (every constant term: ``b_O``, the
    norms' shifts, ``b_Q``/``b_K``). ``score`` is the traced ``hook_scores[0, head, query, key]``; ``total``
    is ``parts.sum()``, equal to ``score`` up to float rounding. ``query_side`` / ``key_side``
    [n_components] are the row and column sums; ``pattern`` the head's attention weight on the key.
    """

    kind = "score_decomposition"

    parts: Tensor
    components: list[str]
    score: float
    total: float
    query_side: Tensor
    key_side: Tensor
    layer: int
    head: int
    query: int
    key: int
    pattern: float
    tokens: list[str]

    def top_pairs(self, k: int = 5) -> list[tuple[str, str, float]]:
        """The ``k`` largest ``|parts[a, b]|``: ``[(query component, key component, value), ...]``."""
        flat = self.parts.flatten()
        order = flat.abs().argsort(descending=True)[:k]
        n = self.parts.shape[1]
        return [(self.components[int(i) // n], self.components[int(i) % n], float(flat[i])) for i in order]


def _check_index(name: str, value: Any, size: int, what: str) -> int:
    if not is_int(value):
        raise TypeError(f"{name} must be an int ({what}); got {type(value).__name__} {value!r}")
    if not -size <= value < size:
        raise ValueError(f"{name} must be in [-{size}, {size}) ({what}); got {value}")
    return int(value) % size


def _hook_names(layer: int) -> list[str]:
    names = ["hook_embed", "blocks.*.attn.hook_result", "blocks.*.attn.hook_z", "blocks.*.hook_mlp_out"]
    names += ["blocks.*.hook_resid_pre", "blocks.*.hook_attn_out", "blocks.*.hook_resid_mid"]
    names += [f"blocks.{layer}.attn.hook_q", f"blocks.{layer}.attn.hook_k"]  # QK-norm's scales
    return [*names, f"blocks.{layer}.attn.hook_scores", f"blocks.{layer}.attn.hook_pattern"]


def _freeze(norm: nn.Module, at: Tensor, parts: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """Send ``parts`` [n, seq, d_model] and ``bias`` [seq, d_model] through ``norm`` frozen at ``at``."""
    scale, beta = frozen_norm(norm, at.double())  # (seq, d_model) x 2
    return centered(norm, parts) * scale, centered(norm, bias) * scale + beta


def residual_parts(module: nn.Module, t: Any, layer: int) -> tuple[list[str], Tensor, Tensor]:
    """Block ``layer``'s attention input as parts: (names, parts [n, seq, d_model], bias [seq, d_model]).

    From a trace of one prompt (batch 1) holding :func:`_hook_names`; float64; pre-LN and sandwich: after
    the frozen LN1 of block ``layer``, post-LN and post-sublayer: the block's input itself. A sandwich
    (Gemma) or post-sublayer (OLMo 2) block's heads and ``b_O`` reach the stream through the norm after
    the attention, frozen at the layer's output; its MLP's ``hook_mlp_out`` is taken after its norm.
    ``parts.sum(0) + bias`` is that input.
    """
    names = ["embed"]
    parts = [t["hook_embed"][0].double()]  # (seq, d_model)
    bias = torch.zeros_like(parts[0])
    for i in range(layer):
        block = module.blocks[i]
        kind = getattr(block, "norm", "pre" if block.pre_ln else "post")
        result = t[f"blocks.{i}.attn.hook_result"][0].double()  # (seq, H, d_model): a DeltaNet's heads too
        if hasattr(block.attn, "head_parts"):  # differential: hook_result is per pair; split into heads
            result = block.attn.head_parts(t[f"blocks.{i}.attn.hook_z"][0].double())  # (seq, H, d_model)
        b_O = getattr(block.attn, "b_O", None)  # a Gated DeltaNet has none
        b_O = torch.zeros_like(bias) if b_O is None else b_O.double().expand_as(bias)
        post = post_attention_norm(block)
        if post is not None:  # h = x + N(a): N frozen at the layer's output a
            scale, beta = frozen_norm(post, result.sum(1) + b_O)  # (seq, d_model) x 2
            result = centered(post, result) * scale[:, None]  # (seq, H, d_model)
            b_O = centered(post, b_O) * scale + beta  # (seq, d_model)
        names += [f"L{i}H{h}" for h in range(result.shape[1])]
        parts += list(result.unbind(1))
        bias = bias + b_O
        if kind == "post":  # h = LN1(x + a)
            at = t[f"blocks.{i}.hook_resid_pre"][0] + t[f"blocks.{i}.hook_attn_out"][0]
            stack, bias = _freeze(block.ln1, at, torch.stack(parts), bias)
            parts = list(stack.unbind(0))
        names.append(f"mlp{i}")
        parts.append(t[f"blocks.{i}.hook_mlp_out"][0].double())
        if kind == "post":  # out = LN2(h + m)
            at = t[f"blocks.{i}.hook_resid_mid"][0] + t[f"blocks.{i}.hook_mlp_out"][0]
            stack, bias = _freeze(block.ln2, at, torch.stack(parts), bias)
            parts = list(stack.unbind(0))
    stack = torch.stack(parts)  # (n, seq, d_model)
    block = module.blocks[layer]
    if block.pre_ln or getattr(block, "norm", None) in ("sandwich", "parallel"):  # heads read LN1(x)
        stack, bias = _freeze(block.ln1, t[f"blocks.{layer}.hook_resid_pre"][0], stack, bias)
    return names, stack, bias


def _augmented_rows(stack: Tensor, bias: Tensor, pos: int) -> Tensor:
    """Rows ``[part, 0]`` per part, then ``[bias, 1]``, at position ``pos`` -> [n + 1, d_model + 1]."""
    rows = torch.cat((stack[:, pos], bias[pos][None]), dim=0)  # (n + 1, d_model)
    ones = torch.zeros(rows.shape[0], 1, dtype=rows.dtype)
    ones[-1] = 1.0
    return torch.cat((rows, ones), dim=1)  # (n + 1, d_model + 1)


@torch.no_grad()
def score_decomposition(
    model: Any, prompt: Any, layer: int, head: int, query: int = -1, key: int | None = None
) -> ScoreDecomposition:
    """Split head ``head`` of layer ``layer``'s score of ``query`` on ``key`` over pairs of parts.

    See the module docstring for the formula. Exact: ``parts.sum() == score`` to float rounding. On a
    hybrid (Qwen3-Next, Qwen3.5) the earlier Gated DeltaNet layers' heads are parts like any head (their
    ``hook_result``); a Gated DeltaNet ``layer`` itself has no score and is refused by name.

    Args:
        model: a loaded model (``headspace.load(...)``) or a bare Encoder/Decoder (then ``prompt`` is ids).
        prompt: one text, or int64 ids [seq] / [1, seq].
        layer, head: the head (negative indices count from the end).
        query: the query position (default the last token).
        key: the key position; None: the key the head attends to most from ``query``.

    Returns:
        :class:`ScoreDecomposition` with ``parts`` [n_components, n_components], ``n_components =
        1 + layer * (n_heads + 1) + 1`` (embed, each earlier layer's heads and MLP, bias).
    """
    module = stack_of(model, "score_decomposition")
    p = prompts_of(model, prompt)
    if p.batch != 1:
        raise ValueError(f"score_decomposition takes one prompt; got {p.batch}")
    seq = int(p.last[0]) + 1
    tokens = p.tokens[:, :seq]  # (1, seq)
    layer = _check_index("layer", layer, len(module.blocks), "an attention layer")
    attn = module.blocks[layer].attn
    refuse_linear_attention(attn, f"score_decomposition (why) of layer {layer}")  # a hybrid's DeltaNet
    head = _check_index("head", head, attn.n_heads, f"a head of layer {layer}")
    i = _check_index("query", query, seq, "a position of the prompt")
    source = getattr(getattr(attn, "spec", None), "kv_source", None)
    if source is not None:  # its keys are layer `source`'s, made from that layer's residual stream
        raise ValueError(
            f"score_decomposition: layer {layer} has no keys of its own (attention field kv_source={source}: "
            f"it reads layer {source}'s keys and values); its scores are not split over its residual parts"
        )
    with eval_mode(module), trace(module, names=_hook_names(layer)) as t:
        module(tokens)
    pattern = t[f"blocks.{layer}.attn.hook_pattern"][0, head, i]  # (seq,)
    j = int(pattern.argmax()) if key is None else _check_index("key", key, seq, "a position of the prompt")
    if is_decoder(module) and j > i:
        raise ValueError(f"key must be at or before the query ({i}) in a causal model; got {j}")
    names, stack, bias = residual_parts(module, t, layer)
    rows_i, rows_j = _augmented_rows(stack, bias, i), _augmented_rows(stack, bias, j)  # (n + 1, d + 1) x 2
    if getattr(attn, "latent", None) is not None:  # MLA: at the run's frozen latent-norm scales
        parts = latent_score_parts(attn, head, rows_i, rows_j, (stack.sum(0) + bias)[None], i, j)
    else:
        qk = attn.heads[head].qk(i - j, augmented=True)  # (d_model + 1, dh), (dh, d_model + 1)
        parts = (rows_i @ qk.A.double()) @ (qk.B.double() @ rows_j.T) * attn.scale  # (n + 1, n + 1)
    if (
        getattr(attn.heads[head], "alibi_slope", None) is not None
    ):  # ALiBi's -m_h (i - j): a constant, in bias x bias
        parts[-1, -1] += float(attn.heads[head].alibi_bias(i - j))
    if getattr(attn, "qk_norm", None) is not None:  # at this run's frozen norm scales (see Head.qk)
        s_q, s_k = attn.qk_norm_scales(t[f"blocks.{layer}.attn.hook_q"], t[f"blocks.{layer}.attn.hook_k"])
        parts = parts * float(s_q[0, i, head]) * float(s_k[0, j, attn.heads[head].kv_index])
    texts = [token_str(model, int(x)) for x in tokens[0]]
    score = float(t[f"blocks.{layer}.attn.hook_scores"][0, head, i, j])
    return ScoreDecomposition(
        parts=parts, components=[*names, "bias"], score=score,
        total=float(parts.sum()), query_side=parts.sum(1), key_side=parts.sum(0), layer=layer, head=head,
        query=i, key=j, pattern=float(pattern[j]), tokens=texts,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------ composition
@dataclass
class CompositionScores(JsonResult):
    """Q-, K- and V-composition of every earlier head into every later head.

    Shapes: ``q``, ``k`` [n_offsets, n_layers, n_heads, n_layers, n_heads] (one slice per rotary offset in
    ``offsets``; a head without rotary positions has the same value at every offset); ``v`` [n_layers,
    n_heads, n_layers, n_heads]. ``[.., ls, hs, lt, ht]`` is sender head ``(ls, hs)`` into receiver
    ``(lt, ht)``; 0 where ``ls >= lt`` (only earlier heads compose), NaN for a pruned head.
    ``baseline``: ``{"q", "k", "v"}`` -> the mean score of random Gaussian matrices of the same shapes.
    """

    kind = "composition_scores"

    q: Tensor
    k: Tensor
    v: Tensor
    offsets: list[int]
    baseline: dict[str, float]
    fold_norms: bool

    def top(self, mode: str = "k", n: int = 10, offset: int = 0) -> list[tuple[str, str, float]]:
        """The ``n`` largest scores of ``mode``: ``[("L1H4", "L3H0", score), ...]`` (sender, receiver)."""
        if mode not in ("q", "k", "v"):
            raise ValueError(f"mode must be 'q', 'k' or 'v'; got {mode!r}")
        s = getattr(self, mode)
        s = s[self.offsets.index(offset)] if mode != "v" else s
        flat = torch.nan_to_num(s, nan=0.0).flatten()
        L, H = s.shape[0], s.shape[1]
        out = []
        for idx in flat.argsort(descending=True)[:n].tolist():
            ls, rest = divmod(idx, H * L * H)
            hs, rest = divmod(rest, L * H)
            lt, ht = divmod(rest, H)
            out.append((f"L{ls}H{hs}", f"L{lt}H{ht}", float(flat[idx])))
        return out


def _rfactor(W: Tensor) -> Tensor:
    """``R`` with ``||W X||_F == ||R X||_F`` for any ``X``: the triangle of a thin QR of ``W`` [.., m, r]."""
    return torch.linalg.qr(W, mode="r")[1]  # (.., r, r)


def _layer_circuits(module: nn.Module, fold_norms: bool, offsets: Sequence[int]) -> list[dict[str, Tensor]]:
    """Per layer, float64: writer ``W_V``, ``W_O`` and reader ``W_Q R(delta)`` [n_off, H, d, dh], ``W_K``."""
    out = []
    for block in module.blocks:
        attn = block.attn
        W_Q, W_V, W_O = attn.W_Q.double(), attn.W_V.double(), attn.W_O.double()  # (H|Hkv, d, dh), (H, dh, d)
        W_K = attn.W_K.double()  # (Hkv, d, dh)
        gains = attn.qk_norm_gains() if hasattr(attn, "qk_norm_gains") else None
        if gains is not None:  # QK-norm: q and k scaled by their gains (their RMS: a scalar, cancels)
            W_Q, W_K = W_Q * gains[0].double()[:, None, :], W_K * gains[1].double()[:, None, :]
        g = attn.n_heads // attn.n_kv_heads
        W_K, W_V = W_K.repeat_interleave(g, 0), W_V.repeat_interleave(g, 0)  # (H, d, dh) x 2
        reads_ln1 = getattr(block, "norm", None) in ("pre", "sandwich", "parallel")  # heads read ln1(x)
        if fold_norms and reads_ln1 and getattr(block.ln1, "weight", None) is not None:  # not Identity
            w = block.ln1.weight.double() + getattr(block.ln1, "offset", 0.0)  # (d,)
            W_Q, W_K, W_V = W_Q * w[:, None], W_K * w[:, None], W_V * w[:, None]
        after = post_attention_norm(block)
        if after is not None and getattr(after, "weight", None) is not None:
            # the writer passes the post-attention norm (Gemma's ln_attn_out, OLMo 2's ln1): its gain
            W_O = W_O * (after.weight.double() + getattr(after, "offset", 0.0))  # (H, dh, d)
        if fold_norms and isinstance(block.ln1, nn.LayerNorm):
            W_O = W_O - W_O.mean(-1, keepdim=True)  # centred writing weights: LN removes the mean
        if attn.rotary is not None:
            R = attn.rotary.rotation(torch.tensor(list(offsets)), dtype=torch.float64)  # (n_off, dh, dh)
            W_Qr = torch.einsum("hdk,okj->ohdj", W_Q, R)  # (n_off, H, d, dh)
        else:
            W_Qr = W_Q.expand(len(offsets), *W_Q.shape)  # (n_off, H, d, dh)
        out.append({"W_Q": W_Qr, "W_K": W_K, "W_V": W_V, "W_O": W_O})
    return out


def _fro_of_products(P: Tensor, Qm: Tensor) -> Tensor:
    """``||P_s Q_t||_F`` for every pair: P [S, r, d], Qm [..., T, d, r'] -> [..., S, T]."""
    prod = torch.einsum("srd,...tdk->...strk", P, Qm)  # (..., S, T, r, r')
    return prod.pow(2).sum((-1, -2)).sqrt()


def _random_baseline(d_model: int, d_head: int, samples: int, seed: int) -> float:
    """Mean ``||A1 B1 A2 B2|| / (||A1 B1|| ||A2 B2||)``, Gaussian A [d_model, d_head], B [d_head, d_model]."""
    g = torch.Generator().manual_seed(seed)
    scores = []
    for _ in range(samples):
        A1, A2 = (torch.randn(d_model, d_head, generator=g, dtype=torch.float64) for _ in range(2))
        B1, B2 = (torch.randn(d_head, d_model, generator=g, dtype=torch.float64) for _ in range(2))
        M1, M2 = A1 @ B1, A2 @ B2  # (d_model, d_model) x 2
        scores.append(float(torch.linalg.norm(M1 @ M2) / (torch.linalg.norm(M1) * torch.linalg.norm(M2))))
    return sum(scores) / len(scores)


@torch.no_grad()
def composition_scores(
    model: Any, *, offsets: Sequence[int] = (0,), fold_norms: bool = True, baseline_samples: int = 8
) -> CompositionScores:
    """Q-, K- and V-composition scores of every head pair (see the module docstring).

    Norms go through the factors: with ``W = QR`` thin factorisations, ``||W_V (W_O M) W_K^T||_F =
    ||R_V (W_O M) R_K^T||_F``, so each pair costs one [d_head, d_model] x [d_model, d_head] product.
    Exact (float64) up to rounding.

    Args:
        model: a loaded model or an Encoder/Decoder (self-attention with kdim == vdim == d_model).
        offsets: query-minus-key offsets at which rotary heads' QK circuits are taken (``qk(delta)``).
        fold_norms: fold LN1's weight into the readers and centre LayerNorm models' writers.
        baseline_samples: Gaussian samples for the random-matrix baseline.

    Returns:
        :class:`CompositionScores`.
    """
    module = stack_of(model, "composition_scores")
    refuse_linear_attention_model(module, "composition_scores")
    if isinstance(offsets, (str, bytes)) or not isinstance(offsets, Sequence) or not offsets:
        raise TypeError(f"offsets must be a non-empty sequence of ints; got {offsets!r}")
    if not all(is_int(o) for o in offsets):
        raise TypeError(f"offsets must be ints (query position minus key position); got {list(offsets)}")
    if not is_int(baseline_samples) or baseline_samples < 1:
        raise ValueError(f"baseline_samples must be a positive int; got {baseline_samples!r}")
    layers = _layer_circuits(module, bool(fold_norms), offsets)
    L, H = len(layers), max(c["W_O"].shape[0] for c in layers)
    n_off = len(offsets)
    nan = float("nan")
    q = torch.full((n_off, L, H, L, H), nan, dtype=torch.float64)
    k = torch.full_like(q, nan)
    v = torch.full((L, H, L, H), nan, dtype=torch.float64)
    # writers: P = R_V W_O [H, dh, d] with ||W_V W_O X|| = ||P X||; ||W_OV|| = ||P||
    P = [_rfactor(c["W_V"]) @ c["W_O"] for c in layers]  # (H, dh, d) each
    ov_norm = [p.pow(2).sum((-1, -2)).sqrt() for p in P]  # (H,)
    for lt, c in enumerate(layers):
        RK, RQ = _rfactor(c["W_K"]), _rfactor(c["W_Q"])  # (H, dh, dh), (n_off, H, dh, dh)
        read_q = c["W_Q"] @ RK.transpose(-1, -2)  # (n_off, H, d, dh): ||X W_Q R W_K^T|| = ||X read_q||
        read_k = c["W_K"] @ RQ.transpose(-1, -2)  # (n_off, H, d, dh): ||X W_K R^T W_Q^T||
        qk_norm = (RQ @ RK.transpose(-1, -2)).pow(2).sum((-1, -2)).sqrt()  # (n_off, H)
        Ht = read_q.shape[1]
        # V: ||W_OV^s W_V^t W_O^t|| = ||P_s W_V^t R_O^T|| with R_O the QR triangle of W_O^t^T
        read_ov = (c["W_V"] @ _rfactor(c["W_O"].transpose(-1, -2)).transpose(-1, -2))[None]  # (1, H, d, dh)
        for ls in range(lt):
            Hs = P[ls].shape[0]
            denom_qk = ov_norm[ls][None, :, None] * qk_norm[:, None, :]  # (n_off, Hs, Ht)
            q[:, ls, :Hs, lt, :Ht] = _fro_of_products(P[ls], read_q) / denom_qk
            k[:, ls, :Hs, lt, :Ht] = _fro_of_products(P[ls], read_k) / denom_qk
            denom_v = ov_norm[ls][:, None] * ov_norm[lt][None]  # (Hs, Ht)
            v[ls, :Hs, lt, :Ht] = _fro_of_products(P[ls], read_ov)[0] / denom_v
        for ls in range(lt, L):
            q[:, ls, :, lt], k[:, ls, :, lt], v[ls, :, lt] = 0.0, 0.0, 0.0
    attn0 = module.blocks[0].attn
    base = _random_baseline(attn0.d_model, attn0.d_head, baseline_samples, seed=0)
    return CompositionScores(
        q=q, k=k, v=v, offsets=[int(o) for o in offsets], baseline={"q": base, "k": base, "v": base},
        fold_norms=bool(fold_norms),
    )  # fmt: skip
