"""Llama-family checkpoints (Hugging Face Llama, Mistral, Qwen2 folders) onto a headspace Decoder.

What the three architectures are, in headspace's terms (transformers' ``LlamaForCausalLM``,
``MistralForCausalLM``, ``Qwen2ForCausalLM``)::

    h_0 = E_tok[t]                                  (no position table)
    h   = x + Attn(RMSNorm_1(x))                    queries and keys rotated by RoPE (rotate-half)
    out = h + (silu(RMSNorm_2(h) W_gate) * (RMSNorm_2(h) W_in)) W_out
    logits = RMSNorm_f(h_L) W_U                     W_U = E_tok^T when tie_word_embeddings

Grouped-query attention (``num_key_value_heads``) and an explicit ``head_dim`` are kept as they are.
Biases: Llama's ``attention_bias`` puts them on q, k, v and o; its ``mlp_bias`` on the three MLP
projections; Qwen2 has them on q, k and v only; Mistral has none.

Tensor names (``model.``-prefixed in ``*ForCausalLM`` checkpoints, bare in ``*Model`` ones)::

    model.embed_tokens.weight                          [vocab, hidden]          -> tok_embed.weight
    model.layers.N.self_attn.{q,k,v}_proj.weight       [heads * head_dim, hidden] -> blocks.N.attn.qkv_weight
    model.layers.N.self_attn.o_proj.weight             [hidden, heads * head_dim] -> blocks.N.attn.o_weight
    model.layers.N.mlp.{gate,up,down}_proj.weight      -> blocks.N.mlp.fc_gate / fc_in / fc_out
    model.layers.N.{input,post_attention}_layernorm    -> blocks.N.ln1 / ln2
    model.norm.weight                                  -> ln_final.weight
    lm_head.weight                                     -> lm_head.weight (untied only)

Untrusted folders, with :mod:`headspace.pretrained.hf`'s checks: ``config.json`` and the shard index are
read as regular files of bounded size; every safetensors header is parsed and checked against its file's
size before anything is read; the parameter count the configuration implies is compared with what the
headers hold before any tensor is allocated; names, shapes and dtypes are checked from the headers; a
shard index may only name files of the folder itself. Settings headspace cannot reproduce exactly are
refused with an error naming the field and what is supported (see :func:`llama_config`).

The pieces are public so that other readers (the GGUF reader, :mod:`headspace.gguf_format`, which yields
a Hugging Face-style config dict and HF-named float32 tensors) reuse the converter::

    g = read_gguf(path)
    model = llama_from_tensors(g.hf_config, g.tensors, g.tokenizer, name=path.stem, source=str(path))
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..model.config import ModelConfig
from ..model.models import Decoder, check_precision
from .config_checks import MAX_HEAD_DIM, MAX_LAYERS, at_most, refuse_rope_scaling_beside_parameters
from .empty_weights import SkipMetaInit as _SkipMetaInit
from .empty_weights import all_finite_floats as _all_finite_floats  # re-exported: tests use it
from .empty_weights import allocate_parameters as _allocate_parameters
from .family_frame import folder_headers, open_family, read_listed
from .hf import (
    ConfigFields,
    SafetensorsHeader,
    TensorEntry,
    check_parameter_count,
    check_tensors,
    check_values,
    folder_tokenizer,
)
from .llama_variants import (
    VARIANT_CONTEXT,
    VARIANT_MODEL_TYPES,
    extra_tensors,
    hidden_act_key,
    local_rope,
    variant_fields,
    windows,
)
from .rope_config import extend_rope
from .tokenization import TextTokenizer
from .wrappers import PretrainedDecoder

__all__ = [
    "LLAMA_MODEL_TYPES",
    "EmptyLlama",
    "empty_llama",
    "llama_config",
    "llama_expected",
    "llama_from_tensors",
    "llama_parameter_count",
    "llama_state_dict",
    "load_llama",
]

#: ``config.json`` model types :func:`load_llama` reads.
LLAMA_MODEL_TYPES = ("llama", "mistral", "qwen2", *VARIANT_MODEL_TYPES)

# transformers' ACT2FN names -> headspace activations (the same functions)
_HIDDEN_ACT = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
}
# transformers' defaults where config.json is silent (LlamaConfig, MistralConfig, Qwen2Config)
_DEFAULT_CONTEXT = {"llama": 2048, "mistral": 131072, "qwen2": 32768, **VARIANT_CONTEXT}


# ----------------------------------------------------------------------------------------------- config
def _rope(hf: Mapping[str, Any], f: ConfigFields) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling for :class:`~headspace.positions.Rotary` or None) from either spelling.

    transformers 5 writes ``rope_parameters`` ({"rope_type", "rope_theta", scaling keys}); older configs
    have ``rope_theta`` at the top and ``rope_scaling`` ({"type" or "rope_type", ...}) or null.
    """
    key = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
    scaling = hf.get(key)
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"{f.source}: {key} must be null or an object; got {scaling!r:.80}")
    scaling = dict(scaling or {})
    if any(isinstance(v, dict) for v in scaling.values()):
        raise ValueError(
            f"{f.source}: {key} holds one setting per layer type; a Llama-family model has one "
            "(supported: a single object such as {'rope_type': 'default', 'rope_theta': 10000.0}); "
            f"got {scaling!r:.120}"
        )
    if key == "rope_parameters":
        refuse_rope_scaling_beside_parameters(hf, scaling, f.source)  # transformers would apply it
    theta_fields = ConfigFields(scaling, f"{f.source} {key}") if "rope_theta" in scaling else f
    theta = theta_fields.number("rope_theta", 10000.0, low=0.0, low_open=True)
    scaling.pop("rope_theta", None)
    partial = scaling.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(
            f"{f.source}: partial_rotary_factor={partial!r:.40}: transformers' Llama, Mistral and Qwen2 "
            "rotate every feature of a head (supported: 1.0 or absent)"
        )
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default") and set(scaling) <= {"rope_type", "type"}:
        return theta, None
    return theta, scaling


def _sizes(f: ConfigFields) -> tuple[int, int, int, int, int, int, int]:
    """(vocab, hidden, layers, heads, intermediate, key/value heads, head_dim) of a config, checked."""
    source = f.source
    f.require(["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"],
              "Llama-family")  # fmt: skip
    vocab = f.integer("vocab_size")
    d_model = f.integer("hidden_size")
    n_layers = at_most(source, "num_hidden_layers", f.integer("num_hidden_layers"), MAX_LAYERS)
    n_heads = f.integer("num_attention_heads")
    d_mlp = f.integer("intermediate_size")
    n_kv = f.integer("num_key_value_heads", None, allow_none=True) or n_heads
    d_head = at_most(source, "head_dim", f.integer("head_dim", None, allow_none=True), MAX_HEAD_DIM)
    if d_head is None:
        if d_model % n_heads:
            raise ValueError(
                f"{source}: hidden_size={d_model} is not divisible by num_attention_heads={n_heads} and "
                "there is no head_dim"
            )
        d_head = at_most(source, "hidden_size / num_attention_heads", d_model // n_heads, MAX_HEAD_DIM)
    if n_heads % n_kv:
        raise ValueError(
            f"{source}: num_attention_heads={n_heads} is not divisible by num_key_value_heads={n_kv}"
        )
    return vocab, d_model, n_layers, n_heads, d_mlp, n_kv, d_head


def _context(f: ConfigFields, kind: str, max_seq_len: int | None) -> int:
    """``max_position_embeddings`` (the model type's default), or ``max_seq_len`` (at most that)."""
    context = f.integer("max_position_embeddings", _DEFAULT_CONTEXT[kind])
    if max_seq_len is None:
        return context
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
        raise ValueError(f"max_seq_len must be None or a positive int; got {max_seq_len!r}")
    if max_seq_len > context:
        raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's max_position_embeddings={context}")
    return max_seq_len


def _pad_id(f: ConfigFields, vocab: int) -> int | None:
    """``pad_token_id`` (None for null or the -1 old Llama configs write), which must be < vocab."""
    pad = f.integer("pad_token_id", None, minimum=-(2**31), allow_none=True)
    if pad is not None and pad < 0:
        pad = None  # old Llama configs write -1 for "no padding token"
    if pad is not None and pad >= vocab:
        raise ValueError(f"{f.source}: pad_token_id must be < vocab_size={vocab}; got {pad}")
    return pad


def _biases(f: ConfigFields, kind: str) -> tuple[bool, bool, bool]:
    """(q/k/v, output, MLP) biases: Llama's ``attention_bias`` / ``mlp_bias``; transformers' Mistral
    has none; Qwen2 has them on q, k, v only (whatever the config says); the variants set their own."""
    if kind == "llama":
        attention = f.flag("attention_bias", False)
        return attention, attention, f.flag("mlp_bias", False)
    return kind == "qwen2", False, False


def llama_config(
    hf: Mapping[str, Any], name: str = "", *, max_seq_len: int | None = None, source: str = "config.json"
) -> ModelConfig:
    """A headspace :class:`ModelConfig` from a Hugging Face ``config.json`` dict of a Llama-family model.

    Supported: ``model_type`` in :data:`LLAMA_MODEL_TYPES` (llama, mistral, qwen2 and the variants of
    :mod:`headspace.pretrained.llama_variants`: gemma2, gemma3_text, qwen3, olmo2, smollm3);
    ``hidden_act`` (Gemma: ``hidden_activation``) silu (swish), gelu, gelu_new, gelu_pytorch_tanh or
    relu; RoPE with ``rope_scaling`` / ``rope_parameters`` of type default, linear or llama3 (both
    spellings; Gemma 3's per-layer-type ``rope_parameters``), yarn, dynamic and longrope
    (:mod:`~headspace.nn.rope_scaling`); grouped-query attention; an explicit
    ``head_dim``; biases as each architecture has them; tied or untied embeddings; sliding windows on
    the layers ``layer_types`` (or the model type's rule) names, exactly. Refused, with an error naming
    the field: any other model_type, hidden_act or rope type,
    ``partial_rotary_factor`` != 1, a ``quantization_config``, ``layer_types`` other than full and
    sliding attention, bidirectional Gemma attention, a ``rope_scaling`` beside ``rope_parameters``
    that says something else, absurd layer counts and head widths
    (:mod:`~headspace.pretrained.config_checks`). Every field read is checked for type and range
    (:class:`~headspace.pretrained.hf.ConfigFields`): a string where a number or boolean belongs is an
    error, never converted.

    Args:
        hf: the ``config.json`` dict (or the GGUF reader's ``hf_config``).
        name: the model's name in summaries.
        max_seq_len: the longest sequence to accept (default: ``max_position_embeddings``; at most that).
        source: what ``hf`` came from, in error messages.

    Raises:
        ValueError: a field headspace cannot represent, of the wrong type or range, or missing, named.
    """
    if not isinstance(hf, Mapping):
        raise TypeError(f"hf must be a dict (config.json); got {type(hf).__name__}")
    f = ConfigFields(hf, source)
    kind = f.text("model_type", None, allow_none=True)
    if kind not in LLAMA_MODEL_TYPES:
        raise ValueError(
            f"{source}: model_type={kind!r} is not supported here; supported: {list(LLAMA_MODEL_TYPES)}"
        )
    if hf.get("quantization_config") is not None:
        raise ValueError(
            f"{source} has a quantization_config: quantized checkpoints (GPTQ, AWQ, bitsandbytes ...) are "
            "not supported; use the full-precision weights (float32, float16 or bfloat16)"
        )
    return _read_config(hf, f, kind, name, max_seq_len)


def _read_config(
    hf: Mapping[str, Any], f: ConfigFields, kind: str, name: str, max_seq_len: int | None
) -> ModelConfig:
    """:func:`llama_config` once ``model_type`` is known (``kind``) and no quantization is claimed."""
    source = f.source
    act_key = hidden_act_key(hf, kind)
    act = f.text(act_key, "gelu_pytorch_tanh" if act_key == "hidden_activation" else "silu")
    if act not in _HIDDEN_ACT:
        raise ValueError(f"{source}: {act_key}={act!r} is not supported; supported: {sorted(_HIDDEN_ACT)}")
    vocab, d_model, n_layers, n_heads, d_mlp, n_kv, d_head = _sizes(f)
    context = _context(f, kind, max_seq_len)
    window, layer_types = windows(f, kind, n_layers, context)
    full_rope, local_theta = local_rope(hf, f, kind)
    theta, scaling = _rope(full_rope, f)
    scaling, context = extend_rope(scaling, f, context, max_seq_len)  # YaRN, dynamic NTK, LongRoPE
    variant = variant_fields(f, kind, d_model, n_layers)
    qkv_bias, out_bias, mlp_bias = _biases(f, kind)
    pad = _pad_id(f, vocab)
    init = hf.get("initializer_range")
    init_std = 0.02 if init is None else f.number("initializer_range", low=0.0, low_open=True)
    extra = {
        "model_type": kind,
        **{k: hf[k] for k in ("bos_token_id", "eos_token_id") if hf.get(k) is not None},
    }
    kw: dict[str, Any] = dict(
        arch="decoder",
        vocab_size=vocab,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        d_head=d_head,
        n_kv_heads=n_kv,
        d_mlp=d_mlp,
        max_seq_len=context,
        act=_HIDDEN_ACT[act],
        norm="pre",
        dropout=0.0,
        attn_dropout=f.probability("attention_dropout", 0.0),
        emb_dropout=0.0,
        ln_eps=f.number("rms_norm_eps", 1e-6, low=0.0, low_open=True),
        bias=False,
        type_vocab_size=0,
        tie_embeddings=f.flag("tie_word_embeddings", False),
        pad_token_id=pad,
        embed_ln=False,
        final_ln=True,
        init_std=init_std,
        name=name,
        extra=extra,
        positions="rotary",
        rope_theta=theta,
        rope_scaling=scaling,
        norm_kind="rmsnorm",
        mlp_kind="gated",
        qkv_bias=qkv_bias,
        out_bias=out_bias,
        mlp_bias=mlp_bias,
        sliding_window=window,
        layer_types=layer_types,
        rope_local_theta=local_theta if layer_types else None,
    )
    kw.update(variant)
    try:
        return ModelConfig(**kw)
    except ValueError as e:
        raise ValueError(f"{source} does not fit headspace: {e}") from None


def _tensors(c: ModelConfig, prefix: str = "model.") -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    """(Decoder state-dict name, the Hugging Face tensors (name, shape) whose rows it stacks), every
    parameter of a checkpoint of config ``c``: one HF tensor per parameter, but for the fused
    ``qkv_weight`` / ``qkv_bias`` (q, k, v). The norms follow ``c.norm`` and ``c.qk_norm``
    (:func:`~headspace.pretrained.llama_variants.extra_tensors`)."""
    d, dm, q, kv = c.d_model, c.d_mlp, c.n_heads * c.d_head, c.n_kv_heads * c.d_head
    out: list[tuple[str, list[tuple[str, tuple[int, ...]]]]] = [
        ("tok_embed.weight", [(f"{prefix}embed_tokens.weight", (c.vocab_size, d))])
    ]
    qk_widths = (c.d_head, c.d_head) if c.qk_norm == "head" else (q, kv)
    for i in range(c.n_layers):
        p, b = f"{prefix}layers.{i}.", f"blocks.{i}."
        a = f"{p}self_attn."
        qkv = [(a + "q_proj.weight", (q, d)), (a + "k_proj.weight", (kv, d)), (a + "v_proj.weight", (kv, d))]
        out.append((b + "attn.qkv_weight", qkv))
        if c.qkv_bias:
            out.append(
                (b + "attn.qkv_bias", [(a + f"{x}_proj.bias", (n,)) for x, n in zip("qkv", (q, kv, kv))])
            )
        out.append((b + "attn.o_weight", [(a + "o_proj.weight", (d, q))]))
        if c.out_bias:
            out.append((b + "attn.o_bias", [(a + "o_proj.bias", (d,))]))
        for ours, theirs, shape in (("fc_gate", "gate_proj", (dm, d)), ("fc_in", "up_proj", (dm, d)),
                                    ("fc_out", "down_proj", (d, dm))):  # fmt: skip
            out.append((f"{b}mlp.{ours}.weight", [(f"{p}mlp.{theirs}.weight", shape)]))
            if c.mlp_bias:
                out.append((f"{b}mlp.{ours}.bias", [(f"{p}mlp.{theirs}.bias", shape[:1])]))
        for ours, theirs, shape in extra_tensors(c.norm or "pre", c.qk_norm, p, b, (d, *qk_widths)):
            out.append((ours, [(theirs, shape)]))
    out.append(("ln_final.weight", [(f"{prefix}norm.weight", (d,))]))
    if not c.tie_embeddings:
        out.append(("lm_head.weight", [("lm_head.weight", (c.vocab_size, d))]))
    return out


def llama_parameter_count(c: ModelConfig) -> tuple[int, int]:
    """(parameters, tensors) a Llama-family checkpoint of config ``c`` holds, by arithmetic (no tensors).

    An untied checkpoint's ``lm_head.weight`` is counted; a tied one's copy of the embedding is not needed.
    """
    d, dm, q, kv = c.d_model, c.d_mlp, c.n_heads * c.d_head, c.n_kv_heads * c.d_head
    n_norms = 4 if c.norm == "sandwich" else 2
    qk = 0 if c.qk_norm is None else (2 * c.d_head if c.qk_norm == "head" else q + kv)
    layer = d * (q + 2 * kv) + q * d + 3 * d * dm + n_norms * d + qk
    layer += (q + 2 * kv) * c.qkv_bias + d * c.out_bias + (2 * dm + d) * c.mlp_bias
    layer_tensors = 7 + n_norms + 2 * (c.qk_norm is not None) + 3 * c.qkv_bias + c.out_bias + 3 * c.mlp_bias
    untied = not c.tie_embeddings
    n_params = c.vocab_size * d * (1 + untied) + c.n_layers * layer + d
    return n_params, 2 + untied + c.n_layers * layer_tensors


def llama_expected(c: ModelConfig, prefix: str = "model.") -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape that a checkpoint of config ``c`` holds (``prefix``: "model." or "")."""
    return {name: shape for _, theirs in _tensors(c, prefix) for name, shape in theirs}


def _layout(c: ModelConfig, prefix: str = "model.") -> list[tuple[str, list[str]]]:
    """(Decoder state-dict name, the Hugging Face tensors whose rows it stacks, in order), every parameter."""
    return [(ours, [name for name, _ in theirs]) for ours, theirs in _tensors(c, prefix)]


def llama_state_dict(
    t: Mapping[str, Tensor], c: ModelConfig, prefix: str = "model.", *, consume: bool = False
) -> dict[str, Tensor]:
    """Hugging Face Llama tensor names -> headspace :class:`~headspace.Decoder` state-dict names.

    q, k and v are concatenated (rows [W_q; W_k; W_v], nn.Linear [out, in]) into the fused
    ``qkv_weight`` [(n_heads + 2 n_kv_heads) d_head, d_model]; everything else moves as it is.
    ``consume=True`` (``t`` a dict the caller gives away) pops each layer's q, k and v weights from ``t``
    once fused, so that the separate and the fused copies never all exist at once.
    """
    sd: dict[str, Tensor] = {}
    for ours, theirs in _layout(c, prefix):
        if len(theirs) == 1:
            sd[ours] = t[theirs[0]]
            continue
        sd[ours] = torch.cat([t[n].float() for n in theirs])  # ((H + 2 Hkv) dh, ...)
        if consume:
            for n in theirs:
                del t[n]  # type: ignore[attr-defined]
    return sd


def _prefix(names: Any) -> str:
    """'model.' for ``*ForCausalLM`` checkpoints, '' for bare ``*Model`` ones."""
    return "" if "embed_tokens.weight" in names and "model.embed_tokens.weight" not in names else "model."


def _ignorable(name: str) -> bool:
    # the RoPE frequencies older checkpoints store beside the weights (recomputed here)
    return name.endswith(".self_attn.rotary_emb.inv_freq")


def _fields(c: ModelConfig) -> str:
    """The config values behind the parameter count, for messages."""
    return (
        f"num_hidden_layers={c.n_layers}, hidden_size={c.d_model}, intermediate_size={c.d_mlp}, "
        f"num_attention_heads={c.n_heads}, num_key_value_heads={c.n_kv_heads}, head_dim={c.d_head}, "
        f"vocab_size={c.vocab_size}, tie_word_embeddings={str(c.tie_embeddings).lower()}"
    )


def _as_text_tokenizer(tokenizer: Any, pad_id: int | None) -> TextTokenizer | None:
    """A :class:`TextTokenizer` from one, from a ``tokenizers.Tokenizer`` (the GGUF reader's), or None."""
    if tokenizer is None or isinstance(tokenizer, TextTokenizer):
        return tokenizer
    from tokenizers import Tokenizer

    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(
            f"tokenizer must be a headspace TextTokenizer, a tokenizers.Tokenizer or None; got "
            f"{type(tokenizer).__name__}"
        )
    return TextTokenizer.from_tokenizer(tokenizer, pad_id=pad_id)


def _build(
    config: ModelConfig,
    tensors: Mapping[str, Tensor],
    prefix: str,
    tokenizer: TextTokenizer | None,
    ignored: list[str],
    *,
    consume: bool = False,
) -> PretrainedDecoder:
    """The Decoder with the converted weights (built on the meta device: no random initialisation).

    ``consume``: ``tensors`` is a dict given away (q, k, v are dropped from it as they are fused).
    """
    sd = {k: v.float() for k, v in llama_state_dict(tensors, config, prefix, consume=consume).items()}
    model = _meta_decoder(config)
    model.load_state_dict(sd, strict=True, assign=True)
    return _wrap(model, config, tokenizer, ignored)


def _meta_decoder(config: ModelConfig) -> Decoder:
    """A Decoder of ``config`` on the meta device: shapes only, nothing allocated or initialised."""
    with torch.device("meta"), _SkipMetaInit():
        return Decoder(config)


def _wrap(
    model: Decoder, config: ModelConfig, tokenizer: TextTokenizer | None, ignored: list[str]
) -> PretrainedDecoder:
    """``model`` (weights in place) with its RoPE tables, as a :class:`PretrainedDecoder`."""
    rotaries = config.make_rotaries()  # on the CPU (meta or not), shared by kind of layer as Decoder does
    for block, rotary in zip(model.blocks, rotaries, strict=True):
        block.attn.rotary = rotary
    return PretrainedDecoder(model, tokenizer, ignored=ignored)


class EmptyLlama:
    """A Decoder whose float32 parameters are allocated but not yet written, for a reader to fill.

    Made by :func:`empty_llama`. ``destinations`` maps each Hugging Face tensor name to the parameter
    (or, for q, k and v, the rows of the fused ``qkv_weight``) that receives it: contiguous float32 CPU
    tensors of the checkpoint's shapes, sharing the parameters' storage. Once every one is written,
    :meth:`finish` checks the values and returns the model, so the weights exist once, never beside a
    second copy. A reader that does not fill every destination leaves uninitialised memory in the model.
    """

    def __init__(
        self, config: ModelConfig, model: Decoder, destinations: dict[str, Tensor], ignored: list[str]
    ) -> None:
        self.config = config
        self.model = model
        self.destinations = destinations
        self.ignored = ignored

    def finish(self, tokenizer: Any = None, *, precision: str = "float32") -> PretrainedDecoder:
        """The filled model, NaN/Inf and non-float weights refused (named), converted to ``precision``."""
        names = list(self.destinations)
        if not _all_finite_floats(self.destinations, names):
            check_values(self.destinations, names, Path(self.config.extra["source"]))
        tok = _as_text_tokenizer(tokenizer, self.config.pad_token_id)
        return _wrap(self.model, self.config, tok, self.ignored).to_precision(precision)


def empty_llama(
    hf_config: Mapping[str, Any],
    shapes: Mapping[str, tuple[int, ...]],
    *,
    name: str = "",
    source: str = "tensors",
    max_seq_len: int | None = None,
) -> EmptyLlama:
    """An :class:`EmptyLlama` for a checkpoint of ``hf_config`` holding tensors of ``shapes`` (HF names).

    The checks of :func:`llama_from_tensors` that need no values run first, on the shapes, before
    anything is allocated: the config (:func:`llama_config`), the parameter count, missing / unexpected
    / mis-shaped tensors. A tied checkpoint's ``lm_head.weight``, whose values must be compared with the
    embedding, is refused here (read it into a dict and use :func:`llama_from_tensors`).
    """
    config, prefix, expected, where, summary = _checked_config(hf_config, shapes, name, source, max_seq_len)
    if config.tie_embeddings and "lm_head.weight" in shapes:
        raise ValueError(
            f"{source}: a tied checkpoint's lm_head.weight cannot be filled in place (it is compared with "
            "the embedding); pass the tensors to llama_from_tensors"
        )
    entries = {k: TensorEntry(k, "F32", tuple(s), 0, 0) for k, s in shapes.items()}
    ignored = check_tensors(entries, expected, _ignorable, where, summary=summary)
    model = _meta_decoder(config)
    _allocate_parameters(model)
    params = dict(model.named_parameters())
    layout = _layout(config, prefix)
    if {ours for ours, _ in layout} != set(model.state_dict()):
        raise RuntimeError("the Decoder's parameters do not match the Llama layout")  # a headspace bug
    destinations: dict[str, Tensor] = {}
    for ours, theirs in layout:
        rows = [expected[n][0] for n in theirs]
        for n, part in zip(theirs, params[ours].detach().split(rows), strict=True):
            destinations[n] = part  # a row slice: contiguous
    return EmptyLlama(config, model, destinations, ignored)


def _checked_config(
    hf_config: Mapping[str, Any],
    shapes: Mapping[str, tuple[int, ...]],
    name: str,
    source: str,
    max_seq_len: int | None,
) -> tuple[ModelConfig, str, dict[str, tuple[int, ...]], Path, str | None]:
    """(config, name prefix, expected shapes, source path, parameter-count summary) from shapes alone."""
    config = llama_config(hf_config, name=name, max_seq_len=max_seq_len)
    config.extra["source"] = source
    where = Path(source)
    # the header of what was given, so that the shared checks read it as they read a file's
    entries = {k: TensorEntry(k, "F32", tuple(s), 0, 0) for k, s in shapes.items()}
    summary = check_parameter_count(
        *llama_parameter_count(config), SafetensorsHeader(where, entries, {}, 0), _fields(config)
    )
    prefix = _prefix(shapes)
    return config, prefix, llama_expected(config, prefix), where, summary


def _tied_head(tensors: Mapping[str, Tensor], c: ModelConfig, prefix: str, source: Any) -> None:
    """A tied checkpoint may store lm_head.weight; it must then equal the token embedding."""
    head, emb = tensors.get("lm_head.weight"), tensors.get(f"{prefix}embed_tokens.weight")
    if c.tie_embeddings and head is not None and emb is not None:
        if head.shape != emb.shape or not torch.equal(head.float(), emb.float()):
            raise ValueError(
                f"{source}: config.json says tie_word_embeddings=true but lm_head.weight differs from "
                f"{prefix}embed_tokens.weight"
            )


def llama_from_tensors(
    hf_config: Mapping[str, Any],
    tensors: Mapping[str, Tensor],
    tokenizer: Any = None,
    *,
    name: str = "",
    source: str = "tensors",
    max_seq_len: int | None = None,
    precision: str = "float32",
    consume: bool = False,
) -> PretrainedDecoder:
    """A :class:`PretrainedDecoder` from a Hugging Face-style config dict and HF-named tensors.

    For readers of other formats (GGUF): ``hf_config`` as in ``config.json`` (``model_type`` llama,
    mistral or qwen2), ``tensors`` with Hugging Face Llama names and [out, in] layout (any float dtype;
    converted to float32), ``tokenizer`` a :class:`~headspace.tokenization.TextTokenizer`, a
    ``tokenizers.Tokenizer`` or None. ``source`` names the origin in error messages (and is kept in
    ``config.extra["source"]``). The same checks as :func:`load_llama`: the config
    (:func:`llama_config`), the parameter count against the tensors, missing / unexpected / mis-shaped
    tensors, non-float and NaN/Inf weights. ``precision``: as :func:`load_llama`'s. ``consume=True``:
    ``tensors`` is a dict given away, emptied as it is used (q, k and v dropped as they are fused).
    A reader that can write the weights in place instead should use :func:`empty_llama`.
    """
    check_precision(precision)
    if not isinstance(tensors, Mapping) or not all(isinstance(v, Tensor) for v in tensors.values()):
        raise TypeError("tensors must be a dict {Hugging Face name: tensor}")
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    config, prefix, expected, where, summary = _checked_config(hf_config, shapes, name, source, max_seq_len)
    _tied_head(tensors, config, prefix, source)
    if consume and isinstance(tensors, dict):
        if config.tie_embeddings:
            tensors.pop("lm_head.weight", None)
        present = tensors
    else:
        present = {k: v for k, v in tensors.items() if not (config.tie_embeddings and k == "lm_head.weight")}
        consume = False
    ignored = check_tensors(present, expected, _ignorable, where, summary=summary)
    if not _all_finite_floats(present, list(expected)):
        check_values(dict(present), list(expected), where)  # names every non-float or NaN/Inf weight
    tok = _as_text_tokenizer(tokenizer, config.pad_token_id)
    pre = _build(config, present, prefix, tok, ignored, consume=consume)
    return pre.to_precision(precision)


def load_llama(
    folder: str | Path, *, name: str = "", max_seq_len: int | None = None, precision: str = "float32"
) -> PretrainedDecoder:
    """Load a local Hugging Face Llama, Mistral or Qwen2 checkpoint folder onto a headspace Decoder.

    Reads ``config.json``, the weights (``model.safetensors``, or the shards a
    ``model.safetensors.index.json`` names) and ``tokenizer.json`` when present. Both ``*ForCausalLM``
    (``model.``-prefixed, ``lm_head.weight`` optional when tied) and bare ``*Model`` checkpoints are
    accepted. Weights of any float dtype are converted to float32. What is supported and what is refused:
    :func:`llama_config`. ``max_seq_len`` caps the accepted length (default ``max_position_embeddings``).

    The folder is untrusted input (see :mod:`headspace.pretrained.hf`): everything is checked before the
    weights are read: the headers of the safetensors files against their sizes, the parameter count the
    config implies against what the headers hold (an absurd config is refused at once), tensor names,
    shapes and dtypes; a shard index may name only files of the folder. Tensors are then read one at a
    time.

    Raises:
        FileNotFoundError: the folder or a needed file is missing (named).
        ValueError: a config headspace cannot represent (the field is named); a malformed or truncated
            safetensors file or shard index; missing / unexpected / mis-shaped tensors (listed);
            weights that are not floating point or hold NaN/Inf (named); an unknown ``precision``.

    ``precision``: ``"float32"`` (exact), ``"bfloat16"`` or ``"int8"``; the model is built in float32
    and converted (:meth:`headspace.Decoder.to_precision`).
    """
    opened = open_family(folder, precision)
    path = opened.path
    config = llama_config(
        opened.hf, name=name or path.name, max_seq_len=max_seq_len, source=opened.config_file
    )
    config.extra["source"] = str(path)
    headers = folder_headers(path)
    prefix = _prefix(headers[0].tensors)
    tensors, ignored = read_listed(  # a tied checkpoint may store lm_head: a copy checked below
        headers, lambda: llama_expected(config, prefix), config, _fields(config), opened.config_file,
        _ignorable, count=llama_parameter_count(config),
    )  # fmt: skip
    _tied_head(tensors, config, prefix, headers[0].path)
    if config.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    tokenizer = folder_tokenizer(path, config.pad_token_id)
    return _build(config, tensors, prefix, tokenizer, ignored).to_precision(precision)
