"""Partial-rotary LayerNorm families, parallel or sequential: gpt_neox, stablelm, cohere, phi, gptj.

Each ``config.json`` becomes a :class:`~headspace.ModelConfig` with LayerNorm blocks and a partial
rotation (``rotary_dim = int(d_head * partial_rotary_factor)``; the rest of each head passes through);
the tensors are renamed to the Decoder's state dict. Per family (transformers 5's ``*ForCausalLM``)::

    gpt_neox  LayerNorm with bias, plain GELU MLP with biases, q/k/v fused per head ([H, 3, d_head]
              rows), rotary_pct / partial_rotary_factor (Pythia 0.25); use_parallel_residual:
              out = x + A(N1(x)) + M(N2(x)) (layout "parallel"), else the pre layout
    stablelm  LayerNorm with bias, SwiGLU MLP, optional q/k/v biases, partial rotary; parallel
              (use_parallel_residual: one norm, N2 a copy of N1) or pre; qk_layernorm: a LayerNorm
              per head on q and k (qk_norm "head_layernorm")
    cohere    parallel with one LayerNorm without bias (bias 0), SwiGLU, interleaved rotary pairs
              (2i, 2i + 1), logits times logit_scale (folded into an untied unembedding: a copy of a
              tied embedding); use_qk_norm: a LayerNorm per head (qk_norm "head_layernorm")
    phi       parallel with one LayerNorm (bias), plain gelu_new MLP, biases everywhere, partial rotary,
              an unembedding with a bias; qk_layernorm refused
    gptj      parallel with one LayerNorm (bias), q/k/v/out without bias, interleaved rotary pairs on
              the first rotary_dim features (base 10000), an unembedding with a bias

Rotary scaling of every kind is read as :mod:`headspace.pretrained.rotary_families` reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..model.config import ModelConfig
from .hf import ConfigFields, fitting_headspace
from .llama import _HIDDEN_ACT
from .renamed_loader import family_kind, load_renamed
from .rope_config import extend_rope
from .rotary_families import read_rope
from .wrappers import PretrainedDecoder

_Renamer = Callable[[dict[str, Tensor], ModelConfig], dict[str, Tensor]]


def _refuse_true(f: ConfigFields, key: str, what: str) -> None:
    if f.hf.get(key) is not None and f.flag(key):
        raise ValueError(f"{f.source}: {key}=true ({what}) is not supported; supported: false")


def _common(hf: Mapping[str, Any], f: ConfigFields, kind: str, max_seq_len: int | None) -> dict[str, Any]:
    """The ModelConfig fields every family here shares: sizes, LayerNorm, rotation, context."""
    f.require(["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"], kind)
    d_model, n_heads = f.integer("hidden_size"), f.integer("num_attention_heads")
    act = f.text("hidden_act", {"gpt_neox": "gelu", "phi": "gelu_new"}.get(kind, "silu"))
    if act not in _HIDDEN_ACT:
        raise ValueError(f"{f.source}: hidden_act={act!r} is not supported; supported: {sorted(_HIDDEN_ACT)}")
    limit = f.integer("max_position_embeddings", 2048)
    context = limit if max_seq_len is None else max_seq_len
    if context > limit:
        raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's max_position_embeddings={limit}")
    theta, scaling, fraction = read_rope(hf, f)
    if kind == "gpt_neox":
        theta = (
            f.number("rotary_emb_base", theta, low=0.0, low_open=True)
            if "rope_parameters" not in hf
            else theta
        )
        if "rope_parameters" not in hf or "partial_rotary_factor" not in (hf.get("rope_parameters") or {}):
            fraction = f.number("rotary_pct", fraction, low=0.0, low_open=True)
    scaling, context = extend_rope(scaling, f, context, max_seq_len)
    pad = f.integer("pad_token_id", None, allow_none=True, minimum=-(2**31))
    vocab = f.integer("vocab_size")
    return dict(
        arch="decoder",
        vocab_size=vocab,
        d_model=d_model,
        n_layers=f.integer("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=f.integer("num_key_value_heads", None, allow_none=True) or n_heads,
        d_mlp=f.integer("intermediate_size", 4 * d_model),
        max_seq_len=context,
        act=_HIDDEN_ACT[act],
        dropout=0.0,
        emb_dropout=0.0,
        ln_eps=f.number("layer_norm_eps", 1e-5, low=0.0, low_open=True),
        type_vocab_size=0,
        pad_token_id=pad if pad is not None and 0 <= pad < vocab else None,
        embed_ln=False,
        final_ln=True,
        positions="rotary",
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_fraction=fraction,
        norm_kind="layernorm",
        extra={"model_type": kind},
    )


def _neox(hf: Mapping[str, Any], f: ConfigFields, kw: dict[str, Any]) -> dict[str, Any]:
    bias = f.flag("attention_bias", True)
    parallel = f.flag("use_parallel_residual", True)
    tied = f.flag("tie_word_embeddings", False)
    return dict(kw, norm="parallel" if parallel else "pre", mlp_kind="plain", bias=True, qkv_bias=bias,
                out_bias=bias, mlp_bias=True, tie_embeddings=tied)  # fmt: skip


def _stablelm(hf: Mapping[str, Any], f: ConfigFields, kw: dict[str, Any]) -> dict[str, Any]:
    parallel = f.flag("use_parallel_residual", False)
    qk = "head_layernorm" if f.hf.get("qk_layernorm") is not None and f.flag("qk_layernorm") else None
    return dict(kw, norm="parallel" if parallel else "pre", mlp_kind="gated", bias=True, qk_norm=qk,
                qkv_bias=f.flag("use_qkv_bias", False), out_bias=False, mlp_bias=False,
                tie_embeddings=f.flag("tie_word_embeddings", False))  # fmt: skip


def _cohere(hf: Mapping[str, Any], f: ConfigFields, kw: dict[str, Any]) -> dict[str, Any]:
    qk = "head_layernorm" if f.hf.get("use_qk_norm") is not None and f.flag("use_qk_norm") else None
    bias = f.flag("attention_bias", False)
    extra = {**kw["extra"], "logit_scale": f.number("logit_scale", 0.0625, low=0.0, low_open=True)}
    extra["tied_checkpoint"] = f.flag("tie_word_embeddings", True)
    return dict(kw, norm="parallel", mlp_kind="gated", bias=True, qkv_bias=bias, out_bias=bias, qk_norm=qk,
                mlp_bias=False, tie_embeddings=False, rope_interleaved=True, extra=extra)  # fmt: skip


def _phi(hf: Mapping[str, Any], f: ConfigFields, kw: dict[str, Any]) -> dict[str, Any]:
    _refuse_true(f, "qk_layernorm", "a LayerNorm on q and k")
    return dict(kw, norm="parallel", mlp_kind="plain", bias=True, qkv_bias=True, out_bias=True,
                mlp_bias=True, tie_embeddings=False, unembed_bias=True)  # fmt: skip


_GPTJ_KEYS = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
              "n_positions": "max_position_embeddings", "n_inner": "intermediate_size",
              "activation_function": "hidden_act", "layer_norm_epsilon": "layer_norm_eps"}  # fmt: skip


def gptj_as_common(hf: Mapping[str, Any]) -> dict[str, Any]:
    """GPT-J's config keys under the names :func:`_common` reads (``n_embd`` -> ``hidden_size`` ...);
    ``rotary_dim`` as ``partial_rotary_factor`` (None: the whole head); ``rotary_dim`` of the head."""
    skip = set(_GPTJ_KEYS.values())  # transformers' GPT-J reads only its own names (a stray one is ignored)
    out = {k: v for k, v in hf.items() if k not in skip}
    out.update({ours: hf[theirs] for theirs, ours in _GPTJ_KEYS.items() if hf.get(theirs) is not None})
    d_head = out["hidden_size"] // out["num_attention_heads"] if "hidden_size" in out else None
    rotary = hf.get("rotary_dim")
    if d_head and rotary is not None and not isinstance(rotary, bool) and isinstance(rotary, int):
        out["partial_rotary_factor"] = rotary / d_head
    out.pop("rope_parameters", None)  # GPT-J's rotation is plain, base 10000: nothing else reads it
    return out


def _gptj(hf: Mapping[str, Any], f: ConfigFields, kw: dict[str, Any]) -> dict[str, Any]:
    return dict(kw, norm="parallel", mlp_kind="plain", bias=True, qkv_bias=False, out_bias=False,
                mlp_bias=True, tie_embeddings=False, unembed_bias=True, rope_interleaved=True)  # fmt: skip


# ------------------------------------------------------------------------------------------- tensors
def _norm(sd: dict[str, Tensor], t: dict[str, Tensor], ours: str, theirs: str) -> None:
    """A LayerNorm: its weight, and its bias or zeros (a LayerNorm without bias)."""
    sd[f"{ours}.weight"] = t.pop(f"{theirs}.weight")
    bias = t.pop(f"{theirs}.bias", None)
    sd[f"{ours}.bias"] = torch.zeros_like(sd[f"{ours}.weight"]) if bias is None else bias


def _move(sd: dict[str, Tensor], t: dict[str, Tensor], ours: str, theirs: str, bias: bool) -> None:
    sd[f"{ours}.weight"] = t.pop(f"{theirs}.weight")
    if bias:
        sd[f"{ours}.bias"] = t.pop(f"{theirs}.bias")


def _neox_tensors(t: dict[str, Tensor], c: ModelConfig) -> dict[str, Tensor]:
    assert c.d_head is not None
    sd: dict[str, Tensor] = {"tok_embed.weight": t.pop("gpt_neox.embed_in.weight")}
    H, dh, d = c.n_heads, c.d_head, c.d_model
    for i in range(c.n_layers):
        p, b = f"gpt_neox.layers.{i}.", f"blocks.{i}."
        _norm(sd, t, b + "ln1", p + "input_layernorm")
        _norm(sd, t, b + "ln2", p + "post_attention_layernorm")
        w = t.pop(p + "attention.query_key_value.weight")  # [H 3 dh, d], rows per head (q, k, v)
        sd[b + "attn.qkv_weight"] = w.view(H, 3, dh, d).transpose(0, 1).reshape(3 * H * dh, d)  # [3 H dh, d]
        if c.qkv_bias:
            bq = t.pop(p + "attention.query_key_value.bias")  # [H 3 dh]
            sd[b + "attn.qkv_bias"] = bq.view(H, 3, dh).transpose(0, 1).reshape(3 * H * dh)  # [3 H dh]
        sd[b + "attn.o_weight"] = t.pop(p + "attention.dense.weight")
        if c.out_bias:
            sd[b + "attn.o_bias"] = t.pop(p + "attention.dense.bias")
        _move(sd, t, b + "mlp.fc_in", p + "mlp.dense_h_to_4h", True)
        _move(sd, t, b + "mlp.fc_out", p + "mlp.dense_4h_to_h", True)
    _norm(sd, t, "ln_final", "gpt_neox.final_layer_norm")
    sd["lm_head.weight"] = (
        t.pop("embed_out.weight", None) if "embed_out.weight" in t else t.pop("lm_head.weight")
    )
    return {**t, **sd}


def _llama_like_tensors(t: dict[str, Tensor], c: ModelConfig) -> dict[str, Tensor]:
    """StableLM / Cohere: separate q, k, v (fused here), SwiGLU, LayerNorms (one per block if parallel)."""
    sd: dict[str, Tensor] = {"tok_embed.weight": t.pop("model.embed_tokens.weight")}
    for i in range(c.n_layers):
        p, b = f"model.layers.{i}.", f"blocks.{i}."
        a = p + "self_attn."
        _norm(sd, t, b + "ln1", p + "input_layernorm")
        if c.norm == "parallel":  # one norm: both sublayers read it
            sd[b + "ln2.weight"], sd[b + "ln2.bias"] = (
                sd[b + "ln1.weight"].clone(),
                sd[b + "ln1.bias"].clone(),
            )
        else:
            _norm(sd, t, b + "ln2", p + "post_attention_layernorm")
        sd[b + "attn.qkv_weight"] = torch.cat(
            [t.pop(f"{a}{x}_proj.weight") for x in "qkv"]
        )  # [(H+2Hkv) dh, d]
        if c.qkv_bias:
            sd[b + "attn.qkv_bias"] = torch.cat([t.pop(f"{a}{x}_proj.bias") for x in "qkv"])  # [(H+2Hkv) dh]
        _move(sd, t, b + "attn.o", a + "o_proj", bool(c.out_bias))
        sd[b + "attn.o_weight"] = sd.pop(b + "attn.o.weight")
        if c.out_bias:
            sd[b + "attn.o_bias"] = sd.pop(b + "attn.o.bias")
        for ours, theirs in (("fc_gate", "gate_proj"), ("fc_in", "up_proj"), ("fc_out", "down_proj")):
            _move(sd, t, f"{b}mlp.{ours}", f"{p}mlp.{theirs}", bool(c.mlp_bias))
        if c.qk_norm == "head_layernorm":
            _head_norms(sd, t, b, a, c)
    _norm(sd, t, "ln_final", "model.norm")
    head = t.pop("lm_head.weight", None)
    if c.extra.get("tied_checkpoint"):
        head = sd["tok_embed.weight"]
    if head is not None:
        sd["lm_head.weight"] = head * c.extra.get("logit_scale", 1.0) if "logit_scale" in c.extra else head
    return {**t, **sd}


def _parallel_one_norm(sd: dict[str, Tensor], b: str) -> None:
    """A one-norm parallel block: its LN2 a copy of its LN1 (both sublayers read the same norm)."""
    sd[b + "ln2.weight"], sd[b + "ln2.bias"] = sd[b + "ln1.weight"].clone(), sd[b + "ln1.bias"].clone()


def _phi_tensors(t: dict[str, Tensor], c: ModelConfig) -> dict[str, Tensor]:
    sd: dict[str, Tensor] = {"tok_embed.weight": t.pop("model.embed_tokens.weight")}
    for i in range(c.n_layers):
        p, b = f"model.layers.{i}.", f"blocks.{i}."
        a = p + "self_attn."
        _norm(sd, t, b + "ln1", p + "input_layernorm")
        _parallel_one_norm(sd, b)
        sd[b + "attn.qkv_weight"] = torch.cat(
            [t.pop(f"{a}{x}_proj.weight") for x in "qkv"]
        )  # [(H+2Hkv) dh, d]
        sd[b + "attn.qkv_bias"] = torch.cat([t.pop(f"{a}{x}_proj.bias") for x in "qkv"])  # [(H+2Hkv) dh]
        sd[b + "attn.o_weight"], sd[b + "attn.o_bias"] = t.pop(a + "dense.weight"), t.pop(a + "dense.bias")
        _move(sd, t, b + "mlp.fc_in", p + "mlp.fc1", True)
        _move(sd, t, b + "mlp.fc_out", p + "mlp.fc2", True)
    _norm(sd, t, "ln_final", "model.final_layernorm")
    _move(sd, t, "lm_head", "lm_head", True)
    return {**t, **sd}


def _gptj_tensors(t: dict[str, Tensor], c: ModelConfig) -> dict[str, Tensor]:
    sd: dict[str, Tensor] = {"tok_embed.weight": t.pop("transformer.wte.weight")}
    for i in range(c.n_layers):
        p, b = f"transformer.h.{i}.", f"blocks.{i}."
        _norm(sd, t, b + "ln1", p + "ln_1")
        _parallel_one_norm(sd, b)
        sd[b + "attn.qkv_weight"] = torch.cat([t.pop(f"{p}attn.{x}_proj.weight") for x in "qkv"])  # [3 d, d]
        sd[b + "attn.o_weight"] = t.pop(p + "attn.out_proj.weight")
        _move(sd, t, b + "mlp.fc_in", p + "mlp.fc_in", True)
        _move(sd, t, b + "mlp.fc_out", p + "mlp.fc_out", True)
    _norm(sd, t, "ln_final", "transformer.ln_f")
    _move(sd, t, "lm_head", "lm_head", True)
    return {k: v for k, v in {**t, **sd}.items() if not k.endswith(("attn.bias", "attn.masked_bias"))}


def _head_norms(sd: dict[str, Tensor], t: dict[str, Tensor], b: str, a: str, c: ModelConfig) -> None:
    """The per-head QK LayerNorm weights [heads, d_head]: Cohere's q_norm / k_norm as they are,
    StableLM's one LayerNorm per head (``q_layernorm.norms.{h}.weight`` [d_head]) stacked."""
    assert c.n_kv_heads is not None
    for ours, cohere, stablelm, heads in (("q_norm", "q_norm", "q_layernorm", c.n_heads),
                                          ("k_norm", "k_norm", "k_layernorm", c.n_kv_heads)):  # fmt: skip
        if f"{a}{cohere}.weight" in t:
            sd[f"{b}attn.{ours}.weight"] = t.pop(f"{a}{cohere}.weight")  # [heads, d_head]
        else:  # [heads, d_head] from heads x [d_head]
            sd[f"{b}attn.{ours}.weight"] = torch.stack(
                [t.pop(f"{a}{stablelm}.norms.{h}.weight") for h in range(heads)]
            )


#: model_type -> (config fields, tensor renamer).
FAMILIES: dict[str, tuple[Callable[..., dict[str, Any]], _Renamer]] = {
    "gpt_neox": (_neox, _neox_tensors),
    "stablelm": (_stablelm, _llama_like_tensors),
    "cohere": (_cohere, _llama_like_tensors),
    "phi": (_phi, _phi_tensors),
    "gptj": (_gptj, _gptj_tensors),
}
#: The ``config.json`` model types of :data:`FAMILIES`.
PARALLEL_FAMILY_TYPES = tuple(FAMILIES)


def parallel_family_config(
    hf: Mapping[str, Any], name: str = "", *, max_seq_len: int | None = None, source: str = "config.json"
) -> ModelConfig:
    """The :class:`ModelConfig` of a ``config.json`` of one of :data:`FAMILIES` (module docstring)."""
    f = ConfigFields(hf, source)
    kind = family_kind(f, FAMILIES)
    if kind == "gptj":
        hf = gptj_as_common(hf)
        f = ConfigFields(hf, source)
    kw = FAMILIES[kind][0](hf, f, _common(hf, f, kind, max_seq_len))
    with fitting_headspace(source):
        return ModelConfig(name=name, **kw)


def load_parallel_family(
    folder: str | Path, *, name: str = "", max_seq_len: int | None = None, precision: str = "float32"
) -> PretrainedDecoder:
    """Load a checkpoint folder of one of :data:`FAMILIES` onto a Decoder: the config field by field
    (:func:`parallel_family_config`), then missing / unexpected / mis-shaped tensors refused (listed)
    from the safetensors headers, before any tensor is read (:func:`~.renamed_loader.load_renamed`)."""

    def read(hf: dict[str, Any], name: str, source: str) -> ModelConfig:
        return parallel_family_config(hf, name, max_seq_len=max_seq_len, source=source)

    renamers = {k: v[1] for k, v in FAMILIES.items()}
    return load_renamed(folder, read, renamers, name=name, precision=precision, ignorable=_inv_freq)


def _inv_freq(name: str) -> bool:
    """The RoPE frequencies older checkpoints store (recomputed here)."""
    return name.endswith("rotary_emb.inv_freq")
