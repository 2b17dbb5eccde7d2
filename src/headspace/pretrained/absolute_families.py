"""Decoders with learned absolute positions: opt, gpt_neo, gpt_bigcode.

Each ``config.json`` becomes a :class:`~headspace.ModelConfig` with a learned position table
(``positions="learned"``), LayerNorm blocks and a plain MLP; the tensors are renamed to the Decoder's
state dict. Per family (transformers 5's ``*ForCausalLM``)::

    opt          position p reads row p + 2 of embed_positions (OPT's offset: the table has
                 max_position_embeddings + 2 rows; the first two are dropped, so headspace's row p is
                 OPT's row p + 2); do_layer_norm_before true: the pre layout with a final LayerNorm,
                 false (OPT-350m): the post layout without one; enable_bias switches every bias;
                 layer_norm_elementwise_affine false: norms of weight 1, bias 0; word_embed_proj_dim !=
                 hidden_size: project_in folded into the token table (E P_in^T, [vocab, hidden]) and
                 project_out into the unembedding (E P_out, [vocab, hidden], untied)
    gpt_neo      unscaled scores (scale 1), attention_types expanded to one "global" / "local" per layer,
                 a "local" layer a sliding window of window_size keys (the ``window`` field of its block);
                 q/k/v without bias, out_proj with one
    gpt_bigcode  multi_query: one key/value head (n_kv_heads 1), c_attn rows [q (d); k (d_head);
                 v (d_head)]; otherwise c_attn rows per head [q; k; v]; scale_attn_weights false:
                 scale 1. attention_softmax_in_fp32 and scale_attention_softmax_in_fp32 change nothing
                 in float32

Positions are exact for unpadded rows and for left-padded rows given per-row positions (each row
counting from 0 at its first real token, which is what OPT's cumsum of the attention mask gives).
Anything else these families can set that headspace does not run exactly is refused by its field name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..model.config import ModelConfig
from .family_frame import tie_differs
from .hf import ConfigFields, fitting_headspace
from .llama import _HIDDEN_ACT
from .renamed_loader import family_kind, load_renamed
from .wrappers import PretrainedDecoder

#: OPT's position table starts this many rows before position 0 (transformers' OPTLearnedPositionalEmbedding).
OPT_POSITION_OFFSET = 2
_Renamer = Callable[[dict[str, Tensor], ModelConfig], dict[str, Tensor]]


def _act(f: ConfigFields, key: str, default: str) -> str:
    act = f.text(key, default)
    if act not in _HIDDEN_ACT:
        raise ValueError(f"{f.source}: {key}={act!r} is not supported; supported: {sorted(_HIDDEN_ACT)}")
    return _HIDDEN_ACT[act]


def _refuse(f: ConfigFields, key: str, ok: Callable[[Any], bool], supported: str) -> None:
    if key in f.hf and not ok(f.hf[key]):
        raise ValueError(f"{f.source}: {key}={f.hf[key]!r:.60} is not supported; supported: {supported}")


def _pad(f: ConfigFields, vocab: int) -> int | None:
    pad = f.integer("pad_token_id", None, allow_none=True, minimum=-(2**31))
    return pad if pad is not None and 0 <= pad < vocab else None


# ------------------------------------------------------------------------------------------- configs
def _opt(f: ConfigFields) -> dict[str, Any]:
    f.require(["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "ffn_dim"], "OPT")
    d_model, vocab = f.integer("hidden_size"), f.integer("vocab_size")
    before = f.flag("do_layer_norm_before", True)
    final = before and not f.flag("_remove_final_layer_norm", False)
    proj = f.integer("word_embed_proj_dim", d_model)
    tied = f.flag("tie_word_embeddings", True)
    bias = f.flag("enable_bias", True)
    extra = {"position_offset": OPT_POSITION_OFFSET, "word_embed_proj_dim": proj, "tied_checkpoint": tied}
    return dict(
        vocab_size=vocab, d_model=d_model, n_layers=f.integer("num_hidden_layers"),
        n_heads=f.integer("num_attention_heads"), d_mlp=f.integer("ffn_dim"),
        max_seq_len=f.integer("max_position_embeddings", 2048), act=_act(f, "activation_function", "relu"),
        norm="pre" if before else "post", embed_ln=False, final_ln=final, ln_eps=1e-5, bias=bias,
        dropout=f.probability("dropout", 0.1), attn_dropout=f.probability("attention_dropout", 0.0),
        tie_embeddings=tied and proj == d_model, pad_token_id=_pad(f, vocab),
        extra={**extra, "elementwise_affine": f.flag("layer_norm_elementwise_affine", True)},
    )  # fmt: skip


def _attention_layers(f: ConfigFields, n_layers: int) -> list[str]:
    """GPT-Neo's ``attention_types`` ([[["global", "local"], repeats], ...]) expanded, one per layer."""
    types = f.hf.get("attention_types", [[["global", "local"], 12]])
    out: list[str] = []
    ok = isinstance(types, list)
    for item in types if ok else []:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], list)
                and isinstance(item[1], int) and not isinstance(item[1], bool) and item[1] >= 0
                and all(t in ("global", "local") for t in item[0])):  # fmt: skip
            ok = False
            break
        out += list(item[0]) * item[1]
    if not ok or len(out) != n_layers:
        raise ValueError(
            f"{f.source}: attention_types must expand to one of ['global', 'local'] per layer "
            f"(num_layers={n_layers}); got {types!r:.120}"
        )
    return out


def _gpt_neo(f: ConfigFields) -> dict[str, Any]:
    f.require(["vocab_size", "hidden_size", "num_layers", "num_heads"], "GPT-Neo")
    d_model, n_layers, vocab = f.integer("hidden_size"), f.integer("num_layers"), f.integer("vocab_size")
    kinds = _attention_layers(f, n_layers)
    window = f.integer("window_size", 256)
    local = "local" in kinds
    return dict(
        vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=f.integer("num_heads"),
        d_mlp=f.integer("intermediate_size", None, allow_none=True) or 4 * d_model,
        max_seq_len=f.integer("max_position_embeddings", 2048),
        act=_act(f, "activation_function", "gelu_new"), norm="pre",
        ln_eps=f.number("layer_norm_epsilon", 1e-5, low=0.0, low_open=True),
        bias=True, qkv_bias=False, out_bias=True, mlp_bias=True, query_pre_attn_scalar=1.0,
        sliding_window=window if local else None,
        layer_types=["sliding" if k == "local" else "full" for k in kinds] if local else None,
        dropout=f.probability("resid_dropout", 0.0), emb_dropout=f.probability("embed_dropout", 0.0),
        attn_dropout=f.probability("attention_dropout", 0.0),
        tie_embeddings=f.flag("tie_word_embeddings", True), pad_token_id=_pad(f, vocab), extra={},
    )  # fmt: skip


def _gpt_bigcode(f: ConfigFields) -> dict[str, Any]:
    f.require(["vocab_size", "n_embd", "n_layer", "n_head"], "GPT-BigCode")
    _refuse(f, "add_cross_attention", lambda v: v is False, "false")
    d_model, n_heads, vocab = f.integer("n_embd"), f.integer("n_head"), f.integer("vocab_size")
    mq = f.flag("multi_query", True)
    return dict(
        vocab_size=vocab, d_model=d_model, n_layers=f.integer("n_layer"), n_heads=n_heads,
        n_kv_heads=1 if mq else n_heads, d_mlp=f.integer("n_inner", None, allow_none=True) or 4 * d_model,
        max_seq_len=f.integer("n_positions", 1024), act=_act(f, "activation_function", "gelu_pytorch_tanh"),
        norm="pre", ln_eps=f.number("layer_norm_epsilon", 1e-5, low=0.0, low_open=True), bias=True,
        query_pre_attn_scalar=None if f.flag("scale_attn_weights", True) else 1.0,
        dropout=f.probability("resid_pdrop", 0.1), emb_dropout=f.probability("embd_pdrop", 0.1),
        attn_dropout=f.probability("attn_pdrop", 0.1),
        tie_embeddings=f.flag("tie_word_embeddings", True), pad_token_id=_pad(f, vocab),
        extra={"multi_query": mq},
    )  # fmt: skip


# ------------------------------------------------------------------------------------------- tensors
def _norm(sd: dict[str, Tensor], t: dict[str, Tensor], ours: str, theirs: str, affine: bool = True) -> None:
    """A LayerNorm: its weight and bias, or weight 1 and bias 0 where it has none (OPT's non-affine)."""
    if affine:
        sd[f"{ours}.weight"], sd[f"{ours}.bias"] = t.pop(f"{theirs}.weight"), t.pop(f"{theirs}.bias")
    else:
        sd[f"{ours}.weight"], sd[f"{ours}.bias"] = torch.ones(0), torch.zeros(0)  # sized in _sized_norms


def _linear(sd: dict[str, Tensor], t: dict[str, Tensor], ours: str, theirs: str, bias: bool) -> None:
    sd[f"{ours}.weight"] = t.pop(f"{theirs}.weight")
    if bias:
        sd[f"{ours}.bias"] = t.pop(f"{theirs}.bias")


def _qkv(sd: dict[str, Tensor], t: dict[str, Tensor], b: str, a: str, bias: bool) -> None:
    """Separate q, k, v projections into the fused ``qkv_weight`` rows [q; k; v]."""
    sd[b + "attn.qkv_weight"] = torch.cat([t.pop(f"{a}{x}_proj.weight") for x in "qkv"])  # [3 H dh, d]
    if bias:
        sd[b + "attn.qkv_bias"] = torch.cat([t.pop(f"{a}{x}_proj.bias") for x in "qkv"])  # [3 H dh]


def _opt_tensors(t: dict[str, Tensor], c: ModelConfig) -> dict[str, Tensor]:
    p = "model.decoder." if "model.decoder.embed_tokens.weight" in t else "decoder."
    affine = bool(c.extra["elementwise_affine"])
    embed = t.pop(p + "embed_tokens.weight")  # [vocab, word_embed_proj_dim]
    table = t.pop(p + "embed_positions.weight")  # [max_seq_len + 2, d_model]
    if table.shape[0] != c.max_seq_len + OPT_POSITION_OFFSET:
        raise ValueError(
            f"{p}embed_positions.weight must have max_position_embeddings + 2 = "
            f"{c.max_seq_len + OPT_POSITION_OFFSET} rows (OPT's offset 2); found {list(table.shape)}"
        )
    sd: dict[str, Tensor] = {"pos_embed.weight": table[OPT_POSITION_OFFSET:]}  # [max_seq_len, d_model]
    head = embed if c.extra["tied_checkpoint"] else t.pop("lm_head.weight")  # [vocab, proj]
    if c.extra["tied_checkpoint"] and tie_differs(t.pop("lm_head.weight", None), embed):
        raise ValueError("tie_word_embeddings=true but lm_head.weight differs from embed_tokens.weight")
    if c.extra["word_embed_proj_dim"] != c.d_model:
        sd["tok_embed.weight"] = embed @ t.pop(p + "project_in.weight").T  # [vocab, d_model]
        sd["lm_head.weight"] = head @ t.pop(p + "project_out.weight")  # [vocab, d_model]
    else:
        sd["tok_embed.weight"] = embed
        if not c.tie_embeddings:
            sd["lm_head.weight"] = head
    for i in range(c.n_layers):
        q, b = f"{p}layers.{i}.", f"blocks.{i}."
        _norm(sd, t, b + "ln1", q + "self_attn_layer_norm", affine)
        _norm(sd, t, b + "ln2", q + "final_layer_norm", affine)
        _qkv(sd, t, b, q + "self_attn.", c.bias)
        sd[b + "attn.o_weight"] = t.pop(q + "self_attn.out_proj.weight")
        if c.bias:
            sd[b + "attn.o_bias"] = t.pop(q + "self_attn.out_proj.bias")
        _linear(sd, t, b + "mlp.fc_in", q + "fc1", c.bias)
        _linear(sd, t, b + "mlp.fc_out", q + "fc2", c.bias)
    if c.final_ln:
        _norm(sd, t, "ln_final", p + "final_layer_norm", affine)
    return {**t, **sd}


def _gpt2_like(t: dict[str, Tensor], c: ModelConfig, attn: Callable[..., None]) -> dict[str, Tensor]:
    """GPT-Neo / GPT-BigCode: ``transformer.``-prefixed wte, wpe, h.{i}.ln_1 / ln_2 / mlp.c_fc / c_proj,
    ln_f (Linear layers, [out, in]); ``attn(sd, t, block prefix, layer prefix)`` moves the attention."""
    p = "transformer." if "transformer.wte.weight" in t else ""
    sd: dict[str, Tensor] = {
        "tok_embed.weight": t.pop(p + "wte.weight"),
        "pos_embed.weight": t.pop(p + "wpe.weight"),
    }
    for i in range(c.n_layers):
        q, b = f"{p}h.{i}.", f"blocks.{i}."
        _norm(sd, t, b + "ln1", q + "ln_1")
        _norm(sd, t, b + "ln2", q + "ln_2")
        attn(sd, t, b, q)
        _linear(sd, t, b + "mlp.fc_in", q + "mlp.c_fc", True)
        _linear(sd, t, b + "mlp.fc_out", q + "mlp.c_proj", True)
    _norm(sd, t, "ln_final", p + "ln_f")
    head = t.pop("lm_head.weight", None)
    if c.tie_embeddings and tie_differs(head, sd["tok_embed.weight"]):
        raise ValueError("tie_word_embeddings=true but lm_head.weight differs from wte.weight")
    if not c.tie_embeddings:
        sd["lm_head.weight"] = t.pop("lm_head.weight") if head is None else head
    return {k: v for k, v in {**t, **sd}.items() if not k.endswith(("attn.bias", "attn.masked_bias"))}


def _neo_tensors(t: dict[str, Tensor], c: ModelConfig) -> dict[str, Tensor]:
    def attn(sd: dict[str, Tensor], t: dict[str, Tensor], b: str, q: str) -> None:
        _qkv(sd, t, b, q + "attn.attention.", False)
        sd[b + "attn.o_weight"] = t.pop(q + "attn.attention.out_proj.weight")
        sd[b + "attn.o_bias"] = t.pop(q + "attn.attention.out_proj.bias")

    return _gpt2_like(t, c, attn)


def _bigcode_tensors(t: dict[str, Tensor], c: ModelConfig) -> dict[str, Tensor]:
    assert c.d_head is not None
    H, dh, d = c.n_heads, c.d_head, c.d_model

    def attn(sd: dict[str, Tensor], t: dict[str, Tensor], b: str, q: str) -> None:
        w, bias = t.pop(q + "attn.c_attn.weight"), t.pop(q + "attn.c_attn.bias")  # [(H + 2 Hkv) dh, d]
        if not c.extra["multi_query"] and w.shape == (3 * H * dh, d):  # rows per head: [H, 3, dh]
            w = w.view(H, 3, dh, d).transpose(0, 1).reshape(3 * H * dh, d)  # [3 H dh, d]: q, k, v
            bias = bias.view(H, 3, dh).transpose(0, 1).reshape(3 * H * dh)  # [3 H dh]
        sd[b + "attn.qkv_weight"], sd[b + "attn.qkv_bias"] = w, bias  # multi-query: [q (d); k (dh); v (dh)]
        sd[b + "attn.o_weight"] = t.pop(q + "attn.c_proj.weight")
        sd[b + "attn.o_bias"] = t.pop(q + "attn.c_proj.bias")

    return _gpt2_like(t, c, attn)


#: model_type -> (config fields, tensor renamer).
FAMILIES: dict[str, tuple[Callable[[ConfigFields], dict[str, Any]], _Renamer]] = {
    "opt": (_opt, _opt_tensors),
    "gpt_neo": (_gpt_neo, _neo_tensors),
    "gpt_bigcode": (_gpt_bigcode, _bigcode_tensors),
}
#: The ``config.json`` model types of :data:`FAMILIES`.
ABSOLUTE_FAMILY_TYPES = tuple(FAMILIES)


def absolute_family_config(
    hf: Mapping[str, Any], name: str = "", *, source: str = "config.json"
) -> ModelConfig:
    """The :class:`ModelConfig` of a ``config.json`` of one of :data:`FAMILIES` (module docstring);
    a field headspace cannot run exactly is refused by name."""
    f = ConfigFields(hf, source)
    kind = family_kind(f, FAMILIES)
    kw = FAMILIES[kind][0](f)
    kw["extra"] = {**kw["extra"], "model_type": kind}
    with fitting_headspace(source):
        return ModelConfig(arch="decoder", type_vocab_size=0, positions="learned", name=name, **kw)


def _sized_norms(sd: dict[str, Tensor], expected: dict[str, tuple[int, ...]]) -> None:
    """Norms without parameters (placeholders of size 0 from :func:`_norm`): weight 1, bias 0."""
    for key, shape in expected.items():
        if key in sd and sd[key].numel() == 0 and len(shape) == 1 and shape[0]:
            sd[key] = torch.ones(shape) if key.endswith(".weight") else torch.zeros(shape)


def load_absolute_family(
    folder: str | Path, *, name: str = "", precision: str = "float32"
) -> PretrainedDecoder:
    """Load a checkpoint folder of one of :data:`FAMILIES` onto a Decoder: the config field by field
    (:func:`absolute_family_config`), then missing / unexpected / mis-shaped tensors refused (listed)
    from the safetensors headers, before any tensor is read (:func:`~.renamed_loader.load_renamed`)."""

    def read(hf: dict[str, Any], name: str, source: str) -> ModelConfig:
        return absolute_family_config(hf, name, source=source)

    renamers = {k: v[1] for k, v in FAMILIES.items()}
    return load_renamed(folder, read, renamers, name=name, precision=precision, fill=_sized_norms)
