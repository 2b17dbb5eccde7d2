"""Gemma 3n text checkpoints (``model_type: gemma3n_text``, transformers' ``Gemma3nForCausalLM``) onto a
:class:`~headspace.model.gemma3n_model.Gemma3nDecoder` (its docstring gives the maths).

Read from ``config.json`` beyond what Gemma 4 shares (:mod:`headspace.pretrained.gemma4`: sizes,
``layer_types``, ``sliding_window``, per-type ``rope_parameters`` (plain RoPE), ``num_kv_shared_layers``,
per-layer inputs, ``final_logit_softcapping``): ``intermediate_size`` (one or one per layer),
``altup_num_inputs``, ``altup_active_idx``, ``altup_correct_scale``, ``laurel_rank``,
``activation_sparsity_pattern``. ``altup_coef_clip`` acts in training only (transformers clamps the
coefficients then): not applied. Refused, by name: ``attention_bias``, ``use_bidirectional_attention``,
rope types other than ``default``. The untrusted-folder checks of
:func:`~headspace.pretrained.load_llama`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..model.config import ModelConfig
from ..model.gemma3n_model import Gemma3nDecoder
from ..model.gemma4_model import _rotaries
from .empty_weights import SkipMetaInit
from .family_frame import folder_headers, open_family, pop_tied_head, read_listed
from .gemma4 import _NORMS, _kv_sources, gemma4_config
from .hf import ConfigFields, folder_tokenizer
from .wrappers import PretrainedDecoder

#: ``config.json`` model types read here.
GEMMA3N_MODEL_TYPES = ("gemma3n_text",)


def _per_layer(value: Any, key: str, n: int, kind: type, source: str) -> list[Any]:
    """``value`` (``config[key]``) as one value per layer (a single value repeated)."""
    values = value if isinstance(value, list) else [value] * n
    if len(values) != n or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
        raise ValueError(f"{source}: {key} must be a number or a list of {n} numbers; got {value!r:.120}")
    return [kind(v) for v in values]


def gemma3n_config(hf: Mapping[str, Any], name: str = "", *, source: str = "config.json") -> ModelConfig:
    """A :class:`ModelConfig` (with ``extra["gemma3n"]``) from a ``gemma3n_text`` config.json dict."""
    f = ConfigFields(hf, source)
    if f.text("model_type", None, allow_none=True) not in GEMMA3N_MODEL_TYPES:
        raise ValueError(f"{source}: model_type={hf.get('model_type')!r} is not {list(GEMMA3N_MODEL_TYPES)}")
    n = f.integer("num_hidden_layers")
    widths = _per_layer(hf.get("intermediate_size"), "intermediate_size", n, int, source)
    default_sparsity = [0.95] * 10 + [0.0] * (n - 10) if n > 10 else [0.0] * n
    pattern = hf.get("activation_sparsity_pattern")
    sparsity = _per_layer(default_sparsity if pattern is None else pattern, "activation_sparsity_pattern",
                          n, float, source)  # fmt: skip
    if any(not 0.0 <= s < 1.0 for s in sparsity):
        raise ValueError(
            f"{source}: activation_sparsity_pattern values must be in [0, 1); got {sparsity!r:.120}"
        )
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(n)
    ]
    shared = f.integer("num_kv_shared_layers", 15, minimum=0)
    rope = hf.get("rope_parameters") or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
    }
    base = {**dict(hf), "model_type": "gemma4_text", "intermediate_size": widths[0], "layer_types": types,
            "num_kv_shared_layers": 0, "attention_k_eq_v": False, "per_layer_config": {},
            "rope_parameters": rope, "final_logit_softcapping": hf.get("final_logit_softcapping", 30.0),
            "hidden_size_per_layer_input": f.integer("hidden_size_per_layer_input", 256, minimum=1),
            "vocab_size_per_layer_input": f.integer("vocab_size_per_layer_input", 262144, minimum=1),
            # (transformers' Gemma 3n defaults where they differ from Gemma 4's)
            "num_key_value_heads": hf.get("num_key_value_heads", 2),
            "max_position_embeddings": hf.get("max_position_embeddings", 32768)}  # fmt: skip
    for kind in ("sliding_attention", "full_attention"):
        if isinstance(rope.get(kind), dict) and rope[kind].get("rope_type", "default") != "default":
            raise ValueError(
                f"{source}: rope_parameters[{kind!r}] must be a plain rotation (rope_type default)"
            )
    c = gemma4_config(base, name, source=source)
    g = dict(c.extra["gemma4"])
    sources = _kv_sources([layer["type"] for layer in g["layers"]], shared, source)
    g["layers"] = [{**layer, "d_mlp": w, "kv_source": s} for layer, w, s in zip(g["layers"], widths, sources)]
    k = f.integer("altup_num_inputs", 4, minimum=1)
    active = f.integer("altup_active_idx", 0, minimum=0)
    if active >= k:
        raise ValueError(f"{source}: altup_active_idx must be < altup_num_inputs={k}; got {active}")
    g.update(
        altup={"k": k, "active": active, "correct_scale": f.flag("altup_correct_scale", True)},
        laurel_rank=f.integer("laurel_rank", 64), sparsity=sparsity,
    )  # fmt: skip
    extra = {k: v for k, v in c.extra.items() if k != "gemma4"}
    return dataclasses.replace(c, extra={**extra, "model_type": "gemma3n_text", "gemma3n": g})


def gemma3n_tensors(
    c: ModelConfig, prefix: str = "model."
) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    """(Gemma3nDecoder state-dict name, the HF tensors (name, shape) whose rows it stacks), every one."""
    g = c.extra["gemma3n"]
    d, H, L, K, pd = c.d_model, c.n_heads, c.n_layers, g["altup"]["k"], g["ple"]
    out: list[tuple[str, list[tuple[str, tuple[int, ...]]]]] = []
    for i, layer in enumerate(g["layers"]):
        p, b = f"{prefix}layers.{i}.", f"blocks.{i}."
        dh, kv, dm, a = layer["d_head"], layer["n_kv_heads"], layer["d_mlp"], f"{prefix}layers.{i}.self_attn."
        rows = [(a + "q_proj.weight", (H * dh, d))]
        if layer["kv_source"] is None:
            rows += [(a + "k_proj.weight", (kv * dh, d)), (a + "v_proj.weight", (kv * dh, d))]
            out.append((b + "attn.k_norm.weight", [(a + "k_norm.weight", (dh,))]))
        single = {
            b + "attn.o_weight": (a + "o_proj.weight", (d, H * dh)),
            b + "attn.q_norm.weight": (a + "q_norm.weight", (dh,)),
            b + "mlp.fc_gate.weight": (p + "mlp.gate_proj.weight", (dm, d)),
            b + "mlp.fc_in.weight": (p + "mlp.up_proj.weight", (dm, d)),
            b + "mlp.fc_out.weight": (p + "mlp.down_proj.weight", (d, dm)),
            **{f"{b}{ours}.weight": (f"{p}{theirs}.weight", (d,)) for ours, theirs in _NORMS},
            f"altup.{i}.router.weight": (p + "altup.modality_router.weight", (K, d)),
            f"altup.{i}.router_norm.weight": (p + "altup.router_norm.weight", (d,)),
            f"altup.{i}.prediction_coefs.weight": (p + "altup.prediction_coefs.weight", (K * K, K)),
            f"altup.{i}.correction_coefs.weight": (p + "altup.correction_coefs.weight", (K, K)),
            f"altup.{i}.correct_output_scale": (p + "altup.correct_output_scale", (d,)),
            f"laurel.{i}.left.weight": (p + "laurel.linear_left.weight", (g["laurel_rank"], d)),
            f"laurel.{i}.right.weight": (p + "laurel.linear_right.weight", (d, g["laurel_rank"])),
            f"laurel.{i}.norm.weight": (p + "laurel.post_laurel_norm.weight", (d,)),
            f"ple.{i}.gate.weight": (p + "per_layer_input_gate.weight", (pd, d)),
            f"ple.{i}.proj.weight": (p + "per_layer_projection.weight", (d, pd)),
            f"ple.{i}.norm.weight": (p + "post_per_layer_input_norm.weight", (d,)),
        }
        out.append((b + "attn.qkv_weight", rows))
        out += [(ours, [theirs]) for ours, theirs in single.items()]
    model = {
        "tok_embed.weight": ("embed_tokens.weight", (c.vocab_size, d)),
        "ln_final.weight": ("norm.weight", (d,)),
        "ple_embed.weight": ("embed_tokens_per_layer.weight", (g["ple_vocab"], L * pd)),
        "ple_model_proj.weight": ("per_layer_model_projection.weight", (L * pd, d)),
        "ple_norm.weight": ("per_layer_projection_norm.weight", (pd,)),
        **{f"altup_up.{k}.weight": (f"altup_projections.{k}.weight", (d, d)) for k in range(K - 1)},
        **{f"altup_down.{k}.weight": (f"altup_unembed_projections.{k}.weight", (d, d)) for k in range(K - 1)},
    }
    out += [(ours, [(prefix + theirs, shape)]) for ours, (theirs, shape) in model.items()]
    if not c.tie_embeddings:
        out.append(("lm_head.weight", [("lm_head.weight", (c.vocab_size, d))]))
    return out


def load_gemma3n(
    folder: str | Path, *, name: str = "", max_seq_len: int | None = None, precision: str = "float32"
) -> PretrainedDecoder:
    """Load a local ``gemma3n_text`` checkpoint folder (module docstring) onto a Gemma3nDecoder."""
    opened = open_family(folder, precision)
    path = opened.path
    config = gemma3n_config(opened.hf, name=name or path.name, source=opened.config_file)
    if max_seq_len is not None:
        if max_seq_len > config.max_seq_len:
            raise ValueError(
                f"max_seq_len={max_seq_len} exceeds the model's max_position_embeddings={config.max_seq_len}"
            )
        window = None if config.sliding_window is None else min(config.sliding_window, max_seq_len)
        config = dataclasses.replace(config, max_seq_len=max_seq_len, sliding_window=window)
    config.extra["source"] = str(path)
    headers = folder_headers(path)
    prefix = "" if "embed_tokens.weight" in headers[0].tensors else "model."
    pieces = gemma3n_tensors(config, prefix)
    expected = {n: s for _, theirs in pieces for n, s in theirs}
    fields = (
        f"num_hidden_layers={config.n_layers}, hidden_size={config.d_model}, vocab_size={config.vocab_size}"
    )
    tensors, ignored = read_listed(headers, expected, config, fields, opened.config_file, lambda _: False)
    pop_tied_head(tensors, config, prefix, headers[0].path)
    with torch.device("meta"), SkipMetaInit():
        model = Gemma3nDecoder(config)
    sd = {ours: torch.cat([tensors[n].float() for n, _ in theirs]) for ours, theirs in pieces}
    sd["layer_scalars"] = torch.ones(config.n_layers)  # (Gemma 3n has none: Gemma 4's, at 1)
    model.load_state_dict(sd, strict=True, assign=True)
    fresh = _rotaries(config, config.extra["gemma3n"])  # (non-persistent tables: built on the CPU)
    for block, layer in zip(model.blocks, config.extra["gemma3n"]["layers"], strict=True):
        block.attn.rotary = fresh[layer["type"]]
        if block.attn.spec.kv_source is not None:
            block.attn.share_from(model.blocks[block.attn.spec.kv_source].attn)
    pre = PretrainedDecoder(model, folder_tokenizer(path, config.pad_token_id), ignored=ignored)
    return pre.to_precision(precision)
