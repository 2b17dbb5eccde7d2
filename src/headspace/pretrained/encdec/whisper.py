"""Whisper checkpoints (``WhisperForConditionalGeneration`` folders, ``model_type`` ``whisper``).

The encoder reads log-mel features [batch, num_mel_bins, frames <= 2 max_source_positions] through two
convolutions (``conv1``: kernel 3, padding 1; ``conv2``: kernel 3, stride 2, padding 1; GELU after each)
and adds ``embed_positions`` (a fixed sinusoid stored in the checkpoint); the decoder adds learned
positions. Pre-LN blocks with LayerNorms (eps 1e-5), a final LayerNorm in each stack, scores scaled by
``1 / sqrt(d_head)``; the k projections have no bias (zeros here); the unembedding ``proj_out`` is tied to
the decoder's token embedding. State dicts in transformers' naming load through :func:`whisper_plan`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from ...model.encdec import EncDecConfig, EncoderDecoder
from ..hf import config_fields
from .bart import seq2seq_layers
from .common import Plan, act_of, encdec_from_state_dict, load_encdec, same_heads


def whisper_config(hf: dict[str, Any], name: str = "", source: str = "config.json") -> EncDecConfig:
    """An :class:`EncDecConfig` from a Whisper ``config.json`` dict."""
    f = config_fields(hf, source)
    f.require(["vocab_size", "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads",
               "encoder_ffn_dim", "num_mel_bins"], "Whisper")  # fmt: skip
    same_heads(
        f, [("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")]
    )
    d_model, heads = f.integer("d_model"), f.integer("encoder_attention_heads")
    if d_model % heads:
        raise ValueError(f"{source}: d_model={d_model} must be divisible by encoder_attention_heads={heads}")
    if f.flag("scale_embedding", False):
        raise ValueError(
            f"{source}: scale_embedding=true is not supported for Whisper (its checkpoints have false)"
        )
    return EncDecConfig(
        vocab_size=f.integer("vocab_size"), d_model=d_model, n_heads=heads, d_head=d_model // heads,
        d_mlp=f.integer("encoder_ffn_dim"), n_encoder_layers=f.integer("encoder_layers"),
        n_decoder_layers=f.integer("decoder_layers"), norm="layernorm", norm_eps=1e-5, layout="pre",
        act=act_of(f, "activation_function", "gelu"), encoder_positions="learned",
        decoder_positions="learned",
        max_source_positions=f.integer("max_source_positions", 1500),
        max_target_positions=f.integer("max_target_positions", 448), final_norm=True,
        n_mels=f.integer("num_mel_bins", 80),
        decoder_start_token_id=f.integer("decoder_start_token_id", 50257, minimum=0),
        eos_token_id=f.integer("eos_token_id", 50256, minimum=0, allow_none=True),
        pad_token_id=f.integer("pad_token_id", 50256, minimum=0, allow_none=True), name=name,
    )  # fmt: skip


def whisper_plan(c: EncDecConfig) -> Plan:
    """headspace's names -> Whisper's (transformers' ``WhisperForConditionalGeneration`` state dict)."""
    plan = Plan(tied={"proj_out.weight": "model.decoder.embed_tokens.weight"})
    n = plan.names
    n["tok_embed.weight"] = "model.decoder.embed_tokens.weight"
    for w in ("weight", "bias"):
        n[f"encoder.conv1.{w}"] = f"model.encoder.conv1.{w}"
        n[f"encoder.conv2.{w}"] = f"model.encoder.conv2.{w}"
        n[f"encoder.final_ln.{w}"] = "model.encoder.layer_norm." + w
        n[f"decoder.final_ln.{w}"] = "model.decoder.layer_norm." + w
    n["encoder.embed.pos_embed.weight"] = "model.encoder.embed_positions.weight"
    n["decoder.embed.pos_embed.weight"] = "model.decoder.embed_positions.weight"
    seq2seq_layers(plan, c, (True, False, True, True))
    return plan


def load_whisper(folder: str | Path, *, name: str = "", precision: str = "float32") -> EncoderDecoder:
    """A Whisper folder as an :class:`EncoderDecoder` (module docstring)."""
    return load_encdec(folder, whisper_config, whisper_plan, name=name, precision=precision)


def whisper_from_state_dict(
    hf: dict[str, Any], tensors: Mapping[str, Tensor], *, name: str = "whisper"
) -> EncoderDecoder:
    """A Whisper :class:`EncoderDecoder` from a ``config.json`` dict ``hf`` and a state dict in
    transformers' naming (``WhisperForConditionalGeneration.state_dict()``, or a converted checkpoint's),
    checked as a folder's tensors are (names, shapes, dtypes, NaN/Inf; ``proj_out.weight`` may be present,
    equal to the decoder's embedding)."""
    config = whisper_config(hf, name, "config")
    return encdec_from_state_dict(config, whisper_plan, tensors, f"{name} state dict")
