"""BERT checkpoints (Hugging Face ``BertModel`` / ``BertFor*`` folders) onto a headspace Encoder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor, nn

from .. import layouts
from ..config import ModelConfig
from ..models import Encoder
from .hf import (
    check_tensors,
    check_values,
    config_problems,
    folder_tokenizer,
    load_converted,
    open_folder,
    read_json,
    read_tensors,
    strip_prefix,
)
from .wrappers import PretrainedEncoder

_BERT_ACT = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def bert_config(hf: dict[str, Any], name: str = "") -> ModelConfig:
    """A headspace :class:`ModelConfig` from a Hugging Face BERT ``config.json`` dict."""
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
    needed = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"]
    absent = [k for k in needed if k not in hf]
    if absent:
        raise ValueError(f"config.json lacks the BERT fields {absent}")
    try:
        return ModelConfig(
            arch="encoder",
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"],
            d_mlp=hf["intermediate_size"],
            max_seq_len=hf.get("max_position_embeddings", 512),
            act=_BERT_ACT[hf.get("hidden_act", "gelu")],
            norm="post",
            dropout=hf.get("hidden_dropout_prob", 0.1),
            attn_dropout=hf.get("attention_probs_dropout_prob", 0.1),
            ln_eps=hf.get("layer_norm_eps", 1e-12),
            type_vocab_size=hf.get("type_vocab_size", 2),
            pad_token_id=hf.get("pad_token_id", 0),
            embed_ln=True,
            final_ln=False,
            init_std=hf.get("initializer_range", 0.02),
            name=name,
        )
    except ValueError as e:
        raise ValueError(f"config.json does not fit headspace: {e}") from None


def _bert_expected(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, dm, hq = c.d_model, c.d_mlp, c.n_heads * c.d_head
    exp: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (c.vocab_size, d),
        "embeddings.position_embeddings.weight": (c.max_seq_len, d),
        "embeddings.LayerNorm.weight": (d,),
        "embeddings.LayerNorm.bias": (d,),
    }
    if c.type_vocab_size:
        exp["embeddings.token_type_embeddings.weight"] = (c.type_vocab_size, d)
    for i in range(c.n_layers):
        p = f"encoder.layer.{i}."
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


def load_bert(folder: str | Path, *, name: str = "", max_length: int | None = None) -> PretrainedEncoder:
    """Load a local Hugging Face BERT checkpoint folder onto a headspace :class:`~headspace.Encoder`.

    Reads ``config.json`` and ``model.safetensors`` (``tokenizer.json`` and sentence-transformers'
    ``sentence_bert_config.json`` when present). ``bert.``-prefixed checkpoints (task models) are
    accepted; their task heads (``cls.*``) are ignored and listed in ``.ignored``.

    Raises:
        FileNotFoundError: the folder or a needed file is missing (named).
        ValueError: a config headspace cannot represent; missing/unexpected tensors or shape mismatches
            (listed with their shapes); weights that are not floating point or hold NaN/Inf (named);
            ``max_length`` < 1.
        TypeError: ``max_length`` is not an int (or None).
    """
    path, hf, weights = open_folder(folder)
    config = bert_config(hf, name=name or path.name)
    tensors = strip_prefix(read_tensors(weights), "bert.", "embeddings.")
    expected = _bert_expected(config)
    has_pooler = "pooler.dense.weight" in tensors
    if has_pooler:
        expected["pooler.dense.weight"] = (config.d_model, config.d_model)
        expected["pooler.dense.bias"] = (config.d_model,)
    ignored = check_tensors(tensors, expected, _bert_ignorable, weights)
    check_values(tensors, list(expected), weights)
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
    st_config = path / "sentence_bert_config.json"
    if max_length is None and st_config.is_file():
        max_length = read_json(st_config).get("max_seq_length")
    return PretrainedEncoder(model, tokenizer, max_length=max_length, pooler=pooler, ignored=ignored)
