"""Mixture-of-experts checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss) onto a headspace Decoder.

Each is a Llama-family decoder whose MLP is a :class:`~headspace.model.moe.MixtureOfExperts`
(``mlp_kind="moe"``); the attention is that of the family it extends::

    mixtral    Mistral attention (sliding window on every layer when ``sliding_window`` is set);
               top-k weights always renormalised; tensors ``block_sparse_moe.gate`` (router) and
               ``block_sparse_moe.experts.E.{w1, w3, w2}`` (gate, up, down)
    qwen2_moe  Qwen2 attention (q/k/v biases per ``qkv_bias``, windows per ``layer_types``); a shared
               gated expert ``mlp.shared_expert.{gate,up,down}_proj`` of width
               ``shared_expert_intermediate_size``, scaled by ``sigmoid(x mlp.shared_expert_gate)``
    qwen3_moe  Qwen3 attention (QK-norm per head; every layer slides when ``use_sliding_window``)
    olmoe      Llama attention with QK-norm over all heads at once (``q_norm`` [n_heads d_head])
    gpt_oss    Mistral-like attention with q/k/v/o biases, learned sinks (``self_attn.sinks``) and windows
               per ``layer_types``; experts fused (:mod:`headspace.pretrained.gpt_oss`); its YaRN RoPE
               (as released) loads as every YaRN rotation does (:mod:`headspace.nn.rope_scaling`)

The experts' width is ``moe_intermediate_size`` (Qwen) or ``intermediate_size`` (Mixtral, OLMoE);
``norm_topk_prob`` switches the renormalisation (Qwen, OLMoE). Checkpoints in transformers' saved
layout (one tensor per expert: ``mlp.experts.E.{gate,up,down}_proj.weight``) are stacked into
``experts_gate`` / ``experts_in`` [n_experts, d_mlp, d_model] and ``experts_out`` [n_experts, d_model,
d_mlp]. Refused, by field name: dense layers among the sparse ones (``mlp_only_layers``,
``decoder_sparse_step`` != 1), OLMoE's ``clip_qkv``; and all that :func:`~headspace.pretrained.llama.
llama_config` refuses. The same untrusted-folder checks as :func:`~headspace.pretrained.load_llama`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..model.config import ModelConfig
from .family_frame import folder_headers, open_family, read_listed
from .gpt_oss import gpt_oss_fields, gpt_oss_state_dict, gpt_oss_tensors
from .hf import (
    ConfigFields,
    folder_tokenizer,
)
from .llama import (
    _ignorable,
    _meta_decoder,
    _prefix,
    _tensors,
    _tied_head,
    _wrap,
    llama_config,
)
from .wrappers import PretrainedDecoder

#: ``config.json`` model types read here, and the Llama-family model type whose attention each has.
MOE_MODEL_TYPES = {
    "mixtral": "mistral",
    "qwen2_moe": "qwen2",
    "qwen3_moe": "qwen3",
    "olmoe": "llama",
    "gpt_oss": "mistral",  # windows per layer_types; biases, sinks and experts: gpt_oss.gpt_oss_fields
}
#: (router, expert prefix, (gate, up, down) names) of each family's tensors under ``model.layers.N.``.
_NAMES = {
    "mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts", ("w1", "w3", "w2")),
    "default": ("mlp.gate", "mlp.experts", ("gate_proj", "up_proj", "down_proj")),
}


def _moe_fields(f: ConfigFields, kind: str) -> dict[str, Any]:
    """The ModelConfig fields of the experts: count, top-k, renormalisation, shared width."""
    n_experts = f.integer("num_local_experts" if f.hf.get("num_experts") is None else "num_experts")
    top_k = f.integer("num_experts_per_tok", 2)
    if top_k > n_experts:
        raise ValueError(
            f"{f.source}: num_experts_per_tok must be at most the {n_experts} experts; got {top_k}"
        )
    if kind in ("qwen2_moe", "qwen3_moe"):
        only = f.hf.get("mlp_only_layers") or []
        if only:
            raise ValueError(
                f"{f.source}: mlp_only_layers={only!r:.80} is not supported (every layer sparse)"
            )
        if f.integer("decoder_sparse_step", 1) != 1:
            raise ValueError(f"{f.source}: decoder_sparse_step must be 1 (every layer sparse)")
    if kind == "olmoe" and f.hf.get("clip_qkv") is not None:
        raise ValueError(f"{f.source}: clip_qkv={f.hf['clip_qkv']!r} is not supported (null only)")
    shared = f.integer("shared_expert_intermediate_size") if kind == "qwen2_moe" else None
    return dict(
        mlp_kind="moe",
        mlp_bias=False,
        n_experts=n_experts,
        experts_top_k=top_k,
        experts_norm_topk=True if kind == "mixtral" else f.flag("norm_topk_prob", False),
        shared_expert_d_mlp=shared,
    )


def _base_config(hf: Mapping[str, Any], f: ConfigFields, kind: str) -> dict[str, Any]:
    """``hf`` as the config of the Llama-family model whose attention ``kind`` has (the experts'
    width as ``intermediate_size``, the windows as that family states them)."""
    base = dict(hf)
    base["model_type"] = MOE_MODEL_TYPES[kind]
    if kind in ("qwen2_moe", "qwen3_moe"):
        base["intermediate_size"] = f.integer("moe_intermediate_size")
    if kind in ("qwen2_moe", "qwen3_moe") and not f.flag("use_sliding_window", False):
        base["sliding_window"] = None  # transformers: 0 (Qwen2-MoE) or None (Qwen3-MoE) then
    if kind == "qwen3_moe" and base.get("sliding_window") is not None:
        base["layer_types"] = ["sliding_attention"] * f.integer("num_hidden_layers")
    if kind == "olmoe":
        base["mlp_bias"] = False
    return base


def moe_config(
    hf: Mapping[str, Any], name: str = "", *, max_seq_len: int | None = None, source: str = "config.json"
) -> ModelConfig:
    """A :class:`ModelConfig` (``mlp_kind="moe"``) from a Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE
    ``config.json`` dict; a field headspace cannot represent is refused by name (module docstring)."""
    if not isinstance(hf, Mapping):
        raise TypeError(f"hf must be a dict (config.json); got {type(hf).__name__}")
    f = ConfigFields(hf, source)
    kind = f.text("model_type", None, allow_none=True)
    if kind not in MOE_MODEL_TYPES:
        raise ValueError(
            f"{source}: model_type={kind!r} is not a mixture of experts read here: {list(MOE_MODEL_TYPES)}"
        )
    moe = _moe_fields(f, kind)
    if kind == "gpt_oss":
        moe.update(gpt_oss_fields(f))
    config = llama_config(_base_config(hf, f, kind), name, max_seq_len=max_seq_len, source=source)
    extra = {**config.extra, "model_type": kind}
    changes: dict[str, Any] = {**moe, "extra": extra}
    if kind == "qwen2_moe":
        changes.update(qkv_bias=f.flag("qkv_bias", True))
    if kind == "olmoe":
        changes.update(qk_norm="all")
    try:
        return dataclasses.replace(config, **changes)
    except ValueError as e:
        raise ValueError(f"{source} does not fit headspace: {e}") from None


def moe_tensors(
    c: ModelConfig, kind: str, prefix: str = "model."
) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    """(Decoder state-dict name, the Hugging Face tensors (name, shape) it is made of), every parameter:
    the Llama family's attention, norms and embeddings, and per layer the router, the experts (one HF
    tensor per expert, stacked) and the shared expert."""
    assert c.n_experts is not None and c.d_mlp is not None
    d, dm, n = c.d_model, c.d_mlp, c.n_experts
    out = [(ours, theirs) for ours, theirs in _tensors(c, prefix) if ".mlp." not in ours]
    if kind == "gpt_oss":
        return gpt_oss_tensors(c, prefix, out)
    router, experts, (gate, up, down) = _NAMES.get(kind, _NAMES["default"])
    for i in range(c.n_layers):
        p, b = f"{prefix}layers.{i}.", f"blocks.{i}.mlp."
        out.append((b + "router.weight", [(f"{p}{router}.weight", (n, d))]))
        for ours, theirs, shape in (("experts_gate", gate, (dm, d)), ("experts_in", up, (dm, d)),
                                    ("experts_out", down, (d, dm))):  # fmt: skip
            out.append((b + ours, [(f"{p}{experts}.{e}.{theirs}.weight", shape) for e in range(n)]))
        if c.shared_expert_d_mlp is not None:
            ds = c.shared_expert_d_mlp
            for ours, theirs, shape in (("fc_gate", "gate_proj", (ds, d)), ("fc_in", "up_proj", (ds, d)),
                                        ("fc_out", "down_proj", (d, ds))):  # fmt: skip
                out.append((f"{b}shared.{ours}.weight", [(f"{p}mlp.shared_expert.{theirs}.weight", shape)]))
            out.append((b + "shared_gate.weight", [(f"{p}mlp.shared_expert_gate.weight", (1, d))]))
    return out


def moe_state_dict(t: Mapping[str, Tensor], layout: list[tuple[str, list[str]]]) -> dict[str, Tensor]:
    """HF tensors -> Decoder state dict: q, k, v concatenated into ``qkv_weight`` (rows), the experts
    stacked along a new first axis ([n_experts, out, in]), everything else as it is (float32)."""
    sd: dict[str, Tensor] = {}
    for ours, theirs in layout:
        if len(theirs) == 1:
            sd[ours] = t[theirs[0]].float()
        elif ".experts_" in ours:
            sd[ours] = torch.stack([t[n].float() for n in theirs])  # (n_experts, out, in)
        else:
            sd[ours] = torch.cat([t[n].float() for n in theirs])  # ((H + 2 Hkv) dh, ...)
    return sd


def load_moe(
    folder: str | Path, *, name: str = "", max_seq_len: int | None = None, precision: str = "float32"
) -> PretrainedDecoder:
    """Load a local Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE checkpoint folder onto a headspace Decoder
    (module docstring), with :func:`~headspace.pretrained.load_llama`'s checks: the parameter count the
    config implies against the headers, tensor names, shapes and dtypes, NaN/Inf weights."""
    opened = open_family(folder, precision)
    path = opened.path
    config = moe_config(opened.hf, name=name or path.name, max_seq_len=max_seq_len, source=opened.config_file)
    config.extra["source"] = str(path)
    kind = config.extra["model_type"]
    headers = folder_headers(path)
    prefix = _prefix(headers[0].tensors)
    pieces = moe_tensors(config, kind, prefix)
    expected = {n: s for _, theirs in pieces for n, s in theirs}
    fields = (
        f"num_hidden_layers={config.n_layers}, hidden_size={config.d_model}, experts={config.n_experts} "
        f"of width {config.d_mlp}, vocab_size={config.vocab_size}"
    )
    tensors, ignored = read_listed(headers, expected, config, fields, opened.config_file, _ignorable)
    _tied_head(tensors, config, prefix, headers[0].path)
    if config.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    model = _meta_decoder(config)
    extra: dict[str, Tensor] = {}
    if kind == "gpt_oss":  # the fused experts (pieces named "mlp:..."): converted by gpt_oss_state_dict
        extra = gpt_oss_state_dict(tensors, config.n_layers, prefix)
        pieces = [(o, t) for o, t in pieces if ".mlp:" not in o]
    sd = moe_state_dict(tensors, [(o, [n for n, _ in t]) for o, t in pieces])
    model.load_state_dict({**sd, **extra}, strict=True, assign=True)
    tokenizer = folder_tokenizer(path, config.pad_token_id)
    return _wrap(model, config, tokenizer, ignored).to_precision(precision)
