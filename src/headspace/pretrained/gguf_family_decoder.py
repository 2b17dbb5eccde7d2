"""The Decoder of a GGUF file of the families of :mod:`.gguf_families`, once its tensors are read:
what llama.cpp's converter changed undone (GPT-NeoX's and BLOOM's q/k/v row order, phi2's fused q/k/v,
Phi-3's LongRoPE factor tensors), then the same config checks and tensor renaming as a checkpoint folder
of the family (:mod:`.rotary_families`, :mod:`.parallel_families`, :mod:`.absolute_families`,
:mod:`.alibi_families`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .gguf_families import _LONGROPE, _PHI2_QKV

__all__ = ["family_decoder"]


def _neox_rows(t: dict[str, Tensor], hf: dict[str, Any]) -> None:
    """GPT-NeoX's and BLOOM's fused q/k/v rows from llama.cpp's order [3, H, d_head] back to Hugging
    Face's [H, 3, d_head] (weights and biases), in place of ``t`` (GPTNeoXModel / BloomModel
    .modify_tensors)."""
    H = hf.get("num_attention_heads") or hf["n_head"]
    d = hf["hidden_size"] // H
    for name in [n for n in t if n.endswith("attention.query_key_value.weight")]:
        w = t[name]  # [3 H d, hidden] rows q (all heads), k, v
        t[name] = w.view(3, H, d, -1).transpose(0, 1).reshape(w.shape)  # [H 3 d, hidden]
    for name in [n for n in t if n.endswith("attention.query_key_value.bias")]:
        b = t[name]  # [3 H d]
        t[name] = b.view(3, H, d).transpose(0, 1).reshape(-1)  # [H 3 d]


def _phi2_split(t: dict[str, Tensor], hf: dict[str, Any]) -> None:
    """phi2's fused q/k/v (rows [q (H d); k (Hkv d); v (Hkv d)], llama.cpp's phi2 graph views them so)
    into q_proj / k_proj / v_proj, in place of ``t``."""
    d = hf["hidden_size"] // hf["num_attention_heads"]
    rows = [hf["num_attention_heads"] * d, hf["num_key_value_heads"] * d, hf["num_key_value_heads"] * d]
    for name in [n for n in t if n.endswith(_PHI2_QKV + ".weight") or n.endswith(_PHI2_QKV + ".bias")]:
        stem, kind = name.rsplit(".", 1)
        for x, part in zip("qkv", t.pop(name).split(rows, dim=0), strict=True):  # [rows, hidden] or [rows]
            t[f"{stem.removesuffix('qkv')}{x}_proj.{kind}"] = part.contiguous()  # self_attn.{x}_proj


def _falcon_rows(t: dict[str, Tensor], hf: dict[str, Any]) -> None:
    """Falcon's q/k/v rows from llama.cpp's [q (H d); k (Hkv d); v (Hkv d)] (FalconModel.modify_tensors)
    back to Hugging Face's: per kv group [a group's queries; its key; its value] (new architecture), per
    head [q; k; v] (old, one kv head per head); multi-query's are already Hugging Face's. In place."""
    H, Hkv = hf["num_attention_heads"], hf["num_kv_heads"]
    d = hf["hidden_size"] // H
    if hf["multi_query"]:
        return
    for name in [n for n in t if n.endswith("self_attention.query_key_value.weight")]:
        w = t[name]  # [(H + 2 Hkv) d, hidden]
        q, k, v = w.split([H * d, Hkv * d, Hkv * d])
        g = H // Hkv
        parts = [q.view(Hkv, g, d, -1), k.view(Hkv, 1, d, -1), v.view(Hkv, 1, d, -1)]  # [Hkv, ., d, hidden]
        t[name] = torch.cat(parts, dim=1).reshape(w.shape)  # [Hkv (g + 2) d, hidden]


def family_decoder(
    hf: dict[str, Any], tensors: dict[str, Tensor], tokenizer: Any, *, name: str, source: str, precision: str
) -> Any:
    """The :class:`~headspace.pretrained.PretrainedDecoder` of a family file: ``hf`` (its
    :class:`FamilyLayout` config, special token ids added), ``tensors`` (Hugging Face names, float32, as
    read) and ``tokenizer`` (a ``tokenizers.Tokenizer``), through the config checks and tensor renaming a
    checkpoint folder of the family gets (:func:`~.rotary_families.family_config`,
    :func:`~.parallel_families.parallel_family_config`)."""
    from .absolute_families import FAMILIES as ABSOLUTE
    from .absolute_families import absolute_family_config
    from .alibi_families import FAMILIES as ALIBI
    from .alibi_families import alibi_family_config
    from .hf import check_tensors
    from .llama import _ignorable, _meta_decoder, _wrap, llama_expected, llama_state_dict
    from .parallel_families import FAMILIES as PARALLEL
    from .parallel_families import parallel_family_config
    from .rotary_families import FAMILIES as ROTARY
    from .rotary_families import family_config
    from .tokenization import TextTokenizer

    t = dict(tensors)
    kind = hf["model_type"]
    if kind in ("gpt_neox", "bloom"):
        _neox_rows(t, hf)
    if kind == "phi":
        _phi2_split(t, hf)
    if kind == "falcon":
        _falcon_rows(t, hf)
    if _LONGROPE["rope_factors_long.weight"] in t:  # [rotary_dim / 2] each, float32 as stored
        factors = {hf_name.split(".")[1]: t.pop(hf_name).tolist() for hf_name in _LONGROPE.values()}
        hf = {**hf, "rope_parameters": {**hf["rope_parameters"], "rope_type": "longrope", **factors}}
    where = f"{source} (GGUF metadata)"
    made_by = {**dict.fromkeys(PARALLEL, (PARALLEL, parallel_family_config)),
               **dict.fromkeys(ABSOLUTE, (ABSOLUTE, absolute_family_config)),
               **dict.fromkeys(ALIBI, (ALIBI, alibi_family_config))}  # fmt: skip
    if kind in made_by:
        families, make = made_by[kind]
        config = make(hf, name, source=where)
        model = _meta_decoder(config)
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        sd = families[kind][1](t, config)
        ignored = check_tensors(sd, expected, lambda k: False, Path(source))
    else:
        config = family_config(hf, name, source=where)
        if config.tie_embeddings or config.extra.get("tied_checkpoint"):
            t.pop("lm_head.weight", None)
        t = ROTARY[kind][1](t, config)
        ignored = check_tensors(t, llama_expected(config, "model."), _ignorable, Path(source))
        sd = llama_state_dict(t, config, "model.")
        model = _meta_decoder(config)
        for key, param in model.state_dict().items():  # a LayerNorm bias the file has not: 0 (OLMo)
            if key not in sd and key.endswith(".bias") and key.rsplit(".", 2)[-2].startswith("ln"):
                sd[key] = torch.zeros(param.shape)
    config.extra["source"] = source
    sd = {k: v.float() for k, v in sd.items() if k in model.state_dict()}
    model.load_state_dict(sd, strict=True, assign=True)
    tok = TextTokenizer.from_tokenizer(tokenizer, pad_id=config.pad_token_id, copy=False)
    return _wrap(model, config, tok, ignored).to_precision(precision)
