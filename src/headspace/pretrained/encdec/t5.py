"""T5 checkpoints (``T5ForConditionalGeneration`` folders, ``model_type`` ``t5``) on an EncoderDecoder.

T5: pre-LN blocks with RMS norms without bias (``layer_norm_epsilon``), no bias in any linear, scores
unscaled (``scale = 1``), relative-position buckets (``relative_attention_num_buckets``,
``relative_attention_max_distance``) in each stack's first self-attention layer shared by all its layers
(bidirectional in the encoder, causal in the decoder), an MLP ``wo(act(wi(x)))`` or, gated (t5 v1.1,
``feed_forward_proj="gated-gelu"``), ``wo(act(wi_0(x)) * wi_1(x))``; the decoder's output is scaled by
``d_model ** -0.5`` before the tied unembedding where ``scale_decoder_outputs`` (transformers 5) says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...model.encdec import EncDecConfig, EncoderDecoder
from ..hf import config_fields
from .common import AttentionNames, Plan, act_of, load_encdec


def t5_config(hf: dict[str, Any], name: str = "", source: str = "config.json") -> EncDecConfig:
    """An :class:`EncDecConfig` from a T5 ``config.json`` dict (every field read is checked)."""
    f = config_fields(hf, source)
    f.require(["vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads"], "T5")
    proj = f.text("feed_forward_proj", "relu")
    gated = f.flag("is_gated_act", proj.startswith("gated-"))
    act = act_of(f, "dense_act_fn", proj.split("-")[-1] if proj.split("-")[-1] != "gelu" else "gelu_new")
    d_model = f.integer("d_model")
    n_layers = f.integer("num_layers")
    scale_out = f.flag("scale_decoder_outputs", hf.get("tie_word_embeddings", True) is not False)
    return EncDecConfig(
        vocab_size=f.integer("vocab_size"), d_model=d_model, n_heads=f.integer("num_heads"),
        d_head=f.integer("d_kv"), d_mlp=f.integer("d_ff"), n_encoder_layers=n_layers,
        n_decoder_layers=f.integer("num_decoder_layers", n_layers), norm="rmsnorm",
        norm_eps=f.number("layer_norm_epsilon", 1e-6, low=0.0, low_open=True), layout="pre",
        mlp="gated" if gated else "plain", act=act, bias=False, scale=1.0, encoder_positions="buckets",
        decoder_positions="buckets", num_buckets=f.integer("relative_attention_num_buckets", 32, minimum=2),
        max_distance=f.integer("relative_attention_max_distance", 128, minimum=2), final_norm=True,
        output_scale=d_model**-0.5 if scale_out else 1.0,
        decoder_start_token_id=f.integer("decoder_start_token_id", 0, minimum=0),
        eos_token_id=f.integer("eos_token_id", 1, minimum=0, allow_none=True),
        pad_token_id=f.integer("pad_token_id", 0, minimum=0, allow_none=True), name=name,
    )  # fmt: skip


def _t5_attention(p: str) -> AttentionNames:
    return AttentionNames(f"{p}.q", f"{p}.k", f"{p}.v", f"{p}.o", (False, False, False, False))


def _t5_mlp(c: EncDecConfig, ours: str, theirs: str) -> dict[str, str]:
    if c.mlp == "gated":
        return {
            f"{ours}.fc_gate.weight": f"{theirs}.wi_0.weight",
            f"{ours}.fc_in.weight": f"{theirs}.wi_1.weight",
            f"{ours}.fc_out.weight": f"{theirs}.wo.weight",
        }
    return {f"{ours}.fc_in.weight": f"{theirs}.wi.weight", f"{ours}.fc_out.weight": f"{theirs}.wo.weight"}


def t5_plan(c: EncDecConfig) -> Plan:
    """headspace's names -> T5's (see :class:`~headspace.pretrained.encdec.common.Plan`)."""
    copies = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight")
    plan = Plan(tied=dict.fromkeys(copies, "shared.weight"))
    n = plan.names
    n["tok_embed.weight"] = "shared.weight"
    for stack, count in (("encoder", c.n_encoder_layers), ("decoder", c.n_decoder_layers)):
        n[f"{stack}.rel_bias.weight"] = (
            f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        )
        n[f"{stack}.final_ln.weight"] = f"{stack}.final_layer_norm.weight"
        for i in range(count):
            ours, theirs = f"{stack}.blocks.{i}", f"{stack}.block.{i}.layer"
            plan.attention[f"{ours}.attn"] = _t5_attention(f"{theirs}.0.SelfAttention")
            n[f"{ours}.ln1.weight"] = f"{theirs}.0.layer_norm.weight"
            last = 1
            if stack == "decoder":
                plan.attention[f"{ours}.cross_attn"] = _t5_attention(f"{theirs}.1.EncDecAttention")
                n[f"{ours}.ln_cross.weight"] = f"{theirs}.1.layer_norm.weight"
                last = 2
            n[f"{ours}.ln2.weight"] = f"{theirs}.{last}.layer_norm.weight"
            n.update(_t5_mlp(c, f"{ours}.mlp", f"{theirs}.{last}.DenseReluDense"))
    return plan


def load_t5(folder: str | Path, *, name: str = "", precision: str = "float32") -> EncoderDecoder:
    """A T5 folder (``config.json``, ``model.safetensors``) as an :class:`EncoderDecoder`."""
    return load_encdec(folder, t5_config, t5_plan, name=name, precision=precision)
