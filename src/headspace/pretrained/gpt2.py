"""GPT-2 checkpoints (Hugging Face ``GPT2Model`` / ``GPT2LMHeadModel`` folders) onto a headspace Decoder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..model import layouts
from ..model.config import ModelConfig
from ..model.models import Decoder, check_precision
from .config_checks import MAX_LAYERS, at_most
from .hf import (
    config_fields,
    config_sizes,
    conv1d_shapes,
    embedding_shapes,
    fitting_headspace,
    folder_tokenizer,
    layered_count,
    load_converted,
    norm_shapes,
    open_checkpoint,
    read_checked,
    refuse_unsupported,
    renamed,
)
from .wrappers import PretrainedDecoder

_GPT2_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}


def gpt2_config(hf: dict[str, Any], name: str = "", *, source: str = "config.json") -> ModelConfig:
    """A headspace :class:`ModelConfig` from a Hugging Face GPT-2 ``config.json`` dict.

    Every field read is checked for type and range first (``ValueError`` naming the field: a string
    where an int or a boolean belongs is refused, never converted, so ``tie_word_embeddings: "false"``
    is an error); then what headspace cannot represent is refused in one message listing the fields.
    Every message begins with ``source``: the loaders pass the file's full path, so that it names the
    folder.
    """
    f = config_fields(hf, source)
    f.text("activation_function", "gelu_new")
    f.flag("scale_attn_weights", True)
    f.flag("scale_attn_by_inverse_layer_idx", False)
    refuse_unsupported(
        f,
        "gpt2",
        {
            "activation_function": lambda v: v in _GPT2_ACT,
            "scale_attn_weights": lambda v: v is True,
            "scale_attn_by_inverse_layer_idx": lambda v: not v,
        },
        {"activation_function": "gelu_new", "scale_attn_weights": True},
    )
    f.require(["vocab_size", "n_embd", "n_layer", "n_head"], "GPT-2")
    sizes = config_sizes(f, "n_embd", "n_head", pad_default=None)
    n_layers = at_most(source, "n_layer", f.integer("n_layer"), MAX_LAYERS)  # before any per-layer list
    with fitting_headspace(source):
        return ModelConfig(
            arch="decoder",
            n_layers=n_layers,
            d_mlp=f.integer("n_inner", None, allow_none=True) or 4 * sizes["d_model"],
            max_seq_len=f.integer("n_positions", 1024),
            act=_GPT2_ACT[hf.get("activation_function", "gelu_new")],
            norm="pre",
            dropout=f.probability("resid_pdrop", 0.1),
            attn_dropout=f.probability("attn_pdrop", 0.1),
            emb_dropout=f.probability("embd_pdrop", 0.1),
            ln_eps=f.number("layer_norm_epsilon", 1e-5, low=0.0, low_open=True),
            type_vocab_size=0,
            tie_embeddings=f.flag("tie_word_embeddings", True),
            embed_ln=False,
            final_ln=True,
            init_std=f.number("initializer_range", 0.02, low=0.0, low_open=True),
            name=name,
            **sizes,
        )


def _gpt2_layer(c: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    d, dm, hq = c.d_model, c.d_mlp, c.n_heads * c.d_head
    p = f"h.{i}."
    return {
        **norm_shapes(f"{p}ln_1", d),
        **conv1d_shapes(f"{p}attn.c_attn", d, 3 * hq),
        **conv1d_shapes(f"{p}attn.c_proj", hq, d),
        **norm_shapes(f"{p}ln_2", d),
        **conv1d_shapes(f"{p}mlp.c_fc", d, dm),
        **conv1d_shapes(f"{p}mlp.c_proj", dm, d),
    }


def _gpt2_base(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    exp = {**embedding_shapes(c, "wte.weight", "wpe.weight"), **norm_shapes("ln_f", c.d_model)}
    if not c.tie_embeddings:
        exp["lm_head.weight"] = (c.vocab_size, c.d_model)
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
    return layered_count(_gpt2_base(c), _gpt2_layer(c, 0), c.n_layers)


#: A block's tensors but attention: headspace's name (under ``blocks.{i}.``) -> GPT-2's (under ``h.{i}.``).
_GPT2_LAYER_NAMES = {
    "ln1.weight": "ln_1.weight",
    "ln1.bias": "ln_1.bias",
    "ln2.weight": "ln_2.weight",
    "ln2.bias": "ln_2.bias",
    "mlp.fc_in.weight": "mlp.c_fc.weight",
    "mlp.fc_in.bias": "mlp.c_fc.bias",
    "mlp.fc_out.weight": "mlp.c_proj.weight",
    "mlp.fc_out.bias": "mlp.c_proj.bias",
}


def gpt2_state_dict(t: dict[str, Tensor], c: ModelConfig) -> dict[str, Tensor]:
    """GPT-2 tensor names (Conv1D [in, out]) -> :class:`Decoder` state-dict names, attention aside.

    The attention layers are converted by :func:`headspace.layouts.load_gpt2` (see :func:`load_gpt2`).
    """
    sd = {"tok_embed.weight": t["wte.weight"], "pos_embed.weight": t["wpe.weight"]}
    for i in range(c.n_layers):
        b = f"blocks.{i}."
        sd.update(renamed(t, _GPT2_LAYER_NAMES, b, f"h.{i}."))
        for conv1d in ("mlp.fc_in.weight", "mlp.fc_out.weight"):
            sd[b + conv1d] = sd[b + conv1d].T  # Conv1D [in, out] -> [out, in]
    sd["ln_final.weight"] = t["ln_f.weight"]
    sd["ln_final.bias"] = t["ln_f.bias"]
    if not c.tie_embeddings:
        sd["lm_head.weight"] = t["lm_head.weight"]
    return sd


def _gpt2_ignorable(name: str) -> bool:
    # the causal-mask buffers older GPT-2 checkpoints store beside the weights
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "h" and parts[2] == "attn" and parts[3] in ("bias", "masked_bias")


#: The config.json fields behind the parameter count (for its message): key -> ModelConfig attribute.
_GPT2_COUNTED = {
    "n_layer": "n_layers",
    "n_embd": "d_model",
    "n_inner": "d_mlp",
    "vocab_size": "vocab_size",
    "n_positions": "max_seq_len",
    "tie_word_embeddings": "tie_embeddings",
}


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
    ckpt = open_checkpoint(
        folder, name, gpt2_config, "transformer.", "wte.", gpt2_parameter_count, _GPT2_COUNTED
    )
    config = ckpt.config
    expected = _gpt2_expected(config)
    # an untied checkpoint needs its head; a tied one may store it, as a copy of wte checked below
    if not config.tie_embeddings or "lm_head.weight" in ckpt.entries:
        expected["lm_head.weight"] = (config.vocab_size, config.d_model)
    tensors, ignored = read_checked(
        ckpt, expected, _gpt2_ignorable
    )  # NaN/Inf first: a NaN head is not "different"
    if config.tie_embeddings and "lm_head.weight" in tensors:
        if not torch.equal(tensors["lm_head.weight"], tensors["wte.weight"]):
            raise ValueError(
                f"{ckpt.weights}: config.json says tie_word_embeddings=true but lm_head.weight differs from "
                "wte.weight"
            )
        del tensors["lm_head.weight"]
    model = Decoder(config)
    load_converted(model, gpt2_state_dict(tensors, config), tensors, layouts.load_gpt2, "h.{}.attn.")
    tokenizer = folder_tokenizer(ckpt.path, config.pad_token_id)
    return PretrainedDecoder(model, tokenizer, ignored=ignored).to_precision(precision)
