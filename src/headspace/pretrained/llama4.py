"""Llama 4's text model (``model_type`` ``llama4_text``) onto a headspace Decoder.

What transformers' ``Llama4TextModel`` computes, field by field of the block description:

* ``no_rope_layers`` (1 = rotary, 0 = NoPE; default a NoPE layer every ``no_rope_layer_interval``): the
  NoPE layers have no rotation and, with ``attn_temperature_tuning``, scale each query by the
  temperature ``1 + attn_scale * log(1 + floor((p + 1) / floor_scale))`` (``AttentionSpec.temperature``);
* ``layer_types`` ``chunked_attention`` (the rotary layers, with ``attention_chunk_size``): a query sees
  the earlier keys of its own chunk only (``AttentionSpec.chunk``);
* ``use_qk_norm``: a weightless RMSNorm of q and k per head on the rotary layers (``qk_norm="l2"``);
  transformers applies it after the rotation, headspace before: the rotation keeps each head's norm, so
  the values agree to rounding;
* the rotation pairs features (2i, 2i + 1) (transformers' complex ``freqs_cis``): ``rope_interleaved``;
* ``moe_layers`` (default every ``interleave_moe_layer_step``-th layer): a mixture of experts whose router
  takes the top ``num_experts_per_tok`` logits through a sigmoid and scales the chosen expert's *input*
  by it (``routing="topk_sigmoid"``), plus an ungated shared expert of width ``intermediate_size``; the
  other layers a gated MLP of width ``intermediate_size_mlp``.

Tensors: ``feed_forward.experts.gate_up_proj`` [E, d_model, 2 d_mlp] (gate the first half, up the second)
and ``down_proj`` [E, d_mlp, d_model], stored [in, out], become ``experts_gate`` / ``experts_in`` [E,
d_mlp, d_model] and ``experts_out`` [E, d_model, d_mlp]; ``feed_forward.router.weight`` the router;
``feed_forward.shared_expert.*`` the shared expert; a dense layer's ``feed_forward.{gate,up,down}_proj``
its MLP. Refused by name: any ``layer_types`` but chunked and full attention, and all that
:func:`~headspace.pretrained.llama.llama_config` refuses.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..model.config import ModelConfig
from .family_frame import folder_headers, open_family, read_listed
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

MODEL_TYPE = "llama4_text"
_LAYER_TYPES = {"chunked_attention": "chunked", "full_attention": "full"}
#: Llama 4's fields that the Llama reader must not see (read here instead).
_OWN = ("layer_types", "no_rope_layers", "moe_layers", "model_type")


def _int_list(f: ConfigFields, name: str, n: int, default: list[int]) -> list[int]:
    """``name`` as a list of ints (``default`` where missing or empty), checked: one-line error."""
    value = f.hf.get(name) or default
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise ValueError(f"{f.source}: {name} must be a list of ints; got {value!r:.80}")
    if name == "no_rope_layers" and len(value) != n:
        raise ValueError(f"{f.source}: no_rope_layers must have one entry per layer ({n}); got {len(value)}")
    return list(value)


def _layer_fields(f: ConfigFields, n: int) -> dict[str, Any]:
    """The ModelConfig fields of Llama 4's layers: NoPE layers, layer types and chunk, experts' layers."""
    interval = f.integer("no_rope_layer_interval", 4)
    uses_rope = _int_list(f, "no_rope_layers", n, [int((i + 1) % interval != 0) for i in range(n)])
    chunk = f.hf.get("attention_chunk_size")
    default_types = ["chunked_attention" if r and chunk is not None else "full_attention" for r in uses_rope]
    types = f.hf.get("layer_types") or default_types
    if not isinstance(types, list) or len(types) != n or any(t not in _LAYER_TYPES for t in types):
        raise ValueError(
            f"{f.source}: layer_types must list {sorted(_LAYER_TYPES)}, one per layer ({n}); "
            f"got {types!r:.120}"
        )
    step = f.integer("interleave_moe_layer_step", 1)
    moe = _int_list(f, "moe_layers", n, list(range(step - 1, n, step)))
    temperature = None
    if f.flag("attn_temperature_tuning", True):
        temperature = [
            f.number("floor_scale", 8192, low=0.0, low_open=True),
            f.number("attn_scale", 0.1, low=-math.inf),
        ]
    return dict(
        nope_layers=[i for i, r in enumerate(uses_rope) if not r],
        layer_types=[_LAYER_TYPES[t] for t in types],
        attention_chunk=None if "chunked_attention" not in types else f.integer("attention_chunk_size"),
        attn_temperature=temperature,
        moe_layers=moe,
        qk_norm="l2" if f.flag("use_qk_norm", True) else None,
    )


def llama4_config(
    hf: Mapping[str, Any], name: str = "", *, max_seq_len: int | None = None, source: str = "config.json"
) -> ModelConfig:
    """A :class:`ModelConfig` from a ``llama4_text`` ``config.json`` dict (module docstring); a field
    headspace cannot represent is refused by name."""
    if not isinstance(hf, Mapping):
        raise TypeError(f"hf must be a dict (config.json); got {type(hf).__name__}")
    f = ConfigFields(hf, source)
    kind = f.text("model_type", None, allow_none=True)
    if kind != MODEL_TYPE:
        raise ValueError(f"{source}: model_type={kind!r} is not {MODEL_TYPE!r}")
    base = {k: v for k, v in hf.items() if k not in _OWN}
    base["model_type"] = "llama"
    config = llama_config(base, name, max_seq_len=max_seq_len, source=source)
    n_experts = f.integer("num_local_experts")
    top_k = f.integer("num_experts_per_tok", 1)
    if top_k > n_experts:
        raise ValueError(
            f"{source}: num_experts_per_tok must be at most the {n_experts} experts; got {top_k}"
        )
    changes: dict[str, Any] = dict(
        rope_interleaved=True, mlp_kind="moe", mlp_bias=False, n_experts=n_experts, experts_top_k=top_k,
        experts_routing="topk_sigmoid", shared_expert_d_mlp=config.d_mlp, shared_expert_gate=False,
        dense_d_mlp=f.integer("intermediate_size_mlp"), extra={**config.extra, "model_type": MODEL_TYPE},
        **_layer_fields(f, config.n_layers),
    )  # fmt: skip
    try:
        return dataclasses.replace(config, **changes)
    except ValueError as e:
        raise ValueError(f"{source} does not fit headspace: {e}") from None


def llama4_tensors(c: ModelConfig, prefix: str = "model.") -> list[tuple[str, str, tuple[int, ...]]]:
    """(our state-dict name or ``name:part`` of a split tensor, the HF tensor, its shape), every tensor."""
    assert c.n_experts is not None and c.d_mlp is not None and c.dense_d_mlp is not None
    plain = dataclasses.replace(c, qk_norm=None)  # the attention and norms (l2 has no weights)
    out = [(ours, name, shape) for ours, theirs in _tensors(plain, prefix) if ".mlp." not in ours
           for name, shape in theirs]  # fmt: skip
    d, n, dm = c.d_model, c.n_experts, c.d_mlp
    for i in range(c.n_layers):
        p, b = f"{prefix}layers.{i}.feed_forward.", f"blocks.{i}.mlp."
        moe = c.moe_layers is None or i in c.moe_layers
        width = dm if moe else c.dense_d_mlp
        mlp = (b + "shared.", p + "shared_expert.") if moe else (b, p)
        for ours, theirs, shape in (("fc_gate", "gate_proj", (width, d)), ("fc_in", "up_proj", (width, d)),
                                    ("fc_out", "down_proj", (d, width))):  # fmt: skip
            out.append((f"{mlp[0]}{ours}.weight", f"{mlp[1]}{theirs}.weight", shape))
        if moe:
            out.append((b + "router.weight", p + "router.weight", (n, d)))
            out.append((b + "experts:gate_up", p + "experts.gate_up_proj", (n, d, 2 * dm)))
            out.append((b + "experts:down", p + "experts.down_proj", (n, dm, d)))
    return out


def llama4_state_dict(
    t: Mapping[str, Tensor], pieces: list[tuple[str, str, tuple[int, ...]]]
) -> dict[str, Tensor]:
    """HF tensors -> Decoder state dict (float32): q, k, v concatenated into ``qkv_weight``, the fused
    experts split and turned [out, in] (module docstring), everything else as it is."""
    sd: dict[str, Tensor] = {}
    qkv: dict[str, list[Tensor]] = {}
    for ours, theirs, _ in pieces:
        value = t[theirs].float()
        if ours.endswith("experts:gate_up"):
            base, dm = ours[: -len("experts:gate_up")], value.shape[-1] // 2
            sd[base + "experts_gate"] = value[:, :, :dm].transpose(1, 2).contiguous()  # (E, d_mlp, d_model)
            sd[base + "experts_in"] = value[:, :, dm:].transpose(1, 2).contiguous()  # (E, d_mlp, d_model)
        elif ours.endswith("experts:down"):
            sd[ours[: -len("experts:down")] + "experts_out"] = value.transpose(
                1, 2
            ).contiguous()  # (E, d, dm)
        elif ours.endswith("attn.qkv_weight") or ours.endswith("attn.qkv_bias"):
            qkv.setdefault(ours, []).append(value)
        else:
            sd[ours] = value
    for ours, parts in qkv.items():
        sd[ours] = torch.cat(parts)  # ((H + 2 Hkv) dh, ...): q, k, v rows in order
    return sd


Pieces = list[tuple[str, str, tuple[int, ...]]]


def load_llama4(
    folder: str | Path, *, name: str = "", max_seq_len: int | None = None, precision: str = "float32"
) -> PretrainedDecoder:
    """Load a local ``llama4_text`` checkpoint folder (module docstring) onto a headspace Decoder, with
    :func:`~headspace.pretrained.load_llama`'s checks (:func:`load_pieces`)."""
    return load_pieces(folder, llama4_config, llama4_tensors, name=name, max_seq_len=max_seq_len,
                       precision=precision)  # fmt: skip


def load_pieces(
    folder: str | Path,
    read_config: Callable[..., ModelConfig],
    pieces_of: Callable[[ModelConfig, str], Pieces],
    *,
    name: str = "",
    max_seq_len: int | None = None,
    precision: str = "float32",
) -> PretrainedDecoder:
    """A Llama-family checkpoint folder whose config ``read_config(hf, name, max_seq_len=, source=)``
    reads and whose tensors ``pieces_of(config, prefix)`` lists (as :func:`llama4_tensors`), onto a
    Decoder, with :func:`~headspace.pretrained.load_llama`'s checks: the parameter count the config
    implies against the headers, tensor names, shapes and dtypes, NaN/Inf weights."""
    opened = open_family(folder, precision)
    path = opened.path
    config = read_config(opened.hf, name or path.name, max_seq_len=max_seq_len, source=opened.config_file)
    config.extra["source"] = str(path)
    headers = folder_headers(path)
    prefix = _prefix(headers[0].tensors)
    pieces = pieces_of(config, prefix)
    expected = {theirs: shape for _, theirs, shape in pieces}
    fields = (
        f"num_hidden_layers={config.n_layers}, hidden_size={config.d_model}, n_experts={config.n_experts}, "
        f"moe_layers={config.moe_layers}, vocab_size={config.vocab_size}"
    )
    tensors, ignored = read_listed(headers, expected, config, fields, opened.config_file, _ignorable)
    _tied_head(tensors, config, prefix, headers[0].path)
    if config.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    model = _meta_decoder(config)
    model.load_state_dict(llama4_state_dict(tensors, pieces), strict=True, assign=True)
    return _wrap(model, config, folder_tokenizer(path, config.pad_token_id), ignored).to_precision(precision)
