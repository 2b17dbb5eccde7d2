"""BERT checkpoints (Hugging Face ``BertModel`` / ``BertFor*`` folders) onto a headspace Encoder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor, nn

from ..model import layouts
from ..model.config import ModelConfig
from ..model.models import Encoder, check_precision
from .config_checks import MAX_LAYERS, at_most
from .hf import (
    ConfigFields,
    config_fields,
    config_sizes,
    embedding_shapes,
    fitting_headspace,
    folder_tokenizer,
    layered_count,
    linear_shapes,
    load_converted,
    norm_shapes,
    open_checkpoint,
    optional_file,
    read_checked,
    read_json,
    refuse_unsupported,
    renamed,
)
from .wrappers import PretrainedEncoder

_BERT_ACT = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
_BERT_FIELDS = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"]
#: A block's tensors but attention: headspace's name (under ``blocks.{i}.``) -> BERT's (under
#: ``encoder.layer.{i}.``).
_BERT_LAYER_NAMES = {
    "ln1.weight": "attention.output.LayerNorm.weight",
    "ln1.bias": "attention.output.LayerNorm.bias",
    "mlp.fc_in.weight": "intermediate.dense.weight",
    "mlp.fc_in.bias": "intermediate.dense.bias",
    "mlp.fc_out.weight": "output.dense.weight",
    "mlp.fc_out.bias": "output.dense.bias",
    "ln2.weight": "output.LayerNorm.weight",
    "ln2.bias": "output.LayerNorm.bias",
}
#: The config.json fields behind the parameter count (for its message): key -> ModelConfig attribute.
_BERT_COUNTED = {
    "num_hidden_layers": "n_layers",
    "hidden_size": "d_model",
    "intermediate_size": "d_mlp",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_seq_len",
}


def bert_config(hf: dict[str, Any], name: str = "", *, source: str = "config.json") -> ModelConfig:
    """A headspace :class:`ModelConfig` from a Hugging Face BERT ``config.json`` dict.

    Every field read is checked for type and range first (``ValueError`` naming the field: a string
    where an int or a boolean belongs is refused, never converted); then what headspace cannot represent
    is refused in one message listing the fields. Every message begins with ``source``: the loaders pass
    the file's full path, so that it names the folder.
    """
    f = config_fields(hf, source)
    f.text("hidden_act", "gelu")
    f.text("position_embedding_type", None, allow_none=True)
    f.flag("is_decoder", False)
    refuse_unsupported(
        f,
        "bert",
        {
            "hidden_act": lambda v: v in _BERT_ACT,
            "position_embedding_type": lambda v: v in (None, "absolute"),
            "is_decoder": lambda v: not v,
        },
        {"hidden_act": "gelu"},
    )
    f.require(_BERT_FIELDS, "BERT")
    sizes = config_sizes(f, "hidden_size", "num_attention_heads", pad_default=0)
    n_layers = at_most(source, "num_hidden_layers", f.integer("num_hidden_layers"), MAX_LAYERS)
    with fitting_headspace(source):
        return ModelConfig(
            arch="encoder",
            n_layers=n_layers,
            d_mlp=f.integer("intermediate_size"),
            max_seq_len=f.integer("max_position_embeddings", 512),
            act=_BERT_ACT[hf.get("hidden_act", "gelu")],
            norm="post",
            dropout=f.probability("hidden_dropout_prob", 0.1),
            attn_dropout=f.probability("attention_probs_dropout_prob", 0.1),
            ln_eps=f.number("layer_norm_eps", 1e-12, low=0.0, low_open=True),
            type_vocab_size=f.integer("type_vocab_size", 2, minimum=0),
            embed_ln=True,
            final_ln=False,
            init_std=f.number("initializer_range", 0.02, low=0.0, low_open=True),
            name=name,
            **sizes,
        )


def _bert_base(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    exp = embedding_shapes(c, "embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight")
    exp.update(norm_shapes("embeddings.LayerNorm", c.d_model))
    if c.type_vocab_size:
        exp["embeddings.token_type_embeddings.weight"] = (c.type_vocab_size, c.d_model)
    return exp


def _bert_layer(c: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    d, dm, hq = c.d_model, c.d_mlp, c.n_heads * c.d_head
    p = f"encoder.layer.{i}."
    exp: dict[str, tuple[int, ...]] = {}
    for proj in ("query", "key", "value"):
        exp.update(linear_shapes(f"{p}attention.self.{proj}", hq, d))
    exp.update(linear_shapes(f"{p}attention.output.dense", d, hq))
    exp.update(norm_shapes(f"{p}attention.output.LayerNorm", d))
    exp.update(linear_shapes(f"{p}intermediate.dense", dm, d))
    exp.update(linear_shapes(f"{p}output.dense", d, dm))
    exp.update(norm_shapes(f"{p}output.LayerNorm", d))
    return exp


def _bert_expected(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    exp = _bert_base(c)
    for i in range(c.n_layers):
        exp.update(_bert_layer(c, i))
    return exp


def bert_parameter_count(c: ModelConfig) -> tuple[int, int]:
    """(parameters, tensors) a BERT checkpoint of config ``c`` holds at least (no pooler), by arithmetic."""
    return layered_count(_bert_base(c), _bert_layer(c, 0), c.n_layers)


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
        sd.update(renamed(t, _BERT_LAYER_NAMES, f"blocks.{i}.", f"encoder.layer.{i}."))
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
    ckpt = open_checkpoint(
        folder, name, bert_config, "bert.", "embeddings.", bert_parameter_count, _BERT_COUNTED
    )
    config = ckpt.config
    expected = _bert_expected(config)
    has_pooler = "pooler.dense.weight" in ckpt.entries
    if has_pooler:
        expected.update(linear_shapes("pooler.dense", config.d_model, config.d_model))
    tensors, ignored = read_checked(ckpt, expected, _bert_ignorable)
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
    tokenizer = folder_tokenizer(ckpt.path, config.pad_token_id or 0)
    st_config = optional_file(ckpt.path, "sentence_bert_config.json", "sentence-transformers' settings")
    if max_length is None and st_config is not None:
        max_length = ConfigFields(read_json(st_config), str(st_config)).integer(
            "max_seq_length", None, allow_none=True
        )
    pre = PretrainedEncoder(model, tokenizer, max_length=max_length, pooler=pooler, ignored=ignored)
    return pre.to_precision(precision)
