"""DiffLlama (``model_type`` ``diffllama``) onto a headspace Decoder: a Llama decoder whose attention is
differential (:class:`~headspace.attention.differential.DifferentialAttention`,
``ModelConfig.diff_attention``).

Beside the Llama tensors, each layer's ``self_attn.lambda_q1``, ``lambda_k1``, ``lambda_q2``, ``lambda_k2``
[head_dim] become the layer's parameters of the same names; the pair norm has no weight (its eps is
``rms_norm_eps``); ``lambda_init`` follows the layer's index as in transformers. Refused by name: an odd
``num_key_value_heads`` (the pairs split the value heads in two), ``attention_dropout`` > 0, and all that
:func:`~headspace.pretrained.llama.llama_config` refuses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..model.config import ModelConfig
from .hf import ConfigFields
from .llama import _tensors, llama_config
from .llama4 import Pieces, load_pieces
from .wrappers import PretrainedDecoder

MODEL_TYPE = "diffllama"
_LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


def diffllama_config(
    hf: Mapping[str, Any], name: str = "", *, max_seq_len: int | None = None, source: str = "config.json"
) -> ModelConfig:
    """A :class:`ModelConfig` (``diff_attention=True``) from a ``diffllama`` ``config.json`` dict."""
    if not isinstance(hf, Mapping):
        raise TypeError(f"hf must be a dict (config.json); got {type(hf).__name__}")
    f = ConfigFields(hf, source)
    kind = f.text("model_type", None, allow_none=True)
    if kind != MODEL_TYPE:
        raise ValueError(f"{source}: model_type={kind!r} is not {MODEL_TYPE!r}")
    config = llama_config({**hf, "model_type": "llama"}, name, max_seq_len=max_seq_len, source=source)
    if config.n_kv_heads % 2:  # type: ignore[operator]
        raise ValueError(
            f"{source}: num_key_value_heads must be even for differential attention; got {config.n_kv_heads}"
        )
    if config.attn_dropout:
        raise ValueError(
            f"{source}: attention_dropout must be 0 for differential attention; got {config.attn_dropout}"
        )
    extra = {**config.extra, "model_type": MODEL_TYPE}
    return dataclasses.replace(config, diff_attention=True, extra=extra)


def diffllama_tensors(c: ModelConfig, prefix: str = "model.") -> Pieces:
    """(our state-dict name, the HF tensor, its shape), every tensor: Llama's and the lambdas."""
    out = [(ours, name, shape) for ours, theirs in _tensors(c, prefix) for name, shape in theirs]
    assert c.d_head is not None
    for i in range(c.n_layers):
        for lam in _LAMBDAS:
            out.append((f"blocks.{i}.attn.{lam}", f"{prefix}layers.{i}.self_attn.{lam}", (c.d_head,)))
    return out


def load_diffllama(
    folder: str | Path, *, name: str = "", max_seq_len: int | None = None, precision: str = "float32"
) -> PretrainedDecoder:
    """Load a local ``diffllama`` checkpoint folder (module docstring) onto a headspace Decoder."""
    return load_pieces(folder, diffllama_config, diffllama_tensors, name=name, max_seq_len=max_seq_len,
                       precision=precision)  # fmt: skip
