"""GGUF files of the rotary, parallel, absolute-position and ALiBi families: gptneox, gptj, phi2, phi3,
stablelm, olmo, granite, command-r, gemma, starcoder, bloom, mpt and falcon (llama.cpp's
``general.architecture`` names; the last four's specs in :mod:`.gguf_families_abs`).

:func:`~.gguf_format.read_gguf` dispatches here by ``general.architecture`` (:data:`FAMILY_ARCHITECTURES`)
after the container's header-first checks (:mod:`.gguf_container`: every count, length and tensor extent
checked against the file's size); :func:`family_layout` then reads the sizes from the metadata with bounds,
builds the Hugging Face ``config.json`` dict of the family, and requires the tensor table to hold exactly
the tensors that configuration implies, each of its shape, before any tensor data is read. The tensors
come back in Hugging Face naming; :func:`.gguf_family_decoder.family_decoder` undoes what llama.cpp's
converter changed and builds the Decoder with the same config checks and tensor renaming as a checkpoint
folder of that family (:mod:`.rotary_families`, :mod:`.parallel_families`, :mod:`.absolute_families`,
:mod:`.alibi_families`). Each convention was
checked against llama.cpp's convert_hf_to_gguf.py (the converter class in brackets)::

    arch        model_type   tensors (GGUF, per layer)                        what llama.cpp changed
    gptneox     gpt_neox     attn_qkv, attn_output, ffn_up/down, 2 LNs  qkv rows [3, H, d], not [H, 3, d]
    gptj        gptj         attn_q/k/v/output, ffn_up/down, one LN    (no converter class: unverified)
    phi2        phi          attn_q/k/v (or a fused attn_qkv [q; k; v]), attn_output, ffn_up/down, 1 LN
    phi3        phi3         attn_qkv, attn_output, ffn_up ([gate; up]), down   -
    stablelm    stablelm     attn_q/k/v/output, ffn_gate/up/down, LNs, attn_q/k_norm [heads, d_head]
    olmo        olmo         attn_q/k/v/output, ffn_gate/up/down (no norms)   W_Q / W_K rows permuted
    granite     granite      Llama's                                          W_Q / W_K rows permuted
    command-r   cohere       attn_q/k/v/output, ffn_gate/up/down, 1 LN (+ QK)   -
    gemma       gemma        Llama's                                          norms stored as 1 + w
    bloom       bloom        token_embd_norm; attn_qkv, attn_output, ffn_up/down, 2 LNs  qkv [3, H, d]
    mpt         mpt          attn_qkv [q; k; v], attn_output, ffn_up/down, 2 LNs without bias   -
    falcon      falcon       attn_qkv, attn_output, ffn_up/down, attn_norm (+ _2)   kv groups -> [q; k; v]
    starcoder   gpt_bigcode  attn_qkv [q; k; v] (one kv head), attn_output, ffn_up/down, 2 LNs   -

The metadata keys are llama.cpp's (``{arch}.block_count``, ``{arch}.rope.dimension_count`` for the
rotated dims of each head, ``{arch}.use_parallel_residual``, ``granite.embedding_scale`` ...). What the
converter writes, and so what is read: no RoPE base for gptneox, stablelm, phi2 and gemma (GPTNeoXModel,
StableLMModel, Phi2Model, GemmaModel: llama.cpp then runs its default 10000, and so does this reader);
phi2's and starcoder's ``feed_forward_length`` as 4 * hidden whatever the checkpoint has (Phi2Model,
StarCoderModel: the MLP width is read from ffn_up's shape instead); stablelm's per-head QK LayerNorms
stacked (StableLMModel._stack_qk_norm); phi3's ``sliding_window`` 0 for none and its LongRoPE as the
tensors ``rope_factors_long`` / ``rope_factors_short`` ([rotary_dim / 2] each) with
``phi3.rope.scaling.original_context_length`` and ``attn_factor`` (Phi3MiniModel.generate_extra_tensors:
a stored factor other than transformers' derived one is used as it is); granite's multipliers only when
set (GraniteModel: an absent ``attention.scale`` is llama.cpp's 1 / sqrt(d_head)); starcoder's one
key/value head (StarCoderModel). ``{arch}.rope.scaling.type`` linear (LlamaModel writes it with
``rope.scaling.factor``) and yarn are read as a Llama file's are (:mod:`.gguf_config`). Refused by name:
another scaling type (or any on gptj and starcoder), a starcoder file with several key/value heads, any
tensor the configuration does not imply.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .gguf_config import _rope_scaling
from .gguf_container import _Header
from .gguf_families_abs import (
    _bloom_config,
    _bloom_globals,
    _bloom_layer,
    _falcon_config,
    _falcon_layer,
    _mpt_config,
    _mpt_layer,
    _starcoder_config,
    _starcoder_globals,
    _starcoder_layer,
)
from .gguf_meta import GGUFError, meta_float, meta_int
from .gguf_specs import _eps, _globals, _ln, _Names, _rope, _rope_fraction, _Spec, _Specs

__all__ = ["FAMILY_ARCHITECTURES", "FAMILY_MODEL_TYPES", "FamilyLayout", "family_layout"]

_MAX_LAYERS, _MAX_HIDDEN, _MAX_INTERMEDIATE = 10_000, 1 << 17, 1 << 20
_MAX_HEADS, _MAX_VOCAB, _MAX_CONTEXT = 4096, 1 << 22, 1 << 24


def _llama_attn(o: str = "self_attn.o_proj") -> list[_Spec]:
    return [
        ("attn_q.weight", "self_attn.q_proj.weight", "q,h"),
        ("attn_k.weight", "self_attn.k_proj.weight", "kv,h"),
        ("attn_v.weight", "self_attn.v_proj.weight", "kv,h"),
        ("attn_output.weight", f"{o}.weight", "h,q"),
    ]


_SWIGLU: list[_Spec] = [
    ("ffn_gate.weight", "mlp.gate_proj.weight", "i,h"),
    ("ffn_up.weight", "mlp.up_proj.weight", "i,h"),
    ("ffn_down.weight", "mlp.down_proj.weight", "h,i"),
]
_RMS: list[_Spec] = [
    ("attn_norm.weight", "input_layernorm.weight", "h"),
    ("ffn_norm.weight", "post_attention_layernorm.weight", "h"),
]


@dataclass(frozen=True)
class _Arch:
    """One llama.cpp architecture: its model_type, where its layers live in Hugging Face naming, its
    per-layer and global tensors, and how its config is read (``config(meta, sizes, tensors, path)``)."""

    model_type: str
    layer_prefix: str
    layer: _Specs
    globals: _Specs
    config: Callable[[dict[str, Any], dict[str, Any], _Names, Path], dict[str, Any]]
    permuted: bool = False  # llama.cpp permuted W_Q / W_K rows (its LlamaModel.permute)
    plus_one: bool = False  # norms stored as 1 + w (Gemma)


def _shape(key: str, s: dict[str, int]) -> tuple[int, ...]:
    """``"q,h"`` -> (heads * d_head, hidden) from the sizes ``s`` (:func:`_dims`: h, i, q, kv, v, 3q, qkv,
    2i, H, Hkv, d; r = rotary_dim / 2)."""
    return tuple(s[k] for k in key.split(","))


def _sizes(meta: dict[str, Any], arch: str, path: Path) -> dict[str, Any]:
    """The sizes every family shares, each checked against a sane bound."""
    p = arch + "."
    heads = meta_int(meta, p + "attention.head_count", path, 1, _MAX_HEADS)
    kv = meta_int(meta, p + "attention.head_count_kv", path, 1, heads, default=heads)
    if heads % kv:
        raise GGUFError(path, f"{heads} attention heads cannot be shared among {kv} key/value heads")
    hidden = meta_int(meta, p + "embedding_length", path, 1, _MAX_HIDDEN)
    d_head = meta_int(meta, p + "attention.key_length", path, 2, _MAX_HIDDEN, default=hidden // heads)
    tokens = meta.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens) if isinstance(tokens, list) else None
    return {
        "vocab_size": meta_int(meta, p + "vocab_size", path, 1, _MAX_VOCAB, default=n_tokens),
        "hidden_size": hidden,
        "intermediate_size": meta_int(meta, p + "feed_forward_length", path, 1, _MAX_INTERMEDIATE),
        "num_hidden_layers": meta_int(meta, p + "block_count", path, 1, _MAX_LAYERS),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "max_position_embeddings": meta_int(meta, p + "context_length", path, 1, _MAX_CONTEXT, default=2048),
        "d_head": d_head,
        "rope_theta": meta_float(meta, p + "rope.freq_base", path, 0.0, 1e12, 10000.0),
        "rope_dims": meta_int(meta, p + "rope.dimension_count", path, 2, _MAX_HIDDEN, default=d_head),
    }


def _hf_base(s: dict[str, Any], model_type: str, keys: tuple[str, ...]) -> dict[str, Any]:
    return {"model_type": model_type, **{k: s[k] for k in keys}}


_SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings")  # fmt: skip


def _flag(meta: dict[str, Any], key: str, default: bool, path: Path) -> bool:
    value = meta.get(key, default)
    if not isinstance(value, bool):
        raise GGUFError(path, f"metadata {key!r} is {value!r}, not a bool")
    return value


# ---------------------------------------------------------------------------------------------- configs
def _neox_config(meta: dict[str, Any], s: dict[str, Any], names: _Names, path: Path) -> dict[str, Any]:
    return {
        **_hf_base(s, "gpt_neox", _SIZE_KEYS),
        "layer_norm_eps": _eps(meta, "gptneox", path, rms=False),
        "use_parallel_residual": _flag(meta, "gptneox.use_parallel_residual", True, path),
        "rope_parameters": _rope(s, path),
        "hidden_act": "gelu",
        "attention_bias": True,
        "tie_word_embeddings": "output.weight" not in names,
    }


def _stablelm_config(meta: dict[str, Any], s: dict[str, Any], names: _Names, path: Path) -> dict[str, Any]:
    return {
        **_hf_base(s, "stablelm", _SIZE_KEYS),
        "layer_norm_eps": _eps(meta, "stablelm", path, rms=False),
        # StableLMModel.set_gguf_parameters writes the flag; without it, a layer without ffn_norm is parallel
        "use_parallel_residual": _flag(
            meta, "stablelm.use_parallel_residual", "blk.0.ffn_norm.weight" not in names, path
        ),
        "use_qkv_bias": "blk.0.attn_q.bias" in names,
        "qk_layernorm": "blk.0.attn_q_norm.weight" in names,
        "rope_parameters": _rope(s, path),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
    }


def _phi2_config(meta: dict[str, Any], s: dict[str, Any], names: _Names, path: Path) -> dict[str, Any]:
    return {
        **_hf_base(s, "phi", _SIZE_KEYS),
        "layer_norm_eps": _eps(meta, "phi2", path, rms=False),
        "rope_parameters": _rope(s, path),
        "hidden_act": "gelu_new",
        "tie_word_embeddings": False,
    }


def _gptj_config(meta: dict[str, Any], s: dict[str, Any], names: _Names, path: Path) -> dict[str, Any]:
    if s["rope_theta"] != 10000.0:
        raise GGUFError(path, f"gptj.rope.freq_base is {s['rope_theta']}; GPT-J's rotation has base 10000")
    _rope_fraction(s["rope_dims"], s["d_head"], path)
    return {
        "model_type": "gptj",
        "vocab_size": s["vocab_size"],
        "n_embd": s["hidden_size"],
        "n_layer": s["num_hidden_layers"],
        "n_head": s["num_attention_heads"],
        "n_inner": s["intermediate_size"],
        "n_positions": s["max_position_embeddings"],
        "rotary_dim": s["rope_dims"],
        "layer_norm_epsilon": _eps(meta, "gptj", path, rms=False),
        "activation_function": "gelu_new",
        "tie_word_embeddings": False,
    }


def _longrope_lengths(meta: dict[str, Any], hf: dict[str, Any], path: Path) -> None:
    """Phi-3's LongRoPE lengths (Phi3MiniModel.set_gguf_parameters / generate_extra_tensors): the original
    context, and the attention factor the converter wrote, sqrt(1 + ln(s) / ln(original)) for
    s = context / original > 1 (else 1), as transformers derives it; another stored value is kept as the
    scaling's ``attention_factor``, since llama.cpp multiplies by the stored one."""
    original = meta_int(meta, "phi3.rope.scaling.original_context_length", path, 1, _MAX_CONTEXT)
    hf["original_max_position_embeddings"] = original
    scale = hf["max_position_embeddings"] / original
    derived = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 and original > 1 else 1.0
    stored = meta_float(meta, "phi3.rope.scaling.attn_factor", path, 0.0, 1e3, derived)
    if abs(stored - derived) > 1e-6 * derived:  # beyond the float32 rounding of the derived one
        hf["rope_parameters"]["attention_factor"] = stored


def _llama_like(model_type: str, arch: str, **fixed: Any):
    """phi3, gemma, granite, olmo, command-r: sizes, RMS (or LayerNorm) eps, the rotation."""

    def config(meta: dict[str, Any], s: dict[str, Any], names: _Names, path: Path) -> dict[str, Any]:
        hf = {**_hf_base(s, model_type, _SIZE_KEYS), "head_dim": s["d_head"], **fixed}
        hf["rope_parameters"] = _rope(s, path)
        hf["tie_word_embeddings"] = "output.weight" not in names
        if arch == "phi3":
            hf["rms_norm_eps"] = _eps(meta, arch, path, rms=True)
            hf["partial_rotary_factor"] = hf["rope_parameters"]["partial_rotary_factor"]
            # Phi3MiniModel writes 0 for "no window" (its sign for Phi-4)
            window = meta_int(meta, "phi3.attention.sliding_window", path, 0, _MAX_CONTEXT, default=0)
            hf["sliding_window"] = window or None
            if "rope_factors_long.weight" in names:  # LongRoPE: its factor lists are tensors of the file
                _longrope_lengths(meta, hf, path)
        elif arch in ("gemma", "granite"):
            hf["rms_norm_eps"] = _eps(meta, arch, path, rms=True)
        elif arch == "command-r":
            hf["layer_norm_eps"] = _eps(meta, arch, path, rms=False)
            hf["logit_scale"] = meta_float(meta, "command-r.logit_scale", path, 0.0, 1e6, 0.0625)
            hf["use_qk_norm"] = "blk.0.attn_q_norm.weight" in names
        if arch == "granite":  # GraniteModel.set_gguf_parameters writes each multiplier that is set
            for key, gguf_key in (("embedding_multiplier", "embedding_scale"), ("residual_multiplier",
                                  "residual_scale"), ("attention_multiplier", "attention.scale"),
                                  ("logits_scaling", "logit_scale")):  # fmt: skip
                # an absent attention.scale is llama.cpp's 1 / sqrt(d_head) (its f_attention_scale 0)
                unset = 1.0 / math.sqrt(s["d_head"]) if key == "attention_multiplier" else 1.0
                hf[key] = meta_float(meta, f"granite.{gguf_key}", path, 0.0, 1e6, unset)
        if arch == "olmo" and "olmo.attention.clamp_kqv" in meta:
            hf["clip_qkv"] = meta["olmo.attention.clamp_kqv"]  # refused by name, as in a folder
        return hf

    return config


# ---------------------------------------------------------------------------------------------- tensors
def _neox_layer(c: dict[str, Any], names: _Names) -> list[_Spec]:
    return [
        *_ln("attn_norm", "input_layernorm"),
        *_ln("ffn_norm", "post_attention_layernorm"),
        ("attn_qkv.weight", "attention.query_key_value.weight", "3q,h"),
        ("attn_qkv.bias", "attention.query_key_value.bias", "3q"),
        ("attn_output.weight", "attention.dense.weight", "h,q"),
        ("attn_output.bias", "attention.dense.bias", "h"),
        ("ffn_up.weight", "mlp.dense_h_to_4h.weight", "i,h"),
        ("ffn_up.bias", "mlp.dense_h_to_4h.bias", "i"),
        ("ffn_down.weight", "mlp.dense_4h_to_h.weight", "h,i"),
        ("ffn_down.bias", "mlp.dense_4h_to_h.bias", "h"),
    ]


def _stablelm_layer(c: dict[str, Any], names: _Names) -> list[_Spec]:
    out = [*_ln("attn_norm", "input_layernorm"), *_llama_attn(), *_SWIGLU]
    if not c["use_parallel_residual"]:
        out += _ln("ffn_norm", "post_attention_layernorm")
    if c["use_qkv_bias"]:
        out += [(f"attn_{x}.bias", f"self_attn.{x}_proj.bias", "q" if x == "q" else "kv") for x in "qkv"]
    if c["qk_layernorm"]:  # StableLMModel._stack_qk_norm: the per-head norms stacked, [heads, d_head]
        out += [("attn_q_norm.weight", "self_attn.q_norm.weight", "H,d"),
                ("attn_k_norm.weight", "self_attn.k_norm.weight", "Hkv,d")]  # fmt: skip
    return out


_PHI2_QKV = "self_attn.qkv"  # a fused q/k/v of phi2 until family_decoder splits it


def _phi2_layer(c: dict[str, Any], names: _Names) -> list[_Spec]:
    if "blk.0.attn_qkv.weight" in names:  # the older Wqkv checkpoints: rows [q; k; v], split on reading
        attn = [("attn_qkv.weight", _PHI2_QKV + ".weight", "qkv,h"),
                ("attn_qkv.bias", _PHI2_QKV + ".bias", "qkv"),
                ("attn_output.weight", "self_attn.dense.weight", "h,q")]  # fmt: skip
    else:
        attn = _llama_attn("self_attn.dense") + [
            (f"attn_{x}.bias", f"self_attn.{x}_proj.bias", "q" if x == "q" else "kv") for x in "qkv"
        ]
    return [
        *_ln("attn_norm", "input_layernorm"),
        *attn,
        ("attn_output.bias", "self_attn.dense.bias", "h"),
        ("ffn_up.weight", "mlp.fc1.weight", "i,h"),
        ("ffn_up.bias", "mlp.fc1.bias", "i"),
        ("ffn_down.weight", "mlp.fc2.weight", "h,i"),
        ("ffn_down.bias", "mlp.fc2.bias", "h"),
    ]


def _gptj_layer(c: dict[str, Any], names: _Names) -> list[_Spec]:
    return [
        *_ln("attn_norm", "ln_1"),
        ("attn_q.weight", "attn.q_proj.weight", "h,h"),
        ("attn_k.weight", "attn.k_proj.weight", "h,h"),
        ("attn_v.weight", "attn.v_proj.weight", "h,h"),
        ("attn_output.weight", "attn.out_proj.weight", "h,h"),
        ("ffn_up.weight", "mlp.fc_in.weight", "i,h"),
        ("ffn_up.bias", "mlp.fc_in.bias", "i"),
        ("ffn_down.weight", "mlp.fc_out.weight", "h,i"),
        ("ffn_down.bias", "mlp.fc_out.bias", "h"),
    ]


def _phi3_layer(c: dict[str, Any], names: _Names) -> list[_Spec]:
    return [
        *_RMS,
        ("attn_qkv.weight", "self_attn.qkv_proj.weight", "qkv,h"),
        ("attn_output.weight", "self_attn.o_proj.weight", "h,q"),
        ("ffn_up.weight", "mlp.gate_up_proj.weight", "2i,h"),
        ("ffn_down.weight", "mlp.down_proj.weight", "h,i"),
    ]


def _rms_llama_layer(c: dict[str, Any], names: _Names) -> list[_Spec]:
    return [*_RMS, *_llama_attn(), *_SWIGLU]


def _olmo_layer(c: dict[str, Any], names: _Names) -> list[_Spec]:
    return [*_llama_attn(), *_SWIGLU]


def _cohere_layer(c: dict[str, Any], names: _Names) -> list[_Spec]:
    out = [("attn_norm.weight", "input_layernorm.weight", "h"), *_llama_attn(), *_SWIGLU]
    if c["use_qk_norm"]:
        out += [("attn_q_norm.weight", "self_attn.q_norm.weight", "H,d"),
                ("attn_k_norm.weight", "self_attn.k_norm.weight", "Hkv,d")]  # fmt: skip
    return out


#: LongRoPE's factor lists, as the file stores them ([rotary_dim / 2] each) -> where they go for a while
_LONGROPE = {"rope_factors_long.weight": "rope_parameters.long_factor",
             "rope_factors_short.weight": "rope_parameters.short_factor"}  # fmt: skip


def _phi3_globals(c: dict[str, Any], names: _Names) -> list[_Spec]:
    """Phi-3's: a Llama's, and LongRoPE's factor lists where the file has them (both, or neither)."""
    out = _globals(*_MODEL, norm_bias=False)(c, names)
    if "rope_factors_long.weight" in names or "rope_factors_short.weight" in names:
        out += [(gguf_name, hf_name, "r") for gguf_name, hf_name in _LONGROPE.items()]
    return out


def _olmo_globals(c: dict[str, Any], names: _Names) -> list[_Spec]:
    """OLMo's: the embedding and the unembedding where the file has one (its norms have no weights)."""
    head = [("output.weight", "lm_head.weight", "v,h")] if "output.weight" in names else []
    return [("token_embd.weight", "model.embed_tokens.weight", "v,h"), *head]


_MODEL = ("model.embed_tokens.weight", "model.norm", "lm_head")
_ARCHS: dict[str, _Arch] = {
    "gptneox": _Arch(
        "gpt_neox",
        "gpt_neox.layers",
        _neox_layer,
        _globals("gpt_neox.embed_in.weight", "gpt_neox.final_layer_norm", "lm_head", norm_bias=True),
        _neox_config,
    ),
    "stablelm": _Arch(
        "stablelm", "model.layers", _stablelm_layer, _globals(*_MODEL, norm_bias=True), _stablelm_config
    ),
    "phi2": _Arch(
        "phi",
        "model.layers",
        _phi2_layer,
        _globals(
            "model.embed_tokens.weight", "model.final_layernorm", "lm_head", norm_bias=True, head_bias=True
        ),
        _phi2_config,
    ),
    "gptj": _Arch(
        "gptj",
        "transformer.h",
        _gptj_layer,
        _globals("transformer.wte.weight", "transformer.ln_f", "lm_head", norm_bias=True, head_bias=True),
        _gptj_config,
    ),
    "phi3": _Arch(
        "phi3",
        "model.layers",
        _phi3_layer,
        _phi3_globals,
        _llama_like("phi3", "phi3", hidden_act="silu"),
    ),
    "gemma": _Arch(
        "gemma",
        "model.layers",
        _rms_llama_layer,
        _globals(*_MODEL, norm_bias=False),
        _llama_like("gemma", "gemma", hidden_activation="gelu_pytorch_tanh"),
        plus_one=True,
    ),
    "granite": _Arch(
        "granite",
        "model.layers",
        _rms_llama_layer,
        _globals(*_MODEL, norm_bias=False),
        _llama_like("granite", "granite", hidden_act="silu"),
        permuted=True,
    ),
    "olmo": _Arch(
        "olmo",
        "model.layers",
        _olmo_layer,
        _olmo_globals,
        _llama_like("olmo", "olmo", hidden_act="silu"),
        permuted=True,
    ),
    "command-r": _Arch(
        "cohere",
        "model.layers",
        _cohere_layer,
        _globals(*_MODEL, norm_bias=False),
        _llama_like("cohere", "command-r", hidden_act="silu"),
    ),
    "bloom": _Arch("bloom", "transformer.h", _bloom_layer, _bloom_globals, _bloom_config),
    "falcon": _Arch(
        "falcon",
        "transformer.h",
        _falcon_layer,
        _globals("transformer.word_embeddings.weight", "transformer.ln_f", "lm_head", norm_bias=True),
        _falcon_config,
    ),
    "mpt": _Arch(
        "mpt",
        "transformer.blocks",
        _mpt_layer,
        _globals("transformer.wte.weight", "transformer.norm_f", "lm_head", norm_bias=False),
        _mpt_config,
    ),
    "starcoder": _Arch(
        "gpt_bigcode", "transformer.h", _starcoder_layer, _starcoder_globals, _starcoder_config
    ),
}
#: Architectures whose converter writes feed_forward_length as 4 * embedding_length whatever the
#: checkpoint has (Phi2Model, StarCoderModel): their MLP width is read from ffn_up's shape instead.
_FFN_FROM_TABLE = ("phi2", "starcoder", "falcon")
#: Architectures whose config takes no RoPE scaling (GPT-J's fixed rotation; StarCoder has none).
_UNROTATED = ("gptj", "starcoder", "bloom", "mpt")
#: The ``general.architecture`` values this module reads.
FAMILY_ARCHITECTURES: tuple[str, ...] = tuple(_ARCHS)


@dataclass(frozen=True)
class FamilyLayout:
    """A checked file's plan: the Hugging Face ``config`` dict, ``expected`` (GGUF name -> PyTorch shape,
    exactly the file's tensors), ``names`` (GGUF name -> Hugging Face name), ``heads`` (W_Q / W_K GGUF
    name -> heads whose rows llama.cpp permuted) and ``minus_one`` (norms stored as 1 + w)."""

    config: dict[str, Any]
    expected: dict[str, tuple[int, ...]]
    names: dict[str, str]
    heads: dict[str, int]
    minus_one: frozenset[str]


def _dims(s: dict[str, Any]) -> dict[str, int]:
    """The shape keys of :data:`_Spec` from the sizes of :func:`_sizes`."""
    h, i, H, kv, d = (s["hidden_size"], s["intermediate_size"], s["num_attention_heads"],
                      s["num_key_value_heads"], s["d_head"])  # fmt: skip
    return {"h": h, "i": i, "q": H * d, "kv": kv * d, "v": s["vocab_size"], "3q": 3 * H * d,
            "qkv": (H + 2 * kv) * d, "2i": 2 * i, "H": H, "Hkv": kv, "d": d,
            "r": s["rope_dims"] // 2, "p": s["max_position_embeddings"]}  # fmt: skip


def _check_table(header: _Header, expected: dict[str, tuple[int, ...]], arch: str, path: Path) -> None:
    """Exactly the expected tensors, each of its expected shape; the message names the first few."""
    present = {t.name: t.shape for t in header.tensors}
    missing = [n for n in expected if n not in present]
    unexpected = [n for n in present if n not in expected]
    for what, listed in (("missing tensors", missing), ("tensors it does not have", unexpected)):
        if listed:
            shown = ", ".join(listed[:8]) + (f", ... ({len(listed)} in all)" if len(listed) > 8 else "")
            raise GGUFError(path, f"{what} for a {arch!r} model as its metadata describes it: {shown}")
    for name, shape in expected.items():
        if present[name] != shape:
            raise GGUFError(
                path,
                f"tensor {name!r} has shape {list(present[name])}, but the metadata implies {list(shape)}",
            )


def family_layout(meta: dict[str, Any], arch: str, header: _Header, path: Path) -> FamilyLayout:
    """The configuration and tensor plan of a file of architecture ``arch`` (one of
    :data:`FAMILY_ARCHITECTURES`), every check done before any tensor data is read."""
    a = _ARCHS[arch]
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind not in ("none", "linear", "yarn") or (kind != "none" and arch in _UNROTATED):
        raise GGUFError(
            path, f"metadata '{arch}.rope.scaling.type' is {kind!r}: RoPE scaling is not read here"
        )
    present = {t.name: t.shape for t in header.tensors}
    s = _sizes(meta, arch, path)
    # linear (LlamaModel.set_gguf_parameters: type and factor) and YaRN, read as a Llama file's are
    s["rope_scaling"] = _rope_scaling(meta, arch, path)
    up = present.get("blk.0.ffn_up.weight", ())
    if arch in _FFN_FROM_TABLE and len(up) == 2 and 1 <= up[0] <= _MAX_INTERMEDIATE:
        s["intermediate_size"] = up[0]
    hf = a.config(meta, s, present, path)
    dims = _dims(s)
    expected: dict[str, tuple[int, ...]] = {}
    names: dict[str, str] = {}
    for gguf_name, hf_name, key in a.globals(hf, present):
        expected[gguf_name], names[gguf_name] = _shape(key, dims), hf_name
    layer_specs = a.layer(hf, present)
    for n in range(s["num_hidden_layers"]):
        for part, hf_name, key in layer_specs:
            expected[f"blk.{n}.{part}"] = _shape(key, dims)
            names[f"blk.{n}.{part}"] = f"{a.layer_prefix}.{n}.{hf_name}"
    _check_table(header, expected, arch, path)
    heads: dict[str, int] = {}
    if a.permuted:
        for n in range(s["num_hidden_layers"]):
            heads[f"blk.{n}.attn_q.weight"] = dims["H"]
            heads[f"blk.{n}.attn_k.weight"] = dims["Hkv"]
    minus_one = frozenset(n for n in expected if a.plus_one and n.endswith("norm.weight"))
    return FamilyLayout(hf, expected, names, heads, minus_one)


#: The Hugging Face model types :func:`.gguf_family_decoder.family_decoder` builds.
FAMILY_MODEL_TYPES: tuple[str, ...] = tuple(a.model_type for a in _ARCHS.values())
