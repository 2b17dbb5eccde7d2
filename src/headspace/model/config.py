"""ModelConfig: everything that fixes the shape and behaviour of an Encoder or Decoder.

Validated on construction (errors name the field), derived fields filled in, JSON round-trip through
``to_dict()`` / ``from_dict()``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ..attention.layer import resolve_head_dims
from ..attention.pruning import kept_kv_heads
from ..core.checks import check_index, check_positive_int, check_probability, is_int
from ..nn.alibi import check_slopes
from ..nn.positions import Rotary
from ..nn.spec import MLP_KINDS, AttentionSpec, BlockSpec, MLPSpec, NormSpec
from .block import ACTIVATIONS, NORM_KINDS, NORMS
from .hybrid import check_hybrid, delta_net_spec

ARCHS = ("encoder", "decoder")
#: The kinds of attention layer (``ModelConfig.layer_types``): a sliding window, every earlier key, or
#: a Gated DeltaNet (linear attention, ``delta_net``: :mod:`headspace.model.hybrid`).
LAYER_TYPES = ("sliding", "full", "linear")
#: How a model knows where a token is: a learned table added to the embeddings, rotary positions
#: (RoPE) in every attention layer, or nothing (causal decoders can do without: "NoPE").
POSITIONS = ("learned", "rotary", "none")

# the rotary fields and their defaults: any other value asks for positions="rotary"
_ROPE_DEFAULTS: dict[str, Any] = {
    "rope_theta": 10000.0,
    "rotary_fraction": 1.0,
    "rope_interleaved": False,
    "rope_scaling": None,
}


def _finite(value: Any) -> bool:
    """A real number (not a bool) that is finite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive_int(name: str, value: Any) -> None:
    check_positive_int(f"ModelConfig.{name}", value)


def _probability(name: str, value: Any) -> None:
    check_probability(f"ModelConfig.{name}", value)


@dataclass
class ModelConfig:
    """Everything that fixes the shape and behaviour of an :class:`Encoder` or :class:`Decoder`.

    Fields left as ``None`` are derived in ``__post_init__`` (their documented default), so a stored
    config always lists concrete values. Invalid values raise ``ValueError`` naming the field.
    ``to_dict()``/``from_dict()`` round-trip through JSON; a dict written before a field existed loads
    with that field's default, which keeps the old meaning (the fields from ``positions`` on came
    with Llama-family support: their defaults are GPT-2/BERT's choices).

    Llama-family decoders (Llama, Mistral, Qwen2) are, beside their sizes::

        ModelConfig(arch="decoder", positions="rotary", rope_theta=..., rope_scaling=...,
                    norm_kind="rmsnorm", mlp_kind="gated", act="silu", bias=False,
                    qkv_bias=False (Qwen2: True), tie_embeddings=..., ln_eps=rms_norm_eps)
    """

    #: "encoder" (BERT family: bidirectional, token-type embeddings) or "decoder" (GPT family: causal).
    arch: str = "encoder"
    #: Number of token ids (rows of the token embedding, columns of the logits).
    vocab_size: int = 30522
    #: Width of the residual stream.
    d_model: int = 512
    #: Number of transformer blocks.
    n_layers: int = 6
    #: Query heads per attention layer.
    n_heads: int = 8
    #: Width of one head; derived: d_model // n_heads (d_model must then be divisible by n_heads).
    d_head: int | None = None
    #: Key/value heads (grouped-query attention; must divide n_heads); derived: n_heads.
    n_kv_heads: int | None = None
    #: Hidden width of the feed-forward network (the paper's d_ff); derived: 4 * d_model.
    d_mlp: int | None = None
    #: The longest sequence the model accepts (with learned positions: the rows of the position table;
    #: with rotary positions: the largest position + 1).
    max_seq_len: int = 512
    #: Feed-forward activation, one of "gelu" (exact), "gelu_tanh", "relu", "silu" (the gate of a
    #: gated MLP: "silu" = SwiGLU); derived: encoder "gelu", decoder "gelu_tanh" (GPT-2's gelu_new).
    act: str | None = None
    #: "post" (LN after each residual add: BERT) or "pre" (LN before each sublayer: GPT-2); derived:
    #: encoder "post", decoder "pre".
    norm: str | None = None
    #: Dropout on each sublayer's output before the residual add, in [0, 1).
    dropout: float = 0.0
    #: Dropout on the attention pattern, in [0, 1).
    attn_dropout: float = 0.0
    #: Dropout on the embeddings; derived: dropout.
    emb_dropout: float | None = None
    #: LayerNorm (or RMSNorm) epsilon (BERT 1e-12, GPT-2 1e-5, Llama's rms_norm_eps 1e-5 or 1e-6).
    ln_eps: float = 1e-5
    #: Biases in the attention and feed-forward projections (the default of qkv_bias, out_bias and
    #: mlp_bias, which switch them apart).
    bias: bool = True
    #: Rows of the token-type (segment) embedding; 0 = none; derived: encoder 2, decoder 0.
    type_vocab_size: int | None = None
    #: Decoder: the output projection is the token embedding transposed; derived: decoder True,
    #: encoder False (an encoder has no output projection).
    tie_embeddings: bool | None = None
    #: Id of the padding token (None = no padding token); must be < vocab_size.
    pad_token_id: int | None = None
    #: LayerNorm on the embeddings (BERT); derived: norm == "post".
    embed_ln: bool | None = None
    #: LayerNorm after the last block (GPT-2's ln_f); derived: norm == "pre".
    final_ln: bool | None = None
    #: Standard deviation of the normal initialisation of embeddings and feed-forward weights.
    init_std: float = 0.02
    #: A free-form name shown in summaries (e.g. "all-MiniLM-L6-v2").
    name: str = ""
    #: Free-form extra information (e.g. where the weights came from); must be JSON-serialisable.
    extra: dict[str, Any] = field(default_factory=dict)
    #: Heads removed for good, ``{layer: [original head indices]}`` (empty: none): the model is built
    #: with those heads' rows of W_Q (and of W_K/W_V for a key/value group that loses all its query
    #: heads) and columns of W_O left out, as :func:`headspace.prune_heads` leaves them, so a pruned
    #: model's config rebuilds it and its saved weights load back. Sorted and checked here: layers in
    #: [0, n_layers), heads in [0, n_heads), at least one head kept per layer, equal group sizes under
    #: grouped-query attention. JSON keys (strings) are read back as ints.
    pruned_heads: dict[int, list[int]] = field(default_factory=dict)
    #: Position information, one of "learned" (a table of max_seq_len rows added to the token
    #: embeddings: BERT, GPT-2), "rotary" (RoPE: queries and keys rotated in every attention layer, no
    #: table: Llama) or "none" (no position information).
    positions: str = "learned"
    #: Rotary only: the RoPE base ("rope_theta"; Llama 2 10000, Llama 3 500000).
    rope_theta: float = 10000.0
    #: Rotary only: share of each head's features that rotate, in (0, 1] ("partial_rotary_factor");
    #: int(d_head * rotary_fraction) must be even. The others pass through unrotated.
    rotary_fraction: float = 1.0
    #: Rotary only: pair features (2i, 2i + 1) (GPT-J, Meta's checkpoints) instead of (i, i + rotary_dim/2)
    #: (Hugging Face's rotate-half, what Llama checkpoints in transformers' layout need).
    rope_interleaved: bool = False
    #: Rotary only: None, or transformers' rope_scaling dict: {"rope_type": "linear", "factor": f} or
    #: {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    #: "original_max_position_embeddings"} (validated by headspace.positions.Rotary).
    rope_scaling: dict[str, Any] | None = None
    #: The normalisation layers (blocks, embeddings, final): "layernorm" (weight and bias) or "rmsnorm"
    #: (weight only, no mean subtraction: Llama).
    norm_kind: str = "layernorm"
    #: The feed-forward network: "plain" (act(x W_in) W_out) or "gated" (act(x W_gate) * (x W_in)) W_out,
    #: SwiGLU with act="silu").
    mlp_kind: str = "plain"
    #: mlp_kind="moe" only (mixture of experts, :mod:`headspace.model.moe`): the number of experts (each
    #: a gated MLP of width d_mlp), how many each token takes, whether their k weights are renormalised
    #: to sum to 1, and the width of the shared gated expert (None: none).
    n_experts: int | None = None
    experts_top_k: int | None = None
    experts_norm_topk: bool = False
    shared_expert_d_mlp: int | None = None
    #: mlp_kind="moe": how the k experts are weighed ("softmax_topk" or gpt-oss's "topk_softmax"), a
    #: router bias, and gpt-oss's clamped SwiGLU (limit, alpha; None: the plain gated act).
    experts_routing: str = "softmax_topk"
    router_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None
    #: Learned attention sinks on every layer (gpt-oss: one logit per head in each row's softmax).
    attn_sink: bool = False
    #: Biases on the q, k and v projections; derived: bias (Qwen2: True with bias=False).
    qkv_bias: bool | None = None
    #: Bias on the attention output projection (b_O); derived: bias.
    out_bias: bool | None = None
    #: Biases in the feed-forward projections; derived: bias.
    mlp_bias: bool | None = None
    #: Sliding-window attention: on a "sliding" layer (``layer_types``) query i sees key j iff
    #: i - sliding_window < j <= i (positions absolute, also with a KV cache); None: no window. A window
    #: longer than ``max_seq_len`` is stored as ``max_seq_len`` (the same maths: every earlier key).
    sliding_window: int | None = None
    #: One of "sliding" / "full" per layer; derived: all "sliding" with a sliding_window, else all "full".
    layer_types: list[str] | None = None
    #: Rotary only: the RoPE base of the "sliding" layers (Gemma 3's rope_local_base_freq 10000; the
    #: "full" layers use rope_theta); None: rope_theta on every layer.
    rope_local_theta: float | None = None
    #: Layers whose attention has no rotary positions (NoPE: SmolLM3's no_rope_layers); empty: none.
    nope_layers: list[int] = field(default_factory=list)
    #: QK-norm: None, "head" (RMSNorm of each head's q and k over d_head before RoPE: Qwen3, Gemma 3)
    #: or "all" (one RMSNorm over all heads' q, one over all k: OLMo 2). Needs norm_kind="rmsnorm".
    qk_norm: str | None = None
    #: Every RMSNorm scales by (norm_offset + weight): 0 (Llama), 1 (Gemma's 1 + w).
    norm_offset: float = 0.0
    #: Attention logit soft-capping (Gemma 2): scores s -> cap * tanh(s / cap) before the mask; None: off.
    attn_softcap: float | None = None
    #: Final-logit soft-capping (Gemma 2): logits -> cap * tanh(logits / cap); None: off.
    final_softcap: float | None = None
    #: The token embeddings are multiplied by this (Gemma: sqrt(d_model)); the unembedding is not.
    embed_scale: float = 1.0
    #: Scores are scaled by 1 / sqrt(query_pre_attn_scalar) (Gemma's field); None: d_head.
    query_pre_attn_scalar: float | None = None
    #: The unembedding has a bias (GPT-J, Phi: logits = h W_U + b_U); needs an untied unembedding.
    unembed_bias: bool = False
    #: ALiBi (BLOOM, MPT, Falcon's alibi variant): one slope m_h per head, -m_h (i - j) added to every
    #: layer's scaled scores (headspace.nn.alibi); None: no ALiBi.
    alibi_slopes: list[float] | None = None
    #: Output gates on every softmax layer (Qwen3-Next): None, "elementwise" or "headwise".
    attn_gate: str | None = None
    #: The Gated DeltaNet of the "linear" layers (``layer_types``): None or a dict (model/hybrid.py).
    delta_net: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"ModelConfig.arch must be one of {list(ARCHS)}; got {self.arch!r}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            _positive_int(name, getattr(self, name))
        try:
            self.d_head, self.n_kv_heads = resolve_head_dims(
                self.d_model, self.n_heads, self.d_head, self.n_kv_heads
            )
        except ValueError as e:
            raise ValueError(f"ModelConfig: {e}") from None
        encoder = self.arch == "encoder"
        if self.d_mlp is None:
            self.d_mlp = 4 * self.d_model
        _positive_int("d_mlp", self.d_mlp)
        if self.act is None:
            self.act = "gelu" if encoder else "gelu_tanh"
        if self.act not in ACTIVATIONS:
            raise ValueError(f"ModelConfig.act must be one of {list(ACTIVATIONS)}; got {self.act!r}")
        if self.norm is None:
            self.norm = "post" if encoder else "pre"
        if self.norm not in NORMS:
            raise ValueError(f"ModelConfig.norm must be one of {list(NORMS)}; got {self.norm!r}")
        if self.emb_dropout is None:
            self.emb_dropout = self.dropout
        for name in ("dropout", "attn_dropout", "emb_dropout"):
            _probability(name, getattr(self, name))
        if (
            isinstance(self.ln_eps, bool)
            or not isinstance(self.ln_eps, (int, float))
            or not math.isfinite(self.ln_eps)
            or not self.ln_eps > 0
        ):
            raise ValueError(f"ModelConfig.ln_eps must be a finite positive float; got {self.ln_eps!r}")
        if self.type_vocab_size is None:
            self.type_vocab_size = 2 if encoder else 0
        if (
            not isinstance(self.type_vocab_size, int)
            or isinstance(self.type_vocab_size, bool)
            or self.type_vocab_size < 0
        ):
            raise ValueError(f"ModelConfig.type_vocab_size must be an int >= 0; got {self.type_vocab_size!r}")
        if self.tie_embeddings is None:
            self.tie_embeddings = not encoder
        if self.embed_ln is None:
            self.embed_ln = self.norm == "post"
        if self.final_ln is None:
            self.final_ln = self.norm in ("pre", "sandwich", "post_sublayer", "parallel")
        for name in ("bias", "tie_embeddings", "embed_ln", "final_ln"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name} must be a bool; got {getattr(self, name)!r}")
        if self.pad_token_id is not None and (
            not isinstance(self.pad_token_id, int)
            or isinstance(self.pad_token_id, bool)
            or not 0 <= self.pad_token_id < self.vocab_size
        ):
            raise ValueError(
                f"ModelConfig.pad_token_id must be None or an int in [0, vocab_size={self.vocab_size}); "
                f"got {self.pad_token_id!r}"
            )
        if (
            isinstance(self.init_std, bool)
            or not isinstance(self.init_std, (int, float))
            or not math.isfinite(self.init_std)
            or self.init_std <= 0
        ):
            raise ValueError(f"ModelConfig.init_std must be a finite positive float; got {self.init_std!r}")
        if not isinstance(self.name, str):
            raise ValueError(f"ModelConfig.name must be a str; got {self.name!r}")
        if not isinstance(self.extra, dict):
            raise ValueError(f"ModelConfig.extra must be a dict; got {type(self.extra).__name__}")
        self.pruned_heads = _checked_pruned_heads(
            self.pruned_heads, self.n_layers, self.n_heads, self.n_kv_heads
        )
        self._check_llama_fields()
        self._check_layer_fields()
        if self.alibi_slopes is not None:
            slopes = check_slopes("ModelConfig.alibi_slopes", self.alibi_slopes, self.n_heads)
            self.alibi_slopes = list(slopes)
        check_hybrid(self)

    def _check_layer_fields(self) -> None:
        """The fields that came with Gemma / Qwen3 / OLMo 2 / SmolLM3 / Mistral's sliding window."""
        window = self.sliding_window
        if window is not None and (not is_int(window) or window < 1):
            raise ValueError(f"ModelConfig.sliding_window must be None or an int >= 1; got {window!r}")
        if window is not None and window > self.max_seq_len:
            # a window past the position table sees every earlier key of any input the model takes: the
            # table's length is the same maths, and it fits every executor's integers (2**63 did not)
            self.sliding_window = window = self.max_seq_len
        if self.layer_types is None:
            self.layer_types = ["sliding" if window is not None else "full"] * self.n_layers
        types = self.layer_types
        if (
            not isinstance(types, list)
            or len(types) != self.n_layers
            or any(t not in LAYER_TYPES for t in types)
        ):
            raise ValueError(
                f"ModelConfig.layer_types must list {list(LAYER_TYPES)}, one per layer "
                f"(n_layers={self.n_layers}); got {types!r:.120}"
            )
        if "sliding" in types and window is None:
            raise ValueError("ModelConfig.layer_types has 'sliding' layers but sliding_window is None")
        nope = self.nope_layers
        if not isinstance(nope, list) or any(not is_int(i) or not 0 <= i < self.n_layers for i in nope):
            raise ValueError(
                f"ModelConfig.nope_layers must be a list of layer indices in [0, n_layers={self.n_layers}); "
                f"got {nope!r:.120}"
            )
        self.nope_layers = sorted(set(nope))
        if (nope or self.rope_local_theta is not None) and self.positions != "rotary":
            raise ValueError("ModelConfig.nope_layers and rope_local_theta need positions='rotary'")
        local = self.rope_local_theta
        if local is not None and (not _finite(local) or local <= 0):
            raise ValueError(
                f"ModelConfig.rope_local_theta must be None or a finite number > 0; got {local!r}"
            )
        if self.qk_norm not in (None, "head", "all", "head_layernorm"):
            raise ValueError(
                f"ModelConfig.qk_norm must be None, 'head', 'all' or 'head_layernorm'; got {self.qk_norm!r}"
            )
        if self.qk_norm in ("head", "all") and self.norm_kind != "rmsnorm":
            raise ValueError("ModelConfig.qk_norm is an RMSNorm: it needs norm_kind='rmsnorm'")
        if not _finite(self.norm_offset) or (self.norm_offset and self.norm_kind != "rmsnorm"):
            raise ValueError(
                f"ModelConfig.norm_offset must be a finite number, non-zero only with norm_kind='rmsnorm'; "
                f"got {self.norm_offset!r} with norm_kind={self.norm_kind!r}"
            )
        for name in ("attn_softcap", "final_softcap", "query_pre_attn_scalar"):
            v = getattr(self, name)
            if v is not None and (not _finite(v) or v <= 0):
                raise ValueError(f"ModelConfig.{name} must be None or a finite number > 0; got {v!r}")
        if not _finite(self.embed_scale) or self.embed_scale <= 0:
            raise ValueError(f"ModelConfig.embed_scale must be a finite number > 0; got {self.embed_scale!r}")
        if not isinstance(self.unembed_bias, bool) or (self.unembed_bias and self.tie_embeddings):
            raise ValueError(
                f"ModelConfig.unembed_bias must be a bool, True only with tie_embeddings=False; "
                f"got {self.unembed_bias!r} with tie_embeddings={self.tie_embeddings!r}"
            )

    @property
    def attn_scale(self) -> float:
        """The score scale: 1 / sqrt(query_pre_attn_scalar), or 1 / sqrt(d_head) without it."""
        d = self.d_head if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
        return 1.0 / math.sqrt(d)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None on a "full" layer)."""
        assert self.layer_types is not None
        return self.sliding_window if self.layer_types[layer] == "sliding" else None

    def block_spec(self, layer: int, positions: Rotary | None = None) -> BlockSpec:
        """Block ``layer``'s description (:class:`~headspace.nn.spec.BlockSpec`), built from this config
        once per block: its window (:meth:`layer_window`), the score scale, soft-cap, QK-norm, biases,
        norms and MLP. ``positions``: the block's rotation (the model's shared one from
        :meth:`make_rotaries`; None for no rotation)."""
        layer = check_index("layer", layer, self.n_layers, of="n_layers")
        assert self.d_head is not None and self.n_kv_heads is not None and self.d_mlp is not None
        assert self.act is not None and self.norm is not None
        bias = self.bias
        attention = AttentionSpec(
            self.d_model, self.n_heads, self.d_head, self.n_kv_heads,
            qkv_bias=bias if self.qkv_bias is None else self.qkv_bias,
            out_bias=bias if self.out_bias is None else self.out_bias,
            positions=positions, scale=self.attn_scale, window=self.layer_window(layer),
            softcap=self.attn_softcap, qk_norm=self.qk_norm, qk_norm_eps=self.ln_eps,
            qk_norm_offset=self.norm_offset, dropout=self.attn_dropout,
            sink="learned" if self.attn_sink else None, gate=self.attn_gate,
            bias=None if self.alibi_slopes is None else "alibi",
            alibi_slopes=None if self.alibi_slopes is None else tuple(self.alibi_slopes),
        )  # fmt: skip
        linear = self.layer_types is not None and self.layer_types[layer] == "linear"
        return BlockSpec(
            mixer="gated_deltanet" if linear else "attention",
            delta_net=delta_net_spec(self) if linear else None,
            attention=attention,
            mlp=MLPSpec(
                self.d_mlp,
                self.mlp_kind,
                self.act,
                bias if self.mlp_bias is None else self.mlp_bias,
                n_experts=self.n_experts,
                top_k=self.experts_top_k,
                norm_topk=self.experts_norm_topk,
                d_shared=self.shared_expert_d_mlp,
                routing=self.experts_routing,
                router_bias=self.router_bias,
                swiglu_limit=self.swiglu_limit,
                swiglu_alpha=self.swiglu_alpha,
            ),
            norm=NormSpec(self.norm_kind, float(self.ln_eps), float(self.norm_offset)),
            layout=self.norm,
            dropout=float(self.dropout),
        )

    def block_specs(self) -> list[BlockSpec]:
        """Every block's description (:meth:`block_spec`), the rotations shared as :meth:`make_rotaries`
        makes them."""
        return [self.block_spec(i, rotary) for i, rotary in enumerate(self.make_rotaries())]

    def make_rotaries(self) -> list[Rotary | None]:
        """One :class:`~headspace.positions.Rotary` (or None: NoPE) per layer; layers of one kind share
        one object (the "full" layers' base rope_theta, the "sliding" layers' rope_local_theta; "linear"
        layers have none)."""
        full = self.make_rotary()
        if full is None:
            return [None] * self.n_layers
        local = full
        if self.rope_local_theta is not None:
            local = Rotary(
                self.d_head,
                base=float(self.rope_local_theta),
                fraction=float(self.rotary_fraction),
                interleaved=self.rope_interleaved,
            )
        assert self.layer_types is not None
        return [
            None if i in self.nope_layers or t == "linear" else (local if t == "sliding" else full)
            for i, t in enumerate(self.layer_types)
        ]

    def _check_mlp_spec(self) -> None:
        """The MLP fields (the experts' among them) checked as the blocks' ``MLPSpec`` checks them."""
        assert self.d_mlp is not None and self.act is not None
        try:
            MLPSpec(
                self.d_mlp, self.mlp_kind, self.act, bool(self.mlp_bias), n_experts=self.n_experts,
                top_k=self.experts_top_k, norm_topk=self.experts_norm_topk, d_shared=self.shared_expert_d_mlp,
                routing=self.experts_routing, router_bias=self.router_bias, swiglu_limit=self.swiglu_limit,
                swiglu_alpha=self.swiglu_alpha,
            )  # fmt: skip
        except ValueError as e:
            raise ValueError(f"ModelConfig: {e}") from None

    def _check_llama_fields(self) -> None:
        """positions and the rotary fields, norm_kind, mlp_kind and the three bias switches."""
        if self.positions not in POSITIONS:
            raise ValueError(
                f"ModelConfig.positions must be one of {list(POSITIONS)}; got {self.positions!r}"
            )
        if self.norm_kind not in NORM_KINDS:
            raise ValueError(
                f"ModelConfig.norm_kind must be one of {list(NORM_KINDS)}; got {self.norm_kind!r}"
            )
        if self.mlp_kind not in MLP_KINDS:
            raise ValueError(
                f"ModelConfig.mlp_kind must be one of {list(MLP_KINDS)} ('gated' = SwiGLU / GeGLU, 'moe' = "
                "mixture of experts); "
                f"got {self.mlp_kind!r}"
            )
        for name in ("qkv_bias", "out_bias", "mlp_bias"):
            if getattr(self, name) is None:
                setattr(self, name, self.bias)
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"ModelConfig.{name} must be a bool (or None for bias); got {getattr(self, name)!r}"
                )
        self._check_mlp_spec()
        theta = self.rope_theta
        if (
            isinstance(theta, bool)
            or not isinstance(theta, (int, float))
            or not math.isfinite(theta)
            or theta <= 0
        ):
            raise ValueError(f"ModelConfig.rope_theta must be a finite number > 0; got {theta!r}")
        frac = self.rotary_fraction
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac <= 1:
            raise ValueError(f"ModelConfig.rotary_fraction must be a number in (0, 1]; got {frac!r}")
        if not isinstance(self.rope_interleaved, bool):
            raise ValueError(f"ModelConfig.rope_interleaved must be a bool; got {self.rope_interleaved!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ValueError(
                "ModelConfig.rope_scaling must be None or a dict such as "
                "{'rope_type': 'linear', 'factor': 2.0}; "
                f"got {type(self.rope_scaling).__name__}"
            )
        if self.positions != "rotary":
            changed = [k for k, v in _ROPE_DEFAULTS.items() if getattr(self, k) != v]
            if changed:
                raise ValueError(
                    f"ModelConfig: {', '.join(f'{k}={getattr(self, k)!r}' for k in changed)} set but "
                    f"positions={self.positions!r}; the rotary fields need positions='rotary'"
                )
            return
        try:
            Rotary(self.d_head, base=float(theta), fraction=float(frac), interleaved=self.rope_interleaved)
        except ValueError as e:
            raise ValueError(f"ModelConfig.rotary_fraction: {e}") from None
        try:
            self.make_rotary()
        except (TypeError, ValueError) as e:
            raise ValueError(f"ModelConfig.rope_scaling: {e}") from None

    def make_rotary(self) -> Rotary | None:
        """A :class:`~headspace.positions.Rotary` for this config's heads (None unless positions="rotary")."""
        if self.positions != "rotary":
            return None
        return Rotary(
            self.d_head,
            base=float(self.rope_theta),
            fraction=float(self.rotary_fraction),
            interleaved=self.rope_interleaved,
            scaling=None if self.rope_scaling is None else dict(self.rope_scaling),
        )

    def kept_heads(self, layer: int) -> list[int]:
        """The original indices of the heads layer ``layer`` keeps (all ``n_heads`` unless pruned)."""
        check_index("layer", layer, self.n_layers, of="n_layers")
        pruned = set(self.pruned_heads.get(layer, ()))
        return [h for h in range(self.n_heads) if h not in pruned]

    def to_dict(self) -> dict[str, Any]:
        """Every field, derived ones included, as JSON values (``pruned_heads`` keys as strings)."""
        d = dataclasses.asdict(self)
        d["pruned_heads"] = {str(layer): heads for layer, heads in self.pruned_heads.items()}
        if self.sliding_window is None and set(self.layer_types or ()) <= {"full"}:
            d["layer_types"] = None  # every layer full: derived again on load (files as before windows)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build a config from :meth:`to_dict` output; unknown keys are an error that lists them."""
        if not isinstance(data, dict):
            raise TypeError(f"ModelConfig.from_dict expects a dict; got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"ModelConfig.from_dict: unknown fields {unknown}; known fields: {sorted(known)}"
            )
        return cls(**data)

    def summary(self) -> str:
        """One line: architecture and sizes."""
        name = f"{self.name}: " if self.name else ""
        return (
            f"{name}{self.arch}, {self.n_layers} layers x {self.n_heads} heads, d_model {self.d_model}, "
            f"d_head {self.d_head}, d_mlp {self.d_mlp}, vocab {self.vocab_size}, "
            f"max_seq_len {self.max_seq_len}, "
            f"{self.norm}-LN, {self.act}"
            + (f", {self.norm_kind}" if self.norm_kind != "layernorm" else "")
            + (f", {self.mlp_kind} MLP" if self.mlp_kind != "plain" else "")
            + (f", positions {self.positions}" if self.positions != "learned" else "")
            + (f" (theta {self.rope_theta:g})" if self.positions == "rotary" else "")
            + (", ALiBi" if self.alibi_slopes is not None else "")
            + (f", {sum(map(len, self.pruned_heads.values()))} heads pruned" if self.pruned_heads else "")
            + self._layer_summary()
        )

    def _layer_summary(self) -> str:
        """The #27 features that are on, for :meth:`summary` ("" for a classic model)."""
        parts = []
        types = self.layer_types or []
        if self.sliding_window is not None:
            parts.append(f"window {self.sliding_window} on {types.count('sliding')}/{len(types)} layers")
        if self.rope_local_theta is not None:
            parts.append(f"local theta {self.rope_local_theta:g}")
        if self.nope_layers:
            parts.append(f"NoPE layers {self.nope_layers}")
        if self.qk_norm is not None:
            parts.append(f"QK-norm ({self.qk_norm})")
        if self.norm_offset:
            parts.append(f"norms ({self.norm_offset:g} + w)")
        for name, v in (("attn softcap", self.attn_softcap), ("final softcap", self.final_softcap)):
            if v is not None:
                parts.append(f"{name} {v:g}")
        if self.embed_scale != 1.0:
            parts.append(f"embed x {self.embed_scale:.4g}")
        if self.query_pre_attn_scalar is not None:
            parts.append(f"scale 1/sqrt({self.query_pre_attn_scalar:g})")
        if "linear" in types:
            parts.append(f"Gated DeltaNet on {types.count('linear')}/{len(types)} layers")
        if self.attn_gate is not None:
            parts.append(f"{self.attn_gate} output gates")
        return "".join(f", {p}" for p in parts)


def _checked_pruned_heads(value: Any, n_layers: int, n_heads: int, n_kv_heads: int) -> dict[int, list[int]]:
    """``ModelConfig.pruned_heads`` normalised to ``{layer: sorted heads}`` (int keys, no empty lists)."""
    what = "ModelConfig.pruned_heads must be a dict {layer: [head, ...]}"
    if not isinstance(value, dict):
        raise ValueError(f"{what}; got {type(value).__name__}")
    out: dict[int, list[int]] = {}
    for key, heads in value.items():
        layer = int(key) if isinstance(key, str) and key.isdigit() else key
        if not is_int(layer) or not 0 <= layer < n_layers:
            raise ValueError(f"{what} with layers in [0, n_layers={n_layers}); got layer {key!r}")
        if layer in out:
            raise ValueError(f"{what}; layer {layer} is given twice ({key!r})")
        if isinstance(heads, (str, bytes, dict)) or not hasattr(heads, "__iter__"):
            raise ValueError(f"{what}; got {heads!r} for layer {layer}")
        heads = list(heads)
        for h in heads:
            if not is_int(h) or not 0 <= h < n_heads:
                raise ValueError(f"{what} with heads in [0, n_heads={n_heads}); got {h!r} for layer {layer}")
        heads = sorted(set(heads))
        if len(heads) == n_heads:
            raise ValueError(
                f"ModelConfig.pruned_heads[{layer}] prunes all {n_heads} heads; a layer needs at least one"
            )
        kept_kv_heads(
            n_heads,
            n_kv_heads,
            [h for h in range(n_heads) if h not in heads],
            f"ModelConfig.pruned_heads[{layer}]",
        )
        if heads:
            out[layer] = heads
    return dict(sorted(out.items()))
