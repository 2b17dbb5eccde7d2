"""ModernBERT checkpoints (Hugging Face ``ModernBertModel`` / ``ModernBertForMaskedLM``) onto an Encoder.

ModernBERT is a pre-norm encoder with rotary positions and no position table::

    h_0 = LN_emb(E_tok[t_i])
    h   = x + A(LN_1(x))          (layer 0: h = x + A(x), no attention norm: ``BlockSpec.attn_norm``)
    out = h + M(LN_2(h))          M(h) = (act(h W_a) * (h W_b)) W_o   (GeGLU: Wi's rows are [W_a; W_b])
    states = LN_final(h_L)

Every ``global_attn_every_n_layers``-th layer (or ``layer_types``' ``"full_attention"`` ones) sees every
key, with RoPE base ``global_rope_theta``; the others ("sliding_attention") see key ``j`` from query
``i`` iff ``|i - j| <= local_attention // 2``, with base ``local_rope_theta``: headspace's
``window_sides="both"`` with ``window = local_attention // 2 + 1`` (``|i - j| < window``). The norms
have no bias unless ``norm_bias`` (a zero bias is loaded, the same maths); the projections none unless
``attention_bias`` / ``mlp_bias``. A masked-LM checkpoint's head (``head.dense`` + act + ``head.norm``
+ ``decoder`` with its bias) becomes :class:`MaskedLMHead`, kept as ``.mlm_head`` of the loaded model;
other task heads (``classifier.*``) are ignored and listed. Dropouts are not carried (the model is run
in eval mode). Rope types other than ``"default"`` are refused by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..model import layouts
from ..model.config import ModelConfig
from ..model.mlp import make_activation
from ..model.models import Encoder, check_precision
from .config_checks import MAX_LAYERS, at_most
from .hf import (
    ConfigFields,
    config_fields,
    config_sizes,
    fitting_headspace,
    folder_tokenizer,
    load_converted,
    open_checkpoint,
    parameter_count,
    read_checked,
    refuse_unsupported,
)
from .wrappers import PretrainedEncoder

_ACT = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
}
_REQUIRED = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"]
_COUNTED = {
    "num_hidden_layers": "n_layers",
    "hidden_size": "d_model",
    "intermediate_size": "d_mlp",
    "vocab_size": "vocab_size",
}
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


def _layer_types(f: ConfigFields, n_layers: int) -> list[str]:
    """headspace's ``layer_types`` from ``layer_types`` (transformers 5) or ``global_attn_every_n_layers``."""
    given = f.hf.get("layer_types")
    if given is None:
        every = f.integer("global_attn_every_n_layers", 3)
        return ["sliding" if i % every else "full" for i in range(n_layers)]
    if not isinstance(given, list) or len(given) != n_layers or any(t not in _LAYER_TYPES for t in given):
        raise ValueError(
            f"{f.source}: layer_types must list {sorted(_LAYER_TYPES)}, one per layer "
            f"(num_hidden_layers={n_layers}); got {given!r:.120}"
        )
    return [_LAYER_TYPES[t] for t in given]


def _rope_theta(f: ConfigFields, kind: str, legacy: str, default: float) -> float:
    """The RoPE base of ``kind`` layers: ``rope_parameters[kind]["rope_theta"]`` or the older ``legacy``
    key; a ``rope_type`` other than ``"default"`` is refused by name."""
    params = f.hf.get("rope_parameters")
    if params is None:
        return f.number(legacy, default, low=0.0, low_open=True)
    entry = params.get(kind) if isinstance(params, dict) else None
    if entry is None:
        return f.number(legacy, default, low=0.0, low_open=True)
    if not isinstance(entry, dict):
        raise ValueError(f"{f.source}: rope_parameters[{kind!r}] must be a dict; got {entry!r:.80}")
    sub = ConfigFields(entry, f"{f.source}: rope_parameters[{kind!r}]")
    rope_type = sub.text("rope_type", "default")
    if rope_type != "default":
        raise ValueError(
            f"{f.source}: rope_parameters[{kind!r}].rope_type={rope_type!r} is not supported "
            "(supported: default)"
        )
    return sub.number("rope_theta", default, low=0.0, low_open=True)


def modernbert_config(hf: dict[str, Any], name: str = "", *, source: str = "config.json") -> ModelConfig:
    """A headspace :class:`ModelConfig` from a Hugging Face ModernBERT ``config.json`` dict (module
    docstring); ``extra`` keeps ``norm_bias`` and the masked-LM head's fields."""
    f = config_fields(hf, source)
    f.text("hidden_activation", "gelu")
    f.text("classifier_activation", "gelu")
    refuse_unsupported(
        f,
        "modernbert",
        {"hidden_activation": lambda v: v in _ACT, "classifier_activation": lambda v: v in _ACT},
        {"hidden_activation": "gelu", "classifier_activation": "gelu"},
    )
    f.require(_REQUIRED, "ModernBERT")
    sizes = config_sizes(f, "hidden_size", "num_attention_heads", pad_default=None)
    n_layers = at_most(source, "num_hidden_layers", f.integer("num_hidden_layers"), MAX_LAYERS)
    local = f.integer("local_attention", 128, minimum=1)
    extra = {
        "model_type": "modernbert",
        "norm_bias": f.flag("norm_bias", False),
        "local_attention": local,
        "decoder_bias": f.flag("decoder_bias", True),
        "classifier_bias": f.flag("classifier_bias", False),
        "classifier_activation": _ACT[hf.get("classifier_activation", "gelu")],
        "tie_word_embeddings": f.flag("tie_word_embeddings", True),
    }
    attention_bias = f.flag("attention_bias", False)
    fields: dict[str, Any] = {
        "d_mlp": f.integer("intermediate_size"),
        "max_seq_len": f.integer("max_position_embeddings", 8192),
        "act": _ACT[hf.get("hidden_activation", "gelu")],
        "ln_eps": f.number("norm_eps", 1e-5, low=0.0, low_open=True),
        "init_std": f.number("initializer_range", 0.02, low=0.0, low_open=True),
        "rope_theta": _rope_theta(f, "full_attention", "global_rope_theta", 160_000.0),
        "rope_local_theta": _rope_theta(f, "sliding_attention", "local_rope_theta", 10_000.0),
        "layer_types": _layer_types(f, n_layers),
        "mlp_bias": f.flag("mlp_bias", False),
    }
    with fitting_headspace(source):
        return ModelConfig(
            arch="encoder", n_layers=n_layers, norm="pre", type_vocab_size=0, embed_ln=True, final_ln=True,
            positions="rotary", sliding_window=local // 2 + 1, window_sides="both", no_attn_norm_layers=[0],
            mlp_kind="gated", bias=False, qkv_bias=attention_bias, out_bias=attention_bias, name=name,
            extra=extra, **fields, **sizes,
        )  # fmt: skip


def _linear(name: str, n_out: int, n_in: int, bias: bool) -> dict[str, tuple[int, ...]]:
    return {f"{name}.weight": (n_out, n_in), **({f"{name}.bias": (n_out,)} if bias else {})}


def _norm(name: str, d: int, bias: bool) -> dict[str, tuple[int, ...]]:
    return {f"{name}.weight": (d,), **({f"{name}.bias": (d,)} if bias else {})}


def _layer(c: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    d, dm, nb, p = c.d_model, int(c.d_mlp or 0), bool(c.extra["norm_bias"]), f"layers.{i}."
    exp = {} if i == 0 else _norm(f"{p}attn_norm", d, nb)
    exp.update(_linear(f"{p}attn.Wqkv", 3 * d, d, bool(c.qkv_bias)))
    exp.update(_linear(f"{p}attn.Wo", d, d, bool(c.out_bias)))
    exp.update(_norm(f"{p}mlp_norm", d, nb))
    exp.update(_linear(f"{p}mlp.Wi", 2 * dm, d, bool(c.mlp_bias)))
    exp.update(_linear(f"{p}mlp.Wo", d, dm, bool(c.mlp_bias)))
    return exp


def _base(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    nb = bool(c.extra["norm_bias"])
    exp = {"embeddings.tok_embeddings.weight": (c.vocab_size, c.d_model)}
    exp.update(_norm("embeddings.norm", c.d_model, nb))
    exp.update(_norm("final_norm", c.d_model, nb))
    return exp


def modernbert_parameter_count(c: ModelConfig) -> tuple[int, int]:
    """(parameters, tensors) a ModernBERT checkpoint of config ``c`` holds at least (no task head)."""
    base, layer = _base(c), _layer(c, 1)
    first = parameter_count(_layer(c, 0).values())
    n_params = parameter_count(base.values()) + first + (c.n_layers - 1) * parameter_count(layer.values())
    return n_params, len(base) + len(_layer(c, 0)) + (c.n_layers - 1) * len(layer)


def _head_shapes(c: ModelConfig, tied: bool) -> dict[str, tuple[int, ...]]:
    d, nb = c.d_model, bool(c.extra["norm_bias"])
    exp = _linear("head.dense", d, d, bool(c.extra["classifier_bias"]))
    exp.update(_norm("head.norm", d, nb))
    exp.update(_linear("decoder", c.vocab_size, d, bool(c.extra["decoder_bias"])))
    if tied:
        del exp["decoder.weight"]
    return exp


class MaskedLMHead(nn.Module):
    """ModernBERT's masked-LM head: ``logits = LN(act(h W_d + b_d)) W_U + b_U`` (``W_U`` the token
    embedding transposed when tied). ``h``: [batch, seq, d_model] final states -> [batch, seq, vocab]."""

    def __init__(self, config: ModelConfig, unembed: nn.Parameter | None) -> None:
        super().__init__()
        d, ex = config.d_model, config.extra
        self.dense = nn.Linear(d, d, bias=bool(ex["classifier_bias"]))
        self.act = make_activation(str(ex["classifier_activation"]))
        self.norm = nn.LayerNorm(d, eps=config.ln_eps)
        self.decoder = nn.Linear(d, config.vocab_size, bias=bool(ex["decoder_bias"]))
        if unembed is not None:
            self.decoder.weight = unembed  # tied to the token embedding

    def forward(self, h: Tensor) -> Tensor:
        """[batch, seq, d_model] -> logits [batch, seq, vocab_size]."""
        return self.decoder(self.norm(self.act(self.dense(h))))


def _state_dict(t: Mapping[str, Tensor], c: ModelConfig) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(headspace Encoder state dict but attention, BERT-layout attention tensors for ``load_hf_bert``)."""
    d, dm = c.d_model, int(c.d_mlp or 0)

    def norm(ours: str, theirs: str) -> dict[str, Tensor]:
        w = t[f"{theirs}.weight"]
        return {f"{ours}.weight": w, f"{ours}.bias": t.get(f"{theirs}.bias", torch.zeros_like(w))}

    sd = {"tok_embed.weight": t["embeddings.tok_embeddings.weight"]}
    sd.update(norm("embed_ln", "embeddings.norm"))
    sd.update(norm("ln_final", "final_norm"))
    attention: dict[str, Tensor] = {}
    for i in range(c.n_layers):
        p, b = f"layers.{i}.", f"blocks.{i}."
        if i:
            sd.update(norm(f"{b}ln1", f"{p}attn_norm"))
        sd.update(norm(f"{b}ln2", f"{p}mlp_norm"))
        wi = t[f"{p}mlp.Wi.weight"]  # (2 d_mlp, d_model): rows [act input; gate]
        sd[f"{b}mlp.fc_gate.weight"], sd[f"{b}mlp.fc_in.weight"] = wi[:dm], wi[dm:]
        sd[f"{b}mlp.fc_out.weight"] = t[f"{p}mlp.Wo.weight"]
        if c.mlp_bias:
            bi = t[f"{p}mlp.Wi.bias"]  # (2 d_mlp,)
            sd[f"{b}mlp.fc_gate.bias"], sd[f"{b}mlp.fc_in.bias"] = bi[:dm], bi[dm:]
            sd[f"{b}mlp.fc_out.bias"] = t[f"{p}mlp.Wo.bias"]
        a = f"{p}attention."
        qkv = t[f"{p}attn.Wqkv.weight"].view(3, d, d)  # (3, n_heads d_head, d_model): [q; k; v]
        for j, proj in enumerate(("query", "key", "value")):
            attention[f"{a}self.{proj}.weight"] = qkv[j]
        attention[f"{a}output.dense.weight"] = t[f"{p}attn.Wo.weight"]
        if c.qkv_bias:
            bq = t[f"{p}attn.Wqkv.bias"].view(3, d)  # (3, n_heads d_head)
            for j, proj in enumerate(("query", "key", "value")):
                attention[f"{a}self.{proj}.bias"] = bq[j]
            attention[f"{a}output.dense.bias"] = t[f"{p}attn.Wo.bias"]
    return sd, attention


def load_modernbert(
    folder: str | Path, *, name: str = "", max_length: int | None = None, precision: str = "float32"
) -> PretrainedEncoder:
    """Load a local Hugging Face ModernBERT checkpoint folder onto a headspace :class:`~headspace.Encoder`.

    As :func:`~headspace.pretrained.load_bert` (the same untrusted-input checks; ``model.``-prefixed task
    checkpoints accepted). A masked-LM checkpoint's head is loaded as ``.mlm_head``
    (:class:`MaskedLMHead`; None otherwise). ``precision``: ``"float32"`` (exact), ``"bfloat16"``, ``"int8"``.

    Raises:
        FileNotFoundError: the folder or a needed file is missing (named).
        ValueError: a config field of the wrong type or range or one headspace cannot represent (named);
            missing/unexpected tensors or shape mismatches (listed with their shapes).
    """
    check_precision(precision)
    ckpt = open_checkpoint(
        folder, name, modernbert_config, "model.", "embeddings.", modernbert_parameter_count, _COUNTED
    )
    config = ckpt.config
    expected = _base(config)
    for i in range(config.n_layers):
        expected.update(_layer(config, i))
    has_head = "head.dense.weight" in ckpt.entries
    tied = "decoder.weight" not in ckpt.entries
    if has_head:
        expected.update(_head_shapes(config, tied))
    ignorable: Callable[[str], bool] = lambda n: n.startswith(("classifier.", "head.", "decoder."))  # noqa: E731
    tensors, ignored = read_checked(ckpt, expected, ignorable)
    model = Encoder(config)
    sd, attention = _state_dict(tensors, config)
    load_converted(model, sd, attention, layouts.load_hf_bert, "layers.{}.attention.")
    pre = PretrainedEncoder(
        model, folder_tokenizer(ckpt.path, config.pad_token_id), max_length=max_length, ignored=ignored
    )
    pre.mlm_head = None  # type: ignore[attr-defined]
    if has_head:
        head = MaskedLMHead(config, model.tok_embed.weight if tied else None)
        state = {k: v for k, v in tensors.items() if k.startswith(("head.", "decoder."))}
        renamed = {k.removeprefix("head."): v for k, v in state.items()}
        if "norm.bias" not in renamed:
            renamed["norm.bias"] = torch.zeros_like(renamed["norm.weight"])
        if tied:
            renamed["decoder.weight"] = model.tok_embed.weight.detach()
        head.load_state_dict(renamed)
        pre.mlm_head = head.eval()  # type: ignore[attr-defined]
    return pre.to_precision(precision)


#: model_type -> loader.
MODERNBERT_LOADERS: dict[str, Callable[..., PretrainedEncoder]] = {"modernbert": load_modernbert}
