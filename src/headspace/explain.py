"""The lesson, executed: one token's journey through one head of a real model.

:func:`explain` runs a sentence through a model once, with the attention layers' hook points recording,
and returns an :class:`Explanation` holding, for one token and one head, every number of the textbook
pipeline::

    x (d_model)  ->  q = x W_Q[h] + b_Q[h],  k_j = x_j W_K[h] + b_K[h],  v_j = x_j W_V[h] + b_V[h]  (d_head)
                 ->  s_j = q . k_j / sqrt(d_head)  ->  p = softmax(s)  ->  z = sum_j p_j v_j  (d_head)
                 ->  concat_h z_h  (n_heads * d_head)  ->  out = concat W_O + b_O  (d_model)

plus how much each head contributes to ``out`` for this token (the share of ``|| z_h W_O[h] ||``), and a
ranking of every (layer, head) by where this token's attention goes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .checks import is_int
from .defaults import DEFAULT_SENTENCE, DEFAULT_TOKEN


@dataclass
class AttendedToken:
    """One key position a query attends to: its index, its token string and its attention weight."""

    index: int
    token: str
    weight: float


@dataclass
class HeadFocus:
    """Where one (layer, head) sends the token's attention.

    ``focus`` is the largest attention weight the token gives to a *content* key (not itself and not a
    special token such as [CLS]/[SEP]); heads are ranked by it. ``top`` lists the top attended keys of any
    kind.
    """

    layer: int
    head: int
    focus: float
    focus_token: str
    top: list[AttendedToken]


@dataclass
class Explanation:
    """Every number of the pipeline for one token and one head (shapes in brackets).

    Attributes:
        tokens: the sentence's tokens [seq]; ``token_index`` is the explained one.
        x: the token's input to the layer's attention [d_model] (the residual stream, after the block's
            LayerNorm in pre-LN models).
        q: ``x W_Q[h] + b_Q[h]`` [d_head]. k, v: every token's key and value [seq, d_head].
        scores: ``q . k_j / sqrt(d_head)`` [seq] (None where masked). pattern: the softmax [seq].
        z: ``sum_j pattern_j v_j`` [d_head]. concat: all heads' z for this token [n_heads * d_head].
        out: the attention layer's output for this token ``concat W_O + b_O`` [d_model].
        head_shares: each head's share of ``sum_h || z_h W_O[h] ||`` for this token [n_heads].
        head_contributions: ``|| z_h W_O[h] ||`` per head [n_heads].
        ranking: every (layer, head), by decreasing focus.
    """

    model: str
    sentence: str
    tokens: list[str]
    token_index: int
    layer: int
    head: int
    kv_head: int
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    scale: float
    x: list[float]
    q: list[float]
    k: list[list[float]]
    v: list[list[float]]
    scores: list[float | None]
    pattern: list[float]
    top: list[AttendedToken]
    z: list[float]
    concat: list[float]
    out: list[float]
    head_contributions: list[float]
    head_shares: list[float]
    ranking: list[HeadFocus] = field(default_factory=list)

    @property
    def token(self) -> str:
        return self.tokens[self.token_index]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["token"] = self.token
        d["shapes"] = {
            "x": [self.d_model],
            "W_Q[h]": [self.d_model, self.d_head],
            "q": [self.d_head],
            "k": [len(self.tokens), self.d_head],
            "v": [len(self.tokens), self.d_head],
            "scores": [len(self.tokens)],
            "pattern": [len(self.tokens)],
            "z": [self.d_head],
            "concat": [self.n_heads * self.d_head],
            "W_O": [self.n_heads * self.d_head, self.d_model],
            "out": [self.d_model],
        }
        return d


def _attention_layers(model: nn.Module) -> list[nn.Module]:
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise TypeError(f"expected a headspace Encoder or Decoder with .blocks; got {type(model).__name__}")
    return [b.attn for b in blocks]


def token_strings(pretrained: Any, sentence: str) -> list[str]:
    tok = getattr(pretrained, "tokenizer", None)
    if tok is None:
        raise ValueError("this model has no tokenizer (its folder had no tokenizer.json)")
    return tok.tokens(sentence)


def tokenize_one(pretrained: Any, sentence: str) -> tuple[Tensor, Tensor | None]:
    """(tokens [1, seq], key_padding [1, seq] or None) for one sentence, for an encoder or a decoder."""
    out = pretrained.tokenize([sentence])
    if isinstance(out, tuple):
        return out[0], out[1]
    return out, None


def special_positions(pretrained: Any, tokens: list[str]) -> set[int]:
    """Positions of special tokens ([CLS], [SEP], [PAD], <|endoftext|> ...)."""
    special = {"[CLS]", "[SEP]", "[PAD]", "[MASK]", "<s>", "</s>", "<pad>", "<|endoftext|>"}
    return {i for i, t in enumerate(tokens) if t in special}


def find_token(tokens: list[str], token: str | int) -> int:
    """Index of ``token`` (a string, matched case-insensitively, or an int index) in ``tokens``."""
    if is_int(token):
        if not -len(tokens) <= token < len(tokens):
            raise ValueError(f"token index {token} is out of range: the sentence has {len(tokens)} tokens")
        return token % len(tokens)
    want = str(token).strip().lower()
    for i, t in enumerate(tokens):
        if t.lower() in (want, "Ġ" + want):
            return i
    listing = ", ".join(f"{i}:{t}" for i, t in enumerate(tokens))
    raise ValueError(f"token {token!r} is not in the sentence; its tokens are: {listing}")


def record(model: nn.Module, run: Callable[[], Any]) -> dict[str, list[Tensor]]:
    """Run ``run()`` under :func:`headspace.trace` of every attention layer; return the values per layer.

    Keys: ``input`` (the attention's query input [batch, seq, d_model], after the block's LayerNorm in
    pre-LN models) and ``q, k, v, scores, pattern, z, result`` (the hook points' values, shapes as in
    :class:`~headspace.MultiHeadAttention`).
    """
    from .trace import trace

    layers = _attention_layers(model)
    inputs: list[Tensor | None] = [None] * len(layers)

    def grab_input(i: int) -> Callable[..., None]:
        def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
            inputs[i] = args[0].detach().clone()

        return hook

    handles = [
        attn.register_forward_pre_hook(grab_input(i), with_kwargs=True) for i, attn in enumerate(layers)
    ]
    names = ("q", "k", "v", "scores", "pattern", "z", "result")
    try:
        with trace(model, [f"hook_{n}" for n in names]) as t:
            run()
    finally:
        for h in handles:
            h.remove()
    rec = {n: [t.act(n, i) for i in range(len(layers))] for n in names}
    rec["input"] = inputs  # type: ignore[assignment]
    return rec


def rank_heads(
    patterns: list[Tensor], tokens: list[str], index: int, special: set[int], top_k: int = 3
) -> list[HeadFocus]:
    """Rank every (layer, head) by the largest weight the token gives to a content key (see HeadFocus)."""
    content = [j for j in range(len(tokens)) if j != index and j not in special]
    ranking = []
    for layer, pattern in enumerate(patterns):
        for head in range(pattern.shape[1]):
            row = pattern[0, head, index]  # (seq_k,)
            if content:
                vals = row[content]
                j = content[int(vals.argmax())]
                focus = float(row[j])
            else:
                j, focus = index, 0.0
            order = row.argsort(descending=True)[:top_k].tolist()
            top = [AttendedToken(int(t), tokens[t], float(row[t])) for t in order]
            ranking.append(HeadFocus(layer, head, focus, tokens[j], top))
    ranking.sort(key=lambda f: -f.focus)
    return ranking


def _floats(t: Tensor) -> list[float]:
    return [float(v) for v in t.flatten().tolist()]


def explain(
    pretrained: Any,
    sentence: str = DEFAULT_SENTENCE,
    token: str | int = DEFAULT_TOKEN,
    *,
    layer: int | None = None,
    head: int | None = None,
    model_name: str = "",
) -> Explanation:
    """Walk the attention pipeline for ``token`` of ``sentence`` through one head of ``pretrained``.

    Args:
        pretrained: a loaded model (``headspace.load("minilm")``, ``load_bert``, ``load_gpt2``).
        sentence: the text; token: the token (string, case-insensitive; or its index).
        layer, head: the head to explain. When ``head`` is None, the head whose attention from this token
            goes most to one content token (:class:`HeadFocus`) is chosen (within ``layer`` if given).

    Raises:
        ValueError: token not in the sentence (lists the tokens); layer or head out of range (gives it).
    """
    if not isinstance(sentence, str) or not sentence.strip():
        raise ValueError(f"sentence must be a non-empty string; got {sentence!r}")
    model = pretrained.model
    config = model.config
    n_layers = config.n_layers
    if layer is not None and not 0 <= layer < n_layers:
        raise ValueError(f"layer {layer} is out of range: this model has layers 0..{n_layers - 1}")
    # per layer, not config.n_heads: a layer has fewer heads after headspace.prune_heads
    n_heads = (
        _attention_layers(model)[layer].n_heads
        if layer is not None
        else max(a.n_heads for a in _attention_layers(model))
    )
    if head is not None and not 0 <= head < n_heads:
        where = f"layer {layer} has" if layer is not None else "this model has"
        raise ValueError(f"head {head} is out of range: {where} heads 0..{n_heads - 1}")
    tokens = token_strings(pretrained, sentence)
    index = find_token(tokens, token)
    ids, key_padding = tokenize_one(pretrained, sentence)

    def run() -> None:
        with torch.inference_mode():
            if key_padding is None:
                model(ids)
            else:
                model(ids, key_padding)

    rec = record(model, run)
    ranking = rank_heads(rec["pattern"], tokens, index, special_positions(pretrained, tokens))
    if head is None:
        candidates = [f for f in ranking if layer is None or f.layer == layer]
        layer, head = candidates[0].layer, candidates[0].head
    elif layer is None:
        layer = next(f.layer for f in ranking if f.head == head)
    attn = _attention_layers(model)[layer]
    kv_head = head // attn.group_size
    pattern_row = rec["pattern"][layer][0, head, index]  # (seq_k,)
    scores_row = rec["scores"][layer][0, head, index]  # (seq_k,)
    result = rec["result"][layer][0, index]  # (n_heads, d_model)
    contributions = result.norm(dim=-1)  # (n_heads,)
    out = result.sum(dim=0)  # (d_model,)
    if attn.b_O is not None:
        out = out + attn.b_O.detach()
    order = pattern_row.argsort(descending=True)[:5].tolist()
    return Explanation(
        model=model_name or config.name,
        sentence=sentence,
        tokens=tokens,
        token_index=index,
        layer=layer,
        head=head,
        kv_head=kv_head,
        n_layers=n_layers,
        d_model=attn.d_model,
        n_heads=attn.n_heads,
        n_kv_heads=attn.n_kv_heads,
        d_head=attn.d_head,
        scale=attn.scale,
        x=_floats(rec["input"][layer][0, index]),
        q=_floats(rec["q"][layer][0, index, head]),
        k=[_floats(r) for r in rec["k"][layer][0, :, kv_head]],
        v=[_floats(r) for r in rec["v"][layer][0, :, kv_head]],
        scores=[float(s) if math.isfinite(float(s)) else None for s in scores_row.tolist()],
        pattern=_floats(pattern_row),
        top=[AttendedToken(int(j), tokens[j], float(pattern_row[j])) for j in order],
        z=_floats(rec["z"][layer][0, index, head]),
        concat=_floats(rec["z"][layer][0, index]),
        out=_floats(out),
        head_contributions=_floats(contributions),
        head_shares=_floats(contributions / contributions.sum().clamp(min=1e-30)),
        ranking=ranking,
    )
