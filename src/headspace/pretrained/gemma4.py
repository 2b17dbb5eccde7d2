"""Gemma 4 text checkpoints (``model_type: gemma4_text``, transformers' ``Gemma4ForCausalLM``) onto a
:class:`~headspace.model.gemma4_model.Gemma4Decoder` (its docstring gives the maths).

Read from ``config.json``: sizes, ``head_dim`` (sliding layers) and ``per_layer_config`` (the full
layers' ``head_dim`` / ``num_key_value_heads``; older spellings ``global_head_dim`` /
``num_global_key_value_heads``), ``layer_types``, ``sliding_window``, ``rope_parameters`` per layer type
(``default``, or ``proportional`` with ``partial_rotary_factor`` on the full layers),
``attention_k_eq_v``, ``num_kv_shared_layers`` (each shared layer reads the last earlier unshared layer of
its type, as transformers' ``kv_sharing_modes``), ``use_double_wide_mlp``, ``hidden_size_per_layer_input``
/ ``vocab_size_per_layer_input``, ``final_logit_softcapping``, ``hidden_activation``, ``rms_norm_eps``.
``enable_moe_block`` (``num_experts``, ``top_k_experts``, ``moe_intermediate_size``): every layer's MLP a
:class:`~headspace.model.gemma4_moe.Gemma4MoE`. Refused, by name: ``attention_bias``,
``use_bidirectional_attention``, any other rope type. Untrusted folders get
:func:`~headspace.pretrained.load_llama`'s checks (headers, counts, names, shapes, dtypes, NaN/Inf).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..model.config import ModelConfig
from ..model.gemma4_model import Gemma4Decoder, _rotaries, state_dict_names
from .empty_weights import SkipMetaInit
from .family_frame import folder_headers, open_family, pop_tied_head, read_listed
from .hf import ConfigFields, folder_tokenizer
from .wrappers import PretrainedDecoder

#: ``config.json`` model types read here.
GEMMA4_MODEL_TYPES = ("gemma4_text",)
_ACT = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu", "silu": "silu"}
_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}
# (ours, transformers') names of each layer's four norms (the sandwich layout)
_NORMS = (
    ("ln1", "input_layernorm"),
    ("ln_attn_out", "post_attention_layernorm"),
    ("ln2", "pre_feedforward_layernorm"),
    ("ln_mlp_out", "post_feedforward_layernorm"),
)


def _refuse(f: ConfigFields) -> None:
    """Refuse, by name, what headspace does not compute exactly for Gemma 4 yet."""
    if f.hf.get("attention_bias"):
        raise ValueError(f"{f.source}: attention_bias=true is not supported (Gemma 4 has none)")
    if f.hf.get("use_bidirectional_attention") is not None:
        raise ValueError(f"{f.source}: use_bidirectional_attention is not supported (causal only)")


def _pad(f: ConfigFields, vocab: int) -> int | None:
    """``pad_token_id`` (None for null or negative), which must be < ``vocab_size``."""
    pad = f.integer("pad_token_id", None, minimum=-(2**31), allow_none=True)
    if pad is not None and pad >= vocab:
        raise ValueError(f"{f.source}: pad_token_id must be < vocab_size={vocab}; got {pad}")
    return None if pad is None or pad < 0 else pad


def _moe(f: ConfigFields) -> dict[str, int] | None:
    """``enable_moe_block``'s experts (every layer): count, top-k and width; None without."""
    if not f.flag("enable_moe_block", False):
        return None
    n, k = f.integer("num_experts"), f.integer("top_k_experts")
    if k > n:
        raise ValueError(f"{f.source}: top_k_experts must be at most num_experts={n}; got {k}")
    return {"n_experts": n, "top_k": k, "d_expert": f.integer("moe_intermediate_size")}


def _kv_sources(types: list[str], n_shared: int, source: str) -> list[int | None]:
    """Per layer: None (owns its keys and values) or the layer whose keys and values it reads."""
    n = len(types)
    first = n - n_shared
    if n_shared and first <= 0:
        raise ValueError(f"{source}: num_kv_shared_layers={n_shared} leaves no layer that owns its keys")
    out: list[int | None] = [None] * n
    for i in range(first, n):
        owners = [j for j in range(first) if types[j] == types[i]]
        if not owners:
            raise ValueError(f"{source}: shared layer {i} ({types[i]}) has no earlier layer of its type")
        out[i] = owners[-1]
    return out


def _rope(f: ConfigFields, types: list[str]) -> dict[str, dict[str, Any]]:
    """Per layer type: rope_type, rope_theta, partial, factor."""
    params = f.hf.get("rope_parameters") or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
    }
    out = {}
    for theirs, ours in _TYPES.items():
        if ours not in types:
            continue
        p = params.get(theirs)
        if not isinstance(p, dict):
            raise ValueError(f"{f.source}: rope_parameters[{theirs!r}] must be an object; got {p!r:.80}")
        pf = ConfigFields(p, f"{f.source} rope_parameters[{theirs!r}]")
        kind = pf.text("rope_type", "default")
        if kind not in ("default", "proportional"):
            raise ValueError(f"{pf.source}: rope_type={kind!r} is not supported (default, proportional)")
        partial = pf.number("partial_rotary_factor", 1.0, low=0.0, low_open=True)
        if kind == "default" and partial != 1.0:
            raise ValueError(f"{pf.source}: partial_rotary_factor with rope_type 'default' is not supported")
        out[ours] = {
            "rope_type": kind,
            "rope_theta": pf.number("rope_theta", 10000.0, low=0.0, low_open=True),
            "partial": partial,
            "factor": pf.number("factor", 1.0, low=0.0, low_open=True),
        }
    return out


def _by_layer(overrides: Mapping[Any, Any], n: int, source: str) -> dict[int, Any]:
    """``per_layer_config`` keyed by layer index: transformers 5 writes its keys zero-padded to the width
    of the largest ("05", "11") and reads them with ``int``; a key that is no layer of ``range(n)`` is
    refused."""
    out: dict[int, Any] = {}
    for key, value in overrides.items():
        i = int(key) if isinstance(key, int) or (isinstance(key, str) and key.isdigit()) else -1
        if not 0 <= i < n:
            raise ValueError(
                f"{source}: per_layer_config keys must be layer indices 0..{n - 1}; got {key!r:.40}"
            )
        out[i] = value
    return out


def _layers(
    f: ConfigFields, n: int, d_head: int, n_kv: int, d_mlp: int
) -> tuple[list[str], list[dict[str, Any]]]:
    """(layer types, the per-layer entries of ``extra["gemma4"]["layers"]``)."""
    raw = f.hf.get("layer_types") or [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)
    ]
    if not isinstance(raw, list) or len(raw) != n or any(t not in _TYPES for t in raw):
        raise ValueError(f"{f.source}: layer_types must list {n} of {list(_TYPES)}; got {raw!r:.120}")
    types = [_TYPES[t] for t in raw]
    overrides = f.hf.get("per_layer_config")
    if overrides is None:
        g_dh = f.integer("global_head_dim", 512)
        g_kv = f.hf.get("num_global_key_value_heads") if f.flag("attention_k_eq_v", False) else None
        overrides = {str(i): {"head_dim": g_dh, **({"num_key_value_heads": g_kv} if g_kv else {})}
                     for i, t in enumerate(types) if t == "full"}  # fmt: skip
    if not isinstance(overrides, dict):
        raise ValueError(f"{f.source}: per_layer_config must be an object; got {overrides!r:.80}")
    overrides = _by_layer(overrides, n, f.source)
    k_eq_v = f.flag("attention_k_eq_v", False)
    sources = _kv_sources(types, f.integer("num_kv_shared_layers", 0, minimum=0), f.source)
    wide = f.flag("use_double_wide_mlp", False)
    layers = []
    for i, t in enumerate(types):
        o = overrides.get(i, {})
        if not isinstance(o, dict) or set(o) - {"head_dim", "num_key_value_heads"}:
            raise ValueError(
                f"{f.source}: per_layer_config['{i}'] may set head_dim, num_key_value_heads; got {o!r:.80}"
            )
        lf = ConfigFields(o, f"{f.source} per_layer_config['{i}']")
        layers.append({
            "type": t,
            "d_head": lf.integer("head_dim", d_head),
            "n_kv_heads": lf.integer("num_key_value_heads", n_kv),
            "d_mlp": d_mlp * (2 if wide and sources[i] is not None else 1),
            "k_eq_v": bool(k_eq_v and t == "full"),
            "kv_source": sources[i],
        })  # fmt: skip
    return types, layers


def gemma4_config(hf: Mapping[str, Any], name: str = "", *, source: str = "config.json") -> ModelConfig:
    """A :class:`ModelConfig` (with ``extra["gemma4"]``) from a ``gemma4_text`` config.json dict."""
    f = ConfigFields(hf, source)
    kind = f.text("model_type", None, allow_none=True)
    if kind not in GEMMA4_MODEL_TYPES:
        raise ValueError(
            f"{source}: model_type={kind!r} is not supported here; supported: {list(GEMMA4_MODEL_TYPES)}"
        )
    _refuse(f)
    f.require(
        ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"],
        "Gemma 4",
    )
    d, n, H = f.integer("hidden_size"), f.integer("num_hidden_layers"), f.integer("num_attention_heads")
    d_head, n_kv = f.integer("head_dim", 256), f.integer("num_key_value_heads", 4)
    d_mlp = f.integer("intermediate_size")
    act = f.text("hidden_activation", "gelu_pytorch_tanh")
    if act not in _ACT:
        raise ValueError(f"{source}: hidden_activation={act!r} is not supported; supported: {sorted(_ACT)}")
    types, layers = _layers(f, n, d_head, n_kv, d_mlp)
    rope = _rope(f, types)
    ple = f.integer("hidden_size_per_layer_input", 0, minimum=0, allow_none=True) or None
    window = f.integer("sliding_window", 512, minimum=1)
    context = f.integer("max_position_embeddings", 131072)
    vocab = f.integer("vocab_size")
    ple_vocab = f.integer("vocab_size_per_layer_input", vocab) if ple else None
    gemma4 = {"layers": layers, "rope": rope, "ple": ple, "ple_vocab": ple_vocab, "moe": _moe(f)}
    cap = hf.get("final_logit_softcapping")
    cap = None if cap is None else f.number("final_logit_softcapping", low=0.0, low_open=True)
    ids = {k: hf[k] for k in ("bos_token_id", "eos_token_id") if hf.get(k) is not None}
    try:
        return ModelConfig(
            arch="decoder", vocab_size=vocab, d_model=d, n_layers=n, n_heads=H, d_head=d_head,
            n_kv_heads=n_kv, d_mlp=d_mlp, max_seq_len=context, act=_ACT[act], norm="sandwich",
            dropout=0.0, attn_dropout=0.0, emb_dropout=0.0,
            ln_eps=f.number("rms_norm_eps", 1e-6, low=0.0, low_open=True), bias=False, type_vocab_size=0,
            tie_embeddings=f.flag("tie_word_embeddings", True), pad_token_id=_pad(f, vocab), embed_ln=False,
            final_ln=True, name=name, positions="rotary", norm_kind="rmsnorm", mlp_kind="gated",
            qkv_bias=False, out_bias=False, mlp_bias=False, qk_norm="head", embed_scale=math.sqrt(d),
            final_softcap=cap, sliding_window=min(window, context), layer_types=types,
            rope_theta=rope.get("full", rope.get("sliding"))["rope_theta"],
            rope_local_theta=rope["sliding"]["rope_theta"] if "sliding" in rope else None,
            extra={"model_type": kind, "gemma4": gemma4, **ids},
        )  # fmt: skip
    except ValueError as e:
        raise ValueError(f"{source} does not fit headspace: {e}") from None


def gemma4_tensors(
    c: ModelConfig, prefix: str = "model."
) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    """(Gemma4Decoder state-dict name, the HF tensors (name, shape) whose rows it stacks), every one."""
    g = c.extra["gemma4"]
    d, H = c.d_model, c.n_heads
    out: list[tuple[str, list[tuple[str, tuple[int, ...]]]]] = []
    for i, layer in enumerate(g["layers"]):
        p, b = f"{prefix}layers.{i}.", f"blocks.{i}."
        dh, kv, dm = layer["d_head"], layer["n_kv_heads"], layer["d_mlp"]
        a = p + "self_attn."
        rows = [(a + "q_proj.weight", (H * dh, d))]
        if layer["kv_source"] is None:
            rows.append((a + "k_proj.weight", (kv * dh, d)))
            if not layer["k_eq_v"]:
                rows.append((a + "v_proj.weight", (kv * dh, d)))
            out.append((b + "attn.k_norm.weight", [(a + "k_norm.weight", (dh,))]))
        out.append((b + "attn.qkv_weight", rows))
        out.append((b + "attn.o_weight", [(a + "o_proj.weight", (d, H * dh))]))
        out.append((b + "attn.q_norm.weight", [(a + "q_norm.weight", (dh,))]))
        dense = f"{b}mlp.shared." if g.get("moe") else f"{b}mlp."
        for ours, theirs, shape in (("fc_gate", "gate_proj", (dm, d)), ("fc_in", "up_proj", (dm, d)),
                                    ("fc_out", "down_proj", (d, dm))):  # fmt: skip
            out.append((f"{dense}{ours}.weight", [(f"{p}mlp.{theirs}.weight", shape)]))
        for ours, theirs in _NORMS:
            if g.get("moe") and ours == "ln2":
                ours = "mlp.pre_norm"  # (the block's ln2 is the identity: module gemma4_moe)
            out.append((f"{b}{ours}.weight", [(f"{p}{theirs}.weight", (d,))]))
        if g.get("moe"):
            out.extend(_moe_tensors(g["moe"], d, p, b))
        out.append((f"layer_scalars:{i}", [(p + "layer_scalar", (1,))]))
    L, pd = c.n_layers, g["ple"]
    shapes = {"tok_embed.weight": (c.vocab_size, d), "ln_final.weight": (d,)}
    if pd:
        shapes.update({"ple_embed.weight": (g["ple_vocab"], L * pd), "ple_model_proj.weight": (L * pd, d),
                       "ple_norm.weight": (pd,)})  # fmt: skip
        for i in range(L):
            shapes.update(
                {
                    f"ple.{i}.gate.weight": (pd, d),
                    f"ple.{i}.proj.weight": (d, pd),
                    f"ple.{i}.norm.weight": (d,),
                }
            )
    for ours, theirs in state_dict_names(c, prefix).items():
        out.append((ours, [(theirs, shapes[ours])]))
    if not c.tie_embeddings:
        out.append(("lm_head.weight", [("lm_head.weight", (c.vocab_size, d))]))
    return out


def _moe_tensors(moe: dict[str, int], d: int, p: str, b: str) -> list[tuple[str, list[Any]]]:
    """One MoE layer's router, experts and norms (``experts:gate_up`` is split by :func:`_build`)."""
    n, de = moe["n_experts"], moe["d_expert"]
    pieces = {
        "mlp.router.weight": ("router.proj.weight", (n, d)),
        "mlp.router_scale": ("router.scale", (d,)),
        "mlp.per_expert_scale": ("router.per_expert_scale", (n,)),
        "mlp.experts_out": ("experts.down_proj", (n, d, de)),
        "mlp.post_norm_shared.weight": ("post_feedforward_layernorm_1.weight", (d,)),
        "mlp.pre_norm_experts.weight": ("pre_feedforward_layernorm_2.weight", (d,)),
        "mlp.post_norm_experts.weight": ("post_feedforward_layernorm_2.weight", (d,)),
        "mlp:gate_up": ("experts.gate_up_proj", (n, 2 * de, d)),
    }
    return [(b + ours, [(p + theirs, shape)]) for ours, (theirs, shape) in pieces.items()]


def load_gemma4(
    folder: str | Path, *, name: str = "", max_seq_len: int | None = None, precision: str = "float32"
) -> PretrainedDecoder:
    """Load a local ``gemma4_text`` checkpoint folder (module docstring) onto a Gemma4Decoder."""
    opened = open_family(folder, precision)
    path = opened.path
    config = gemma4_config(opened.hf, name=name or path.name, source=opened.config_file)
    if max_seq_len is not None:
        if max_seq_len > config.max_seq_len:
            raise ValueError(
                f"max_seq_len={max_seq_len} exceeds the model's max_position_embeddings={config.max_seq_len}"
            )
        config = _with_context(config, max_seq_len)
    config.extra["source"] = str(path)
    headers = folder_headers(path)
    prefix = "" if "embed_tokens.weight" in headers[0].tensors else "model."
    pieces = gemma4_tensors(config, prefix)
    expected = {n: s for _, theirs in pieces for n, s in theirs}
    fields = (
        f"num_hidden_layers={config.n_layers}, hidden_size={config.d_model}, vocab_size={config.vocab_size}"
    )
    tensors, ignored = read_listed(headers, expected, config, fields, opened.config_file, lambda _: False)
    pop_tied_head(tensors, config, prefix, headers[0].path)
    return _build(config, tensors, pieces, ignored, path).to_precision(precision)


def _with_context(config: ModelConfig, max_seq_len: int) -> ModelConfig:
    import dataclasses

    window = None if config.sliding_window is None else min(config.sliding_window, max_seq_len)
    return dataclasses.replace(config, max_seq_len=max_seq_len, sliding_window=window)


def _build(
    config: ModelConfig, tensors: dict[str, Tensor], pieces: list[Any], ignored: list[str], path: Path
) -> PretrainedDecoder:
    """The Gemma4Decoder with the checkpoint's weights (built on the meta device, then assigned)."""
    with torch.device("meta"), SkipMetaInit():
        model = Gemma4Decoder(config)
    sd: dict[str, Tensor] = {}
    scalars = torch.ones(config.n_layers)
    for ours, theirs in pieces:
        if ours.startswith("layer_scalars:"):
            scalars[int(ours.split(":")[1])] = tensors[theirs[0][0]].float().reshape(())
            continue
        if ours.endswith("mlp:gate_up"):  # (E, 2 d_expert, d_model): gate rows, then up rows
            gate, up = tensors[theirs[0][0]].float().chunk(2, dim=1)  # (E, d_expert, d_model) x 2
            sd[ours.replace("mlp:gate_up", "mlp.experts_gate")] = gate.contiguous()
            sd[ours.replace("mlp:gate_up", "mlp.experts_in")] = up.contiguous()
            continue
        sd[ours] = (
            torch.cat([tensors[n].float() for n, _ in theirs])
            if len(theirs) > 1
            else tensors[theirs[0][0]].float()
        )
    sd["layer_scalars"] = scalars
    model.load_state_dict(sd, strict=True, assign=True)
    fresh = _rotaries(config, config.extra["gemma4"])  # (non-persistent tables: built on the CPU)
    for block, layer in zip(model.blocks, config.extra["gemma4"]["layers"], strict=True):
        block.attn.rotary = fresh[layer["type"]]
    for block in model.blocks:  # re-bind the sharing layers to their owners' assigned weights
        attn = block.attn
        if attn.spec.kv_source is not None:
            attn.share_from(model.blocks[attn.spec.kv_source].attn)
    return PretrainedDecoder(model, folder_tokenizer(path, config.pad_token_id), ignored=ignored)
