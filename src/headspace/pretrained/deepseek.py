"""DeepSeek V2 / V3 checkpoints (``model_type`` ``deepseek_v2``, ``deepseek_v3``) onto a headspace Decoder.

Every block is pre-norm RMSNorm with multi-head latent attention
(:class:`~headspace.attention.latent.LatentAttention`, its ``AttentionSpec.latent``; the tensors keep
transformers' names under ``self_attn.``); the first ``first_k_dense_replace`` blocks have a dense
SwiGLU MLP of width ``intermediate_size``, the others a mixture of ``n_routed_experts`` experts of
width ``moe_intermediate_size`` with ``n_shared_experts`` ungated shared experts (one gated MLP of
``n_shared_experts * moe_intermediate_size``)::

    deepseek_v3   sigmoid router with e_score_correction_bias, group-limited (n_group, topk_group),
                  norm_topk_prob, routed_scaling_factor ("sigmoid_group_topk"); rope_interleave
    deepseek_v2   softmax router, topk_method "greedy" ("softmax_topk") or "group_limited_greedy"
                  ("softmax_group_topk"), routed_scaling_factor, never renormalised; the query latent
                  may be absent (q_lora_rank null: q_proj); RoPE on interleaved pairs

RoPE rotates the ``qk_rope_head_dim`` last features of q and the shared key part; a YaRN rotation
(``rope_parameters`` type yarn) also multiplies the softmax scale by ``mscale(factor, mscale_all_dim)
** 2`` as transformers does. The model's ``ModelConfig`` describes the embeddings, norms and rotation
(``d_head`` is ``qk_rope_head_dim``, the rotated width; ``d_mlp`` the dense width) and keeps the
DeepSeek fields in ``extra["deepseek"]``; each block's true description is ``block.spec``. Refused by
name: ``num_key_value_heads`` other than ``num_attention_heads`` is ignored as transformers ignores it
(MLA has one latent), ``mlp_bias`` true, an unknown ``topk_method``, ``n_routed_experts`` not divisible
by ``n_group``. The same untrusted-folder checks as :func:`~headspace.pretrained.load_llama`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..attention.latent import yarn_mscale
from ..model.block import TransformerBlock
from ..model.config import ModelConfig
from ..nn.spec import BlockSpec, LatentSpec, MLPSpec
from .family_frame import folder_headers, open_family, read_listed
from .hf import (
    ConfigFields,
    folder_tokenizer,
)
from .llama import (
    _ignorable,
    _meta_decoder,
    _prefix,
    _SkipMetaInit,
    _tied_head,
    _wrap,
    llama_config,
)
from .wrappers import PretrainedDecoder

#: The model types read here.
DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
_TOPK_METHODS = {"greedy": "softmax_topk", "group_limited_greedy": "softmax_group_topk"}
Pieces = list[tuple[str, list[tuple[str, tuple[int, ...]]]]]


def deepseek_fields(f: ConfigFields, kind: str) -> dict[str, Any]:
    """The DeepSeek fields of a config (JSON-serialisable; kept in ``ModelConfig.extra["deepseek"]``):
    the latent's sizes, the dense layers, the experts and their routing, the softmax scale."""
    latent = dict(
        q_lora_rank=f.integer("q_lora_rank", None, allow_none=True),
        kv_lora_rank=f.integer("kv_lora_rank"), qk_nope_head_dim=f.integer("qk_nope_head_dim"),
        qk_rope_head_dim=f.integer("qk_rope_head_dim"), v_head_dim=f.integer("v_head_dim"),
    )  # fmt: skip
    if f.flag("mlp_bias", False):
        raise ValueError(f"{f.source}: mlp_bias=true is not supported (DeepSeek's MLPs have no biases)")
    if kind == "deepseek_v3":
        routing, norm_topk = "sigmoid_group_topk", f.flag("norm_topk_prob", True)
    else:
        method = f.hf.get("topk_method", "greedy")
        if method not in _TOPK_METHODS:
            raise ValueError(f"{f.source}: topk_method must be one of {list(_TOPK_METHODS)}; got {method!r}")
        routing, norm_topk = _TOPK_METHODS[method], False  # (V2's router never renormalises)
    grouped = routing != "softmax_topk"
    n_shared = f.integer("n_shared_experts", 0, minimum=0, allow_none=True) or 0
    moe = dict(
        n_experts=f.integer("n_routed_experts"), top_k=f.integer("num_experts_per_tok"),
        d_mlp=f.integer("moe_intermediate_size"), n_shared=n_shared, routing=routing, norm_topk=norm_topk,
        n_group=f.integer("n_group") if grouped else None,
        topk_group=f.integer("topk_group") if grouped else None,
        routed_scale=f.number("routed_scaling_factor", 1.0, low=0.0, low_open=True),
        score_bias=kind == "deepseek_v3",
    )  # fmt: skip
    scale = (latent["qk_nope_head_dim"] + latent["qk_rope_head_dim"]) ** -0.5
    rope = f.hf.get("rope_parameters") or f.hf.get("rope_scaling") or {}
    if isinstance(rope, Mapping) and rope.get("rope_type", rope.get("type", "default")) == "yarn":
        mscale = yarn_mscale(float(rope.get("factor", 1.0)), float(rope.get("mscale_all_dim", 0) or 0))
        scale = scale * mscale * mscale
    first_dense = f.integer("first_k_dense_replace", 0, minimum=0, allow_none=True) or 0
    return {"latent": latent, "moe": moe, "first_dense": first_dense, "scale": scale, "kind": kind}


def deepseek_config(
    hf: Mapping[str, Any], name: str = "", *, max_seq_len: int | None = None, source: str = "config.json"
) -> ModelConfig:
    """A :class:`ModelConfig` of a DeepSeek ``config.json`` dict (module docstring: its ``d_head`` is the
    rotated width, its MLP the dense one; the DeepSeek fields in ``extra["deepseek"]``)."""
    if not isinstance(hf, Mapping):
        raise TypeError(f"hf must be a dict (config.json); got {type(hf).__name__}")
    f = ConfigFields(hf, source)
    kind = f.text("model_type", None, allow_none=True)
    if kind not in DEEPSEEK_MODEL_TYPES:
        raise ValueError(f"{source}: model_type={kind!r} is not one of {list(DEEPSEEK_MODEL_TYPES)}")
    fields = deepseek_fields(f, kind)
    base = {k: v for k, v in hf.items() if k not in ("rope_interleave", "head_dim", "num_key_value_heads")}
    heads = f.integer("num_attention_heads")
    base.update(model_type="llama", head_dim=fields["latent"]["qk_rope_head_dim"], num_key_value_heads=heads)
    config = llama_config(base, name, max_seq_len=max_seq_len, source=source)
    interleaved = kind == "deepseek_v2" or f.flag("rope_interleave", True)
    bias = f.flag("attention_bias", False)
    extra = {**config.extra, "model_type": kind, "deepseek": fields}
    return dataclasses.replace(
        config, rope_interleaved=interleaved, qkv_bias=bias, out_bias=bias, mlp_bias=False, extra=extra
    )


def deepseek_block_specs(config: ModelConfig) -> list[BlockSpec]:
    """Every block's description: :meth:`ModelConfig.block_specs` with the latent attention and, past the
    first ``first_k_dense_replace`` blocks, the mixture of experts (``config.extra["deepseek"]``)."""
    ds = config.extra["deepseek"]
    latent, m = LatentSpec(**ds["latent"]), ds["moe"]
    moe = MLPSpec(
        m["d_mlp"], "moe", config.act or "silu", False, n_experts=m["n_experts"], top_k=m["top_k"],
        norm_topk=m["norm_topk"], d_shared=m["d_mlp"] * m["n_shared"] if m["n_shared"] else None,
        routing=m["routing"], n_group=m["n_group"], topk_group=m["topk_group"],
        routed_scale=float(m["routed_scale"]), score_bias=m["score_bias"], shared_gate=False,
    )  # fmt: skip
    specs = []
    for i, spec in enumerate(config.block_specs()):
        attention = dataclasses.replace(
            spec.attention,
            d_head=latent.qk_head_dim,
            latent=latent,
            scale=float(ds["scale"]),
            qk_norm_eps=1e-6,
        )
        mlp = spec.mlp if i < ds["first_dense"] else moe
        specs.append(dataclasses.replace(spec, attention=attention, mlp=mlp))
    return specs


def deepseek_tensors(config: ModelConfig, prefix: str = "model.") -> Pieces:
    """(Decoder state-dict name, the Hugging Face tensors (name, shape) it is made of), every parameter;
    the experts' one tensor per expert, stacked."""
    ds, c = config.extra["deepseek"], config
    lat, d = ds["latent"], c.d_model
    H, dqk = c.n_heads, lat["qk_nope_head_dim"] + lat["qk_rope_head_dim"]
    out: Pieces = [("tok_embed.weight", [(f"{prefix}embed_tokens.weight", (c.vocab_size, d))])]
    out.append(("ln_final.weight", [(f"{prefix}norm.weight", (d,))]))
    if not c.tie_embeddings:
        out.append(("lm_head.weight", [("lm_head.weight", (c.vocab_size, d))]))
    bias = bool(c.qkv_bias)
    for i in range(c.n_layers):
        p, b = f"{prefix}layers.{i}.", f"blocks.{i}."
        attn: dict[str, tuple[int, ...]] = {
            "kv_a_proj_with_mqa.weight": (lat["kv_lora_rank"] + lat["qk_rope_head_dim"], d),
            "kv_a_layernorm.weight": (lat["kv_lora_rank"],),
            "kv_b_proj.weight": (H * (lat["qk_nope_head_dim"] + lat["v_head_dim"]), lat["kv_lora_rank"]),
            "o_proj.weight": (d, H * lat["v_head_dim"]),
        }
        if lat["q_lora_rank"] is None:
            attn["q_proj.weight"] = (H * dqk, d)
        else:
            r = lat["q_lora_rank"]
            attn.update(
                {"q_a_proj.weight": (r, d), "q_a_layernorm.weight": (r,), "q_b_proj.weight": (H * dqk, r)}
            )
            if bias:
                attn["q_a_proj.bias"] = (r,)
        if bias:
            attn.update(
                {"kv_a_proj_with_mqa.bias": attn["kv_a_proj_with_mqa.weight"][:1], "o_proj.bias": (d,)}
            )
        out += [(f"{b}attn.{n}", [(f"{p}self_attn.{n}", s)]) for n, s in attn.items()]
        out.append((f"{b}ln1.weight", [(f"{p}input_layernorm.weight", (d,))]))
        out.append((f"{b}ln2.weight", [(f"{p}post_attention_layernorm.weight", (d,))]))
        out += _mlp_tensors(c, i, p, b)
    return out


def _mlp_tensors(c: ModelConfig, i: int, p: str, b: str) -> Pieces:
    """Block ``i``'s MLP pieces: dense (``mlp.{gate,up,down}_proj``) or the experts, the router and the
    shared experts."""
    ds, d = c.extra["deepseek"], c.d_model
    names = (("fc_gate", "gate_proj"), ("fc_in", "up_proj"), ("fc_out", "down_proj"))
    if i < ds["first_dense"]:
        dm = c.d_mlp
        assert dm is not None
        return [
            (f"{b}mlp.{o}.weight", [(f"{p}mlp.{t}.weight", (d, dm) if o == "fc_out" else (dm, d))])
            for o, t in names
        ]
    m = ds["moe"]
    n, dm = m["n_experts"], m["d_mlp"]
    out: Pieces = [(f"{b}mlp.router.weight", [(f"{p}mlp.gate.weight", (n, d))])]
    if m["score_bias"]:
        out.append((f"{b}mlp.score_bias", [(f"{p}mlp.gate.e_score_correction_bias", (n,))]))
    for ours, (_, theirs) in zip(("experts_gate", "experts_in", "experts_out"), names, strict=True):
        shape = (d, dm) if ours == "experts_out" else (dm, d)
        out.append((f"{b}mlp.{ours}", [(f"{p}mlp.experts.{e}.{theirs}.weight", shape) for e in range(n)]))
    if m["n_shared"]:
        ds_ = dm * m["n_shared"]
        for o, t in names:
            shape = (d, ds_) if o == "fc_out" else (ds_, d)
            out.append((f"{b}mlp.shared.{o}.weight", [(f"{p}mlp.shared_experts.{t}.weight", shape)]))
    return out


def load_deepseek(
    folder: str | Path, *, name: str = "", max_seq_len: int | None = None, precision: str = "float32"
) -> PretrainedDecoder:
    """Load a local DeepSeek V2 / V3 checkpoint folder onto a headspace Decoder (module docstring), with
    :func:`~headspace.pretrained.load_llama`'s checks: the parameter count the config implies against
    the headers, tensor names, shapes and dtypes, NaN/Inf weights."""
    opened = open_family(folder, precision)
    path = opened.path
    config = deepseek_config(
        opened.hf, name=name or path.name, max_seq_len=max_seq_len, source=opened.config_file
    )
    config.extra["source"] = str(path)
    headers = folder_headers(path)
    prefix = _prefix(headers[0].tensors)
    pieces = deepseek_tensors(config, prefix)
    expected = {n: s for _, theirs in pieces for n, s in theirs}
    fields = (
        f"num_hidden_layers={config.n_layers}, hidden_size={config.d_model}, vocab_size={config.vocab_size}"
    )
    tensors, ignored = read_listed(headers, expected, config, fields, opened.config_file, _ignorable)
    _tied_head(tensors, config, prefix, headers[0].path)
    if config.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    model = _meta_decoder(config)
    specs = deepseek_block_specs(config)
    with torch.device("meta"), _SkipMetaInit():
        for i, spec in enumerate(specs):
            model.blocks[i] = TransformerBlock.from_spec(spec)
    sd = {
        ours: t[0] if len(t) == 1 else torch.stack(t)  # (n_experts, out, in) for the experts
        for ours, t in ((o, [tensors[n].float() for n, _ in theirs]) for o, theirs in pieces)
    }
    model.load_state_dict(sd, strict=True, assign=True)
    tokenizer = folder_tokenizer(path, config.pad_token_id)
    return _wrap(model, config, tokenizer, ignored).to_precision(precision)
