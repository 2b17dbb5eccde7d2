"""The GGUF architectures of :mod:`.gguf_families` without rotary scaling of their own: starcoder
(GPT-BigCode, learned positions), bloom and mpt (ALiBi) and falcon (rotary, parallel), each as llama.cpp's
convert_hf_to_gguf.py writes it (the converter class named in each docstring): the Hugging Face config
read from the metadata, and the tensor specs of :mod:`.gguf_specs`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .gguf_meta import GGUFError, meta_float
from .gguf_specs import _eps, _globals, _ln, _Names, _rope, _Spec


def _starcoder_config(meta: dict[str, Any], s: dict[str, Any], names: _Names, path: Path) -> dict[str, Any]:
    """GPT-BigCode (StarCoderModel.set_gguf_parameters): multi-query, one key/value head always."""
    if s["num_key_value_heads"] != 1:
        raise GGUFError(
            path,
            f"'starcoder.attention.head_count_kv' is {s['num_key_value_heads']}; expected 1 (multi-query)",
        )
    return {
        "model_type": "gpt_bigcode", "vocab_size": s["vocab_size"], "n_embd": s["hidden_size"],
        "n_layer": s["num_hidden_layers"], "n_head": s["num_attention_heads"],
        "n_inner": s["intermediate_size"], "n_positions": s["max_position_embeddings"], "multi_query": True,
        "layer_norm_epsilon": _eps(meta, "starcoder", path, rms=False),
        "activation_function": "gelu_pytorch_tanh",  # llama.cpp's GELU is the tanh approximation
        "tie_word_embeddings": "output.weight" not in names,
    }  # fmt: skip


def _bloom_config(meta: dict[str, Any], s: dict[str, Any], names: _Names, path: Path) -> dict[str, Any]:
    """BLOOM (BloomModel.set_gguf_parameters: context seq_length, else n_embed; MLP 4 * n_embed)."""
    return {
        "model_type": "bloom", "vocab_size": s["vocab_size"], "hidden_size": s["hidden_size"],
        "n_layer": s["num_hidden_layers"], "n_head": s["num_attention_heads"],
        "seq_length": s["max_position_embeddings"],
        "layer_norm_epsilon": _eps(meta, "bloom", path, rms=False),
        "tie_word_embeddings": "output.weight" not in names,
    }  # fmt: skip


def _mpt_config(meta: dict[str, Any], s: dict[str, Any], names: _Names, path: Path) -> dict[str, Any]:
    """MPT (MPTModel.set_gguf_parameters: MLP 4 * d_model, eps 1e-5, ``max_alibi_bias`` the config's
    alibi_bias_max or 0 for no ALiBi, ``clamp_kqv`` when set; no softmax_scale is written)."""
    attn: dict[str, Any] = {"alibi": True, "alibi_bias_max": 8}
    bias_max = meta_float(meta, "mpt.attention.max_alibi_bias", path, -1.0, 1e6, 8.0)
    if bias_max != 8.0:  # 0: no ALiBi; both refused by name, as a folder's would be
        attn = {"alibi": bias_max > 0, "alibi_bias_max": bias_max}
    if "mpt.attention.clamp_kqv" in meta:
        attn["clip_qkv"] = meta["mpt.attention.clamp_kqv"]
    return {
        "model_type": "mpt", "vocab_size": s["vocab_size"], "d_model": s["hidden_size"],
        "n_layers": s["num_hidden_layers"], "n_heads": s["num_attention_heads"],
        "max_seq_len": s["max_position_embeddings"], "attn_config": attn, "no_bias": True,
        "layer_norm_epsilon": _eps(meta, "mpt", path, rms=False),
        "tie_word_embeddings": "output.weight" not in names,
    }  # fmt: skip


def _falcon_config(meta: dict[str, Any], s: dict[str, Any], names: _Names, path: Path) -> dict[str, Any]:
    """Falcon (FalconModel.set_gguf_parameters: context 2048, MLP 4 * hidden, no RoPE base; llama.cpp's
    graph is parallel and rotary): attn_norm_2 present, the new architecture (grouped kv); else the old
    one, multi-query with one kv head or one kv head per head."""
    new, H, kv = "blk.0.attn_norm_2.weight" in names, s["num_attention_heads"], s["num_key_value_heads"]
    if not new and kv not in (1, H):
        raise GGUFError(
            path, f"'falcon.attention.head_count_kv' is {kv}; expected 1 or {H} without attn_norm_2"
        )
    return {
        "model_type": "falcon", "vocab_size": s["vocab_size"], "hidden_size": s["hidden_size"],
        "num_hidden_layers": s["num_hidden_layers"], "num_attention_heads": H, "num_kv_heads": kv,
        "new_decoder_architecture": new, "multi_query": not new and kv == 1, "parallel_attn": True,
        "num_ln_in_parallel_attn": 2 if new else None, "bias": False, "alibi": False,
        "ffn_hidden_size": s["intermediate_size"], "max_position_embeddings": s["max_position_embeddings"],
        "layer_norm_epsilon": _eps(meta, "falcon", path, rms=False), "rope_parameters": _rope(s, path),
        "tie_word_embeddings": "output.weight" not in names,
    }  # fmt: skip


def _starcoder_layer(c: dict[str, Any], names: _Names) -> list[_Spec]:
    return [
        *_ln("attn_norm", "ln_1"),
        *_ln("ffn_norm", "ln_2"),
        ("attn_qkv.weight", "attn.c_attn.weight", "qkv,h"),  # rows [q (H d); k (d); v (d)], as HF has them
        ("attn_qkv.bias", "attn.c_attn.bias", "qkv"),
        ("attn_output.weight", "attn.c_proj.weight", "h,q"),
        ("attn_output.bias", "attn.c_proj.bias", "h"),
        ("ffn_up.weight", "mlp.c_fc.weight", "i,h"),
        ("ffn_up.bias", "mlp.c_fc.bias", "i"),
        ("ffn_down.weight", "mlp.c_proj.weight", "h,i"),
        ("ffn_down.bias", "mlp.c_proj.bias", "h"),
    ]


def _bloom_layer(c: dict[str, Any], names: _Names) -> list[_Spec]:
    return [
        *_ln("attn_norm", "input_layernorm"),
        *_ln("ffn_norm", "post_attention_layernorm"),
        ("attn_qkv.weight", "self_attention.query_key_value.weight", "3q,h"),  # rows [3, H, d] (BloomModel)
        ("attn_qkv.bias", "self_attention.query_key_value.bias", "3q"),
        ("attn_output.weight", "self_attention.dense.weight", "h,q"),
        ("attn_output.bias", "self_attention.dense.bias", "h"),
        ("ffn_up.weight", "mlp.dense_h_to_4h.weight", "i,h"),
        ("ffn_up.bias", "mlp.dense_h_to_4h.bias", "i"),
        ("ffn_down.weight", "mlp.dense_4h_to_h.weight", "h,i"),
        ("ffn_down.bias", "mlp.dense_4h_to_h.bias", "h"),
    ]


def _bloom_globals(c: dict[str, Any], names: _Names) -> list[_Spec]:
    """The embedding and its LayerNorm, the final LayerNorm, the unembedding where there is one."""
    out = _globals("transformer.word_embeddings.weight", "transformer.ln_f", "lm_head", norm_bias=True)(
        c, names
    )
    return [*out, *_ln("token_embd_norm", "transformer.word_embeddings_layernorm")]


def _mpt_layer(c: dict[str, Any], names: _Names) -> list[_Spec]:
    return [
        ("attn_norm.weight", "norm_1.weight", "h"),  # LayerNorms without bias, no biases anywhere
        ("attn_qkv.weight", "attn.Wqkv.weight", "3q,h"),  # rows [q; k; v], as HF has them
        ("attn_output.weight", "attn.out_proj.weight", "h,q"),
        ("ffn_norm.weight", "norm_2.weight", "h"),
        ("ffn_up.weight", "ffn.up_proj.weight", "i,h"),
        ("ffn_down.weight", "ffn.down_proj.weight", "h,i"),
    ]


def _falcon_layer(c: dict[str, Any], names: _Names) -> list[_Spec]:
    # the new architecture: attn_norm is ln_mlp (the MLP's), attn_norm_2 ln_attn (the attention's)
    norms = _ln("attn_norm", "ln_mlp") + _ln("attn_norm_2", "ln_attn")
    return [
        *(norms if c["new_decoder_architecture"] else _ln("attn_norm", "input_layernorm")),
        ("attn_qkv.weight", "self_attention.query_key_value.weight", "qkv,h"),  # rows [q; k; v]
        ("attn_output.weight", "self_attention.dense.weight", "h,q"),
        ("ffn_up.weight", "mlp.dense_h_to_4h.weight", "i,h"),
        ("ffn_down.weight", "mlp.dense_4h_to_h.weight", "h,i"),
    ]


def _starcoder_globals(c: dict[str, Any], names: _Names) -> list[_Spec]:
    """GPT-2's: the token and position tables, the final LayerNorm, the unembedding where there is one."""
    out = _globals("transformer.wte.weight", "transformer.ln_f", "lm_head", norm_bias=True)(c, names)
    return [*out, ("position_embd.weight", "transformer.wpe.weight", "p,h")]
