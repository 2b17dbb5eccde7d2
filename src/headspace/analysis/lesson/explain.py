"""The lesson, executed: one token's journey through one head of a real model.

:func:`explain` runs a sentence through a model once, with the attention layers' hook points recording,
and returns an :class:`Explanation` holding, for one token and one head, every number of the textbook
pipeline::

    x (d_model)  ->  q = x W_Q[h] + b_Q[h],  k_j = x_j W_K[h] + b_K[h],  v_j = x_j W_V[h] + b_V[h]  (d_head)
                 ->  s_j = q . k_j / sqrt(d_head)  ->  p = softmax(s)  ->  z = sum_j p_j v_j  (d_head)
                 ->  concat_h z_h  (n_heads * d_head)  ->  out = concat W_O + b_O  (d_model)

plus how much each head contributes to ``out`` for this token (the share of ``|| z_h W_O[h] ||``), and a
ranking of every (layer, head) by where this token's attention goes, in two groups (:func:`rank_heads`):

* **positional** heads, whose top key for this token is the token itself (``current``), the token just
  before or after it (``previous``, ``next``), the sequence's first token (``first``: [CLS] / BOS) or a
  special token ([SEP] / EOS at the end: ``last``; elsewhere ``special``): they attend by position;
* **relational** heads, whose top key is another content token (:mod:`.content_tokens`: an alphabetic
  word that is not a function word, not the token itself nor another occurrence of it): they attend by
  what the tokens are. These come first, ranked by ``content_flow``, the token's attention mass on
  content tokens weighted by what each adds to its output through the head: ``sum_j p_j || v_j W_O[h] ||``
  over the content keys j (attention weight times the norm of the transformed value; Kobayashi et al.
  2020, "Attention is not only a weight"). The plain mass ``sum_j p_j`` favours heads that spread their
  weight thinly (on SmolLM2's trophy sentence a head with 0.27, 0.20 and 0.18 on "suit", "case",
  "trophy"; on MiniLM's a head that sends "it" to "tired"); ``flow`` is the same product for the top
  key alone;
* **function-word** heads (role ``function``), whose top key is another token that is not content: a
  function word ("the", "didn"), punctuation or a piece such as "'t". They are listed with the
  positional heads: they do not relate the token to another word.

The lesson walks the best relational head: on the default sentence, a head that sends "it" to "animal";
on SmolLM2's "The trophy didn't fit in the suitcase because it was too big", one that sends "it" to
"trophy" (layer 16 head 3), not layer 28 head 6, whose largest flow goes to "'t".
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ...core.checks import is_int
from ...core.defaults import DEFAULT_SENTENCE, DEFAULT_TOKEN
from . import mechanism_steps, sink_steps  # noqa: F401  (register the mechanisms' and the sink's steps)
from .content_tokens import content_positions
from .delta_walk import walk_delta
from .expert_step import expert_step
from .hybrid import is_deltanet, refuse_deltanet_layer, softmax_indices
from .mechanism_walks import capture_shared_kv, flow_norms, head_results, mechanism_names, recorded
from .scheme_steps import SchemeStep, scheme_steps


@dataclass
class AttendedToken:
    """One key position a query attends to: its index, its token string and its attention weight."""

    index: int
    token: str
    weight: float


#: The roles of positional heads (the head's top key for the token, see :func:`key_role`).
POSITIONAL_ROLES = ("current", "previous", "next", "first", "last", "special")
RELATIONAL = "relational"
#: The role of a head whose top key is another token that is not content (a function word, punctuation).
FUNCTION = "function"


@dataclass
class HeadFocus:
    """Where one (layer, head) sends the token's attention.

    ``focus`` is the largest attention weight the token gives to a *content* key
    (:func:`~headspace.analysis.content_tokens.content_positions`: an alphabetic non-function word, not
    itself, not a special token such as [CLS]/[SEP]), ``focus_token`` that key and ``focus_index`` its
    position; ``content_mass`` the sum of the token's weights on every content key and ``content_flow``
    the same sum with each weight times ``|| v_j W_O[h] ||``. ``top`` lists the top attended keys of any
    kind. ``role`` says where the top key lies: ``"relational"`` (another content
    token), ``"function"`` (another token that is not content) or a positional role of
    :data:`POSITIONAL_ROLES`. ``flow`` is ``p_j || v_j W_O[h] ||`` for the top key j: the length of what
    that key adds to the token's output through this head (equal to the weight when no value norms are
    given). Relational heads are ranked by ``content_flow``.
    """

    layer: int
    head: int
    focus: float
    focus_token: str
    top: list[AttendedToken]
    role: str = RELATIONAL
    flow: float = 0.0
    content_mass: float = 0.0
    content_flow: float = 0.0
    focus_index: int = -1

    @property
    def positional(self) -> bool:
        """Whether the head is in the second group: not relational (positional or function-word)."""
        return self.role != RELATIONAL


@dataclass
class Explanation:
    """Every number of the pipeline for one token and one head (shapes in brackets).

    Attributes:
        tokens: the sentence's tokens [seq]; ``token_index`` is the explained one, the ``occurrence``-th
            (1-based) of the positions ``occurrences`` where the same token appears.
        x: the token's input to the layer's attention [d_model] (the residual stream, after the block's
            LayerNorm in pre-LN models).
        q: ``x W_Q[h] + b_Q[h]`` [d_head]. k, v: every token's key and value [seq, d_head].
        scores: ``q . k_j / sqrt(d_head)`` [seq] (None where masked). pattern: the softmax [seq].
        z: ``sum_j pattern_j v_j`` [d_head]. concat: all heads' z for this token [n_heads * d_head].
        out: the attention layer's output for this token ``concat W_O + b_O`` [d_model].
        head_shares: each head's share of ``sum_h || z_h W_O[h] ||`` for this token [n_heads].
        head_contributions: ``|| z_h W_O[h] ||`` per head [n_heads] (differential attention: each head's
            part at its pair's frozen norm scale, ``DifferentialAttention.head_parts``).
        ranking: every (layer, head): the relational heads by decreasing flow, then the positional heads
            by decreasing weight of their top key (:func:`rank_heads`).
        bias: whether the layer has the biases b_Q, b_K, b_V; out_bias: whether it has b_O.
        q_rot, k_rot: with rotary positions, q and the keys rotated by their positions (``q R(i)``,
            ``k_j R(j)``); the scores are ``q_rot . k_rot_j / sqrt(d_head)``. rope_theta, rotary_dim:
            the rotation's base and rotated width (None without rotary positions).
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
    occurrence: int = 1
    occurrences: list[int] = field(default_factory=list)
    bias: bool = True
    out_bias: bool = True
    #: rotary models: q and every k after the rotation by their positions (the scores use these), the
    #: rotation base and how many of the d_head features rotate; empty / None without rotary positions
    q_rot: list[float] = field(default_factory=list)
    k_rot: list[list[float]] = field(default_factory=list)
    rope_theta: float | None = None
    rotary_dim: int | None = None
    #: QK-norm models (Gemma 3, Qwen3, OLMo 2): q and every k after the norm (before any rotation), and
    #: the norm's kind ("head": RMSNorm over each head's d_head; "all": over all heads at once)
    qk_norm: str | None = None
    q_normed: list[float] = field(default_factory=list)
    k_normed: list[list[float]] = field(default_factory=list)
    #: a sliding-window layer's window (query i sees key j iff i - window < j <= i), else None
    window: int | None = None
    #: the window's sides: None (causal, as above) or "both" (key j visible iff |i - j| < window)
    window_sides: str | None = None
    #: the positional scheme's steps for this head (partial rotary, pairs, scaling ...; :mod:`.scheme_steps`)
    scheme_steps: list[SchemeStep] = field(default_factory=list)
    #: gated layers (Qwen3-Next): the head's output gate sigmoid(x W_G[h]) at the token; ``z`` is then
    #: the gated output, (sum_j p_j v_j) * gate; empty without a gate
    gate: list[float] = field(default_factory=list)

    @property
    def token(self) -> str:
        return self.tokens[self.token_index]

    @property
    def relational(self) -> list[HeadFocus]:
        """The relational heads of :attr:`ranking`, best first."""
        return [f for f in self.ranking if not f.positional]

    @property
    def positional(self) -> list[HeadFocus]:
        """The positional heads of :attr:`ranking`, best first."""
        return [f for f in self.ranking if f.positional]

    @property
    def kv_shared_by(self) -> list[int]:
        """The query heads that read this head's key/value head (grouped-query attention)."""
        group = self.n_heads // self.n_kv_heads
        return list(range(self.kv_head * group, (self.kv_head + 1) * group))

    def to_dict(self, top: int | None = None) -> dict[str, Any]:
        """Every field as plain JSON types, and ``token``, ``shapes``, ``positional`` (the [layer, head]
        pairs of the positional heads). With ``top``, ``ranking`` holds the ``top`` best heads of each
        group (relational first, then positional), as the terminal shows them."""
        d = asdict(self)
        d["token"] = self.token
        d["positional"] = [[f.layer, f.head] for f in self.positional]
        if top is not None:
            d["ranking"] = [asdict(f) for f in (*self.relational[:top], *self.positional[:top])]
        d["shapes"] = {
            "x": [self.d_model],
            "W_Q[h]": [self.d_model, len(self.q)],  # (MLA: q and k are qk_head_dim wide, v and z v_head_dim)
            "q": [len(self.q)],
            "k": [len(self.tokens), len(self.k[0])],
            "v": [len(self.tokens), len(self.v[0])],
            "scores": [len(self.tokens)],
            "pattern": [len(self.tokens)],
            "z": [len(self.z)],  # (differential: 2 d_head, the pair's two value heads)
            "concat": [len(self.concat)],
            "W_O": [len(self.concat), self.d_model],  # (a DeltaNet head: n_v_heads d_v)
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


@dataclass(frozen=True)
class TokenizedSentence:
    """One sentence, tokenized once: ``text``; its token strings ``tokens`` (special tokens included);
    ``ids`` int64 [1, seq] and ``key_padding`` bool [1, seq] (True = real token) or None: ``tokens[i]``
    is the string of ``ids[0, i]``."""

    text: str
    tokens: list[str]
    ids: Tensor
    key_padding: Tensor | None


def tokenize_sentence(pretrained: Any, sentence: str) -> TokenizedSentence:
    """``sentence`` tokenized by one call of the tokenizer: the ids of :func:`tokenize_one`, and each id's
    token string (the tokenizer's ``token_of``). A tokenizer without ``token_of`` (a stand-in with only
    ``tokens``) is asked for the strings as well.

    Raises:
        ValueError: the model has no tokenizer.
    """
    tok = getattr(pretrained, "tokenizer", None)
    if tok is None:
        raise ValueError("this model has no tokenizer (its folder had no tokenizer.json)")
    ids, key_padding = tokenize_one(pretrained, sentence)
    token_of = getattr(tok, "token_of", None)
    if token_of is None:
        tokens = list(tok.tokens(sentence))
    else:
        tokens = [str(token_of(i)) for i in ids[0].tolist()]
    return TokenizedSentence(sentence, tokens, ids, key_padding)


def tokenize_one(pretrained: Any, sentence: str) -> tuple[Tensor, Tensor | None]:
    """(tokens [1, seq], key_padding [1, seq] or None) for one sentence, for an encoder or a decoder.

    Uses :class:`~headspace.pretrained.LoadedModel`'s ``tokenize_padded`` where the model has it.
    """
    if hasattr(pretrained, "tokenize_padded"):
        out = pretrained.tokenize_padded([sentence])
    else:
        out = pretrained.tokenize([sentence])
    if isinstance(out, tuple):
        return out[0], out[1]
    return out, None


_SPECIAL = {
    "[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]", "<s>", "</s>", "<pad>", "<unk>", "<bos>", "<eos>",
    "<|endoftext|>", "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|eot_id|>",
}  # fmt: skip
_SPECIAL_FORM = re.compile(r"^(\[[A-Z]+\]|<\|[a-z_]+\|>)$")


def is_special(token: str) -> bool:
    """Whether a token string is a special token ([CLS], [SEP], <s>, <|endoftext|>, <|im_start|> ...)."""
    return token in _SPECIAL or bool(_SPECIAL_FORM.match(token))


def special_positions(pretrained: Any, tokens: Sequence[str]) -> set[int]:
    """Positions of special tokens ([CLS], [SEP], [PAD], <|endoftext|> ...)."""
    return {i for i, t in enumerate(tokens) if is_special(t)}


def _word(t: str) -> str:
    # BERT word pieces as they are; GPT-2 marks a leading space with "Ġ", SentencePiece with "▁", the
    # command line prints it "␣" (strip the mark before lower-casing: "Ġ".lower() is "ġ")
    return t[1:] if t[:1] in ("Ġ", "▁", "␣") and len(t) > 1 else t


def _matches(t: str, want: str) -> bool:
    return _word(t).lower() == want or t.lower() == want


def token_occurrences(tokens: Sequence[str], token: str) -> list[int]:
    """Every position where ``token`` (a string, matched case-insensitively) occurs in ``tokens``."""
    want = _word(str(token).strip()).lower()
    return [i for i, t in enumerate(tokens) if _matches(t, want)]


def find_token(tokens: Sequence[str], token: str | int, occurrence: int | None = None) -> int:
    """Index of ``token`` (a string, matched case-insensitively, or an int index) in ``tokens``.

    A string that occurs several times gives its first occurrence, or the ``occurrence``-th (1-based).
    """
    if is_int(token):
        if occurrence is not None:
            raise ValueError(
                f"occurrence={occurrence} needs the token as text, not as the index {token} (one position)"
            )
        if not -len(tokens) <= token < len(tokens):
            raise ValueError(f"token index {token} is out of range: the sentence has {len(tokens)} tokens")
        return token % len(tokens)
    found = token_occurrences(tokens, token)
    if not found:
        listing = ", ".join(f"{i}:{t}" for i, t in enumerate(tokens))
        raise ValueError(f"token {token!r} is not in the sentence; its tokens are: {listing}")
    if occurrence is None:
        return found[0]
    if not is_int(occurrence) or not 1 <= occurrence <= len(found):
        where = ", ".join(f"{n} at position {i}" for n, i in enumerate(found, start=1))
        raise ValueError(
            f"occurrence {occurrence} of {token!r} is out of range: it occurs {len(found)} time(s) "
            f"({where}); valid occurrences are 1..{len(found)}"
        )
    return found[occurrence - 1]


def record(model: nn.Module, run: Callable[[], Any]) -> dict[str, list[Tensor]]:
    """Run ``run()`` under :func:`headspace.trace` of every attention layer; return the values per layer.

    Keys: ``input`` (the attention's query input [batch, seq, d_model], after the block's LayerNorm in
    pre-LN models) and ``q, k, v, scores, pattern, z, result`` (the hook points' values, shapes as in
    :class:`~headspace.MultiHeadAttention`).
    """
    from ..trace.trace import trace

    layers = _attention_layers(model)
    inputs: list[Tensor | None] = [None] * len(layers)

    def grab_input(i: int) -> Callable[[Tensor, Any], None]:
        def keep(value: Tensor, _point: Any) -> None:
            inputs[i] = value.detach().clone()  # (batch, seq, d_model)

        return keep

    # each block's hook_attn_in: the attention's input after its norm, in every residual layout
    removers = [b.hook_attn_in.add(grab_input(i), this_thread=True) for i, b in enumerate(model.blocks)]
    names = ("q", "k", "v", "scores", "pattern", "z", "result")
    layers = [a for a in layers if not is_deltanet(a)]  # a hybrid's softmax layers
    rotary = [
        n for n in ("rot_q", "rot_k") if all(getattr(a, "hook_rot_q", None) is not None for a in layers)
    ]
    normed = [n for n in ("q_normed", "k_normed") if all(getattr(a, "qk_norm", None) for a in layers)]
    gated = ["gate"] if all(getattr(a, "gate_weight", None) is not None for a in layers) else []
    extra = (*rotary, *normed, *mechanism_names(model))  # (+ latent / differential hook points)
    shared, unhook = capture_shared_kv(model)  # the keys and values kv_source layers read
    try:
        with trace(model, [f"hook_{n}" for n in (*names, *extra, *gated)]) as t:
            run()
    finally:
        for remove in (*removers, unhook):
            remove()
    index = softmax_indices(model)  # per block: its softmax layer index, None for a Gated DeltaNet
    rec = recorded(t, model, index, (*names, *extra), shared)  # (kv_source: the owner's k, v)
    gates = {n: [t[f"{path}.hook_{n}"] for path in t.layer_paths] for n in gated}  # output gates
    rec.update({n: [None if j is None else g[j] for j in index] for n, g in gates.items()})
    rec["input"] = inputs  # type: ignore[assignment]
    return rec


def key_role(key: int, index: int, special: set[int], seq: int) -> str:
    """Where key position ``key`` lies for the query at ``index``: a positional role or ``"relational"``.

    Special tokens first: position 0 is ``first`` ([CLS] / BOS, or a decoder's first token, its usual
    attention sink), a special token at the end ``last`` ([SEP] / EOS), one elsewhere ``special``; then
    ``current`` (the token itself), ``previous`` and ``next``; any other key is ``relational``.
    """
    if key == 0 and (0 in special or key != index):
        return "first"
    if key in special:
        return "last" if key == seq - 1 else "special"
    if key == index:
        return "current"
    if key == index - 1:
        return "previous"
    if key == index + 1:
        return "next"
    return RELATIONAL


def value_norms(values: Tensor, W_O: Tensor) -> Tensor:
    """``|| v_j W_O[h] ||`` for every head h and key j: [n_heads, seq_k].

    ``values`` [seq_k, n_kv_heads, d_head] (one sequence's ``hook_v``), ``W_O`` [n_heads, d_head, d_model];
    with grouped-query attention query head h reads key/value head ``h // (n_heads // n_kv_heads)``.
    """
    group = W_O.shape[0] // values.shape[1]
    v = values.float().repeat_interleave(group, dim=1)  # (seq_k, n_heads, d_head)
    return torch.einsum("khd,hdm->hkm", v, W_O.detach().float()).norm(dim=-1)  # (n_heads, seq_k)


def rank_heads(
    patterns: Sequence[Tensor | None],
    tokens: Sequence[str],
    index: int,
    special: set[int],
    top_k: int = 3,
    norms: Sequence[Tensor | None] | None = None,
) -> list[HeadFocus]:
    """Rank every (layer, head) for the token at ``index``, relational heads first (see the module).

    ``patterns[layer]`` is [1, n_heads, seq_q, seq_k] (or [n_heads, seq_q, seq_k]; None for a layer
    without a pattern, a hybrid's Gated DeltaNet layer, which is skipped); ``norms[layer]``
    [n_heads, seq_k] the :func:`value_norms` (None: flow is the attention weight alone). Relational heads
    (top key another content token) come first, by decreasing ``content_flow``; then the
    positional and function-word heads, by decreasing weight of their top key. Ties keep (layer, head)
    order.
    """
    seq = len(tokens)
    content = content_positions(tokens, index, special)
    relational, positional = [], []
    for layer, pattern in enumerate(patterns):
        if pattern is None:  # a Gated DeltaNet layer of a hybrid: no pattern
            continue
        pattern = pattern[0] if pattern.dim() == 4 else pattern  # (n_heads, seq_q, seq_k)
        for head in range(pattern.shape[0]):
            row = pattern[head, index].float()  # (seq_k,)
            weights = row if norms is None else row * norms[layer][head].float()  # (seq_k,)
            if content:
                j = content[int(row[content].argmax())]
                focus, mass = float(row[j]), float(row[content].sum())
                content_flow = float(weights[content].sum())
            else:
                j, focus, mass, content_flow = index, 0.0, 0.0, 0.0
            order = row.argsort(descending=True, stable=True)[:top_k].tolist()
            top = [AttendedToken(int(t), tokens[t], float(row[t])) for t in order]
            key = order[0]
            role = key_role(key, index, special, seq)
            if role == RELATIONAL and key not in content:
                role = FUNCTION
            f = HeadFocus(
                layer, head, focus, tokens[j], top, role=role, flow=float(weights[key]), content_mass=mass,
                content_flow=content_flow, focus_index=j,
            )  # fmt: skip
            (positional if f.positional else relational).append(f)
    relational.sort(key=lambda f: -f.content_flow)
    positional.sort(key=lambda f: -f.top[0].weight)
    return relational + positional


def default_index(tokens: Sequence[str], token: str | int = DEFAULT_TOKEN) -> int:
    """The token the lesson follows in ``tokens``: ``token`` (default "it") if there, else the first
    token that is not special (or 0)."""
    try:
        return find_token(tokens, token)
    except ValueError:
        return next((i for i, t in enumerate(tokens) if not is_special(t)), 0)


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
    occurrence: int | None = None,
    tokenized: TokenizedSentence | None = None,
) -> Explanation:
    """Walk the attention pipeline for ``token`` of ``sentence`` through one head of ``pretrained``.

    Args:
        pretrained: a loaded model (``headspace.load("minilm")``, ``load_bert``, ``load_gpt2``).
        sentence: the text; token: the token (string, case-insensitive; or its index).
        layer, head: the head to explain. When ``head`` is None, the best-ranked head of
            :func:`rank_heads` is chosen (within ``layer`` if given): the best relational head, or the
            best positional one where no head is relational.
        occurrence: which occurrence of ``token`` (1-based) when it appears several times (default 1).
        tokenized: ``sentence`` already tokenized (:func:`tokenize_sentence`), for a caller that read its
            tokens first; None: tokenized here. The tokenizer runs once either way.

    Raises:
        ValueError: token not in the sentence (lists the tokens); occurrence out of range (lists the
            positions); layer or head out of range (gives it); ``tokenized`` of another sentence.
    """
    if not isinstance(sentence, str) or not sentence.strip():
        raise ValueError(f"sentence must be a non-empty string; got {sentence!r}")
    model = pretrained.model
    _check_head_choice(model, layer, head)
    refuse_deltanet_layer(model, None, "explain (the lesson)")  # a DeltaNet layer: .delta_walk walks it
    if tokenized is None:
        tokenized = tokenize_sentence(pretrained, sentence)
    elif tokenized.text != sentence:
        raise ValueError(f"tokenized holds the sentence {tokenized.text!r}; expected {sentence!r}")
    tokens = tokenized.tokens
    index = find_token(tokens, token, occurrence)
    occurrences = token_occurrences(tokens, tokens[index])
    if index not in occurrences:  # a token the text match does not give back (a bare "Ġ")
        occurrences = [index]
    rec = _record_ids(model, tokenized.ids, tokenized.key_padding)
    layers = _attention_layers(model)
    norms = [None if is_deltanet(a) else flow_norms(a, rec["v"][i][0]) for i, a in enumerate(layers)]
    ranking = rank_heads(rec["pattern"], tokens, index, special_positions(pretrained, tokens), norms=norms)
    if layer is not None and is_deltanet(layers[layer]):  # the delta rule, exactly (.delta_walk)
        ids, pad = tokenized.ids, tokenized.key_padding
        head, walked = walk_delta(model, layer, head, index, tokens, ids, pad, AttendedToken)
    elif head is None:  # the best-ranked head (within `layer` when given)
        candidates = [f for f in ranking if layer is None or f.layer == layer]
        layer, head = candidates[0].layer, candidates[0].head
    elif layer is None:
        layer = next(f.layer for f in ranking if f.head == head)
    attn = layers[layer]
    # (a tempered layer is walked: the "temperature" step gives t(p) and the untempered scores)
    explanation = Explanation(
        model=model_name or model.config.name,
        sentence=sentence,
        tokens=tokens,
        token_index=index,
        layer=layer,
        head=head,
        n_layers=model.config.n_layers,
        ranking=ranking,
        occurrence=occurrences.index(index) + 1,
        occurrences=occurrences,
        **(walked if is_deltanet(attn) else _walk(rec, attn, layer, index, head, tokens)),
    )
    experts = expert_step(model, layer, tokenized.ids, tokenized.key_padding, index)  # a MoE block's step
    if experts is not None:
        explanation.scheme_steps.append(experts)
    return explanation


def _walk(
    rec: dict[str, list[Tensor]], attn: Any, layer: int, index: int, head: int, tokens: list[str]
) -> dict:
    """The fields of an :class:`Explanation` that follow token ``index`` through head ``head`` of layer
    ``layer`` (whose attention is ``attn``), read from the recorded values ``rec`` (batch 1)."""
    kv_head = head // attn.group_size
    pattern_row = rec["pattern"][layer][0, head, index]  # (seq_k,)
    scores_row = rec["scores"][layer][0, head, index]  # (seq_k,)
    result = head_results(attn, rec["result"][layer][0, index], rec["z"][layer][0, index])  # (H, d_model)
    contributions = result.norm(dim=-1)  # (n_heads,)
    out = result.sum(dim=0)  # (d_model,)
    if attn.b_O is not None:
        out = out + attn.b_O.detach()
    order = pattern_row.argsort(descending=True)[:5].tolist()
    return dict(
        kv_head=kv_head,
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
        bias=getattr(attn, "b_Q", None) is not None,
        out_bias=attn.b_O is not None,
        **_rotated(rec, attn, layer, index, head, kv_head),
        **_normed(rec, attn, layer, index, head, kv_head),
        window=getattr(attn, "window", None),
        window_sides=attn.spec.window_sides if hasattr(attn, "spec") else None,
        scheme_steps=scheme_steps(
            attn,
            head,
            len(tokens),
            index=index,
            scores=scores_row.float(),
            pattern=pattern_row,
            keys=tuple(order),
            values={n: v[layer] for n, v in rec.items() if n != "input" and v[layer] is not None},
        ),
        gate=_floats(rec["gate"][layer][0, index, head]) if "gate" in rec else [],
    )


def _check_head_choice(model: Any, layer: int | None, head: int | None) -> None:
    """``ValueError`` unless ``layer`` (when given) is one of the model's layers and ``head`` (when
    given) one of that layer's heads, or of the widest layer's without ``layer`` (a layer has fewer
    heads after :func:`headspace.prune_heads`)."""
    n_layers = model.config.n_layers
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


def _record_ids(model: nn.Module, ids: Tensor, key_padding: Tensor | None) -> dict[str, list[Tensor]]:
    """Every layer's hook values (``input``, ``q``, ``k``, ``v``, ``scores``, ``pattern``, ``z``,
    ``result`` ...; see :func:`record`) for one forward pass of ``ids`` [1, seq] (inference mode)."""

    def run() -> None:
        with torch.inference_mode():
            if key_padding is None:
                model(ids)
            else:
                model(ids, key_padding)

    return record(model, run)


def _normed(rec: dict[str, list[Tensor]], attn: Any, layer: int, index: int, head: int, kv: int) -> dict:
    """The QK-norm fields of an :class:`Explanation` (none without QK-norm)."""
    kind = getattr(attn, "qk_norm", None)
    if kind is None or "q_normed" not in rec:
        return {}
    return {
        "qk_norm": kind,
        "q_normed": _floats(rec["q_normed"][layer][0, index, head]),
        "k_normed": [_floats(r) for r in rec["k_normed"][layer][0, :, kv]],
    }


def _rotated(rec: dict[str, list[Tensor]], attn: Any, layer: int, index: int, head: int, kv: int) -> dict:
    """The rotary fields of an :class:`Explanation` (none without rotary positions)."""
    rotary = getattr(attn, "rotary", None)
    if rotary is None or "rot_q" not in rec or rec["rot_q"][layer] is None:
        return {}
    return {
        "q_rot": _floats(rec["rot_q"][layer][0, index, head]),
        "k_rot": [_floats(r) for r in rec["rot_k"][layer][0, :, kv]],
        "rope_theta": float(rotary.base),
        "rotary_dim": int(rotary.rotary_dim),
    }
