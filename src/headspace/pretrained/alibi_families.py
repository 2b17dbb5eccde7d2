"""ALiBi and Falcon families: bloom, falcon (both architectures, rotary or ALiBi), mpt.

Each ``config.json`` becomes a :class:`~headspace.ModelConfig` with LayerNorm blocks; the tensors are
renamed to the Decoder's state dict. ALiBi (:mod:`headspace.nn.alibi`) is ``ModelConfig.alibi_slopes``.
Per family (transformers 5's ``*ForCausalLM``)::

    bloom   a LayerNorm after the embeddings (word_embeddings_layernorm), pre-norm blocks, q/k/v fused
            per head ([H, 3, d_head] rows), biases everywhere, tanh-GELU MLP of 4 d_model, ALiBi with
            BLOOM's slopes, tied unembedding; apply_residual_connection_post_layernorm=true refused
    falcon  new_decoder_architecture: grouped kv ([Hkv, H/Hkv + 2, d_head] rows: a group's queries, then
            its key and value), parallel with ln_attn / ln_mlp (num_ln_in_parallel_attn 2) or one norm;
            the old one: multi_query (one kv head) or q/k/v per head, parallel_attn (one shared
            LayerNorm) or sequential; rotary (rope_theta) or alibi=true (BLOOM's slopes divided by
            sqrt(d_head); transformers rounds the bias to bfloat16, exact only up to 8 heads and 256
            positions: more heads refused by name, the context capped at 256); bias on or off; GELU
            MLP of ffn_hidden_size
    mpt     no biases, LayerNorms without bias, GELU MLP of 4 d_model, ALiBi with MPT's slopes
            (alibi_bias_max 8), softmax_scale; clip_qkv, qk_ln, alibi=false, alibi_bias_max != 8,
            no_bias=false, expansion_ratio != 4, logit_scale, prefix_lm, attn_uses_sequence_id and
            embedding_fraction != 1 refused by name (transformers' MPT ignores or lacks each of them)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..model.config import ModelConfig
from ..nn.alibi import bloom_slopes, mpt_slopes
from .hf import ConfigFields, fitting_headspace
from .llama import _HIDDEN_ACT
from .parallel_families import _inv_freq, _move, _norm, _parallel_one_norm
from .renamed_loader import family_kind, load_renamed
from .rotary_families import read_rope
from .wrappers import PretrainedDecoder

_Renamer = Callable[[dict[str, Tensor], ModelConfig], dict[str, Tensor]]


def _refuse(f: ConfigFields, key: str, value: Any, ok: Any, why: str) -> None:
    if value != ok:
        raise ValueError(f"{f.source}: {key}={value!r} is not supported ({why}); supported: {ok!r}")


def _base(f: ConfigFields, kind: str, d_model: int, n_heads: int, n_layers: int, context: int,
          max_seq_len: int | None) -> dict[str, Any]:  # fmt: skip
    """The fields every family here shares."""
    if max_seq_len is not None and max_seq_len > context:
        raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's context {context}")
    vocab = f.integer("vocab_size")
    pad = f.integer("pad_token_id", None, allow_none=True, minimum=-(2**31))
    return dict(
        arch="decoder", vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
        max_seq_len=context if max_seq_len is None else max_seq_len, dropout=0.0, emb_dropout=0.0,
        attn_dropout=0.0, ln_eps=f.number("layer_norm_epsilon", 1e-5, low=0.0, low_open=True),
        type_vocab_size=0, pad_token_id=pad if pad is not None and 0 <= pad < vocab else None,
        embed_ln=False, final_ln=True, norm_kind="layernorm", positions="none",
        tie_embeddings=f.flag("tie_word_embeddings", True), extra={"model_type": kind},
    )  # fmt: skip


def _bloom(hf: Mapping[str, Any], f: ConfigFields, max_seq_len: int | None) -> dict[str, Any]:
    d = f.integer("hidden_size") if "hidden_size" in hf else f.integer("n_embed", 64)
    n_heads, n_layers = f.integer("n_head", 8), f.integer("n_layer", 2)
    post = f.flag("apply_residual_connection_post_layernorm", False)
    _refuse(f, "apply_residual_connection_post_layernorm", post, False, "the residual taken after the norm")
    kw = _base(f, "bloom", d, n_heads, n_layers, f.integer("seq_length", 2048), max_seq_len)
    return dict(kw, embed_ln=True, norm="pre", mlp_kind="plain", act="gelu_tanh", bias=True, d_mlp=4 * d,
                alibi_slopes=bloom_slopes(n_heads))  # fmt: skip


def _falcon_heads(f: ConfigFields, n_heads: int) -> tuple[int, str]:
    """(n_kv_heads, the fused q/k/v layout) of a Falcon config."""
    new = f.flag("new_decoder_architecture", False)
    kv = f.integer("num_kv_heads", None, allow_none=True) or n_heads
    if new:
        return kv, "grouped"
    if f.flag("multi_query", True):
        return 1, "multi_query"
    _refuse(
        f, "num_kv_heads", kv, n_heads, "the old architecture without multi_query has one kv head per head"
    )
    return n_heads, "per_head"


def _falcon(hf: Mapping[str, Any], f: ConfigFields, max_seq_len: int | None) -> dict[str, Any]:
    f.require(["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"], "falcon")
    d, n_heads = f.integer("hidden_size"), f.integer("num_attention_heads")
    n_kv, qkv = _falcon_heads(f, n_heads)
    new, parallel = f.flag("new_decoder_architecture", False), f.flag("parallel_attn", True)
    norms = f.integer("num_ln_in_parallel_attn", None, allow_none=True, maximum=2) or (2 if new else 1)
    if new and not parallel:
        _refuse(f, "parallel_attn", parallel, True, "the new decoder architecture is parallel")
    act = f.text("activation", "gelu")
    if act not in _HIDDEN_ACT:
        raise ValueError(f"{f.source}: activation={act!r} is not supported; supported: {sorted(_HIDDEN_ACT)}")
    kw = _base(f, "falcon", d, n_heads, f.integer("num_hidden_layers"),
               f.integer("max_position_embeddings", 2048), max_seq_len)  # fmt: skip
    bias = f.flag("bias", False)
    kw.update(norm="parallel" if (new or parallel) else "pre", mlp_kind="plain", act=_HIDDEN_ACT[act],
              bias=bias, n_kv_heads=n_kv, d_mlp=f.integer("ffn_hidden_size", 4 * d))  # fmt: skip
    kw["extra"].update(qkv=qkv, norms=norms if (new or parallel) else 2)
    if f.flag("alibi", False):
        return _falcon_alibi(f, kw, d, n_heads)
    theta, scaling, fraction = read_rope(hf, f)
    return dict(kw, positions="rotary", rope_theta=theta, rope_scaling=scaling, rotary_fraction=fraction)


#: Falcon's ALiBi bias is exact below this many positions (transformers rounds m_h j to bfloat16).
FALCON_ALIBI_CONTEXT = 256


def _falcon_alibi(f: ConfigFields, kw: dict[str, Any], d: int, n_heads: int) -> dict[str, Any]:
    """Falcon's ALiBi: transformers computes ``bfloat16(bfloat16(m_h) * j) / sqrt(d_head)``, exact (and so
    ``m_h / sqrt(d_head)`` per unit of distance) only where every ``m_h`` is a power of 2 (at most 8
    heads) and ``j < 256``: more heads are refused by name, the context capped at 256."""
    if n_heads > 8:
        raise ValueError(
            f"{f.source}: alibi=true with num_attention_heads={n_heads} is not supported (transformers "
            "rounds Falcon's ALiBi bias to bfloat16, exact only up to 8 heads, whose slopes are powers of 2)"
        )
    kw["max_seq_len"] = min(kw["max_seq_len"], FALCON_ALIBI_CONTEXT)
    scale = 1.0 / math.sqrt(d // n_heads)
    return dict(kw, alibi_slopes=[m * scale for m in bloom_slopes(n_heads)])


def _attn_config(hf: Mapping[str, Any], source: str) -> ConfigFields:
    a = hf.get("attn_config") or {}
    if not isinstance(a, Mapping):
        raise ValueError(f"{source}: attn_config must be an object; got {type(a).__name__}")
    return ConfigFields(a, f"{source} attn_config")


def _mpt(hf: Mapping[str, Any], f: ConfigFields, max_seq_len: int | None) -> dict[str, Any]:
    f.require(["vocab_size", "d_model", "n_heads", "n_layers"], "mpt")
    d, n_heads = f.integer("d_model"), f.integer("n_heads")
    a = _attn_config(hf, f.source)
    ignored = "transformers' MPT does not compute it"
    _refuse(a, "clip_qkv", a.hf.get("clip_qkv"), None, "q, k and v clamped")
    _refuse(a, "qk_ln", a.hf.get("qk_ln", False), False, ignored)
    _refuse(a, "alibi", a.hf.get("alibi", True), True, "transformers' MPT always adds ALiBi")
    _refuse(a, "alibi_bias_max", a.hf.get("alibi_bias_max", 8), 8, "transformers' MPT always uses 8")
    for key in ("prefix_lm", "attn_uses_sequence_id"):
        _refuse(a, key, a.hf.get(key, False), False, ignored)
    _refuse(f, "no_bias", hf.get("no_bias", True), True, "transformers' MPT has no biases")
    _refuse(
        f, "expansion_ratio", hf.get("expansion_ratio", 4), 4, "transformers' MPT's MLP is 4 d_model wide"
    )
    _refuse(f, "logit_scale", hf.get("logit_scale"), None, ignored)
    _refuse(f, "embedding_fraction", hf.get("embedding_fraction", 1.0), 1.0, ignored)
    kw = _base(f, "mpt", d, n_heads, f.integer("n_layers"), f.integer("max_seq_len", 2048), max_seq_len)
    scale = a.hf.get("softmax_scale")
    pre = None if scale is None else 1.0 / a.number("softmax_scale", low=0.0, low_open=True) ** 2
    return dict(kw, norm="pre", mlp_kind="plain", act="gelu", bias=False, d_mlp=4 * d,
                query_pre_attn_scalar=pre, alibi_slopes=mpt_slopes(n_heads))  # fmt: skip


# ------------------------------------------------------------------------------------------- tensors
def _per_head_qkv(w: Tensor, H: int, dh: int) -> Tensor:
    """Rows [H, 3, dh] (q, k, v per head) -> [3 H dh] rows in q, k, v order (also for a bias [H 3 dh])."""
    rest = w.shape[1:]
    return w.reshape(H, 3, dh, *rest).transpose(0, 1).reshape(3 * H * dh, *rest)  # (3 H dh, ...)


def _grouped_qkv(w: Tensor, H: int, Hkv: int, dh: int) -> Tensor:
    """Falcon's new rows [Hkv, H/Hkv + 2, dh] (a group's queries, its key, its value) -> q, k, v order."""
    rest, g = w.shape[1:], H // Hkv
    grouped = w.reshape(Hkv, g + 2, dh, *rest)  # (Hkv, g + 2, dh, ...)
    q = grouped[:, :g].reshape(H * dh, *rest)  # (H dh, ...)
    k, v = grouped[:, g].reshape(Hkv * dh, *rest), grouped[:, g + 1].reshape(Hkv * dh, *rest)  # (Hkv dh, ...)
    return torch.cat([q, k, v])  # ((H + 2 Hkv) dh, ...)


def _unembed(sd: dict[str, Tensor], t: dict[str, Tensor], c: ModelConfig) -> None:
    head = t.pop("lm_head.weight", None)
    if not c.tie_embeddings and head is not None:
        sd["lm_head.weight"] = head


def _bloom_tensors(t: dict[str, Tensor], c: ModelConfig) -> dict[str, Tensor]:
    assert c.d_head is not None
    sd: dict[str, Tensor] = {"tok_embed.weight": t.pop("transformer.word_embeddings.weight")}
    _norm(sd, t, "embed_ln", "transformer.word_embeddings_layernorm")
    for i in range(c.n_layers):
        p, b = f"transformer.h.{i}.", f"blocks.{i}."
        _norm(sd, t, b + "ln1", p + "input_layernorm")
        _norm(sd, t, b + "ln2", p + "post_attention_layernorm")
        a = p + "self_attention."
        sd[b + "attn.qkv_weight"] = _per_head_qkv(t.pop(a + "query_key_value.weight"), c.n_heads, c.d_head)
        sd[b + "attn.qkv_bias"] = _per_head_qkv(t.pop(a + "query_key_value.bias"), c.n_heads, c.d_head)
        sd[b + "attn.o_weight"], sd[b + "attn.o_bias"] = t.pop(a + "dense.weight"), t.pop(a + "dense.bias")
        _move(sd, t, b + "mlp.fc_in", p + "mlp.dense_h_to_4h", True)
        _move(sd, t, b + "mlp.fc_out", p + "mlp.dense_4h_to_h", True)
    _norm(sd, t, "ln_final", "transformer.ln_f")
    _unembed(sd, t, c)
    return {**t, **sd}


def _falcon_tensors(t: dict[str, Tensor], c: ModelConfig) -> dict[str, Tensor]:
    assert c.d_head is not None and c.n_kv_heads is not None
    H, Hkv, dh, bias = c.n_heads, c.n_kv_heads, c.d_head, bool(c.bias)
    layout = c.extra["qkv"]
    fix = {"grouped": lambda w: _grouped_qkv(w, H, Hkv, dh), "per_head": lambda w: _per_head_qkv(w, H, dh)}
    sd: dict[str, Tensor] = {"tok_embed.weight": t.pop("transformer.word_embeddings.weight")}
    for i in range(c.n_layers):
        p, b = f"transformer.h.{i}.", f"blocks.{i}."
        if c.norm == "pre":
            _norm(sd, t, b + "ln1", p + "input_layernorm")
            _norm(sd, t, b + "ln2", p + "post_attention_layernorm")
        elif c.extra["norms"] == 2:
            _norm(sd, t, b + "ln1", p + "ln_attn")
            _norm(sd, t, b + "ln2", p + "ln_mlp")
        else:
            _norm(sd, t, b + "ln1", p + "input_layernorm")
            _parallel_one_norm(sd, b)
        a = p + "self_attention."
        order = fix.get(layout, lambda w: w)  # multi-query: q rows, then k, then v already
        sd[b + "attn.qkv_weight"] = order(t.pop(a + "query_key_value.weight"))  # ((H + 2 Hkv) dh, d)
        if bias:
            sd[b + "attn.qkv_bias"] = order(t.pop(a + "query_key_value.bias"))  # ((H + 2 Hkv) dh,)
        _move(sd, t, b + "attn.o", a + "dense", bias)
        sd[b + "attn.o_weight"] = sd.pop(b + "attn.o.weight")
        if bias:
            sd[b + "attn.o_bias"] = sd.pop(b + "attn.o.bias")
        _move(sd, t, b + "mlp.fc_in", p + "mlp.dense_h_to_4h", bias)
        _move(sd, t, b + "mlp.fc_out", p + "mlp.dense_4h_to_h", bias)
    _norm(sd, t, "ln_final", "transformer.ln_f")
    _unembed(sd, t, c)
    return {**t, **sd}


def _mpt_tensors(t: dict[str, Tensor], c: ModelConfig) -> dict[str, Tensor]:
    sd: dict[str, Tensor] = {"tok_embed.weight": t.pop("transformer.wte.weight")}
    for i in range(c.n_layers):
        p, b = f"transformer.blocks.{i}.", f"blocks.{i}."
        _norm(sd, t, b + "ln1", p + "norm_1")
        _norm(sd, t, b + "ln2", p + "norm_2")
        sd[b + "attn.qkv_weight"] = t.pop(p + "attn.Wqkv.weight")  # (3 d, d): q, k, v
        sd[b + "attn.o_weight"] = t.pop(p + "attn.out_proj.weight")
        _move(sd, t, b + "mlp.fc_in", p + "ffn.up_proj", False)
        _move(sd, t, b + "mlp.fc_out", p + "ffn.down_proj", False)
    _norm(sd, t, "ln_final", "transformer.norm_f")
    _unembed(sd, t, c)
    return {**t, **sd}


#: model_type -> (config fields, tensor renamer).
FAMILIES: dict[str, tuple[Callable[..., dict[str, Any]], _Renamer]] = {
    "bloom": (_bloom, _bloom_tensors),
    "falcon": (_falcon, _falcon_tensors),
    "mpt": (_mpt, _mpt_tensors),
}
#: The ``config.json`` model types of :data:`FAMILIES`.
ALIBI_FAMILY_TYPES = tuple(FAMILIES)


def alibi_family_config(
    hf: Mapping[str, Any], name: str = "", *, max_seq_len: int | None = None, source: str = "config.json"
) -> ModelConfig:
    """The :class:`ModelConfig` of a ``config.json`` of one of :data:`FAMILIES` (module docstring)."""
    f = ConfigFields(hf, source)
    kind = family_kind(f, FAMILIES)
    kw = FAMILIES[kind][0](hf, f, max_seq_len)
    with fitting_headspace(source):
        return ModelConfig(name=name, **kw)


def load_alibi_family(
    folder: str | Path, *, name: str = "", max_seq_len: int | None = None, precision: str = "float32"
) -> PretrainedDecoder:
    """Load a checkpoint folder of one of :data:`FAMILIES` onto a Decoder: the config field by field
    (:func:`alibi_family_config`), then missing / unexpected / mis-shaped tensors refused (listed)
    from the safetensors headers, before any tensor is read (:func:`~.renamed_loader.load_renamed`)."""

    def read(hf: dict[str, Any], name: str, source: str) -> ModelConfig:
        return alibi_family_config(hf, name, max_seq_len=max_seq_len, source=source)

    renamers = {k: v[1] for k, v in FAMILIES.items()}
    return load_renamed(folder, read, renamers, name=name, precision=precision, ignorable=_inv_freq)
