"""BART and Marian checkpoints (``model_type`` ``bart``, ``marian``) on an EncoderDecoder.

Both: post-LN blocks with LayerNorms (eps 1e-5), biases everywhere, scores scaled by ``1 / sqrt(d_head)``,
the embedding scaled by ``sqrt(d_model)`` where ``scale_embedding``, the unembedding tied to the shared
embedding plus ``final_logits_bias``. BART: learned positions read at ``position + 2`` and a LayerNorm
right after the embedding (``layernorm_embedding``). Marian: fixed sinusoidal positions (sines in the
first half of the features, cosines in the second) and no embedding norm.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ...model.encdec import EncDecConfig, EncoderDecoder
from ..hf import config_fields, config_problems
from .common import AttentionNames, Plan, act_of, load_encdec, same_heads


def _seq2seq_config(hf: dict[str, Any], name: str, source: str, marian: bool) -> EncDecConfig:
    f = config_fields(hf, source)
    keys = ["vocab_size", "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads",
            "encoder_ffn_dim"]  # fmt: skip
    f.require(keys, "Marian" if marian else "BART")
    same_heads(
        f, [("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")]
    )
    if marian:
        config_problems(
            hf, {"share_encoder_decoder_embeddings": lambda v: v is True,
                 "decoder_vocab_size": lambda v: v in (None, hf.get("vocab_size"))},
            {"share_encoder_decoder_embeddings": True}, source,
        )  # fmt: skip
    d_model, heads = f.integer("d_model"), f.integer("encoder_attention_heads")
    if d_model % heads:
        raise ValueError(f"{source}: d_model={d_model} must be divisible by encoder_attention_heads={heads}")
    positions = f.integer("max_position_embeddings", 1024)
    kind = "sinusoidal" if marian else "learned"
    return EncDecConfig(
        vocab_size=f.integer("vocab_size"), d_model=d_model, n_heads=heads, d_head=d_model // heads,
        d_mlp=f.integer("encoder_ffn_dim"), n_encoder_layers=f.integer("encoder_layers"),
        n_decoder_layers=f.integer("decoder_layers"), norm="layernorm", norm_eps=1e-5, layout="post",
        act=act_of(f, "activation_function", "gelu"), encoder_positions=kind, decoder_positions=kind,
        max_source_positions=positions, max_target_positions=positions, position_offset=0 if marian else 2,
        embed_scale=math.sqrt(d_model) if f.flag("scale_embedding", False) else 1.0, embed_norm=not marian,
        logits_bias=True, decoder_start_token_id=f.integer("decoder_start_token_id", 2, minimum=0),
        eos_token_id=f.integer("eos_token_id", 2, minimum=0, allow_none=True),
        pad_token_id=f.integer("pad_token_id", 1, minimum=0, allow_none=True), name=name,
    )  # fmt: skip


def bart_config(hf: dict[str, Any], name: str = "", source: str = "config.json") -> EncDecConfig:
    """An :class:`EncDecConfig` from a BART ``config.json`` dict."""
    return _seq2seq_config(hf, name, source, marian=False)


def marian_config(hf: dict[str, Any], name: str = "", source: str = "config.json") -> EncDecConfig:
    """An :class:`EncDecConfig` from a Marian ``config.json`` dict."""
    return _seq2seq_config(hf, name, source, marian=True)


def _layer_names(ours: str, theirs: str, decoder: bool) -> dict[str, str]:
    pairs = {
        "ln1": "self_attn_layer_norm",
        "mlp.fc_in": "fc1",
        "mlp.fc_out": "fc2",
        "ln2": "final_layer_norm",
    }
    if decoder:
        pairs["ln_cross"] = "encoder_attn_layer_norm"
    return {f"{ours}.{a}.{w}": f"{theirs}.{b}.{w}" for a, b in pairs.items() for w in ("weight", "bias")}


def attention_names(p: str, biases: tuple[bool, bool, bool, bool] = (True,) * 4) -> AttentionNames:
    """``{p}.q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` (BART, Marian, Whisper)."""
    return AttentionNames(f"{p}.q_proj", f"{p}.k_proj", f"{p}.v_proj", f"{p}.out_proj", biases)


def seq2seq_layers(plan: Plan, c: EncDecConfig, biases: tuple[bool, bool, bool, bool] = (True,) * 4) -> None:
    """Every block's names in ``model.{encoder,decoder}.layers.{i}`` (BART, Marian, Whisper)."""
    for stack, count in (("encoder", c.n_encoder_layers), ("decoder", c.n_decoder_layers)):
        for i in range(count):
            ours, theirs = f"{stack}.blocks.{i}", f"model.{stack}.layers.{i}"
            plan.attention[f"{ours}.attn"] = attention_names(f"{theirs}.self_attn", biases)
            if stack == "decoder":
                plan.attention[f"{ours}.cross_attn"] = attention_names(f"{theirs}.encoder_attn", biases)
            plan.names.update(_layer_names(ours, theirs, stack == "decoder"))


def seq2seq_plan(c: EncDecConfig) -> Plan:
    """headspace's names -> BART's or Marian's."""
    tied = {f"model.{s}.embed_tokens.weight": "model.shared.weight" for s in ("encoder", "decoder")}
    tied["lm_head.weight"] = "model.shared.weight"
    plan = Plan(tied=tied, reshape={"logits_bias": (1, c.vocab_size)})
    plan.names.update({"tok_embed.weight": "model.shared.weight", "logits_bias": "final_logits_bias"})
    for stack in ("encoder", "decoder"):
        if c.encoder_positions == "learned":
            plan.names[f"{stack}.embed.pos_embed.weight"] = f"model.{stack}.embed_positions.weight"
        if c.embed_norm:
            for w in ("weight", "bias"):
                plan.names[f"{stack}.embed.embed_ln.{w}"] = f"model.{stack}.layernorm_embedding.{w}"
    seq2seq_layers(plan, c)
    return plan


def load_bart(folder: str | Path, *, name: str = "", precision: str = "float32") -> EncoderDecoder:
    """A BART folder as an :class:`EncoderDecoder` (module docstring)."""
    return load_encdec(folder, bart_config, seq2seq_plan, name=name, precision=precision)


def load_marian(folder: str | Path, *, name: str = "", precision: str = "float32") -> EncoderDecoder:
    """A Marian folder as an :class:`EncoderDecoder` (module docstring)."""
    return load_encdec(folder, marian_config, seq2seq_plan, name=name, precision=precision)
