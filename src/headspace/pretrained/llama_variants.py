"""What Gemma 2, Gemma 3, Qwen3, OLMo 2, SmolLM3 and sliding-window Mistral / Qwen2 add to a Llama.

:func:`headspace.pretrained.load_llama` reads these ``config.json`` model types on the same Decoder;
this module says, per model type, which :class:`~headspace.ModelConfig` fields differ from a Llama's
and which tensors the checkpoint holds beside a Llama's (transformers 5's ``*ForCausalLM``)::

    gemma2       h = x + N_post(Attn(N_in(x)))  (sandwich norms, every norm (1 + w))
                 out = h + N_post_ff(MLP(N_pre_ff(h)))
                 e = E_tok[t] * sqrt(d_model); scale 1/sqrt(query_pre_attn_scalar);
                 scores s -> 50 tanh(s / 50), logits -> 30 tanh(logits / 30); sliding / full layers
    gemma3_text  as gemma2, plus QK-norm (1 + w) per head; RoPE base 10,000 on sliding layers and
                 rope_theta (1e6) on full ones; no soft-capping unless the config asks
    qwen3        a Llama with QK-norm per head (RMSNorm over d_head of each head's q and k, before RoPE)
    olmo2        h = x + N_1(Attn(x)), out = h + N_2(MLP(h)) (norms after the sublayers only);
                 QK-norm over all heads at once (q: n_heads d_head features, k: n_kv_heads d_head)
    smollm3      a Llama whose ``no_rope_layers[i] == 0`` layers have no rotary positions (NoPE)
    mistral      with an active ``sliding_window``: every layer sliding (Qwen2 / Qwen3 / SmolLM3 with
                 ``use_sliding_window``: the layers ``layer_types`` names)

The sliding window is exact: query ``i`` sees key ``j`` iff ``i - window < j <= i`` (transformers'
``sliding_window_causal_mask_function``), positions counted over the whole (padded) sequence.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .hf import ConfigFields

#: ``config.json`` model types beyond Llama / Mistral / Qwen2 that :func:`load_llama` reads.
VARIANT_MODEL_TYPES = ("gemma2", "gemma3_text", "qwen3", "olmo2", "smollm3")
#: transformers' defaults where config.json is silent.
VARIANT_CONTEXT = {"gemma2": 8192, "gemma3_text": 131072, "qwen3": 32768, "olmo2": 4096, "smollm3": 32768}
_GEMMA = ("gemma2", "gemma3_text")
_LAYER_TYPES = ("full_attention", "sliding_attention")
# the model types whose sliding window is switched by use_sliding_window (off by default)
_WINDOW_SWITCHED = ("qwen2", "qwen3", "smollm3")


def hidden_act_key(hf: Mapping[str, Any], kind: str) -> str:
    """The config key that names the MLP activation (Gemma's ``hidden_activation``, else ``hidden_act``)."""
    return "hidden_activation" if kind in _GEMMA and hf.get("hidden_activation") is not None else "hidden_act"


def windows(f: ConfigFields, kind: str, n_layers: int, context: int) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types as "sliding"/"full") of a config, or (None, None) when no layer's
    window can change a result within ``context`` tokens (a window >= the context sees every key).
    Gemma 3 keeps its layer types (they pick each layer's RoPE base); a window of its >= ``context``
    becomes ``context``, which sees the same keys.

    ``layer_types`` (transformers 5: "sliding_attention" / "full_attention") says which layers slide;
    without it Mistral slides on every layer, Qwen2 from ``max_window_layers`` on, Gemma 2 on even
    layers, Gemma 3 on five of every six.
    """
    types = f.hf.get("layer_types")
    if types is not None and (not isinstance(types, list) or any(t not in _LAYER_TYPES for t in types)):
        raise ValueError(f"{f.source}: layer_types must list {list(_LAYER_TYPES)}; got {types!r:.120}")
    window = f.integer("sliding_window", None, allow_none=True, minimum=1)
    if kind in ("llama", "olmo2") or window is None:
        return None, None  # (transformers' Llama and OLMo 2 attention has no window, whatever the config)
    if kind in _WINDOW_SWITCHED and not f.flag("use_sliding_window", False):
        return None, None  # transformers sets sliding_window = None then
    if types is None:
        if kind == "smollm3":  # transformers' SmolLM3Config: the layers without RoPE slide
            types = ["full_attention" if r else "sliding_attention" for r in rope_flags(f, n_layers)]
        elif kind in _WINDOW_SWITCHED:
            start = f.integer("max_window_layers", 28, minimum=0)
            types = ["sliding_attention" if i >= start else "full_attention" for i in range(n_layers)]
        elif kind == "gemma2":
            types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
        elif kind == "gemma3_text":
            every = f.integer("sliding_window_pattern", f.hf.get("_sliding_window_pattern", 6), minimum=1)
            types = [
                "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n_layers)
            ]
        else:
            types = ["sliding_attention"] * n_layers
    if len(types) != n_layers:
        raise ValueError(
            f"{f.source}: layer_types must have num_hidden_layers={n_layers} entries; got {len(types)}"
        )
    ours = ["sliding" if t == "sliding_attention" else "full" for t in types]
    if "sliding" not in ours or (window >= context and kind != "gemma3_text"):
        return None, None  # (Gemma 3 keeps its layer types: they pick each layer's RoPE base)
    # a window of at least the context sees every earlier key of a sequence that fits the position
    # table: Gemma 3's becomes the context itself, the same keys seen (sliding_window: 2**63 would
    # otherwise reach the native step, whose windows are 64-bit ints)
    return min(window, context), ours


def local_rope(hf: Mapping[str, Any], f: ConfigFields, kind: str) -> tuple[dict[str, Any], float | None]:
    """Gemma 3's RoPE: (the full layers' settings as one ``rope_parameters`` object, the sliding layers'
    base or None). transformers 5 writes ``rope_parameters`` = {"full_attention": {...},
    "sliding_attention": {...}}; older configs ``rope_theta`` + ``rope_local_base_freq``. The sliding
    layers' rotation must be plain (rope_type default), as transformers' Gemma 3 has it."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        unknown = sorted(set(params) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"{f.source}: rope_parameters has unknown layer types {unknown}")
        full = dict(params.get("full_attention") or {})
        sliding = dict(params.get("sliding_attention") or {})
        if sliding.get("rope_type", "default") != "default" or set(sliding) - {"rope_type", "rope_theta"}:
            raise ValueError(
                f"{f.source}: rope_parameters['sliding_attention'] must be a plain rotation "
                f"({{'rope_type': 'default', 'rope_theta': ...}}); got {sliding!r:.120}"
            )
        local = ConfigFields(sliding, f"{f.source} rope_parameters['sliding_attention']")
        theta = local.number("rope_theta", 10000.0, low=0.0, low_open=True) if sliding else None
        return {**dict(hf), "rope_parameters": full or None}, theta
    if kind == "gemma3_text":
        return dict(hf), f.number("rope_local_base_freq", 10000.0, low=0.0, low_open=True)
    return dict(hf), None


def _optional_positive(f: ConfigFields, key: str) -> float | None:
    """``config[key]``: null / absent (None) or a finite number > 0."""
    return None if f.hf.get(key) is None else f.number(key, low=0.0, low_open=True)


def rope_flags(f: ConfigFields, n_layers: int) -> list[int]:
    """SmolLM3's ``no_rope_layers`` (1: the layer rotates, 0: NoPE), one per layer; where the config has
    none, transformers' default: every ``no_rope_layer_interval``-th layer (default 4) without RoPE."""
    flags = f.hf.get("no_rope_layers")
    if flags is None:
        every = f.integer("no_rope_layer_interval", 4)
        return [int((i + 1) % every != 0) for i in range(n_layers)]
    if not isinstance(flags, list) or any(v not in (0, 1) or isinstance(v, bool) for v in flags):
        raise ValueError(f"{f.source}: no_rope_layers must list 0 / 1 per layer; got {flags!r:.120}")
    if len(flags) != n_layers:
        raise ValueError(
            f"{f.source}: no_rope_layers must have num_hidden_layers={n_layers} entries; got {len(flags)}"
        )
    return flags


def variant_fields(f: ConfigFields, kind: str, d_model: int, n_layers: int) -> dict[str, Any]:
    """The :class:`~headspace.ModelConfig` fields (beyond the windows and RoPE) in which ``kind``
    differs from a Llama: norms, QK-norm, soft-capping, embedding and score scales, biases, NoPE."""
    out: dict[str, Any] = {}
    if kind in ("gemma2", "gemma3_text", "qwen3", "olmo2", "smollm3"):
        bias = f.flag("attention_bias", False)
        out.update(qkv_bias=bias, out_bias=bias)
    if kind == "smollm3":
        out["mlp_bias"] = f.flag("mlp_bias", False)
    if kind in _GEMMA:
        if f.hf.get("use_bidirectional_attention") is not None and f.flag("use_bidirectional_attention"):
            raise ValueError(f"{f.source}: use_bidirectional_attention=true is not supported (causal only)")
        out.update(
            norm="sandwich",
            norm_offset=1.0,
            embed_scale=math.sqrt(d_model),
            query_pre_attn_scalar=f.number("query_pre_attn_scalar", 256, low=0.0, low_open=True),
            attn_softcap=_optional_positive(f, "attn_logit_softcapping"),
            final_softcap=_optional_positive(f, "final_logit_softcapping"),
        )
    if kind in ("gemma3_text", "qwen3"):
        out["qk_norm"] = "head"
    if kind == "olmo2":
        out.update(norm="post_sublayer", qk_norm="all")
    if kind == "smollm3":
        out["nope_layers"] = [i for i, v in enumerate(rope_flags(f, n_layers)) if v == 0]
    return out


def extra_tensors(
    kind_norm: str, qk_norm: str | None, p: str, b: str, widths: tuple[int, int, int]
) -> list[tuple[str, str, tuple[int, ...]]]:
    """(Decoder state-dict name, Hugging Face name, shape) of one layer's norms: ``p`` the HF layer prefix,
    ``b`` ours, ``widths`` (d_model, q width, k width) of the QK-norm weights."""
    d, wq, wk = widths
    if kind_norm == "sandwich":
        norms = [
            ("ln1", "input_layernorm"),
            ("ln_attn_out", "post_attention_layernorm"),
            ("ln2", "pre_feedforward_layernorm"),
            ("ln_mlp_out", "post_feedforward_layernorm"),
        ]
    elif kind_norm == "post_sublayer":
        norms = [("ln1", "post_attention_layernorm"), ("ln2", "post_feedforward_layernorm")]
    else:
        norms = [("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm")]
    out = [(f"{b}{ours}.weight", f"{p}{theirs}.weight", (d,)) for ours, theirs in norms]
    if qk_norm is not None:
        out.append((f"{b}attn.q_norm.weight", f"{p}self_attn.q_norm.weight", (wq,)))
        out.append((f"{b}attn.k_norm.weight", f"{p}self_attn.k_norm.weight", (wk,)))
    return out
