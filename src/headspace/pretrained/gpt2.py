"""GPT-2 checkpoints (Hugging Face ``GPT2Model`` / ``GPT2LMHeadModel`` folders) onto a headspace Decoder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .. import layouts
from ..config import ModelConfig
from ..models import Decoder
from .hf import (
    check_tensors,
    check_values,
    config_problems,
    folder_tokenizer,
    load_converted,
    open_folder,
    read_tensors,
    strip_prefix,
)
from .wrappers import PretrainedDecoder

_GPT2_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}


def gpt2_config(hf: dict[str, Any], name: str = "") -> ModelConfig:
    """A headspace :class:`ModelConfig` from a Hugging Face GPT-2 ``config.json`` dict."""
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
    needed = ["vocab_size", "n_embd", "n_layer", "n_head"]
    absent = [k for k in needed if k not in hf]
    if absent:
        raise ValueError(f"config.json lacks the GPT-2 fields {absent}")
    d = hf["n_embd"]
    try:
        return ModelConfig(
            arch="decoder",
            vocab_size=hf["vocab_size"],
            d_model=d,
            n_layers=hf["n_layer"],
            n_heads=hf["n_head"],
            d_mlp=hf.get("n_inner") or 4 * d,
            max_seq_len=hf.get("n_positions", 1024),
            act=_GPT2_ACT[hf.get("activation_function", "gelu_new")],
            norm="pre",
            dropout=hf.get("resid_pdrop", 0.1),
            attn_dropout=hf.get("attn_pdrop", 0.1),
            emb_dropout=hf.get("embd_pdrop", 0.1),
            ln_eps=hf.get("layer_norm_epsilon", 1e-5),
            type_vocab_size=0,
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
            pad_token_id=hf.get("pad_token_id"),
            embed_ln=False,
            final_ln=True,
            init_std=hf.get("initializer_range", 0.02),
            name=name,
        )
    except ValueError as e:
        raise ValueError(f"config.json does not fit headspace: {e}") from None


def _gpt2_expected(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, dm, hq = c.d_model, c.d_mlp, c.n_heads * c.d_head
    exp: dict[str, tuple[int, ...]] = {"wte.weight": (c.vocab_size, d), "wpe.weight": (c.max_seq_len, d)}
    for i in range(c.n_layers):
        p = f"h.{i}."
        exp.update(
            {
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
        )
    exp["ln_f.weight"] = (d,)
    exp["ln_f.bias"] = (d,)
    return exp


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


def load_gpt2(folder: str | Path, *, name: str = "") -> PretrainedDecoder:
    """Load a local Hugging Face GPT-2 checkpoint folder onto a headspace :class:`~headspace.Decoder`.

    Reads ``config.json`` and ``model.safetensors`` (``tokenizer.json`` when present). Both
    ``GPT2LMHeadModel`` (``transformer.``-prefixed, ``lm_head.weight`` optional when tied) and
    ``GPT2Model`` checkpoints are accepted.

    Raises:
        FileNotFoundError: the folder or a needed file is missing (named).
        ValueError: a config headspace cannot represent; missing/unexpected tensors or shape mismatches;
            weights that are not floating point or hold NaN/Inf (named).
    """
    path, hf, weights = open_folder(folder)
    config = gpt2_config(hf, name=name or path.name)
    tensors = strip_prefix(read_tensors(weights), "transformer.", "wte.")
    expected = _gpt2_expected(config)
    # dtype and NaN/Inf first: a NaN lm_head would otherwise be reported as differing from wte
    check_values(tensors, [k for k in tensors if k in expected or k == "lm_head.weight"], weights)
    lm_head = tensors.get("lm_head.weight")
    if not config.tie_embeddings:
        expected["lm_head.weight"] = (config.vocab_size, config.d_model)
    elif lm_head is not None:
        # a tied checkpoint may store the head; it must then be the token embedding
        if "wte.weight" in tensors and not torch.equal(lm_head, tensors["wte.weight"]):
            raise ValueError(
                f"{weights}: config.json says tie_word_embeddings=true but lm_head.weight differs from "
                "wte.weight"
            )
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    ignored = check_tensors(tensors, expected, _gpt2_ignorable, weights)
    model = Decoder(config)
    load_converted(model, gpt2_state_dict(tensors, config), tensors, layouts.load_gpt2, "h.{}.attn.")
    tokenizer = folder_tokenizer(path, config.pad_token_id)
    return PretrainedDecoder(model, tokenizer, ignored=ignored)
