"""The per-layer fields of a :class:`~headspace.model.config.ModelConfig` that came with Llama 4.

* ``layer_types`` ``"chunked"`` with ``attention_chunk``: chunked attention on those layers
  (``AttentionSpec.chunk``, :func:`headspace.nn.masks.chunk_mask`);
* ``attn_temperature`` ``[floor_scale, attn_scale]``: the query temperature of the NoPE layers
  (``nope_layers``; ``AttentionSpec.temperature``, :mod:`headspace.attention.temperature`);
* ``qk_norm="l2"``: the weightless QK-norm, on the rotary layers only (transformers' Llama 4 has none on
  its NoPE layers);
* ``moe_layers`` with ``dense_d_mlp``: a mixture of experts on those layers only, a gated MLP of width
  ``dense_d_mlp`` on the others (``interleave_moe_layer_step``); ``shared_expert_gate`` False: the shared
  expert is added without a gate;
* ``diff_attention`` (DiffLlama): differential attention on every layer, ``lambda_init`` by the layer's
  index (``AttentionSpec.differential``, :mod:`headspace.attention.differential`).

:func:`check_llama4_fields` checks them (one-line ``ValueError`` naming the field);
:func:`attention_fields` and :func:`mlp_fields` give one layer's changes to its block description.
"""

from __future__ import annotations

from typing import Any

from ..attention.differential import lambda_init_of
from ..core.checks import is_int, is_number


def check_llama4_fields(c: Any) -> None:
    """The Llama 4 fields of config ``c`` (module docstring), each checked; normalises the lists."""
    chunk = c.attention_chunk
    if chunk is not None and (not is_int(chunk) or chunk < 1):
        raise ValueError(f"ModelConfig.attention_chunk must be None or an int >= 1; got {chunk!r}")
    if "chunked" in (c.layer_types or ()) and chunk is None:
        raise ValueError("ModelConfig.layer_types has 'chunked' layers but attention_chunk is None")
    t = c.attn_temperature
    if t is not None:
        ok = isinstance(t, (list, tuple)) and len(t) == 2 and all(is_number(v) for v in t)
        if not ok or not t[0] > 0 or not all(abs(float(v)) < float("inf") for v in t):
            raise ValueError(
                "ModelConfig.attn_temperature must be None or [floor_scale > 0, attn_scale], finite; "
                f"got {t!r:.80}"
            )
        c.attn_temperature = [float(t[0]), float(t[1])]
    layers = c.moe_layers
    if layers is not None:
        if not isinstance(layers, list) or any(not is_int(i) or not 0 <= i < c.n_layers for i in layers):
            raise ValueError(
                "ModelConfig.moe_layers must be None or a list of layer indices in "
                f"[0, n_layers={c.n_layers}); "
                f"got {layers!r:.120}"
            )
        if c.mlp_kind != "moe":
            raise ValueError(f"ModelConfig.moe_layers needs mlp_kind='moe'; got mlp_kind={c.mlp_kind!r}")
        c.moe_layers = sorted(set(layers))
    dense = c.dense_d_mlp
    if dense is not None and (not is_int(dense) or dense < 1):
        raise ValueError(f"ModelConfig.dense_d_mlp must be None or a positive int; got {dense!r}")
    if layers is not None and len(layers) < c.n_layers and dense is None:
        raise ValueError("ModelConfig.moe_layers leaves dense layers: set dense_d_mlp, their MLP's width")
    if not isinstance(c.diff_attention, bool):
        raise ValueError(f"ModelConfig.diff_attention must be a bool; got {c.diff_attention!r}")
    if not isinstance(c.shared_expert_gate, bool):
        raise ValueError(f"ModelConfig.shared_expert_gate must be a bool; got {c.shared_expert_gate!r}")


def attention_fields(c: Any, layer: int) -> dict[str, Any]:
    """Layer ``layer``'s ``AttentionSpec`` fields ``differential``, ``chunk``, ``temperature`` and
    ``qk_norm`` (config ``c``)."""
    nope = c.positions == "rotary" and layer in c.nope_layers
    t = c.attn_temperature
    return {
        "differential": lambda_init_of(layer) if c.diff_attention else None,
        "chunk": c.attention_chunk if c.layer_types[layer] == "chunked" else None,
        "temperature": (t[0], t[1]) if t is not None and nope else None,
        "qk_norm": None if c.qk_norm == "l2" and (nope or c.positions != "rotary") else c.qk_norm,
    }


def mlp_fields(c: Any, layer: int) -> dict[str, Any]:
    """Layer ``layer``'s ``MLPSpec`` fields where it is a dense layer of a mixture-of-experts model (a
    gated MLP of width ``dense_d_mlp``), else ``{}``."""
    if c.moe_layers is None or layer in c.moe_layers:
        return {}
    return dict(kind="gated", d_mlp=c.dense_d_mlp, n_experts=None, top_k=None, d_shared=None,
                routing="softmax_topk", router_bias=False, swiglu_limit=None, swiglu_alpha=None,
                norm_topk=False, shared_gate=True)  # fmt: skip
