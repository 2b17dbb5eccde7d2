"""BERT checkpoints (Hugging Face ``BertModel`` / ``BertFor*`` folders) onto a headspace Encoder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor, nn

from .. import layouts
from ..config import ModelConfig
from ..models import Encoder, check_precision
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
    optional_file,
    parameter_count,
    read_json,
    safetensors_header,
    strip_prefix,
)
from .wrappers import PretrainedEncoder

_BERT_ACT = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
_BERT_FIELDS = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"]


def bert_config(hf: dict[str, Any], name: str = "") -> ModelConfig:
    """A headspace :class:`ModelConfig` from a Hugging Face BERT ``config.json`` dict.

    Every field read is checked for type and range first (``ValueError`` naming the field: a string
    where an int or a boolean belongs is refused, never converted); then what headspace cannot represent
    is refused in one message listing the fields.
    """
    if not isinstance(hf, dict):
        raise TypeError(f"hf must be the config.json dict; got {type(hf).__name__}")
    f = ConfigFields(hf)
    f.text("model_type", None, allow_none=True)
    f.text("hidden_act", "gelu")
    f.text("position_embedding_type", None, allow_none=True)
    f.flag("is_decoder", False)
    f.flag("add_cross_attention", False)
    config_problems(
        hf,
        {
            "model_type": lambda v: v in (None, "bert"),
            "hidden_act": lambda v: v in _BERT_ACT,
            "position_embedding_type": lambda v: v in (None, "absolute"),
            "is_decoder": lambda v: not v,
            "add_cross_attention": lambda v: not v,
        },
        {"hidden_act": "gelu"},
    )
    f.require(_BERT_FIELDS, "BERT")
    vocab_size = f.integer("vocab_size")
    d_model = f.integer("hidden_size")
    n_heads = f.integer("num_attention_heads")
    if d_model % n_heads:
        raise ValueError(
            f"config.json: hidden_size={d_model} must be divisible by num_attention_heads={n_heads} "
            f"(head size {d_model / n_heads:g})"
        )
    pad_token_id = f.integer("pad_token_id", 0, minimum=0, allow_none=True)
    if pad_token_id is not None and pad_token_id >= vocab_size:
        raise ValueError(f"config.json: pad_token_id must be < vocab_size={vocab_size}; got {pad_token_id}")
    try:
        return ModelConfig(
            arch="encoder",
            vocab_size=vocab_size,
            d_model=d_model,
            n_layers=f.integer("num_hidden_layers"),
            n_heads=n_heads,
            d_mlp=f.integer("intermediate_size"),
            max_seq_len=f.integer("max_position_embeddings", 512),
            act=_BERT_ACT[hf.get("hidden_act", "gelu")],
            norm="post",
            dropout=f.probability("hidden_dropout_prob", 0.1),
            attn_dropout=f.probability("attention_probs_dropout_prob", 0.1),
            ln_eps=f.number("layer_norm_eps", 1e-12, low=0.0, low_open=True),
            type_vocab_size=f.integer("type_vocab_size", 2, minimum=0),
            pad_token_id=pad_token_id,
            embed_ln=True,
            final_ln=False,
            init_std=f.number("initializer_range", 0.02, low=0.0, low_open=True),
            name=name,
        )
    except ValueError as e:
        raise ValueError(f"config.json does not fit headspace: {e}") from None


def _bert_base(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    d = c.d_model
    exp: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (c.vocab_size, d),
        "embeddings.position_embeddings.weight": (c.max_seq_len, d),
        "embeddings.LayerNorm.weight": (d,),
        "embeddings.LayerNorm.bias": (d,),
    }
    if c.type_vocab_size:
        exp["embeddings.token_type_embeddings.weight"] = (c.type_vocab_size, d)
    return exp


def _bert_layer(c: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    d, dm, hq = c.d_model, c.d_mlp, c.n_heads * c.d_head
    p = f"encoder.layer.{i}."
    exp: dict[str, tuple[int, ...]] = {}
    for proj in ("query", "key", "value"):
        exp[f"{p}attention.self.{proj}.weight"] = (hq, d)
        exp[f"{p}attention.self.{proj}.bias"] = (hq,)
    exp.update(
        {
            f"{p}attention.output.dense.weight": (d, hq),
            f"{p}attention.output.dense.bias": (d,),
            f"{p}attention.output.LayerNorm.weight": (d,),
            f"{p}attention.output.LayerNorm.bias": (d,),
            f"{p}intermediate.dense.weight": (dm, d),
            f"{p}intermediate.dense.bias": (dm,),
            f"{p}output.dense.weight": (d, dm),
            f"{p}output.dense.bias": (d,),
            f"{p}output.LayerNorm.weight": (d,),
            f"{p}output.LayerNorm.bias": (d,),
        }
    )
    return exp


def _bert_expected(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    exp = _bert_base(c)
    for i in range(c.n_layers):
        exp.update(_bert_layer(c, i))
    return exp


def bert_parameter_count(c: ModelConfig) -> tuple[int, int]:
    """(parameters, tensors) a BERT checkpoint of config ``c`` holds at least (no pooler), by arithmetic."""
    base, layer = _bert_base(c), _bert_layer(c, 0)
    n_params = parameter_count(base.values()) + c.n_layers * parameter_count(layer.values())
    return n_params, len(base) + c.n_layers * len(layer)


def bert_state_dict(t: dict[str, Tensor], c: ModelConfig) -> dict[str, Tensor]:
    """Hugging Face BERT tensor names -> headspace :class:`Encoder` state-dict names, attention aside.

    The attention layers are converted by :func:`headspace.layouts.load_hf_bert` (see :func:`load_bert`).
    """
    sd = {
        "tok_embed.weight": t["embeddings.word_embeddings.weight"],
        "pos_embed.weight": t["embeddings.position_embeddings.weight"],
        "embed_ln.weight": t["embeddings.LayerNorm.weight"],
        "embed_ln.bias": t["embeddings.LayerNorm.bias"],
    }
    if c.type_vocab_size:
        sd["type_embed.weight"] = t["embeddings.token_type_embeddings.weight"]
    for i in range(c.n_layers):
        p, b = f"encoder.layer.{i}.", f"blocks.{i}."
        sd[b + "ln1.weight"] = t[f"{p}attention.output.LayerNorm.weight"]
        sd[b + "ln1.bias"] = t[f"{p}attention.output.LayerNorm.bias"]
        sd[b + "mlp.fc_in.weight"] = t[f"{p}intermediate.dense.weight"]
        sd[b + "mlp.fc_in.bias"] = t[f"{p}intermediate.dense.bias"]
        sd[b + "mlp.fc_out.weight"] = t[f"{p}output.dense.weight"]
        sd[b + "mlp.fc_out.bias"] = t[f"{p}output.dense.bias"]
        sd[b + "ln2.weight"] = t[f"{p}output.LayerNorm.weight"]
        sd[b + "ln2.bias"] = t[f"{p}output.LayerNorm.bias"]
    return sd


def _bert_ignorable(name: str) -> bool:
    # buffers BertModel stores beside its weights, and the heads of task checkpoints (MLM/NSP), unused here
    return name in ("embeddings.position_ids", "embeddings.token_type_ids") or name.startswith("cls.")


def load_bert(
    folder: str | Path, *, name: str = "", max_length: int | None = None, precision: str = "float32"
) -> PretrainedEncoder:
    """Load a local Hugging Face BERT checkpoint folder onto a headspace :class:`~headspace.Encoder`.

    Reads ``config.json`` and ``model.safetensors`` (``tokenizer.json`` and sentence-transformers'
    ``sentence_bert_config.json`` when present). ``bert.``-prefixed checkpoints (task models) are
    accepted; their task heads (``cls.*``) are ignored and listed in ``.ignored``.

    The folder is untrusted input (see :mod:`headspace.pretrained.hf`): files must be regular files of
    bounded size, every config field read is type- and range-checked, and the parameter count the config
    implies, the tensor names, shapes and dtypes are checked from the safetensors header before any
    tensor is read; tensors are then read one at a time and converted to float32.

    ``precision`` (:data:`headspace.models.PRECISIONS`): ``"float32"`` (exact), ``"bfloat16"`` or
    ``"int8"``; the model is built in float32 and converted (:meth:`headspace.Encoder.to_precision`).

    Raises:
        FileNotFoundError: the folder or a needed file is missing (named).
        ValueError: a config field of the wrong type or range (named), or one headspace cannot represent;
            a config implying more parameters than the weights hold (both counts given); a file that is
            not a regular file, too large, or not valid JSON / safetensors / tokenizer.json (named);
            missing/unexpected tensors or shape mismatches (listed with their shapes); weights that are
            not floating point or hold NaN/Inf (named); ``max_length`` < 1; an unknown ``precision``
            (the valid ones listed).
        TypeError: ``max_length`` is not an int (or None).
    """
    check_precision(precision)
    path, hf, weights = open_folder(folder)
    config = bert_config(hf, name=name or path.name)
    header = safetensors_header(weights)
    entries = strip_prefix(header.tensors, "bert.", "embeddings.")
    implied, implied_tensors = bert_parameter_count(config)
    fields = (
        f"num_hidden_layers={config.n_layers}, hidden_size={config.d_model}, "
        f"intermediate_size={config.d_mlp}, vocab_size={config.vocab_size}, "
        f"max_position_embeddings={config.max_seq_len}"
    )
    summary = check_parameter_count(implied, implied_tensors, header, fields)
    expected = _bert_expected(config)
    has_pooler = "pooler.dense.weight" in entries
    if has_pooler:
        expected["pooler.dense.weight"] = (config.d_model, config.d_model)
        expected["pooler.dense.bias"] = (config.d_model,)
    ignored = check_tensors(entries, expected, _bert_ignorable, weights, summary=summary)
    check_dtypes(entries, expected, weights)
    tensors = load_tensors(header, entries, expected)
    model = Encoder(config)
    load_converted(
        model, bert_state_dict(tensors, config), tensors, layouts.load_hf_bert, "encoder.layer.{}.attention."
    )
    pooler = None
    if has_pooler:
        pooler = nn.Linear(config.d_model, config.d_model)
        pooler.load_state_dict(
            {"weight": tensors["pooler.dense.weight"], "bias": tensors["pooler.dense.bias"]}
        )
    tokenizer = folder_tokenizer(path, config.pad_token_id or 0)
    st_config = optional_file(path, "sentence_bert_config.json", "sentence-transformers' settings")
    if max_length is None and st_config is not None:
        max_length = ConfigFields(read_json(st_config), str(st_config)).integer(
            "max_seq_length", None, allow_none=True
        )
    pre = PretrainedEncoder(model, tokenizer, max_length=max_length, pooler=pooler, ignored=ignored)
    return pre.to_precision(precision)
