"""GPT-2 checkpoints (Hugging Face ``GPT2Model`` / ``GPT2LMHeadModel`` folders) onto a headspace Decoder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .. import layouts
from ..config import ModelConfig
from ..models import Decoder, check_precision
from .hf import (
    ConfigFields,
    check_dtypes,
    check_parameter_count,
    check_tensors,
    config_problems,
    folder_tokenizer,
    load_converted,
    load_tensors,
    open_folder,
    parameter_count,
    safetensors_header,
    strip_prefix,
)
from .wrappers import PretrainedDecoder

_GPT2_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}


def gpt2_config(hf: dict[str, Any], name: str = "") -> ModelConfig:
    """A headspace :class:`ModelConfig` from a Hugging Face GPT-2 ``config.json`` dict.

    Every field read is checked for type and range first (``ValueError`` naming the field: a string
    where an int or a boolean belongs is refused, never converted, so ``tie_word_embeddings: "false"``
    is an error); then what headspace cannot represent is refused in one message listing the fields.
    """
    if not isinstance(hf, dict):
        raise TypeError(f"hf must be the config.json dict; got {type(hf).__name__}")
    f = ConfigFields(hf)
    f.text("model_type", None, allow_none=True)
    f.text("activation_function", "gelu_new")
    f.flag("scale_attn_weights", True)
    f.flag("scale_attn_by_inverse_layer_idx", False)
    f.flag("add_cross_attention", False)
    config_problems(
        hf,
        {
            "model_type": lambda v: v in (None, "gpt2"),
            "activation_function": lambda v: v in _GPT2_ACT,
            "scale_attn_weights": lambda v: v is True,
            "scale_attn_by_inverse_layer_idx": lambda v: not v,
            "add_cross_attention": lambda v: not v,
        },
        {"activation_function": "gelu_new", "scale_attn_weights": True},
    )
    f.require(["vocab_size", "n_embd", "n_layer", "n_head"], "GPT-2")
    vocab_size = f.integer("vocab_size")
    d = f.integer("n_embd")
    n_heads = f.integer("n_head")
    if d % n_heads:
        raise ValueError(
            f"config.json: n_embd={d} must be divisible by n_head={n_heads} (head size {d / n_heads:g})"
        )
    pad_token_id = f.integer("pad_token_id", None, minimum=0, allow_none=True)
    if pad_token_id is not None and pad_token_id >= vocab_size:
        raise ValueError(f"config.json: pad_token_id must be < vocab_size={vocab_size}; got {pad_token_id}")
    try:
        return ModelConfig(
            arch="decoder",
            vocab_size=vocab_size,
            d_model=d,
            n_layers=f.integer("n_layer"),
            n_heads=n_heads,
            d_mlp=f.integer("n_inner", None, allow_none=True) or 4 * d,
            max_seq_len=f.integer("n_positions", 1024),
            act=_GPT2_ACT[hf.get("activation_function", "gelu_new")],
            norm="pre",
            dropout=f.probability("resid_pdrop", 0.1),
            attn_dropout=f.probability("attn_pdrop", 0.1),
            emb_dropout=f.probability("embd_pdrop", 0.1),
            ln_eps=f.number("layer_norm_epsilon", 1e-5, low=0.0, low_open=True),
            type_vocab_size=0,
            tie_embeddings=f.flag("tie_word_embeddings", True),
            pad_token_id=pad_token_id,
            embed_ln=False,
            final_ln=True,
            init_std=f.number("initializer_range", 0.02, low=0.0, low_open=True),
            name=name,
        )
    except ValueError as e:
        raise ValueError(f"config.json does not fit headspace: {e}") from None


def _gpt2_layer(c: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    d, dm, hq = c.d_model, c.d_mlp, c.n_heads * c.d_head
    p = f"h.{i}."
    return {
        f"{p}ln_1.weight": (d,),
        f"{p}ln_1.bias": (d,),
        f"{p}attn.c_attn.weight": (d, 3 * hq),
        f"{p}attn.c_attn.bias": (3 * hq,),
        f"{p}attn.c_proj.weight": (hq, d),
        f"{p}attn.c_proj.bias": (d,),
        f"{p}ln_2.weight": (d,),
        f"{p}ln_2.bias": (d,),
        f"{p}mlp.c_fc.weight": (d, dm),
        f"{p}mlp.c_fc.bias": (dm,),
        f"{p}mlp.c_proj.weight": (dm, d),
        f"{p}mlp.c_proj.bias": (d,),
    }


def _gpt2_base(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    d = c.d_model
    exp: dict[str, tuple[int, ...]] = {
        "wte.weight": (c.vocab_size, d),
        "wpe.weight": (c.max_seq_len, d),
        "ln_f.weight": (d,),
        "ln_f.bias": (d,),
    }
    if not c.tie_embeddings:
        exp["lm_head.weight"] = (c.vocab_size, d)
    return exp


def _gpt2_expected(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    base = _gpt2_base(c)
    exp = {k: base[k] for k in ("wte.weight", "wpe.weight")}
    for i in range(c.n_layers):
        exp.update(_gpt2_layer(c, i))
    exp["ln_f.weight"] = base["ln_f.weight"]
    exp["ln_f.bias"] = base["ln_f.bias"]
    return exp


def gpt2_parameter_count(c: ModelConfig) -> tuple[int, int]:
    """(parameters, tensors) a GPT-2 checkpoint of config ``c`` holds at least, by arithmetic.

    An untied checkpoint's ``lm_head.weight`` is counted; a tied one's copy of the embedding is not needed.
    """
    base, layer = _gpt2_base(c), _gpt2_layer(c, 0)
    n_params = parameter_count(base.values()) + c.n_layers * parameter_count(layer.values())
    return n_params, len(base) + c.n_layers * len(layer)


def gpt2_state_dict(t: dict[str, Tensor], c: ModelConfig) -> dict[str, Tensor]:
    """GPT-2 tensor names (Conv1D [in, out]) -> :class:`Decoder` state-dict names, attention aside.

    The attention layers are converted by :func:`headspace.layouts.load_gpt2` (see :func:`load_gpt2`).
    """
    sd = {"tok_embed.weight": t["wte.weight"], "pos_embed.weight": t["wpe.weight"]}
    for i in range(c.n_layers):
        p, b = f"h.{i}.", f"blocks.{i}."
        sd[b + "ln1.weight"] = t[f"{p}ln_1.weight"]
        sd[b + "ln1.bias"] = t[f"{p}ln_1.bias"]
        sd[b + "ln2.weight"] = t[f"{p}ln_2.weight"]
        sd[b + "ln2.bias"] = t[f"{p}ln_2.bias"]
        sd[b + "mlp.fc_in.weight"] = t[f"{p}mlp.c_fc.weight"].T  # (d_mlp, d)
        sd[b + "mlp.fc_in.bias"] = t[f"{p}mlp.c_fc.bias"]
        sd[b + "mlp.fc_out.weight"] = t[f"{p}mlp.c_proj.weight"].T  # (d, d_mlp)
        sd[b + "mlp.fc_out.bias"] = t[f"{p}mlp.c_proj.bias"]
    sd["ln_final.weight"] = t["ln_f.weight"]
    sd["ln_final.bias"] = t["ln_f.bias"]
    if not c.tie_embeddings:
        sd["lm_head.weight"] = t["lm_head.weight"]
    return sd


def _gpt2_ignorable(name: str) -> bool:
    # the causal-mask buffers older GPT-2 checkpoints store beside the weights
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "h" and parts[2] == "attn" and parts[3] in ("bias", "masked_bias")


def load_gpt2(folder: str | Path, *, name: str = "", precision: str = "float32") -> PretrainedDecoder:
    """Load a local Hugging Face GPT-2 checkpoint folder onto a headspace :class:`~headspace.Decoder`.

    Reads ``config.json`` and ``model.safetensors`` (``tokenizer.json`` when present). Both
    ``GPT2LMHeadModel`` (``transformer.``-prefixed, ``lm_head.weight`` optional when tied) and
    ``GPT2Model`` checkpoints are accepted.

    The folder is untrusted input (see :mod:`headspace.pretrained.hf`): files must be regular files of
    bounded size, every config field read is type- and range-checked, and the parameter count the config
    implies, the tensor names, shapes and dtypes are checked from the safetensors header before any
    tensor is read; tensors are then read one at a time and converted to float32.

    Raises:
        FileNotFoundError: the folder or a needed file is missing (named).
        ValueError: a config field of the wrong type or range (named), or one headspace cannot represent;
            a config implying more parameters than the weights hold (both counts given); a file that is
            not a regular file, too large, or not valid JSON / safetensors / tokenizer.json (named);
            missing/unexpected tensors or shape mismatches; weights that are not floating point or hold
            NaN/Inf (named); an unknown ``precision`` (the valid ones listed).

    ``precision``: ``"float32"`` (exact), ``"bfloat16"`` or ``"int8"``
    (:meth:`headspace.Decoder.to_precision`).
    """
    check_precision(precision)
    path, hf, weights = open_folder(folder)
    config = gpt2_config(hf, name=name or path.name)
    header = safetensors_header(weights)
    entries = strip_prefix(header.tensors, "transformer.", "wte.")
    implied, implied_tensors = gpt2_parameter_count(config)
    fields = (
        f"n_layer={config.n_layers}, n_embd={config.d_model}, n_inner={config.d_mlp}, "
        f"vocab_size={config.vocab_size}, n_positions={config.max_seq_len}, "
        f"tie_word_embeddings={str(config.tie_embeddings).lower()}"
    )
    summary = check_parameter_count(implied, implied_tensors, header, fields)
    expected = _gpt2_expected(config)
    # an untied checkpoint needs its head; a tied one may store it, as a copy of wte checked below
    if not config.tie_embeddings or "lm_head.weight" in entries:
        expected["lm_head.weight"] = (config.vocab_size, config.d_model)
    ignored = check_tensors(entries, expected, _gpt2_ignorable, weights, summary=summary)
    check_dtypes(entries, expected, weights)
    tensors = load_tensors(header, entries, expected)  # NaN/Inf first: a NaN head is not "different"
    if config.tie_embeddings and "lm_head.weight" in tensors:
        if not torch.equal(tensors["lm_head.weight"], tensors["wte.weight"]):
            raise ValueError(
                f"{weights}: config.json says tie_word_embeddings=true but lm_head.weight differs from "
                "wte.weight"
            )
        del tensors["lm_head.weight"]
    model = Decoder(config)
    load_converted(model, gpt2_state_dict(tensors, config), tensors, layouts.load_gpt2, "h.{}.attn.")
    tokenizer = folder_tokenizer(path, config.pad_token_id)
    return PretrainedDecoder(model, tokenizer, ignored=ignored).to_precision(precision)
