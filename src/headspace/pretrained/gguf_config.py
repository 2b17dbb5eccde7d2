"""A GGUF file's configuration: the Hugging Face LlamaConfig its metadata describes, and the tensors
that configuration implies (GGUF names, PyTorch shapes, Hugging Face names).

Every size is read with bounds (``_MAX_*``, far above any released model) and the parameters they
imply must fit in the file at the densest supported storage type before anything is allocated; the
tensor table must then hold exactly the implied tensors, each of its implied shape. Part of the GGUF
reader (:mod:`.gguf_format`, which re-exports these names).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .gguf_container import _MIN_BYTES_PER_WEIGHT, _Header
from .gguf_gemma import GEMMA3_ARCH, gemma3_config, gemma3_layer_shapes
from .gguf_meta import GGUFError, meta_float, meta_int

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", GEMMA3_ARCH)
# architectures people expect to load, and why they are refused
_REFUSED_ARCHITECTURES: dict[str, str] = {
    "qwen2": (
        "its tensors are not Llama's: every layer adds q/k/v biases (blk.N.attn_q.bias, attn_k.bias, "
        "attn_v.bias) and its Q/K rows are stored unpermuted (NEOX RoPE)"
    ),
    "mistral": (
        "llama.cpp writes Mistral and Mixtral checkpoints with general.architecture = 'llama' (which is "
        "supported); a file declaring 'mistral' does not come from llama.cpp's converter, so whether its "
        "Q/K rows are permuted is unknown"
    ),
}

# sanity limits on the configuration (all far above any released model)
_MAX_LAYERS = 10_000
_MAX_HIDDEN = 1 << 17
_MAX_INTERMEDIATE = 1 << 20
_MAX_HEADS = 4096
_MAX_HEAD_DIM = 4096
_MAX_VOCAB = 1 << 22
_MAX_CONTEXT = 1 << 24


def _rope_scaling(meta: dict[str, Any], arch: str, path: Path) -> dict[str, Any] | None:
    """Hugging Face ``rope_scaling`` from ``{arch}.rope.scaling.*`` (or the older ``rope.scale_linear``)."""
    p = f"{arch}.rope."
    kind, factor_key = meta.get(p + "scaling.type"), p + "scaling.factor"
    if kind is None and p + "scale_linear" in meta:
        kind, factor_key = "linear", p + "scale_linear"
    if kind is None or kind == "none":
        return None
    if kind not in ("linear", "yarn"):
        raise GGUFError(path, f"RoPE scaling type {kind!r} is not supported (supported: none, linear, yarn)")
    factor = meta_float(meta, factor_key, path, 0.0, 1e6, 1.0)
    if factor == 1.0:
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": factor}
    if kind == "yarn":
        original = meta_int(meta, p + "scaling.original_context_length", path, 1, _MAX_CONTEXT)
        scaling["original_max_position_embeddings"] = original
    return scaling


def _head_dims(meta: dict[str, Any], p: str, hidden: int, path: Path) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dimension) from ``{p}attention.*`` and ``{p}rope.*``, checked.

    The head counts must be single numbers (not per layer) and the key/value heads must divide the
    query heads; the head dimension (``attention.key_length``, else ``rope.dimension_count``, else
    ``hidden / heads``) must be even, rotated whole by RoPE and equal to the value heads' dimension.
    """
    for key in ("attention.head_count", "attention.head_count_kv"):
        if isinstance(meta.get(p + key), (list, np.ndarray)):
            raise GGUFError(path, f"metadata {p + key!r} varies per layer, which a Llama model does not do")
    heads = meta_int(meta, p + "attention.head_count", path, 1, _MAX_HEADS)
    kv_heads = meta_int(meta, p + "attention.head_count_kv", path, 1, heads, default=heads)
    if heads % kv_heads:
        raise GGUFError(path, f"{heads} attention heads cannot be shared among {kv_heads} key/value heads")
    rope_dims = meta.get(p + "rope.dimension_count")
    head_dim = meta_int(meta, p + "attention.key_length", path, 1, _MAX_HEAD_DIM, default=0) or (
        meta_int(meta, p + "rope.dimension_count", path, 1, _MAX_HEAD_DIM)
        if rope_dims is not None
        else hidden // heads
    )
    if head_dim < 2 or head_dim % 2:
        raise GGUFError(path, f"the head dimension is {head_dim}; RoPE needs an even one")
    if rope_dims is not None and rope_dims != head_dim:
        raise GGUFError(
            path,
            f"RoPE rotates {rope_dims} of each head's {head_dim} dimensions; partial RoPE is not supported",
        )
    value_dim = meta_int(meta, p + "attention.value_length", path, 1, _MAX_HEAD_DIM, default=head_dim)
    if value_dim != head_dim:
        raise GGUFError(path, f"key heads of {head_dim} and value heads of {value_dim} dimensions differ")
    return heads, kv_heads, head_dim


def _check_fits(sizes: dict[str, int], arch: str, tied: bool, file_size: int, path: Path) -> None:
    """The parameters ``sizes`` (LlamaConfig's size fields) imply must fit in ``file_size`` bytes at the
    densest supported type (:data:`_MIN_BYTES_PER_WEIGHT`), so that absurd metadata is refused at once.

    Counted: the embedding (twice unless ``tied``), per layer the two norms, W_Q and W_O
    (``hidden * heads * head_dim`` each), W_K and W_V, the three MLP matrices (and for Gemma 3 its
    sandwich norms and QK-norm weights), and the final norm.
    """
    hidden, head_dim = sizes["hidden_size"], sizes["head_dim"]
    q_dim = sizes["num_attention_heads"] * head_dim
    kv_dim = sizes["num_key_value_heads"] * head_dim
    intermediate = sizes["intermediate_size"]
    per_layer = 2 * hidden + 2 * hidden * q_dim + 2 * hidden * kv_dim + 3 * hidden * intermediate
    if arch == GEMMA3_ARCH:
        per_layer += 2 * hidden + 2 * head_dim  # the sandwich norms and the QK-norm weights
    params = (
        sizes["vocab_size"] * hidden * (1 if tied else 2) + sizes["num_hidden_layers"] * per_layer + hidden
    )
    if params * _MIN_BYTES_PER_WEIGHT > file_size:
        raise GGUFError(
            path,
            f"the metadata describes a model of {params:,} parameters, which needs at least "
            f"{math.ceil(params * _MIN_BYTES_PER_WEIGHT):,} bytes, but the file has {file_size:,}",
        )


def _build_config(
    meta: dict[str, Any], arch: str, tensor_names: set[str], file_size: int, path: Path
) -> dict[str, Any]:
    """Hugging Face LlamaConfig keyword arguments from the ``{arch}.*`` and ``tokenizer.ggml.*`` metadata."""
    p = arch + "."
    if meta_int(meta, p + "expert_count", path, 0, 1 << 16, default=0) > 0:
        raise GGUFError(
            path, "mixture-of-experts models (llama.expert_count > 0, e.g. Mixtral) are not supported"
        )
    layers = meta_int(meta, p + "block_count", path, 1, _MAX_LAYERS)
    hidden = meta_int(meta, p + "embedding_length", path, 1, _MAX_HIDDEN)
    intermediate = meta_int(meta, p + "feed_forward_length", path, 1, _MAX_INTERMEDIATE)
    heads, kv_heads, head_dim = _head_dims(meta, p, hidden, path)
    if "rope_freqs.weight" in tensor_names:
        raise GGUFError(
            path,
            "the file stores per-frequency RoPE factors (rope_freqs.weight, Llama 3.1-style 'llama3' RoPE "
            "scaling), which this reader cannot turn into a Hugging Face rope_scaling",
        )

    tokens = meta.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens) if isinstance(tokens, list) else 0
    vocab = meta_int(meta, p + "vocab_size", path, 1, _MAX_VOCAB, default=n_tokens or None)
    tied = "output.weight" not in tensor_names
    sizes = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
    }
    _check_fits(sizes, arch, tied, file_size, path)

    config: dict[str, Any] = {
        "model_type": "llama",
        **sizes,
        # LlamaConfig's defaults where the file is silent, as transformers does
        "max_position_embeddings": meta_int(meta, p + "context_length", path, 1, _MAX_CONTEXT, default=2048),
        "rms_norm_eps": meta_float(meta, p + "attention.layer_norm_rms_epsilon", path, 0.0, 1.0, 1e-6),
        "rope_theta": meta_float(meta, p + "rope.freq_base", path, 0.0, 1e12, 10000.0),
        "rope_scaling": _rope_scaling(meta, arch, path),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }
    for key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        config[key] = _special_id(meta, gguf_key, n_tokens or vocab, path)
    pad = _special_id(meta, "padding_token_id", n_tokens or vocab, path)
    if pad is not None:
        config["pad_token_id"] = pad
    if arch == GEMMA3_ARCH:
        return gemma3_config(meta, config, path)
    return config


def _special_id(meta: dict[str, Any], key: str, n_tokens: int, path: Path) -> int | None:
    full = f"tokenizer.ggml.{key}"
    if full not in meta:
        return None
    return meta_int(meta, full, path, 0, n_tokens - 1)


def _expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> the PyTorch shape the configuration implies, in Hugging Face state-dict order."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (v, h)}
    for n in range(config["num_hidden_layers"]):
        b = f"blk.{n}."
        shapes |= {
            b + "attn_q.weight": (q, h),
            b + "attn_k.weight": (kv, h),
            b + "attn_v.weight": (kv, h),
            b + "attn_output.weight": (h, q),
            b + "ffn_gate.weight": (i, h),
            b + "ffn_up.weight": (i, h),
            b + "ffn_down.weight": (h, i),
            b + "attn_norm.weight": (h,),
            b + "ffn_norm.weight": (h,),
        }
        if config["model_type"] == "gemma3_text":  # (what _build_config makes of arch "gemma3")
            shapes |= {f"{b}{part}.weight": shape for part, shape in gemma3_layer_shapes(config).items()}
    shapes["output_norm.weight"] = (h,)
    if not config["tie_word_embeddings"]:
        shapes["output.weight"] = (v, h)
    return shapes


_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _hf_name(gguf_name: str, layer_names: Mapping[str, str] = _LAYER_NAMES) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (an `_expected_shapes` name);
    ``layer_names``: the architecture's GGUF part -> Hugging Face name (a Llama's by default)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    _, layer, part, suffix = gguf_name.split(".")
    return f"model.layers.{layer}.{layer_names[part]}.{suffix}"


def _check_tensors(header: _Header, expected: dict[str, tuple[int, ...]], path: Path) -> None:
    """Exactly the expected tensors, each of the expected shape."""

    def listing(names: list[str]) -> str:
        shown = ", ".join(names[:12])
        return shown + (f", ... ({len(names)} in all)" if len(names) > 12 else "")

    present = {t.name: t for t in header.tensors}
    missing = [n for n in expected if n not in present]
    if missing:
        raise GGUFError(path, f"missing tensors for a Llama model: {listing(missing)}")
    unexpected = [n for n in present if n not in expected]
    if unexpected:
        raise GGUFError(path, f"tensors a Llama model does not have: {listing(unexpected)}")
    for name, shape in expected.items():
        got = present[name].shape
        if got != shape:
            raise GGUFError(
                path, f"tensor {name!r} has shape {list(got)}, but the metadata implies {list(shape)}"
            )
