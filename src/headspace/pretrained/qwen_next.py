"""Qwen3-Next and Qwen3.5 (text) checkpoints onto a headspace Decoder: hybrids of gated softmax attention
and Gated DeltaNet layers.

Per ``layer_types``, a block mixes tokens by

* ``"full_attention"``: Qwen3 attention (RMSNorm QK-norm per head, partial rotary) whose output is gated
  elementwise, ``z_h * sigmoid(x W_G[h])`` before W_O (:mod:`headspace.attention.gates`);
  ``self_attn.q_proj`` [n_heads 2 d_head, d_model] holds q and the gate interleaved per head (rows
  ``[q_0, gate_0, q_1, gate_1, ...]``, d_head each): split into ``qkv_weight``'s q rows and
  ``gate_weight``;
* ``"linear_attention"``: a Gated DeltaNet (:mod:`headspace.attention.delta_net`). Qwen3.5 stores its
  projections apart (``linear_attn.in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``);
  Qwen3-Next groups them per key head (``in_proj_qkvz`` rows ``[q_g, k_g, v_g, z_g]`` and ``in_proj_ba``
  rows ``[b_g, a_g]`` for each key head g), regrouped here into q, k, v of every head in turn.

Every RMSNorm scales by ``1 + w`` (``norm_offset=1``) but the DeltaNet's gated norm (``w``). Qwen3-Next's
MLPs are mixtures of experts with a shared expert gated by ``sigmoid(x w_sg)`` (saved one tensor per
expert); Qwen3.5's are dense. Qwen3.5's multimodal rotation (``mrope_section``) gives a text-only input
the plain rotation. Refused by name: a ``hidden_act`` other than silu, a rope type other than default,
dense layers among Qwen3-Next's sparse ones (``mlp_only_layers``, ``decoder_sparse_step`` != 1),
``attention_bias``; and the same untrusted-folder checks as :func:`~headspace.pretrained.load_llama`.
"""

from __future__ import annotations

from collections.abc import Mapping
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
from .llama import _ignorable, _meta_decoder, _prefix, _tied_head, _wrap
from .wrappers import PretrainedDecoder

#: The ``config.json`` model types read here.
QWEN_NEXT_MODEL_TYPES = ("qwen3_next", "qwen3_5_text")
_LAYER_TYPES = {"linear_attention": "linear", "full_attention": "full"}


def _rope(f: ConfigFields) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from ``rope_parameters`` (or the top level); only the default
    rope type is read."""
    params = f.hf.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"{f.source}: rope_parameters must be null or an object; got {params!r:.80}")
    inner = ConfigFields(dict(params), f"{f.source} rope_parameters")
    kind = params.get("rope_type", "default")
    if kind != "default":
        raise ValueError(f"{f.source}: rope_parameters.rope_type={kind!r} is not supported (default only)")
    theta = (inner if "rope_theta" in params else f).number("rope_theta", 10000.0, low=0.0, low_open=True)
    partial_from = inner if "partial_rotary_factor" in params else f
    partial = partial_from.number("partial_rotary_factor", 1.0, low=0.0, low_open=True)
    return theta, partial


def _experts(f: ConfigFields, kind: str) -> dict[str, Any]:
    """Qwen3-Next's mixture-of-experts fields (every layer sparse), or the dense MLP's (none)."""
    if kind != "qwen3_next" or f.integer("num_experts", 0, minimum=0) == 0:
        return {"mlp_kind": "gated"}
    if f.hf.get("mlp_only_layers"):
        raise ValueError(
            f"{f.source}: mlp_only_layers={f.hf['mlp_only_layers']!r:.80} is not supported "
            "(every layer sparse)"
        )
    if f.integer("decoder_sparse_step", 1) != 1:
        raise ValueError(f"{f.source}: decoder_sparse_step must be 1 (every layer sparse)")
    n = f.integer("num_experts")
    top_k = f.integer("num_experts_per_tok", 10)
    if top_k > n:
        raise ValueError(f"{f.source}: num_experts_per_tok must be at most the {n} experts; got {top_k}")
    shared = f.integer("shared_expert_intermediate_size", 0, minimum=0) or None
    return dict(
        mlp_kind="moe",
        n_experts=n,
        experts_top_k=top_k,
        experts_norm_topk=f.flag("norm_topk_prob", True),
        shared_expert_d_mlp=shared,
        d_mlp=f.integer("moe_intermediate_size"),
    )


def qwen_next_config(
    hf: Mapping[str, Any], name: str = "", *, max_seq_len: int | None = None, source: str = "config.json"
) -> ModelConfig:
    """A :class:`ModelConfig` from a Qwen3-Next or Qwen3.5 text ``config.json`` dict (module docstring);
    a field headspace cannot represent is refused by name."""
    if not isinstance(hf, Mapping):
        raise TypeError(f"hf must be a dict (config.json); got {type(hf).__name__}")
    f = ConfigFields(hf, source)
    kind = f.text("model_type", None, allow_none=True)
    if kind not in QWEN_NEXT_MODEL_TYPES:
        raise ValueError(f"{source}: model_type={kind!r} is not one read here: {list(QWEN_NEXT_MODEL_TYPES)}")
    if f.text("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act={hf['hidden_act']!r} is not supported (silu only)")
    if f.flag("attention_bias", False):
        raise ValueError(f"{source}: attention_bias=true is not supported (false only)")
    n_layers = f.integer("num_hidden_layers")
    types = hf.get("layer_types")
    if not isinstance(types, list) or len(types) != n_layers or any(t not in _LAYER_TYPES for t in types):
        raise ValueError(
            f"{source}: layer_types must list {list(_LAYER_TYPES)}, one per layer; got {types!r:.120}"
        )
    theta, partial = _rope(f)
    context = f.integer("max_position_embeddings", 32768) if max_seq_len is None else max_seq_len
    delta = dict(
        n_k_heads=f.integer("linear_num_key_heads"),
        n_v_heads=f.integer("linear_num_value_heads"),
        d_k=f.integer("linear_key_head_dim"),
        d_v=f.integer("linear_value_head_dim"),
        conv_kernel=f.integer("linear_conv_kernel_dim", 4),
    )
    kw: dict[str, Any] = dict(
        arch="decoder",
        vocab_size=f.integer("vocab_size"),
        d_model=f.integer("hidden_size"),
        n_layers=n_layers,
        n_heads=f.integer("num_attention_heads"),
        n_kv_heads=f.integer("num_key_value_heads"),
        d_head=f.integer("head_dim"),
        d_mlp=f.integer("intermediate_size"),
        max_seq_len=context,
        act="silu",
        norm="pre",
        ln_eps=f.number("rms_norm_eps", 1e-6, low=0.0, low_open=True),
        bias=False,
        type_vocab_size=0,
        tie_embeddings=f.flag("tie_word_embeddings", False),
        embed_ln=False,
        final_ln=True,
        name=name,
        extra={"model_type": kind},
        positions="rotary",
        rope_theta=theta,
        rotary_fraction=partial,
        norm_kind="rmsnorm",
        qk_norm="head",
        norm_offset=1.0,
        attn_gate="elementwise",
        delta_net=delta,
        layer_types=[_LAYER_TYPES[t] for t in types],
    )
    kw.update(_experts(f, kind))
    try:
        return ModelConfig(**kw)
    except ValueError as e:
        raise ValueError(f"{source} does not fit headspace: {e}") from None


def _delta_shapes(c: ModelConfig, kind: str, p: str) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet layer's HF tensors (name under prefix ``p``, shape)."""
    assert c.delta_net is not None
    s = c.delta_net
    d, kd, vd, hv = c.d_model, s["n_k_heads"] * s["d_k"], s["n_v_heads"] * s["d_v"], s["n_v_heads"]
    a = p + "linear_attn."
    out = {
        a + "conv1d.weight": (2 * kd + vd, 1, s["conv_kernel"]),
        a + "dt_bias": (hv,),
        a + "A_log": (hv,),
        a + "norm.weight": (s["d_v"],),
        a + "out_proj.weight": (d, vd),
    }
    if kind == "qwen3_next":
        out.update({a + "in_proj_qkvz.weight": (2 * kd + 2 * vd, d), a + "in_proj_ba.weight": (2 * hv, d)})
    else:
        out.update(
            {
                a + "in_proj_qkv.weight": (2 * kd + vd, d),
                a + "in_proj_z.weight": (vd, d),
                a + "in_proj_b.weight": (hv, d),
                a + "in_proj_a.weight": (hv, d),
            }
        )
    return out


def _mlp_shapes(c: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """A layer's MLP tensors: the dense gated MLP, or the router, each expert and the shared expert."""
    d, dm, m = c.d_model, c.d_mlp, p + "mlp."
    assert dm is not None
    if c.mlp_kind != "moe":
        return {
            m + "gate_proj.weight": (dm, d),
            m + "up_proj.weight": (dm, d),
            m + "down_proj.weight": (d, dm),
        }
    assert c.n_experts is not None
    out: dict[str, tuple[int, ...]] = {m + "gate.weight": (c.n_experts, d)}
    for e in range(c.n_experts):
        x = f"{m}experts.{e}."
        out.update(
            {x + "gate_proj.weight": (dm, d), x + "up_proj.weight": (dm, d), x + "down_proj.weight": (d, dm)}
        )
    if c.shared_expert_d_mlp is not None:
        ds, x = c.shared_expert_d_mlp, m + "shared_expert."
        out.update(
            {
                x + "gate_proj.weight": (ds, d),
                x + "up_proj.weight": (ds, d),
                x + "down_proj.weight": (d, ds),
                m + "shared_expert_gate.weight": (1, d),
            }
        )
    return out


def qwen_next_tensors(c: ModelConfig, kind: str, prefix: str = "model.") -> dict[str, tuple[int, ...]]:
    """Every HF tensor (name: shape) a checkpoint of config ``c`` holds (module docstring)."""
    assert c.d_head is not None and c.n_kv_heads is not None and c.layer_types is not None
    d, q, kv, dh = c.d_model, c.n_heads * c.d_head, c.n_kv_heads * c.d_head, c.d_head
    out: dict[str, tuple[int, ...]] = {f"{prefix}embed_tokens.weight": (c.vocab_size, d)}
    for i, t in enumerate(c.layer_types):
        p = f"{prefix}layers.{i}."
        if t == "linear":
            out.update(_delta_shapes(c, kind, p))
        else:
            a = p + "self_attn."
            out.update(
                {
                    a + "q_proj.weight": (2 * q, d),
                    a + "k_proj.weight": (kv, d),
                    a + "v_proj.weight": (kv, d),
                    a + "o_proj.weight": (d, q),
                    a + "q_norm.weight": (dh,),
                    a + "k_norm.weight": (dh,),
                }
            )
        out.update(_mlp_shapes(c, p))
        out.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)})
    out[f"{prefix}norm.weight"] = (d,)
    if not c.tie_embeddings:
        out["lm_head.weight"] = (c.vocab_size, d)
    return out


def _delta_state(t: Mapping[str, Tensor], c: ModelConfig, kind: str, p: str, b: str) -> dict[str, Tensor]:
    """A Gated DeltaNet layer's HF tensors -> the :class:`~headspace.attention.delta_net.GatedDeltaNet`'s."""
    assert c.delta_net is not None
    s, a = c.delta_net, p + "linear_attn."
    hk, dk, dv, r = s["n_k_heads"], s["d_k"], s["d_v"], s["n_v_heads"] // s["n_k_heads"]
    if kind == "qwen3_next":
        w = t[a + "in_proj_qkvz.weight"].view(hk, 2 * dk + 2 * r * dv, -1)  # (Hk, [q k v z] of head g, d)
        qw, kw, vw, zw = torch.split(w, [dk, dk, r * dv, r * dv], dim=1)
        ba = t[a + "in_proj_ba.weight"].view(hk, 2 * r, -1)  # (Hk, [b a] of head g, d)
        flat = [x.reshape(-1, x.shape[-1]) for x in (qw, kw, vw, zw, ba[:, :r], ba[:, r:])]  # (rows, d) each
        qkv, z, bw, aw = torch.cat(flat[:3]), flat[3], flat[4], flat[5]
    else:
        qkv, z = t[a + "in_proj_qkv.weight"], t[a + "in_proj_z.weight"]
        bw, aw = t[a + "in_proj_b.weight"], t[a + "in_proj_a.weight"]
    out = {
        "in_qkv.weight": qkv,
        "in_z.weight": z,
        "in_b.weight": bw,
        "in_a.weight": aw,
        "conv_weight": t[a + "conv1d.weight"][:, 0],
        "dt_bias": t[a + "dt_bias"],
        "A_log": t[a + "A_log"],
        "norm_weight": t[a + "norm.weight"],
        "out_proj.weight": t[a + "out_proj.weight"],
    }
    return {f"{b}attn.{k}": v.contiguous() for k, v in out.items()}


def _attention_state(t: Mapping[str, Tensor], c: ModelConfig, p: str, b: str) -> dict[str, Tensor]:
    """A gated softmax layer's HF tensors -> :class:`~headspace.MultiHeadAttention`'s (q and the gate
    de-interleaved from ``q_proj``)."""
    assert c.d_head is not None
    a = p + "self_attn."
    qg = t[a + "q_proj.weight"].view(c.n_heads, 2, c.d_head, -1)  # (H, [q, gate], dh, d)
    q, gate = qg[:, 0].reshape(c.n_heads * c.d_head, -1), qg[:, 1].reshape(c.n_heads * c.d_head, -1)
    return {
        b + "attn.qkv_weight": torch.cat(
            [q, t[a + "k_proj.weight"], t[a + "v_proj.weight"]]
        ),  # ((H + 2 Hkv) dh, d)
        b + "attn.gate_weight": gate.contiguous(),  # (H dh, d)
        b + "attn.o_weight": t[a + "o_proj.weight"],
        b + "attn.q_norm.weight": t[a + "q_norm.weight"],
        b + "attn.k_norm.weight": t[a + "k_norm.weight"],
    }


def _mlp_state(t: Mapping[str, Tensor], c: ModelConfig, p: str, b: str) -> dict[str, Tensor]:
    """A layer's MLP tensors -> the block's ``mlp`` state (experts stacked [n_experts, out, in])."""
    m, o = p + "mlp.", b + "mlp."
    names = (("fc_gate", "gate_proj"), ("fc_in", "up_proj"), ("fc_out", "down_proj"))
    if c.mlp_kind != "moe":
        return {f"{o}{ours}.weight": t[f"{m}{theirs}.weight"] for ours, theirs in names}
    assert c.n_experts is not None
    out = {o + "router.weight": t[m + "gate.weight"]}
    for ours, theirs in (
        ("experts_gate", "gate_proj"),
        ("experts_in", "up_proj"),
        ("experts_out", "down_proj"),
    ):
        out[o + ours] = torch.stack([t[f"{m}experts.{e}.{theirs}.weight"] for e in range(c.n_experts)])
    if c.shared_expert_d_mlp is not None:
        for ours, theirs in names:
            out[f"{o}shared.{ours}.weight"] = t[f"{m}shared_expert.{theirs}.weight"]
        out[o + "shared_gate.weight"] = t[m + "shared_expert_gate.weight"]
    return out


def qwen_next_state_dict(
    t: Mapping[str, Tensor], c: ModelConfig, kind: str, prefix: str
) -> dict[str, Tensor]:
    """HF tensors (float32) -> the Decoder's state dict (module docstring)."""
    assert c.layer_types is not None
    sd = {"tok_embed.weight": t[f"{prefix}embed_tokens.weight"], "ln_final.weight": t[f"{prefix}norm.weight"]}
    if not c.tie_embeddings:
        sd["lm_head.weight"] = t["lm_head.weight"]
    for i, kind_i in enumerate(c.layer_types):
        p, b = f"{prefix}layers.{i}.", f"blocks.{i}."
        sd.update(_delta_state(t, c, kind, p, b) if kind_i == "linear" else _attention_state(t, c, p, b))
        sd.update(_mlp_state(t, c, p, b))
        sd[b + "ln1.weight"] = t[p + "input_layernorm.weight"]
        sd[b + "ln2.weight"] = t[p + "post_attention_layernorm.weight"]
    return sd


def load_qwen_next(
    folder: str | Path, *, name: str = "", max_seq_len: int | None = None, precision: str = "float32"
) -> PretrainedDecoder:
    """Load a local Qwen3-Next or Qwen3.5 text checkpoint folder onto a headspace Decoder (module
    docstring), with :func:`~headspace.pretrained.load_llama`'s checks: the parameter count the config
    implies against the headers, tensor names, shapes and dtypes, NaN/Inf weights."""
    opened = open_family(folder, precision)
    path = opened.path
    config = qwen_next_config(
        opened.hf, name=name or path.name, max_seq_len=max_seq_len, source=opened.config_file
    )
    config.extra["source"] = str(path)
    kind = config.extra["model_type"]
    headers = folder_headers(path)
    prefix = _prefix(headers[0].tensors)
    expected = qwen_next_tensors(config, kind, prefix)
    fields = (
        f"num_hidden_layers={config.n_layers}, hidden_size={config.d_model}, vocab_size={config.vocab_size}"
    )
    tensors, ignored = read_listed(headers, expected, config, fields, opened.config_file, _ignorable)
    _tied_head(tensors, config, prefix, headers[0].path)
    sd = qwen_next_state_dict({k: v.float() for k, v in tensors.items()}, config, kind, prefix)
    model = _meta_decoder(config)
    model.load_state_dict(sd, strict=True, assign=True)
    tokenizer = folder_tokenizer(path, config.pad_token_id)
    return _wrap(model, config, tokenizer, ignored).to_precision(precision)
