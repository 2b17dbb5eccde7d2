"""Encoders beside BERT: roberta, xlm-roberta and camembert (RoBERTa's architecture), as BERT with an
offset position table.

RoBERTa is BERT (post-LN blocks, GELU MLP, embedding LayerNorm, token types) whose learned positions
start past the padding index: transformers numbers a token ``padding_idx + 1 + i`` (``i`` its place
among the real tokens, ``cumsum`` of ``input_ids != padding_idx``) and gives a padding token the row
``padding_idx``. Headspace's Encoder numbers column ``i`` as position ``i``, so the first
``padding_idx + 1`` rows of the table are dropped on loading (headspace's row ``i`` is RoBERTa's row
``padding_idx + 1 + i``; ``max_seq_len`` is ``max_position_embeddings - padding_idx - 1``). Every real
token of a right-padded batch (what the tokenizers produce: real tokens first) is then exact; a
padding token's own row differs (RoBERTa reads row ``padding_idx`` for it) and, as for BERT, is
never attended to and should be ignored. The tensors and their checks are BERT's
(:mod:`headspace.pretrained.bert`); task heads (``lm_head.*``, ``classifier.*``) are ignored and listed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from ..model import layouts
from ..model.config import ModelConfig
from ..model.models import Encoder, check_precision
from .bert import (
    _BERT_COUNTED,
    _bert_expected,
    _bert_ignorable,
    bert_config,
    bert_parameter_count,
    bert_state_dict,
)
from .hf import (
    ConfigFields,
    config_fields,
    fitting_headspace,
    folder_tokenizer,
    linear_shapes,
    load_converted,
    open_checkpoint,
    optional_file,
    read_checked,
    read_json,
)
from .wrappers import PretrainedEncoder

_POSITIONS = "embeddings.position_embeddings.weight"
#: The model_types that are RoBERTa's architecture under another name (their checkpoints differ in
#: vocabulary and training only: transformers' XLM-RoBERTa and CamemBERT modules are RoBERTa's).
ROBERTA_TYPES = ("roberta", "xlm-roberta", "camembert")


def roberta_config(hf: dict[str, Any], name: str = "", *, source: str = "config.json") -> ModelConfig:
    """A headspace :class:`ModelConfig` from a Hugging Face RoBERTa ``config.json`` dict: BERT's fields
    (:func:`~headspace.pretrained.bert.bert_config`, the same checks and refusals) with the position table
    shifted past ``pad_token_id`` (module docstring); ``extra["position_offset"]`` is that shift."""
    f = config_fields(hf, source)
    model_type = f.hf.get("model_type") or "roberta"
    if model_type not in ROBERTA_TYPES:
        raise ValueError(
            f"{source}: model_type={f.hf['model_type']!r} is not supported here; "
            f"supported: {', '.join(ROBERTA_TYPES)}"
        )
    pad = f.integer("pad_token_id", 1, minimum=0)
    limit = f.integer("max_position_embeddings", 512)
    offset = pad + 1
    if limit <= offset:
        raise ValueError(
            f"{source}: max_position_embeddings={limit} leaves no position past pad_token_id={pad} "
            f"(RoBERTa's positions start at pad_token_id + 1); expected more than {offset}"
        )
    base = bert_config({k: v for k, v in hf.items() if k != "model_type"}, name, source=source)
    with fitting_headspace(source):
        return dataclasses.replace(
            base,
            max_seq_len=limit - offset,
            pad_token_id=pad,
            extra={**base.extra, "model_type": model_type, "position_offset": offset},
        )


def _roberta_ignorable(name: str) -> bool:
    # BERT's buffers, and the heads of task checkpoints (masked LM, classification), unused here
    return _bert_ignorable(name) or name.startswith(("lm_head.", "classifier."))


def _expected(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    exp = _bert_expected(c)
    exp[_POSITIONS] = (c.max_seq_len + int(c.extra["position_offset"]), c.d_model)  # the whole table
    return exp


def load_roberta(
    folder: str | Path, *, name: str = "", max_length: int | None = None, precision: str = "float32"
) -> PretrainedEncoder:
    """Load a local Hugging Face RoBERTa checkpoint folder onto a headspace :class:`~headspace.Encoder`.

    As :func:`~headspace.pretrained.load_bert` (the same untrusted-input checks, ``roberta.``-prefixed
    task checkpoints accepted, the pooler kept when present), with the position table shifted past
    ``pad_token_id`` (module docstring); sentence-transformers' ``max_seq_length`` is read as BERT's is.
    ``precision``: ``"float32"`` (exact), ``"bfloat16"`` or ``"int8"``.

    Raises:
        FileNotFoundError: the folder or a needed file is missing (named).
        ValueError: as :func:`~headspace.pretrained.load_bert`; a position table of another length than
            ``max_position_embeddings`` (listed with its shape).
    """
    check_precision(precision)
    ckpt = open_checkpoint(
        folder, name, roberta_config, "roberta.", "embeddings.", bert_parameter_count, _BERT_COUNTED
    )
    config = ckpt.config
    expected = _expected(config)
    has_pooler = "pooler.dense.weight" in ckpt.entries
    if has_pooler:
        expected.update(linear_shapes("pooler.dense", config.d_model, config.d_model))
    tensors, ignored = read_checked(ckpt, expected, _roberta_ignorable)
    tensors[_POSITIONS] = tensors[_POSITIONS][
        int(config.extra["position_offset"]) :
    ]  # [max_seq_len, d_model]
    model = Encoder(config)
    sd: dict[str, Tensor] = bert_state_dict(tensors, config)
    load_converted(model, sd, tensors, layouts.load_hf_bert, "encoder.layer.{}.attention.")
    pooler = None
    if has_pooler:
        pooler = nn.Linear(config.d_model, config.d_model)
        pooler.load_state_dict(
            {"weight": tensors["pooler.dense.weight"], "bias": tensors["pooler.dense.bias"]}
        )
    tokenizer = folder_tokenizer(ckpt.path, config.pad_token_id)
    st_config = optional_file(ckpt.path, "sentence_bert_config.json", "sentence-transformers' settings")
    if max_length is None and st_config is not None:  # a RoBERTa sentence-transformers model's limit
        max_length = ConfigFields(read_json(st_config), str(st_config)).integer(
            "max_seq_length", None, allow_none=True
        )
    pre = PretrainedEncoder(model, tokenizer, max_length=max_length, pooler=pooler, ignored=ignored)
    return pre.to_precision(precision)


#: model_type -> loader.
ENCODER_LOADERS: dict[str, Callable[..., PretrainedEncoder]] = dict.fromkeys(ROBERTA_TYPES, load_roberta)
