"""Rotary families read as a Llama with named differences: phi3, gemma, olmo, seed_oss, olmo3, exaone4.

Each family's ``config.json`` is read as a Llama-family base config (:func:`~headspace.pretrained.llama.
llama_config` of a ``model_type`` it already knows), then the fields in which the family differs are set
on the :class:`~headspace.ModelConfig`; its tensors are renamed (and split where the family fuses them)
to the Llama names :func:`~headspace.pretrained.llama.llama_expected` lists, so the same checks and the
same Decoder serve. Per family (transformers 5's ``*ForCausalLM``)::

    phi3      a Llama with fused qkv_proj ([W_q; W_k; W_v] rows) and gate_up_proj ([gate; up] rows),
              partial rotary (partial_rotary_factor), LongRoPE (short / long factors), an optional
              sliding window on every layer
    gemma     RMSNorm scale (1 + w), embeddings times sqrt(d_model) (rounded to the dtype, as
              transformers), gelu_pytorch_tanh MLP; no soft-capping, no sandwich norms
    granite   a Llama with four multipliers: embeddings times embedding_multiplier, scores times
              attention_multiplier (not 1 / sqrt(d_head)), each sublayer's output times
              residual_multiplier (folded into o_proj and down_proj), logits / logits_scaling (folded
              into the unembedding, which is then untied: a copy of a tied embedding)
    olmo      a Llama whose norms are LayerNorms without weight or bias (eps 1e-5); clip_qkv refused
    seed_oss  a Llama with separate q/k/v (attention_bias) and output (attention_out_bias) biases
    olmo3     OLMo 2 (norms after the sublayers, QK-norm over all heads) with sliding windows on the
              layers ``layer_types`` names
    exaone4   norms after the sublayers, QK-norm per head; with a sliding window, the sliding layers
              rotate and the full layers have no positions (NoPE)

Rotary scaling of every kind (:mod:`headspace.nn.rope_scaling`) is read from ``rope_parameters`` or the
older ``rope_scaling`` / ``rope_theta`` / ``partial_rotary_factor``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..model.config import ModelConfig
from .family_frame import folder_headers, open_family, read_renamed, tie_differs
from .hf import ConfigFields, folder_tokenizer
from .llama import (
    _ignorable,
    _meta_decoder,
    _wrap,
    llama_config,
    llama_expected,
    llama_state_dict,
)
from .llama_variants import local_rope
from .rope_config import extend_rope
from .wrappers import PretrainedDecoder


def read_rope(hf: Mapping[str, Any], f: ConfigFields) -> tuple[float, dict[str, Any] | None, float]:
    """(rope_theta, scaling or None, rotary fraction) from ``rope_parameters`` or the older keys."""
    key = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
    raw = hf.get(key)
    if raw is not None and not isinstance(raw, dict):
        raise ValueError(f"{f.source}: {key} must be null or an object; got {raw!r:.80}")
    scaling = dict(raw or {})
    fields = ConfigFields(scaling, f"{f.source} {key}") if "rope_theta" in scaling else f
    theta = fields.number("rope_theta", 10000.0, low=0.0, low_open=True)
    scaling.pop("rope_theta", None)
    frac_fields = ConfigFields(scaling, f"{f.source} {key}") if "partial_rotary_factor" in scaling else f
    fraction = frac_fields.number("partial_rotary_factor", 1.0, low=0.0, low_open=True)
    scaling.pop("partial_rotary_factor", None)
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default") and set(scaling) <= {"rope_type", "type"}:
        return theta, None, fraction
    return theta, scaling, fraction


def _base(hf: Mapping[str, Any], model_type: str, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """``hf`` as a plain-rotation config of ``model_type`` (the rotation is set afterwards)."""
    skip = {"rope_parameters", "rope_scaling", "partial_rotary_factor", "layer_types", *drop}
    return {**{k: v for k, v in hf.items() if k not in skip}, "model_type": model_type}


def _layer_types(f: ConfigFields, n_layers: int) -> list[str] | None:
    types = f.hf.get("layer_types")
    if types is None:
        return None
    ok = ("full_attention", "sliding_attention")
    if not isinstance(types, list) or len(types) != n_layers or any(t not in ok for t in types):
        raise ValueError(f"{f.source}: layer_types must list {list(ok)}, one per layer; got {types!r:.120}")
    return ["sliding" if t == "sliding_attention" else "full" for t in types]


# ------------------------------------------------------------------------------------------- families
def _phi3(hf: Mapping[str, Any], f: ConfigFields) -> tuple[dict[str, Any], dict[str, Any]]:
    return _base(hf, "mistral" if hf.get("sliding_window") is not None else "llama"), {}


def _gemma(hf: Mapping[str, Any], f: ConfigFields) -> tuple[dict[str, Any], dict[str, Any]]:
    base = _base(hf, "llama", drop=("hidden_act",))
    base["hidden_act"] = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    d_model = f.integer("hidden_size")
    scale = float(torch.tensor(d_model**0.5, dtype=torch.float32))  # transformers' normalizer, float32
    bias = f.flag("attention_bias", False)
    return base, {"norm_offset": 1.0, "embed_scale": scale, "qkv_bias": bias, "out_bias": bias}


def _seed_oss(hf: Mapping[str, Any], f: ConfigFields) -> tuple[dict[str, Any], dict[str, Any]]:
    over = {"qkv_bias": f.flag("attention_bias", True), "out_bias": f.flag("attention_out_bias", False)}
    return _base(hf, "llama"), {**over, "mlp_bias": f.flag("mlp_bias", False)}


def _olmo3(hf: Mapping[str, Any], f: ConfigFields) -> tuple[dict[str, Any], dict[str, Any]]:
    over: dict[str, Any] = {"norm": "post_sublayer", "qk_norm": "all"}
    n_layers = f.integer("num_hidden_layers")
    types = _layer_types(f, n_layers)
    window = f.integer("sliding_window", None, allow_none=True, minimum=1)
    if types is not None and "sliding" in types and window is not None:
        over.update(sliding_window=window, layer_types=types)
    return _base(hf, "olmo2", drop=("sliding_window",)), over


def _exaone4(hf: Mapping[str, Any], f: ConfigFields) -> tuple[dict[str, Any], dict[str, Any]]:
    over: dict[str, Any] = {"norm": "post_sublayer", "qk_norm": "head", "qkv_bias": False, "out_bias": False}
    n_layers = f.integer("num_hidden_layers")
    window = f.integer("sliding_window", None, allow_none=True, minimum=1)
    types = _layer_types(f, n_layers)
    if window is not None and types is not None:  # transformers: full layers have no rotation then
        over["nope_layers"] = [i for i, t in enumerate(types) if t == "full"]
        if "sliding" in types:
            over.update(sliding_window=window, layer_types=types)
    return _base(hf, "llama", drop=("sliding_window",)), over


def _olmo(hf: Mapping[str, Any], f: ConfigFields) -> tuple[dict[str, Any], dict[str, Any]]:
    if hf.get("clip_qkv") is not None:
        clip = hf["clip_qkv"]
        raise ValueError(
            f"{f.source}: clip_qkv={clip!r:.40} (q, k, v clamped) is not supported (supported: null)"
        )
    # OLMo's LayerNorm has no weight or bias and eps 1e-5 whatever the config says: weights 1, biases 0
    bias = f.flag("attention_bias", False)
    return _base(hf, "llama"), {"norm_kind": "layernorm", "ln_eps": 1e-5, "qkv_bias": bias, "out_bias": bias}


def _olmo_tensors(t: dict[str, Tensor], c: ModelConfig) -> dict[str, Tensor]:
    """OLMo's parameter-free LayerNorms as weight-1 norms (their zero biases come in load_family)."""
    prefix = "" if "embed_tokens.weight" in t else "model."
    ones = torch.ones(c.d_model)  # [d_model]
    names = [f"{prefix}norm.weight"]
    for i in range(c.n_layers):
        names += [
            f"{prefix}layers.{i}.input_layernorm.weight",
            f"{prefix}layers.{i}.post_attention_layernorm.weight",
        ]
    return {**t, **{n: ones.clone() for n in names if n not in t}}


_GRANITE = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")


def _granite(hf: Mapping[str, Any], f: ConfigFields) -> tuple[dict[str, Any], dict[str, Any]]:
    m = {k: f.number(k, 1.0, low=0.0, low_open=True) for k in _GRANITE}
    bias = f.flag("attention_bias", False)
    over = {
        "embed_scale": m["embedding_multiplier"],
        "query_pre_attn_scalar": m["attention_multiplier"] ** -2,  # scores times attention_multiplier
        "tie_embeddings": False,  # the unembedding carries 1 / logits_scaling (granite_tensors)
        "qkv_bias": bias,
        "out_bias": bias,
        "mlp_bias": f.flag("mlp_bias", False),
        "extra": {"granite": m, "tied_checkpoint": f.flag("tie_word_embeddings", False)},
    }
    return _base(hf, "llama"), over


def _granite_tensors(t: dict[str, Tensor], c: ModelConfig) -> dict[str, Tensor]:
    """Granite's residual multiplier folded into what each sublayer writes (o_proj, down_proj: weight
    and bias) and 1 / logits_scaling into the unembedding (a copy of the embedding where tied)."""
    m = c.extra["granite"]
    prefix = "" if "embed_tokens.weight" in t else "model."
    out = dict(t)
    r = m["residual_multiplier"]
    for name, value in t.items():
        if name.endswith(("self_attn.o_proj.weight", "self_attn.o_proj.bias", "mlp.down_proj.weight",
                          "mlp.down_proj.bias")):  # fmt: skip
            out[name] = value * r
    head = t.get("lm_head.weight") if not c.extra["tied_checkpoint"] else None
    embed = t.get(f"{prefix}embed_tokens.weight")
    if head is None and embed is not None:
        head = embed
    if head is not None:
        out["lm_head.weight"] = head / m["logits_scaling"]  # [vocab, d_model]
    return out


def _split_rows(t: Tensor, sizes: list[int]) -> list[Tensor]:
    return list(torch.split(t, sizes, dim=0))  # each [size, ...]


def _phi3_tensors(t: dict[str, Tensor], c: ModelConfig) -> dict[str, Tensor]:
    """Phi-3's fused qkv_proj / gate_up_proj rows split into the Llama tensors."""
    assert c.d_head is not None and c.n_kv_heads is not None and c.d_mlp is not None
    q, kv, dm = c.n_heads * c.d_head, c.n_kv_heads * c.d_head, c.d_mlp
    out: dict[str, Tensor] = {}
    for name, value in t.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            a = name[: -len("qkv_proj.weight")]
            if value.shape[0] == q + 2 * kv:
                for x, part in zip("qkv", _split_rows(value, [q, kv, kv])):
                    out[f"{a}{x}_proj.weight"] = part
                continue
        if name.endswith("mlp.gate_up_proj.weight") and value.shape[0] == 2 * dm:
            m = name[: -len("gate_up_proj.weight")]
            out[m + "gate_proj.weight"], out[m + "up_proj.weight"] = _split_rows(value, [dm, dm])
            continue
        out[name] = value
    return out


def _same(t: dict[str, Tensor], c: ModelConfig) -> dict[str, Tensor]:
    return t


_Reader = Callable[[Mapping[str, Any], ConfigFields], tuple[dict[str, Any], dict[str, Any]]]
_Renamer = Callable[[dict[str, Tensor], ModelConfig], dict[str, Tensor]]
#: model_type -> (config reader, tensor renamer).
FAMILIES: dict[str, tuple[_Reader, _Renamer]] = {
    "phi3": (_phi3, _phi3_tensors),
    "gemma": (_gemma, _same),
    "granite": (_granite, _granite_tensors),
    "olmo": (_olmo, _olmo_tensors),
    "seed_oss": (_seed_oss, _same),
    "olmo3": (_olmo3, _same),
    "exaone4": (_exaone4, _same),
}
#: The ``config.json`` model types of :data:`FAMILIES`.
ROTARY_FAMILY_TYPES = tuple(FAMILIES)


def family_config(
    hf: Mapping[str, Any], name: str = "", *, max_seq_len: int | None = None, source: str = "config.json"
) -> ModelConfig:
    """The :class:`ModelConfig` of a ``config.json`` of one of :data:`FAMILIES` (module docstring).
    Anything the family has that headspace cannot run exactly is refused, naming the field."""
    f = ConfigFields(hf, source)
    kind = f.text("model_type", None, allow_none=True)
    if kind not in FAMILIES:
        raise ValueError(f"{source}: model_type={kind!r} is not supported here; supported: {list(FAMILIES)}")
    base, over = FAMILIES[kind][0](hf, f)
    config = llama_config(base, name, max_seq_len=max_seq_len, source=source)
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        # per-layer-type rope_parameters (OLMo 3): transformers reads only the per-type objects
        hf = {**hf, "rope_parameters": {k: v for k, v in params.items() if isinstance(v, dict)}}
    full, local_theta = local_rope(hf, f, kind)
    theta, scaling, fraction = read_rope(full, f)
    if local_theta is not None and local_theta != theta and "sliding" in over.get("layer_types", ()):
        over["rope_local_theta"] = local_theta
    elif local_theta is not None and local_theta != theta:
        raise ValueError(
            f"{source}: rope_parameters['sliding_attention'] has rope_theta={local_theta} but no layer "
            "slides (sliding_window null): per-type bases without a window are not supported"
        )
    scaling, context = extend_rope(
        scaling, f, config.max_seq_len, max_seq_len, longrope_aliases=kind == "phi3"
    )
    extra = {**config.extra, "model_type": kind, **over.pop("extra", {})}
    if kind == "phi3" and scaling is not None and scaling.get("rope_type") == "longrope":
        # transformers' Phi-3 generate re-runs the prefix once the sequence passes the original length
        extra["recompute_cache_at"] = scaling["original_max_position_embeddings"]
    over = dict(
        over,
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_fraction=fraction,
        max_seq_len=context,
        extra=extra,
    )
    try:
        return dataclasses.replace(config, **over)
    except ValueError as e:
        raise ValueError(f"{source} does not fit headspace: {e}") from None


def load_family(
    folder: str | Path, *, name: str = "", max_seq_len: int | None = None, precision: str = "float32"
) -> PretrainedDecoder:
    """Load a checkpoint folder of one of :data:`FAMILIES` (``config.json`` + safetensors) onto a Decoder.

    The same checks as :func:`~headspace.pretrained.load_llama`: the config field by field
    (:func:`family_config`), missing / unexpected / mis-shaped tensors and dtypes from the safetensors
    headers before any tensor is read (:func:`~.family_frame.read_renamed`), NaN/Inf weights.
    """
    opened = open_family(folder, precision)
    path = opened.path
    config = family_config(opened.hf, name or path.name, max_seq_len=max_seq_len, source=opened.config_file)
    config.extra["source"] = str(path)
    headers = folder_headers(path)
    prefix = "" if "embed_tokens.weight" in headers[0].tensors else "model."
    tied = config.tie_embeddings or bool(config.extra.get("tied_checkpoint"))

    def rename(t: dict[str, Tensor]) -> dict[str, Tensor]:
        if tied and tie_differs(t.pop("lm_head.weight", None), t.get(f"{prefix}embed_tokens.weight")):
            raise ValueError("tie_word_embeddings=true but lm_head.weight differs from the embedding")
        return FAMILIES[str(config.extra["model_type"])][1](t, config)

    tensors, ignored = read_renamed(headers, rename, llama_expected(config, prefix), _ignorable)
    tokenizer = folder_tokenizer(path, config.pad_token_id)
    sd = llama_state_dict(tensors, config, prefix)
    model = _meta_decoder(config)
    for key, param in model.state_dict().items():  # a LayerNorm's bias the checkpoint has not: 0 (OLMo)
        if key not in sd and key.endswith(".bias") and key.rsplit(".", 2)[-2].startswith("ln"):
            sd[key] = torch.zeros(param.shape)
    model.load_state_dict(sd, strict=True, assign=True)
    return _wrap(model, config, tokenizer, ignored).to_precision(precision)
