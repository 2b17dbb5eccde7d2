"""The typed description of a transformer block: what every executor of a block runs from.

A :class:`BlockSpec` names, field by field, everything that fixes a block's maths: its norms
(:class:`NormSpec`) and where they sit (``layout``), the attention (:class:`AttentionSpec`: head counts
and widths, the projections' biases, the positional scheme, each score modifier: ``scale``, ``window``,
``chunk``, ``softcap``, ``bias``, ``sink``; the output modifier ``gate``) and the MLP (:class:`MLPSpec`).
The model builds one per block from its configuration (``ModelConfig.block_spec(i)``); the block is built
from it (``TransformerBlock.from_spec``) and keeps it as ``block.spec``. The forward pass, the decoding
step and the circuit runner read the block's maths from ``block.spec`` at call time, so an edited
description (``block.spec = dataclasses.replace(...)``) changes them all alike.

Residual layouts (``BlockSpec.layout``; ``N1``/``N2`` the block's two norms, ``A``/``M`` the sublayers)::

    post (BERT):           h = N1(x + A(x))            out = N2(h + M(h))
    pre (GPT-2, Llama):    h = x + A(N1(x))            out = h + M(N2(h))
    sandwich (Gemma 2/3):  h = x + N_ao(A(N1(x)))      out = h + N_mo(M(N2(h)))
    post_sublayer (OLMo 2): h = x + N1(A(x))           out = h + N2(M(h))
    parallel (GPT-NeoX):   out = x + A(N1(x)) + M(N2(x))   (GPT-J, Phi-2, Cohere: N2 a copy of N1)

A field that no executor computes yet (``chunk``; the ``parallel`` layout beyond the block forward and
the Python step; ``bias`` (ALiBi) beyond the forward, the traced path and the Python step) may be
described; each executor refuses it by the field's name (:func:`refuse_unsupported`), never running
without it. ``sink``, ``gate``, a mixture-of-experts MLP (``MLPSpec.kind == "moe"``) and a Gated DeltaNet
mixer (``BlockSpec.mixer``) are computed by the block forward only: the decoding steps refuse them by
name (decoding runs the forward with its caches).
Every value is checked on construction: a bad one raises a one-line ``ValueError`` naming the field, what
it expects and what came.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..core.checks import is_int, is_number
from .alibi import check_slopes
from .delta_spec import DeltaNetSpec
from .positions import Rotary

#: The kinds of normalisation layer (``NormSpec.kind``).
NORM_KINDS = ("layernorm", "rmsnorm")
#: The residual layouts (``BlockSpec.layout``); ``"parallel"`` runs in the block forward only (the
#: decoding step refuses it by name and decoding falls back to the forward with its KV cache).
LAYOUTS = ("post", "pre", "sandwich", "post_sublayer", "parallel")
#: The kinds of feed-forward network (``MLPSpec.kind``).
MLP_KINDS = ("plain", "gated", "moe")
#: How a mixture of experts weighs its k experts (``MLPSpec.routing``): ``"softmax_topk"`` (the softmax
#: over all experts, then the k largest: Mixtral, Qwen-MoE, OLMoE) or ``"topk_softmax"`` (the k largest
#: logits, then the softmax over those k: gpt-oss).
ROUTINGS = ("softmax_topk", "topk_softmax")
#: The activations of an MLP (``MLPSpec.act``).
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")
#: QK-norm over each head's d_head (``"head"``: Qwen3, Gemma 3) or all heads at once (``"all"``: OLMo 2),
#: RMSNorms; ``"head_layernorm"``: a LayerNorm per head with its own weight, no bias (StableLM, Cohere).
QK_NORMS = ("head", "all", "head_layernorm")
#: Additive score biases (``AttentionSpec.bias``): ALiBi's per-head linear distance penalty.
SCORE_BIASES = ("alibi",)
#: Attention sinks (``AttentionSpec.sink``): one learned logit per head in the softmax (gpt-oss).
SINKS = ("learned",)
#: Output gates (``AttentionSpec.gate``): sigmoid gates on each head's output (Qwen3-Next):
#: ``"elementwise"`` one gate per feature of z_h, ``"headwise"`` one per head
#: (:mod:`headspace.attention.gates`).
GATES = ("headwise", "elementwise")
#: The token mixers of a block (``BlockSpec.mixer``): softmax attention, or a Gated DeltaNet
#: (linear attention with a decaying recurrent state: Qwen3-Next, Qwen3.5; ``BlockSpec.delta_net``).
MIXERS = ("attention", "gated_deltanet")
#: The attention fields that change what an attention layer computes beyond the classic layer, in the
#: order executors check them: :func:`refuse_unsupported` names the first one an executor lacks.
ATTENTION_FEATURES = (
    "window", "chunk", "softcap", "qk_norm", "bias", "sink", "gate", "v_norm", "k_eq_v", "kv_source",
)  # fmt: skip


def _fail(owner: str, name: str, expected: str, value: object) -> ValueError:
    return ValueError(f"{owner}.{name} must be {expected}; got {value!r}")


def _positive_int(owner: str, name: str, value: object) -> None:
    if not is_int(value) or value <= 0:  # type: ignore[operator]
        raise _fail(owner, name, "a positive int", value)


def _optional_positive_int(owner: str, name: str, value: object) -> None:
    if value is not None and (not is_int(value) or value <= 0):  # type: ignore[operator]
        raise _fail(owner, name, "None or a positive int", value)


def _positive_float(owner: str, name: str, value: object) -> None:
    if not is_number(value) or not 0 < value < math.inf:  # type: ignore[operator]
        raise _fail(owner, name, "a finite positive float", value)


def _bool(owner: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise _fail(owner, name, "a bool", value)


def _choice(owner: str, name: str, value: object, choices: tuple[str, ...], optional: bool = False) -> None:
    if (optional and value is None) or value in choices:
        return
    raise _fail(owner, name, ("None or " if optional else "") + f"one of {list(choices)}", value)


@dataclass(frozen=True)
class NormSpec:
    """A norm over d_model: ``kind`` ``"layernorm"`` (weight and bias) or ``"rmsnorm"`` (scale by
    ``offset + weight``: Gemma's offset is 1; a LayerNorm takes no offset), with ``eps``."""

    kind: str = "layernorm"
    eps: float = 1e-5
    offset: float = 0.0

    def __post_init__(self) -> None:
        _choice("NormSpec", "kind", self.kind, NORM_KINDS)
        _positive_float("NormSpec", "eps", self.eps)
        if not is_number(self.offset) or not math.isfinite(self.offset):
            raise _fail("NormSpec", "offset", "a finite float", self.offset)
        if self.kind == "layernorm" and self.offset:
            raise _fail(
                "NormSpec", "offset", "0 for a LayerNorm (the offset is RMSNorm's 1 + weight)", self.offset
            )


@dataclass(frozen=True)
class AttentionSpec:
    """A self-attention layer (see :class:`headspace.MultiHeadAttention` for the formula).

    Shapes: ``n_heads`` query heads and ``n_kv_heads`` key/value heads (dividing ``n_heads``) of width
    ``d_head`` each, on a residual stream of width ``d_model``; ``qkv_bias`` / ``out_bias`` switch the
    biases of the q/k/v and output projections. ``positions``: the rotation (RoPE) of q and k, or None.
    ``scale``: the scores' factor (None: ``1 / sqrt(d_head)``). ``window``: a sliding window (key ``j``
    visible from query ``i`` iff ``i - window < j <= i``). ``chunk``: chunked attention (keys of the
    query's own chunk of that many positions only). ``softcap``: scores become ``softcap * tanh(s /
    softcap)``. ``qk_norm``: RMSNorm of q and k (``"head"`` or ``"all"``) with ``qk_norm_eps`` and
    ``qk_norm_offset``. ``bias``: an additive score bias (``"alibi"``: ``-alibi_slopes[h] * (i - j)``
    added to the scaled scores, :mod:`headspace.nn.alibi`; ``alibi_slopes`` one per head). ``sink``:
    learned sink logits (``"learned"``). ``gate``: a gate on each head's output. ``dropout``: on the
    pattern, in [0, 1).
    Gemma 3n / 4 (:mod:`headspace.model.gemma_extras`): ``v_norm``: each head's v through an RMSNorm
    over d_head without a scale, ``v / sqrt(mean(v^2) + qk_norm_eps)``; ``k_eq_v``: the values are the
    key projection before its norm (``W_V`` is ``W_K``); ``kv_source``: the index of the earlier layer
    whose keys and values this layer attends to (it has no ``W_K`` / ``W_V`` of its own).
    """

    d_model: int
    n_heads: int
    d_head: int
    n_kv_heads: int
    qkv_bias: bool = True
    out_bias: bool = True
    positions: Rotary | None = None
    scale: float | None = None
    window: int | None = None
    chunk: int | None = None
    softcap: float | None = None
    qk_norm: str | None = None
    qk_norm_eps: float = 1e-6
    qk_norm_offset: float = 0.0
    bias: str | None = None
    alibi_slopes: tuple[float, ...] | None = None
    sink: str | None = None
    gate: str | None = None
    dropout: float = 0.0
    v_norm: bool = False
    k_eq_v: bool = False
    kv_source: int | None = None

    def __post_init__(self) -> None:
        o = "AttentionSpec"
        for name in ("d_model", "n_heads", "d_head", "n_kv_heads"):
            _positive_int(o, name, getattr(self, name))
        if self.n_heads % self.n_kv_heads:
            raise _fail(o, "n_kv_heads", f"a divisor of n_heads={self.n_heads}", self.n_kv_heads)
        _bool(o, "qkv_bias", self.qkv_bias)
        _bool(o, "out_bias", self.out_bias)
        if self.positions is not None:
            if not isinstance(self.positions, Rotary):
                raise _fail(o, "positions", "None or a headspace.positions.Rotary", self.positions)
            if self.positions.d_head != self.d_head:
                raise _fail(o, "positions", f"a Rotary made for d_head={self.d_head}", self.positions)
        if self.scale is not None and (not is_number(self.scale) or not math.isfinite(self.scale)):
            raise _fail(o, "scale", "None (1 / sqrt(d_head)) or a finite float", self.scale)
        _optional_positive_int(o, "window", self.window)
        _optional_positive_int(o, "chunk", self.chunk)
        if self.softcap is not None:
            _positive_float(o, "softcap", self.softcap)
        _choice(o, "qk_norm", self.qk_norm, QK_NORMS, optional=True)
        _positive_float(o, "qk_norm_eps", self.qk_norm_eps)
        if not is_number(self.qk_norm_offset) or not math.isfinite(self.qk_norm_offset):
            raise _fail(o, "qk_norm_offset", "a finite float", self.qk_norm_offset)
        _choice(o, "bias", self.bias, SCORE_BIASES, optional=True)
        if self.bias == "alibi" or self.alibi_slopes is not None:
            if self.bias != "alibi":
                raise _fail(o, "alibi_slopes", "None without bias='alibi'", self.alibi_slopes)
            object.__setattr__(
                self, "alibi_slopes", check_slopes(f"{o}.alibi_slopes", self.alibi_slopes, self.n_heads)
            )
        _choice(o, "sink", self.sink, SINKS, optional=True)
        _choice(o, "gate", self.gate, GATES, optional=True)
        if not is_number(self.dropout) or not 0.0 <= self.dropout < 1.0:
            raise _fail(o, "dropout", "a float in [0, 1)", self.dropout)
        _bool(o, "v_norm", self.v_norm)
        _bool(o, "k_eq_v", self.k_eq_v)
        if self.kv_source is not None and (not is_int(self.kv_source) or self.kv_source < 0):
            raise _fail(o, "kv_source", "None or a layer index >= 0", self.kv_source)

    @property
    def score_scale(self) -> float:
        """The factor of the scores: ``scale``, or ``1 / sqrt(d_head)`` where None."""
        return 1.0 / math.sqrt(self.d_head) if self.scale is None else float(self.scale)


@dataclass(frozen=True)
class MLPSpec:
    """A position-wise MLP of hidden width ``d_mlp``: ``"plain"`` ``act(x W_in + b_in) W_out + b_out`` or
    ``"gated"`` ``(act(x W_gate + b_gate) * (x W_in + b_in)) W_out + b_out``; ``bias`` switches every bias.

    ``"moe"``: a mixture of ``n_experts`` gated experts of width ``d_mlp`` each, ``top_k`` of them per
    token, chosen by the router's softmax (``norm_topk``: the k weights renormalised to sum to 1);
    ``d_shared``: the width of a shared gated expert that every token takes, scaled by ``sigmoid(x w_sg)``
    (Qwen2-MoE), None for none (:class:`headspace.model.moe.MixtureOfExperts`). ``routing``: one of
    :data:`ROUTINGS`; ``router_bias``: the router has a bias (gpt-oss); ``bias``: each expert's three
    projections have biases. ``swiglu_limit`` / ``swiglu_alpha`` (gpt-oss's clamped SwiGLU, both or
    neither): ``g = min(x W_gate, limit)``, ``u = clamp(x W_in, -limit, limit)``, hidden ``(u + 1) g
    sigmoid(alpha g)`` in place of ``act(x W_gate) (x W_in)``. The expert fields must keep their
    defaults for the other kinds."""

    d_mlp: int
    kind: str = "plain"
    act: str = "gelu"
    bias: bool = True
    n_experts: int | None = None
    top_k: int | None = None
    norm_topk: bool = False
    d_shared: int | None = None
    routing: str = "softmax_topk"
    router_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None

    def __post_init__(self) -> None:
        _positive_int("MLPSpec", "d_mlp", self.d_mlp)
        _choice("MLPSpec", "kind", self.kind, MLP_KINDS)
        _choice("MLPSpec", "act", self.act, ACTIVATIONS)
        _bool("MLPSpec", "bias", self.bias)
        _bool("MLPSpec", "norm_topk", self.norm_topk)
        _optional_positive_int("MLPSpec", "d_shared", self.d_shared)
        _choice("MLPSpec", "routing", self.routing, ROUTINGS)
        _bool("MLPSpec", "router_bias", self.router_bias)
        for name in ("swiglu_limit", "swiglu_alpha"):
            if getattr(self, name) is not None:
                _positive_float("MLPSpec", name, getattr(self, name))
        if (self.swiglu_limit is None) != (self.swiglu_alpha is None):
            raise _fail("MLPSpec", "swiglu_alpha", "set exactly when swiglu_limit is", self.swiglu_alpha)
        if self.kind != "moe":
            defaults = {"n_experts": None, "top_k": None, "d_shared": None, "routing": "softmax_topk",
                        "router_bias": False, "swiglu_limit": None}  # fmt: skip
            for name, default in defaults.items():
                if getattr(self, name) != default:
                    raise _fail("MLPSpec", name, f"{default!r} for kind={self.kind!r}", getattr(self, name))
            return
        _positive_int("MLPSpec", "n_experts", self.n_experts)
        _positive_int("MLPSpec", "top_k", self.top_k)
        if self.top_k > self.n_experts:  # type: ignore[operator]
            raise _fail("MLPSpec", "top_k", f"at most n_experts={self.n_experts}", self.top_k)


@dataclass(frozen=True)
class BlockSpec:
    """One block: ``attention``, ``mlp``, the ``norm`` of every norm of the block (the two sublayer norms,
    and a sandwich block's two output norms) and the residual ``layout`` (module docstring).
    ``dropout``: on each sublayer's output before its residual add, in [0, 1). ``mixer``: one of
    :data:`MIXERS`; a ``"gated_deltanet"`` block mixes tokens by the Gated DeltaNet ``delta_net``
    describes (set exactly then) and its ``attention`` is not used."""

    attention: AttentionSpec
    mlp: MLPSpec
    norm: NormSpec = dataclasses.field(default_factory=NormSpec)
    layout: str = "pre"
    dropout: float = 0.0
    mixer: str = "attention"
    delta_net: DeltaNetSpec | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.attention, AttentionSpec):
            raise _fail("BlockSpec", "attention", "an AttentionSpec", type(self.attention).__name__)
        if not isinstance(self.mlp, MLPSpec):
            raise _fail("BlockSpec", "mlp", "an MLPSpec", type(self.mlp).__name__)
        if not isinstance(self.norm, NormSpec):
            raise _fail("BlockSpec", "norm", "a NormSpec", type(self.norm).__name__)
        _choice("BlockSpec", "layout", self.layout, LAYOUTS)
        if not is_number(self.dropout) or not 0.0 <= self.dropout < 1.0:
            raise _fail("BlockSpec", "dropout", "a float in [0, 1)", self.dropout)
        _choice("BlockSpec", "mixer", self.mixer, MIXERS)
        deltanet = self.mixer == "gated_deltanet"
        if deltanet != isinstance(self.delta_net, DeltaNetSpec):
            expected = (
                "a DeltaNetSpec for mixer='gated_deltanet'" if deltanet else "None for mixer='attention'"
            )
            raise _fail("BlockSpec", "delta_net", expected, type(self.delta_net).__name__)

    @property
    def d_model(self) -> int:
        """The residual stream's width (the attention's)."""
        return self.attention.d_model


def features_of(spec: AttentionSpec | BlockSpec) -> list[str]:
    """The names of the features ``spec`` sets beyond the classic block, in :data:`ATTENTION_FEATURES`
    order, then ``"layout"`` for a block whose layout is ``"parallel"`` and ``"moe"`` for a block whose
    MLP is a mixture of experts; ``"mixer"`` alone first for a Gated DeltaNet block (its attention
    fields are not used)."""
    if isinstance(spec, BlockSpec) and spec.mixer != "attention":
        return ["mixer"] + (["moe"] if spec.mlp.kind == "moe" else [])
    attention = spec.attention if isinstance(spec, BlockSpec) else spec
    found = [name for name in ATTENTION_FEATURES if getattr(attention, name) not in (None, False)]
    if isinstance(spec, BlockSpec) and spec.layout == "parallel":
        found.append("layout")
    if isinstance(spec, BlockSpec) and spec.mlp.kind == "moe":
        found.append("moe")
    return found


def refuse_unsupported(spec: AttentionSpec | BlockSpec, executor: str, supported: tuple[str, ...]) -> None:
    """Raise ``ValueError("{executor} does not support the attention field '{name}' ...")`` for the first
    feature of ``spec`` (:func:`features_of`) that is not in ``supported``; the ``parallel`` layout is
    named as ``the block field 'layout' ('parallel')``, a mixture of experts as ``the block field
    'mlp.kind' ('moe' ...)``. Nothing where every feature is supported."""
    for name in features_of(spec):
        if name in supported:
            continue
        if name == "layout":
            raise ValueError(f"{executor} does not support the block field 'layout' ('parallel')")
        if name == "mixer":
            raise ValueError(
                f"{executor} does not support the block field 'mixer' ('gated_deltanet': Gated DeltaNet "
                "linear attention)"
            )
        if name == "moe":
            raise ValueError(
                f"{executor} does not support the block field 'mlp.kind' ('moe': mixture of experts)"
            )
        attention = spec.attention if isinstance(spec, BlockSpec) else spec
        raise ValueError(
            f"{executor} does not support the attention field {name!r} (set to {getattr(attention, name)!r})"
        )
