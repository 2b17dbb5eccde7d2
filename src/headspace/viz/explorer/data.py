"""The explorer's data: one traced forward pass of a real model, packed for the page.

What the page stores, per attention layer (``seq`` = the sentence's tokens)::

    q                [seq, n_heads, d_head]       hook_q: each token's query, per head
    k, v             [seq, n_kv_heads, d_head]    hook_k, hook_v
                     (rotary layers: q and k after the rotation, hook_rot_q and hook_rot_k; "rotary" true)
    W_O              [n_heads, d_head, d_model]   out = sum_h z_h W_O[h] + b_O
    b_O              [d_model] or null
    scale, mask      the scores' scale and mask ("none", "causal", "window": causal within the last
                     ``window`` keys, i - window < j <= i, as a sliding-window layer, "band": the keys
                     |i - j| < window on both sides, as ModernBERT's local layers, or "chunk": the keys
                     j <= i of query i's chunk, j // window == i // window, as Llama 4's chunked layers)
    window           the window of a "window" or "band" mask (the model's sliding window), the chunk
                     size of a "chunk" mask, else null
    alibi            ALiBi's slopes [n_heads] (BLOOM, MPT, Falcon): -alibi[h] * (i - j) joins each score;
                     null without ALiBi
    shares           [seq, n_heads]               ||z_h W_O[h]|| / sum_h' ||z_h' W_O[h']|| per token
    wo_norms         [n_heads]                    ||W_O[h]||_F, no input needed
    overlap          {"W_Q", "W_K", "W_V", "W_O"} [heads, heads]: mean squared cosine of the principal
                     angles between two heads' subspaces, with the random baseline d_head / d_model

for a gated layer, its output gate (``gate``, ``gate_mean``, ``gate_kind``, ``gate_label``: :mod:`.gates`);
for a differential layer, ``differential`` and ``diff_maps`` (:mod:`.differential`);

and, for the whole page, ``initial`` {"layer", "head", "token"}: where it opens, and ``results``: the
saved patching / attribution results it shows as heatmaps (a list of views, plain JSON numbers; see
:mod:`headspace.viz.explorer.results`; empty without results).

The page computes the rest in the browser from these: ``scores = q k^T * scale`` (plus ALiBi's
bias, masked),
``pattern = softmax(scores)``, ``z = pattern v``, the concatenation of the heads and
``out = concat(z) W_O + b_O``. Nothing is approximated by that: :func:`capture_layers` checks that the
traced scores are exactly ``q k^T * scale`` under the stated mask before the page is built, and the
browser test holds the page's numbers against the trace.

Arrays travel as ``{"dtype", "shape", "data"}`` with ``data`` the base64 of the little-endian bytes
(float32, or float16 for long inputs to keep the file small; the page says which). A W_O whose float32
values lie exactly on a 4-bit grid per block of 32 (a model loaded from a Q4_1 GGUF file, such as
the packaged SmolLM2) travels as those codes instead (``"dtype": "grid4"``, :mod:`.codec`), 5 or 6 bits a
weight and rebuilt bit for bit, at any ``precision``: W_O is most of the page (SmolLM2: 30 layers of
9 x 64 x 576 weights, 53 of the 55 MB as float32 at 14 tokens; 8.3 MB as codes). A large page stores
the arrays' bytes as one deflated block instead of base64 when it is rendered (:mod:`.blob`).
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ...analysis import overlap_matrix, random_overlap, shares_from_result
from ...analysis.trace.trace import attention_layers, trace
from ...attention.layer import MultiHeadAttention
from ...attention.walkable import refuse_unwalked
from ...nn.alibi import alibi_bias
from .codec import decode_grid, encode_grid
from .differential import DIFF_HOOK, diff_fields, traced_diff
from .gates import GATE_HOOK, gate_fields, traced_gate

#: Format tag written into every page, bumped when the data layout changes.
FORMAT = "headspace-explorer/3"
#: ``precision="auto"`` stores float32 up to this many tokens and float16 above.
AUTO_FLOAT32_MAX_TOKENS = 128
PRECISIONS = ("auto", "float32", "float16")
#: The hook points of an attention layer the explorer reads, with the shapes they carry (batch 1).
_HOOKS = ("hook_q", "hook_k", "hook_v", "hook_scores", "hook_pattern", "hook_z", "hook_result")
#: Rotary layers also have these: q and k after the rotation, the ones the scores are made of.
_ROTARY_HOOKS = ("hook_rot_q", "hook_rot_k")
_NORMED_HOOKS = ("hook_q_normed", "hook_k_normed")


@dataclass
class LayerCapture:
    """One attention layer's activations for a single sequence (the batch axis dropped).

    Shapes: ``q``, ``z`` [seq, n_heads, d_head]; ``k``, ``v`` [seq, n_kv_heads, d_head];
    ``scores``, ``pattern`` [n_heads, seq, seq]; ``result`` [seq, n_heads, d_model];
    ``out`` [seq, d_model] (= ``result.sum(1) + b_O``, the attention layer's output).
    """

    name: str
    attn: MultiHeadAttention
    q: Tensor
    k: Tensor
    v: Tensor
    scores: Tensor
    pattern: Tensor
    z: Tensor
    result: Tensor
    out: Tensor
    mask: str
    gate: Tensor | None = None  # [seq, n_heads, width]: a gated layer's output gate (.gates)
    diff: Tensor | None = None  # [n_pairs, seq, seq]: a differential layer's pair maps (.differential)
    #: the window of a "window" mask (i - window < j <= i), or of a "band" mask (|i - j| < window),
    #: or the chunk of a "chunk" mask (j <= i, j // window == i // window)
    window: int | None = None
    #: ALiBi's slopes [n_heads] (-alibi[h] * (i - j) joins the scores), else None
    alibi: list[float] | None = None


def _mask_kind(name: str, scores: Tensor) -> tuple[str, int | None]:
    """(``"none"``, None) if every score is finite, (``"causal"``, None) if exactly the causal triangle
    is, (``"window"``, w) if exactly the keys ``i - w < j <= i`` are (a sliding window), (``"band"``, b)
    if exactly the keys ``|i - j| < b`` are (a window on both sides), (``"chunk"``, c) if exactly the keys
    ``j <= i`` with ``j // c == i // c`` are (chunked attention); else refuse."""
    finite = torch.isfinite(scores)  # (H, Sq, Sk)
    if bool(finite.all()):
        return "none", None
    seq_q, seq_k = scores.shape[-2:]
    ones = torch.ones(seq_q, seq_k, dtype=torch.bool, device=scores.device)  # (Sq, Sk)
    tri = ones.tril(seq_k - seq_q)  # (Sq, Sk)
    if bool((finite == tri).all()):
        return "causal", None
    w = int(finite.sum(-1).max())  # the widest row: the window
    if bool((finite == (tri & ~ones.tril(seq_k - seq_q - w))).all()):
        return "window", w
    i = torch.arange(seq_q, device=scores.device)[:, None]  # (Sq, 1)
    j = torch.arange(seq_k, device=scores.device)[None, :]  # (1, Sk)
    if seq_q == seq_k and bool((finite == (tri & (i // w == j // w))).all()):
        return "chunk", w  # Llama 4's chunks of w: the keys j <= i of query i's chunk
    b = int(finite[0, 0].sum())  # both sides (ModernBERT's local layers): row 0 keeps the keys j < b
    if seq_q == seq_k and bool((finite == (ones.tril(b - 1) & ~ones.tril(-b))).all()):
        return "band", b
    raise ValueError(
        f"the explorer draws unmasked, causal or sliding-window self-attention; layer {name!r} masks "
        "another set of keys (padding or a custom mask): pass a single unpadded sequence"
    )


def capture_layers(model: nn.Module, run: Callable[[], Any]) -> list[LayerCapture]:
    """Run ``run()`` (a forward pass of ``model`` on one sequence) under :func:`headspace.trace`, recording
    every attention layer's ``hook_q`` ... ``hook_result``.

    Each layer must run exactly once, as self-attention on a batch of one; its scores must be
    ``q k^T * scale`` under no mask or the causal mask (what the page recomputes).
    """
    layers = attention_layers(model)
    if not layers:
        raise ValueError(f"model has no headspace MultiHeadAttention layer to show ({type(model).__name__})")
    for name, attn in layers:  # a field the page's recomputation does not follow, by name, first
        refuse_unwalked(attn, f"the explorer page of layer {name!r}", ("latent", "temperature", "kv_source"))
    wanted = set(_HOOKS + _ROTARY_HOOKS + _NORMED_HOOKS + (GATE_HOOK, DIFF_HOOK))
    with torch.no_grad(), trace(model, lambda name: name.rsplit(".", 1)[-1] in wanted) as t:
        run()
    captures = []
    for i, (name, attn) in enumerate(layers):
        rec = t.layer(i)
        missing = [k for k in _HOOKS if k.removeprefix("hook_") not in rec]
        if missing:
            raise ValueError(
                f"attention layer {name!r} did not run during the forward pass (no {missing[0]} value)"
            )
        runs = max(t.calls.get(t.full_name(h, i), 0) for h in _HOOKS)
        if runs > 1:
            raise ValueError(
                f"layer {name!r} ran {runs} times in one forward pass; the explorer shows one pass"
            )
        q = rec["q"]
        if q.shape[0] != 1:
            raise ValueError(f"the explorer shows one sequence; the forward pass had batch={q.shape[0]}")
        if rec["k"].shape[1] != q.shape[1]:
            raise ValueError(
                f"the explorer shows self-attention; layer {name!r} had {q.shape[1]} queries and "
                f"{rec['k'].shape[1]} keys"
            )
        rot_q, rot_k = f"{name}.hook_rot_q", f"{name}.hook_rot_k"
        norm_q, norm_k = f"{name}.hook_q_normed", f"{name}.hook_k_normed"
        if rot_q in t and rot_k in t:  # rotary positions: the scores are q k^T of the rotated q and k
            q, k = t[rot_q], t[rot_k]
        elif norm_q in t and norm_k in t:  # QK-norm without rotary (a NoPE layer): the normed q and k
            q, k = t[norm_q], t[norm_k]
        else:
            k = rec["k"]
        q, k, v = q[0].float(), k[0].float(), rec["v"][0].float()  # (S, H, dh), (S, Hkv, dh) x 2
        scores = rec["scores"][0].float()  # (H, S, S)
        mask, window = _mask_kind(name, scores)
        slopes = getattr(getattr(attn, "spec", None), "alibi_slopes", None)
        alibi = None if slopes is None else [float(m) for m in slopes]
        _check_scores_are_qk(name, attn, q, k, scores, alibi)
        result = rec["result"][0].float()  # (S, H, d_model)
        out = result.sum(dim=1)  # (S, d_model)
        if attn.b_O is not None:
            out = out + attn.b_O.detach().float()
        captures.append(
            LayerCapture(
                name=name,
                attn=attn,
                q=q,
                k=k,
                v=v,
                scores=scores,
                pattern=rec["pattern"][0].float(),  # (H, S, S)
                z=rec["z"][0].float(),  # (S, H, dh)
                result=result,
                out=out,
                mask=mask,
                gate=traced_gate(t, name),
                diff=traced_diff(t, name),
                window=window,
                alibi=alibi,
            )
        )
    return captures


def _check_scores_are_qk(
    name: str,
    attn: MultiHeadAttention,
    q: Tensor,
    k: Tensor,
    scores: Tensor,
    alibi: list[float] | None = None,
) -> None:
    """The page recomputes scores as ``q k^T * scale`` (plus ALiBi's ``-alibi[h] * (i - j)`` where
    ``alibi`` is given); refuse a layer whose scores are something else (an additive float mask, another
    position bias or a softcap would make the page's numbers wrong)."""
    group = q.shape[1] // k.shape[1]
    k_rep = k.repeat_interleave(group, dim=1).transpose(0, 1)  # (H, S, dh)
    recomputed = torch.matmul((q * attn.scale).transpose(0, 1), k_rep.transpose(1, 2))  # (H, S, S)
    if alibi is not None:
        S = q.shape[0]
        recomputed = recomputed + alibi_bias(alibi, S, S, device=q.device)  # (H, S, S)
    diff = (recomputed - scores).abs()  # (H, S, S); inf where masked
    bad = torch.isfinite(scores) & (diff > 1e-4 + 1e-4 * scores.abs())
    if bool(bad.any()):
        worst = diff[bad].max().item()
        raise ValueError(
            f"layer {name!r}'s scores are not q k^T * scale (max difference {worst:.3g}): the explorer "
            "cannot show layers with additive masks or position biases"
        )


def pack(t: Tensor, dtype: str) -> dict[str, Any]:
    """A tensor as ``{"dtype", "shape", "data"}``: base64 of its little-endian bytes."""
    np_dtype = {"float32": "<f4", "float16": "<f2"}[dtype]
    arr = np.ascontiguousarray(t.detach().cpu().double().numpy().astype(np_dtype))
    return {"dtype": dtype, "shape": list(arr.shape), "data": base64.b64encode(arr.tobytes()).decode("ascii")}


def unpack(a: dict[str, Any]) -> np.ndarray:
    """Inverse of :func:`pack` (as float32), and of :func:`~.codec.encode_grid` (``"grid4"``)."""
    if a["dtype"] == "grid4":
        return decode_grid(a)
    np_dtype = {"float32": "<f4", "float16": "<f2"}[a["dtype"]]
    raw = np.frombuffer(base64.b64decode(a["data"]), dtype=np_dtype)
    return raw.reshape(a["shape"]).astype(np.float32)  # (the stored shape)


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run tiny batched LAPACK calls (SVD/QR of [heads, d_model, d_head]) on one intra-op thread.

    They gain nothing from threads, and on a busy machine the thread hand-off made them many times
    slower (docs/benchmarks.md, "Figures formerly in docstrings"). The previous thread count is restored.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _sinks(attn: MultiHeadAttention) -> list[float] | None:
    """The layer's learned sink logits ``s_h`` [n_heads] as floats (the page adds ``exp(s_h)`` to each
    row's softmax, whose key weights then sum to ``1 - sink``), or None for a layer without sinks."""
    sinks = getattr(attn, "sinks", None)
    return None if sinks is None else [float(x) for x in sinks.detach().float().flatten()]


def resolve_precision(precision: str, seq: int) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}; got {precision!r}")
    if precision == "auto":
        return "float32" if seq <= AUTO_FLOAT32_MAX_TOKENS else "float16"
    return precision


def build_page_data(
    captures: Sequence[LayerCapture],
    tokens: Sequence[str],
    *,
    title: str = "headspace explorer",
    model_name: str = "",
    sentence: str = "",
    precision: str = "auto",
    initial: dict[str, int] | None = None,
    results: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """The JSON object the page reads (see the module docstring for every field).

    ``initial`` ({"layer", "head", "token"}) is the selection the page opens on (default: layer 0,
    head 0, token 1); :class:`~headspace.viz.explorer.Explorer` passes the head and token that
    ``headspace explain`` walks by default. ``results`` are the views of saved results
    (:func:`headspace.viz.explorer.results.result_views`), drawn in the page's fifth view.
    """
    if not captures:
        raise ValueError("captures is empty: nothing to show")
    tokens = [str(t) for t in tokens]
    seq = captures[0].q.shape[0]
    if len(tokens) != seq:
        raise ValueError(f"tokens has {len(tokens)} labels but the traced sequence has {seq} positions")
    dtype = resolve_precision(precision, seq)
    start = {"layer": 0, "head": 0, "token": 1 if seq > 1 else 0, **(initial or {})}
    for key, n in (("layer", len(captures)), ("token", seq)):
        if not 0 <= int(start[key]) < n:
            raise ValueError(f"initial {key} {start[key]} is out of range 0..{n - 1}")
    n_heads = captures[int(start["layer"])].attn.n_heads
    if not 0 <= int(start["head"]) < n_heads:
        raise ValueError(f"initial head {start['head']} is out of range 0..{n_heads - 1}")
    layers = []
    for c in captures:
        attn = c.attn
        W_O = attn.W_O.detach().float()  # (H, dh, d_model)
        # head x head overlaps (headspace.analysis): "q" W_Q, "k" W_K, "v" W_V, "o" W_O[h]^T
        with _one_thread():
            overlap = {f"W_{w.upper()}": overlap_matrix(attn, w) for w in ("q", "k", "v", "o")}
        share, _ = shares_from_result(c.result.unsqueeze(0))  # (1, S, H)
        layers.append(
            {
                "name": c.name,
                "n_heads": attn.n_heads,
                "n_kv_heads": attn.n_kv_heads,
                "d_head": attn.d_head,
                "d_model": attn.d_model,
                "scale": attn.scale,
                "mask": c.mask,
                "window": c.window,
                "alibi": c.alibi,
                "rotary": getattr(attn, "hook_rot_q", None) is not None,
                "sinks": _sinks(attn),  # learned sink logits s_h [n_heads] (gpt-oss), else None
                "q": pack(c.q, dtype),
                "k": pack(c.k, dtype),
                "v": pack(c.v, dtype),
                "W_O": encode_grid(W_O) or pack(W_O, dtype),  # 4-bit codes when exact (GGUF weights)
                "b_O": None if attn.b_O is None else pack(attn.b_O.detach().float(), dtype),
                "shares": pack(share[0], "float32"),
                "wo_norms": [float(x) for x in W_O.flatten(1).norm(dim=1)],
                "overlap": {key: pack(m, "float32") for key, m in overlap.items()},
                "overlap_baseline": random_overlap(attn.d_model, attn.d_head, attn.d_head),
                **gate_fields(c.gate, pack, dtype),  # gated layers: the output gate view (.gates)
                # differential layers: the pair maps, lambda, per-head shares (.differential)
                **diff_fields(attn, c.diff, c.pattern, c.result, pack, dtype),
            }
        )
    return {
        "format": FORMAT,
        "title": title,
        "model": model_name,
        "sentence": sentence,
        "tokens": tokens,
        "precision": dtype,
        "initial": {key: int(start[key]) for key in ("layer", "head", "token")},
        "layers": layers,
        "results": list(results),
    }
