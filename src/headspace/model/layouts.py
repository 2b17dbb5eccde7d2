"""Exact conversion between headspace's attention layer and other libraries' weight layouts.

Four layouts, each a flat dict of tensors (a state dict, or a slice of one under a key ``prefix``):

``torch_mha`` -- ``torch.nn.MultiheadAttention`` (``E = n_heads * d_head = d_model``)::

    in_proj_weight   [3 E, E]        rows [W_q; W_k; W_v], nn.Linear [out, in], head-major rows
      or q_proj_weight [E, E], k_proj_weight [E, kdim], v_proj_weight [E, vdim]   (kdim/vdim != E)
    in_proj_bias     [3 E]           optional (bias=False)
    out_proj.weight  [E, E]          [out, in]: columns are head-major
    out_proj.bias    [E]             optional (bias=False)
    (bias_k, bias_v [1, 1, E] exist only with add_bias_kv: use headspace.compat.MultiheadAttention)

``hf_bert`` -- Hugging Face ``BertAttention`` (``BertSelfAttention`` + the ``dense`` of ``BertSelfOutput``);
in a ``BertModel`` checkpoint the prefix is ``encoder.layer.{i}.attention.``::

    self.query.weight  [n_heads d_head, d_model]   nn.Linear [out, in]
    self.query.bias    [n_heads d_head]
    self.key.*, self.value.*                        the same shapes
    output.dense.weight [d_model, n_heads d_head]
    output.dense.bias   [d_model]
    (output.LayerNorm.* belongs to the residual block, not to attention: ignored when present)

``gpt2`` -- Hugging Face ``GPT2Attention``; ``Conv1D`` computes ``x @ W + b``, so its weights are stored
transposed relative to ``nn.Linear``; in a ``GPT2Model`` checkpoint the prefix is ``h.{i}.attn.``::

    c_attn.weight  [d_model, 3 d_model]   columns [q | k | v], each head-major
    c_attn.bias    [3 d_model]
    c_proj.weight  [d_model, d_model]     rows head-major (z @ W)
    c_proj.bias    [d_model]
    (the causal-mask buffers ``bias`` / ``masked_bias`` of older checkpoints are ignored; GPT-2
    attention is causal: call the converted layer with ``is_causal=True``)

``transformer_lens`` -- TransformerLens's per-head tensors (prefix ``blocks.{i}.attn.``)::

    W_Q [n_heads, d_model, d_head]      q_h = x @ W_Q[h] + b_Q[h]
    W_K [n_heads, d_model, d_head]      or _W_K [n_kv_heads, d_model, d_head] (grouped-query attention)
    W_V [n_heads, d_model, d_head]      or _W_V [n_kv_heads, d_model, d_head]
    W_O [n_heads, d_head, d_model]      out = sum_h z_h @ W_O[h] + b_O
    b_Q [n_heads, d_head]; b_K, b_V [n_heads, d_head] (or _b_K, _b_V [n_kv_heads, d_head]); b_O [d_model]
    (the buffers mask, IGNORE, rotary_sin, rotary_cos are ignored)

For each layout: ``to_<layout>(attn, prefix="") -> dict`` (fresh tensors, not views of the layer),
``from_<layout>(state_dict, ..., prefix="") -> MultiHeadAttention`` (a new layer) and
``load_<layout>(attn, state_dict, prefix="") -> attn`` (copies in place: usable on a layer inside a
model). Conversions only move and transpose values, so round trips are bit-exact. Keys outside
``prefix`` are ignored (a whole-model checkpoint can be passed); under it, missing keys, unexpected
keys and shape mismatches raise :class:`LayoutError`, which lists them all.

What a layout does not hold: the softmax scale (all four use ``1 / sqrt(d_head)``; GPT-2's
``scale_attn_by_inverse_layer_idx`` needs ``from_gpt2(..., scale=...)``), dropout and masking. Biases
are all or none: ``torch_mha`` keeps ``bias=False``; the other three always carry biases, so a
bias-free layer is written with zero biases there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from ..attention.layer import MultiHeadAttention
from ..core.checks import is_int

__all__ = [
    "LAYOUTS",
    "LayoutError",
    "from_gpt2",
    "from_hf_bert",
    "from_torch_mha",
    "from_transformer_lens",
    "load_gpt2",
    "load_hf_bert",
    "load_torch_mha",
    "load_transformer_lens",
    "to_gpt2",
    "to_hf_bert",
    "to_torch_mha",
    "to_transformer_lens",
]

LAYOUTS = ("torch_mha", "hf_bert", "gpt2", "transformer_lens")

# Keys under a layout's prefix that are not attention weights and are skipped.
_IGNORED: dict[str, tuple[str, ...]] = {
    "torch_mha": (),
    "hf_bert": (
        "output.LayerNorm.weight",
        "output.LayerNorm.bias",
        "output.LayerNorm.gamma",
        "output.LayerNorm.beta",
    ),
    "gpt2": ("bias", "masked_bias"),
    "transformer_lens": ("mask", "IGNORE", "rotary_sin", "rotary_cos"),
}


class LayoutError(ValueError):
    """A state dict that does not fit a layout; lists missing and unexpected keys and mismatched shapes."""

    def __init__(
        self,
        layout: str,
        prefix: str,
        *,
        missing: Iterable[str] = (),
        unexpected: Iterable[str] = (),
        mismatched: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
        note: str = "",
    ) -> None:
        self.layout = layout
        self.prefix = prefix
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        self.mismatched = dict(mismatched or {})
        where = f"under prefix {prefix!r}" if prefix else "(no prefix)"
        lines = [f"state dict does not fit the {layout} layout {where}:"]
        if self.missing:
            lines.append(f"  missing keys: {[prefix + k for k in self.missing]}")
        if self.unexpected:
            lines.append(f"  unexpected keys: {[prefix + k for k in self.unexpected]}")
        for k, (want, got) in self.mismatched.items():
            lines.append(f"  {prefix + k}: expected shape {list(want)}, got {list(got)}")
        if note:
            lines.append(f"  {note}")
        super().__init__("\n".join(lines))


@dataclass
class _Parts:
    """One attention layer in a layout-neutral form: nn.Linear [out, in] matrices, head-major rows.

    q [n_heads d_head, d_model], k [n_kv_heads d_head, kdim], v [n_kv_heads d_head, vdim],
    o [d_model, n_heads d_head]; biases bq [n_heads d_head], bk, bv [n_kv_heads d_head], bo [d_model],
    all None when the layer has no bias.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    o: Tensor
    bq: Tensor | None
    bk: Tensor | None
    bv: Tensor | None
    bo: Tensor | None
    n_heads: int
    n_kv_heads: int
    d_head: int

    @property
    def d_model(self) -> int:
        return self.q.shape[1]

    @property
    def has_bias(self) -> bool:
        return self.bq is not None


# ---------------------------------------------------------------------------------------------- helpers
def _check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str):
        raise TypeError(
            f"prefix must be a str (e.g. 'encoder.layer.0.attention.'); got {type(prefix).__name__}"
        )


def _under_prefix(state_dict: Mapping[str, Tensor], prefix: str, layout: str) -> dict[str, Tensor]:
    """The entries under ``prefix`` with the prefix removed; non-tensors are refused."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of str to tensors; got {type(state_dict).__name__}")
    _check_prefix(prefix)
    out = {}
    for key, value in state_dict.items():
        if not isinstance(key, str) or not key.startswith(prefix):
            continue
        if not isinstance(value, Tensor):
            raise TypeError(f"state_dict[{key!r}] must be a tensor; got {type(value).__name__}")
        out[key[len(prefix) :]] = value
    if not out:
        some = [k for k in list(state_dict)[:5]]
        raise LayoutError(
            layout,
            prefix,
            note=f"no key starts with the prefix; the state dict's first keys are {some}",
        )
    return out


def _check_keys(
    layout: str,
    prefix: str,
    got: Mapping[str, Tensor],
    expected: Mapping[str, tuple[int, ...]],
    optional: Iterable[str] = (),
) -> None:
    """Raise one LayoutError listing every missing, unexpected and mis-shaped key (ignored keys aside)."""
    optional = set(optional)
    ignored = set(_IGNORED[layout])
    missing = [k for k in expected if k not in got and k not in optional]
    unexpected = [k for k in got if k not in expected and k not in ignored]
    mismatched = {
        k: (want, tuple(got[k].shape))
        for k, want in expected.items()
        if k in got and tuple(got[k].shape) != want
    }
    if missing or unexpected or mismatched:
        raise LayoutError(layout, prefix, missing=missing, unexpected=unexpected, mismatched=mismatched)
    not_float = [
        f"{prefix + k} ({got[k].dtype})" for k in expected if k in got and not got[k].is_floating_point()
    ]
    if not_float:
        raise LayoutError(
            layout,
            prefix,
            note="weights must be floating point (float32, float64, float16 or bfloat16); got "
            + ", ".join(not_float),
        )
    dtypes = {str(got[k].dtype) for k in expected if k in got}
    if len(dtypes) > 1:
        raise LayoutError(
            layout, prefix, note=f"the tensors have different dtypes {sorted(dtypes)}; expected one"
        )


def _require_rank(
    layout: str, prefix: str, got: Mapping[str, Tensor], key: str, rank: int, shape: str
) -> None:
    """``got[key]`` (when present) must have ``rank`` dims: the shape is read from it, so check it first."""
    if key in got and got[key].dim() != rank:
        t = got[key]
        raise LayoutError(
            layout,
            prefix,
            note=f"{prefix + key} must be a {rank}-D tensor {shape}; got a {t.dim()}-D tensor of shape "
            f"{list(t.shape)}",
        )


def _bias_keys_all_or_none(layout: str, prefix: str, got: Mapping[str, Tensor], bias_keys: list[str]) -> bool:
    present = [k for k in bias_keys if k in got]
    if present and len(present) != len(bias_keys):
        raise LayoutError(
            layout,
            prefix,
            missing=[k for k in bias_keys if k not in got],
            note="biases are all or none: a layer either has every bias or none",
        )
    return bool(present)


def _check_n_heads(n_heads: int, width: int, what: str) -> int:
    if not is_int(n_heads) or n_heads <= 0:
        raise ValueError(f"n_heads must be a positive int; got {n_heads!r}")
    if width % n_heads != 0:
        raise ValueError(
            f"n_heads={n_heads} does not divide {what}={width}; the layout stores n_heads * d_head rows"
        )
    return width // n_heads


def _fresh(t: Tensor) -> Tensor:
    """A contiguous copy that shares nothing with the layer (same dtype, device and bits)."""
    return t.detach().contiguous().clone()


def _parts_of(attn: MultiHeadAttention) -> _Parts:
    """Read a headspace layer (or compat.MultiheadAttention) through its per-head views."""
    if not isinstance(attn, MultiHeadAttention):
        raise TypeError(f"attn must be a headspace MultiHeadAttention; got {type(attn).__name__}")
    H, Hkv, dh, d = attn.n_heads, attn.n_kv_heads, attn.d_head, attn.d_model
    q = attn.W_Q.transpose(1, 2).reshape(H * dh, d)  # (H dh, d_model)
    k = attn.W_K.transpose(1, 2).reshape(Hkv * dh, attn.kdim)  # (Hkv dh, kdim)
    v = attn.W_V.transpose(1, 2).reshape(Hkv * dh, attn.vdim)  # (Hkv dh, vdim)
    o = attn.W_O.permute(2, 0, 1).reshape(d, H * dh)  # (d_model, H dh)
    bq = bk = bv = bo = None
    if attn.b_Q is not None:
        bq = attn.b_Q.reshape(H * dh)  # (H dh,)
        bk = attn.b_K.reshape(Hkv * dh)  # (Hkv dh,)
        bv = attn.b_V.reshape(Hkv * dh)  # (Hkv dh,)
    bo = attn.b_O
    if (bq is None) != (bo is None):  # q/k/v biases without an output bias (Qwen2), or the other way
        # the layouts hold both or neither: the missing one is zero, which is what the layer computes
        zeros = q.new_zeros
        bq, bk, bv = (zeros(H * dh), zeros(Hkv * dh), zeros(Hkv * dh)) if bq is None else (bq, bk, bv)
        bo = zeros(d) if bo is None else bo
    detached = [None if t is None else t.detach() for t in (q, k, v, o, bq, bk, bv, bo)]
    return _Parts(*detached, H, Hkv, dh)  # type: ignore[arg-type]


def _zero_bias_if_none(p: _Parts) -> _Parts:
    if p.has_bias:
        return p
    z = p.q.new_zeros
    return _Parts(
        p.q, p.k, p.v, p.o,
        z(p.q.shape[0]), z(p.k.shape[0]), z(p.v.shape[0]), z(p.o.shape[0]),
        p.n_heads, p.n_kv_heads, p.d_head,
    )  # fmt: skip


def _new_layer(p: _Parts, scale: float | None) -> MultiHeadAttention:
    return MultiHeadAttention(
        d_model=p.d_model,
        n_heads=p.n_heads,
        d_head=p.d_head,
        n_kv_heads=p.n_kv_heads,
        kdim=p.k.shape[1],
        vdim=p.v.shape[1],
        bias=p.has_bias,
        scale=scale,
        device=p.q.device,
        dtype=p.q.dtype,
    )


def _load_parts(attn: MultiHeadAttention, p: _Parts, layout: str) -> MultiHeadAttention:
    """Copy ``p`` into ``attn`` in place, after checking that every size fits."""
    if not isinstance(attn, MultiHeadAttention):
        raise TypeError(f"attn must be a headspace MultiHeadAttention; got {type(attn).__name__}")
    want = {
        "d_model": attn.d_model,
        "n_heads": attn.n_heads,
        "n_kv_heads": attn.n_kv_heads,
        "d_head": attn.d_head,
        "kdim": attn.kdim,
        "vdim": attn.vdim,
        "bias": attn.b_Q is not None or attn.b_O is not None,
    }
    got = {
        "d_model": p.d_model,
        "n_heads": p.n_heads,
        "n_kv_heads": p.n_kv_heads,
        "d_head": p.d_head,
        "kdim": p.k.shape[1],
        "vdim": p.v.shape[1],
        "bias": p.has_bias,
    }
    if got["bias"] and not want["bias"] and layout != "torch_mha":
        # these layouts always carry biases; zeros fit a bias-free layer, anything else does not
        if all(bool((b == 0).all()) for b in (p.bq, p.bk, p.bv, p.bo)):  # type: ignore[union-attr]
            got["bias"] = False
    diff = {k: (want[k], got[k]) for k in want if want[k] != got[k]}
    if diff:
        details = ", ".join(f"{k}: layer {a}, state dict {b}" for k, (a, b) in diff.items())
        raise ValueError(f"the {layout} weights do not fit this layer ({details})")
    H, Hkv, dh, d = attn.n_heads, attn.n_kv_heads, attn.d_head, attn.d_model
    with torch.no_grad():
        attn.W_Q.copy_(p.q.view(H, dh, d).transpose(1, 2))  # (H, d_model, dh)
        attn.W_K.copy_(p.k.view(Hkv, dh, attn.kdim).transpose(1, 2))  # (Hkv, kdim, dh)
        attn.W_V.copy_(p.v.view(Hkv, dh, attn.vdim).transpose(1, 2))  # (Hkv, vdim, dh)
        attn.W_O.copy_(p.o.view(d, H, dh).permute(1, 2, 0))  # (H, dh, d_model)
        for name, have, bias in (
            ("q/k/v", attn.b_Q is not None, p.bq),
            ("output", attn.b_O is not None, p.bo),
        ):
            if want["bias"] and not have and bias is not None and not bool((bias == 0).all()):
                raise ValueError(
                    f"the {layout} weights do not fit this layer (it has no {name} bias; the state dict's "
                    "is not zero)"
                )
        if attn.b_Q is not None:
            attn.b_Q.copy_(p.bq.view(H, dh))  # (H, dh)
            attn.b_K.copy_(p.bk.view(Hkv, dh))  # (Hkv, dh)
            attn.b_V.copy_(p.bv.view(Hkv, dh))  # (Hkv, dh)
        if attn.b_O is not None:
            attn.b_O.copy_(p.bo)
    return attn


def _require_mha_shape(p: _Parts, layout: str, *, self_attention: bool) -> None:
    """torch MHA, BERT and GPT-2 have n_kv_heads == n_heads and (BERT aside) n_heads d_head == d_model."""
    problems = []
    if p.n_kv_heads != p.n_heads:
        problems.append(f"n_kv_heads={p.n_kv_heads} != n_heads={p.n_heads} (grouped-query attention)")
    if layout in ("torch_mha", "gpt2") and p.n_heads * p.d_head != p.d_model:
        problems.append(f"n_heads * d_head = {p.n_heads * p.d_head} != d_model = {p.d_model}")
    if self_attention and (p.k.shape[1] != p.d_model or p.v.shape[1] != p.d_model):
        problems.append(f"kdim={p.k.shape[1]}, vdim={p.v.shape[1]} differ from d_model={p.d_model}")
    if problems:
        raise ValueError(f"this layer cannot be written in the {layout} layout: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------------- torch MHA
def _read_torch_mha(sd: Mapping[str, Tensor], n_heads: int, prefix: str) -> _Parts:
    layout = "torch_mha"
    got = _under_prefix(sd, prefix, layout)
    if "bias_k" in got or "bias_v" in got:
        raise LayoutError(
            layout,
            prefix,
            unexpected=[k for k in ("bias_k", "bias_v") if k in got],
            note="add_bias_kv has no place in headspace.MultiHeadAttention; load this state dict into "
            "headspace.compat.MultiheadAttention(..., add_bias_kv=True) instead",
        )
    fused = "in_proj_weight" in got
    _require_rank(layout, prefix, got, "in_proj_weight", 2, "[3 embed_dim, embed_dim]")
    _require_rank(layout, prefix, got, "q_proj_weight", 2, "[embed_dim, embed_dim]")
    _require_rank(layout, prefix, got, "k_proj_weight", 2, "[embed_dim, kdim]")
    _require_rank(layout, prefix, got, "v_proj_weight", 2, "[embed_dim, vdim]")
    if fused:
        E = got["in_proj_weight"].shape[-1]
        kdim = vdim = E
    elif "q_proj_weight" in got:
        E = got["q_proj_weight"].shape[0]
        kdim = got["k_proj_weight"].shape[-1] if "k_proj_weight" in got else E
        vdim = got["v_proj_weight"].shape[-1] if "v_proj_weight" in got else E
    else:
        raise LayoutError(
            layout,
            prefix,
            missing=["in_proj_weight"],
            note="(or q_proj_weight, k_proj_weight, v_proj_weight)",
        )
    expected: dict[str, tuple[int, ...]] = {}
    if fused:
        expected["in_proj_weight"] = (3 * E, E)
    else:
        expected.update(q_proj_weight=(E, E), k_proj_weight=(E, kdim), v_proj_weight=(E, vdim))
    expected.update({"in_proj_bias": (3 * E,), "out_proj.weight": (E, E), "out_proj.bias": (E,)})
    bias = _bias_keys_all_or_none(layout, prefix, got, ["in_proj_bias", "out_proj.bias"])
    _check_keys(layout, prefix, got, expected, optional=() if bias else ("in_proj_bias", "out_proj.bias"))
    dh = _check_n_heads(n_heads, E, "embed_dim")
    if fused:
        q, k, v = got["in_proj_weight"].split(E, dim=0)  # (E, E) x 3
    else:
        q, k, v = got["q_proj_weight"], got["k_proj_weight"], got["v_proj_weight"]
    bq = bk = bv = bo = None
    if bias:
        bq, bk, bv = got["in_proj_bias"].split(E)  # (E,) x 3
        bo = got["out_proj.bias"]
    return _Parts(q, k, v, got["out_proj.weight"], bq, bk, bv, bo, n_heads, n_heads, dh)


def to_torch_mha(attn: MultiHeadAttention, prefix: str = "") -> dict[str, Tensor]:
    """The ``torch.nn.MultiheadAttention`` state dict of ``attn`` (keys prefixed with ``prefix``).

    ``torch.nn.MultiheadAttention(d_model, n_heads, bias=..., kdim=..., vdim=...).load_state_dict(...)``
    accepts it. A :class:`headspace.compat.MultiheadAttention` is written with its ``bias_k``/``bias_v``.
    """
    _check_prefix(prefix)
    from ..attention.compat import MultiheadAttention as CompatMHA

    if isinstance(attn, CompatMHA):
        return {prefix + k: _fresh(v) for k, v in attn.state_dict().items()}
    p = _parts_of(attn)
    _require_mha_shape(p, "torch_mha", self_attention=False)
    out: dict[str, Tensor] = {}
    if p.k.shape[1] == p.d_model and p.v.shape[1] == p.d_model:
        out["in_proj_weight"] = torch.cat([p.q, p.k, p.v], dim=0)  # (3 E, E)
    else:
        out.update(q_proj_weight=_fresh(p.q), k_proj_weight=_fresh(p.k), v_proj_weight=_fresh(p.v))
    if p.has_bias:
        out["in_proj_bias"] = torch.cat([p.bq, p.bk, p.bv])  # (3 E,)
    out["out_proj.weight"] = _fresh(p.o)
    if p.has_bias:
        out["out_proj.bias"] = _fresh(p.bo)  # type: ignore[arg-type]
    return {prefix + k: v for k, v in out.items()}


def from_torch_mha(
    state_dict: Mapping[str, Tensor], *, n_heads: int, prefix: str = "", scale: float | None = None
) -> MultiHeadAttention:
    """A new :class:`MultiHeadAttention` holding a ``torch.nn.MultiheadAttention`` state dict.

    ``n_heads`` is torch's ``num_heads`` (a state dict does not record it); d_model, kdim, vdim and bias
    are read from the shapes. The new layer is batch-first and uses headspace's mask convention.
    """
    return _load_parts_new(_read_torch_mha(state_dict, n_heads, prefix), scale)


def load_torch_mha(
    attn: MultiHeadAttention, state_dict: Mapping[str, Tensor], *, prefix: str = ""
) -> MultiHeadAttention:
    """Copy a ``torch.nn.MultiheadAttention`` state dict into ``attn`` in place; returns ``attn``."""
    return _load_parts(attn, _read_torch_mha(state_dict, attn.n_heads, prefix), "torch_mha")


def _load_parts_new(p: _Parts, scale: float | None) -> MultiHeadAttention:
    return _load_parts(_new_layer(p, scale), p, "new layer")


# ---------------------------------------------------------------------------------------------- HF BERT
_BERT_LINEARS = ("self.query", "self.key", "self.value", "output.dense")


def _read_hf_bert(sd: Mapping[str, Tensor], n_heads: int, prefix: str) -> _Parts:
    layout = "hf_bert"
    got = _under_prefix(sd, prefix, layout)
    if "self.query.weight" not in got:
        raise LayoutError(layout, prefix, missing=["self.query.weight"], note=f"found keys {sorted(got)}")
    _require_rank(
        layout, prefix, got, "self.query.weight", 2, "[n_heads d_head, d_model] (nn.Linear [out, in])"
    )
    hd, d = got["self.query.weight"].shape  # (n_heads d_head, d_model)
    expected = {
        "self.query.weight": (hd, d),
        "self.key.weight": (hd, d),
        "self.value.weight": (hd, d),
        "output.dense.weight": (d, hd),
        "self.query.bias": (hd,),
        "self.key.bias": (hd,),
        "self.value.bias": (hd,),
        "output.dense.bias": (d,),
    }
    bias_keys = [f"{name}.bias" for name in _BERT_LINEARS]
    bias = _bias_keys_all_or_none(layout, prefix, got, bias_keys)
    _check_keys(layout, prefix, got, expected, optional=() if bias else bias_keys)
    dh = _check_n_heads(n_heads, hd, "the query width (all_head_size)")
    w = [got[f"{name}.weight"] for name in _BERT_LINEARS]
    b = [got[f"{name}.bias"] for name in _BERT_LINEARS] if bias else [None] * 4
    return _Parts(w[0], w[1], w[2], w[3], b[0], b[1], b[2], b[3], n_heads, n_heads, dh)


def to_hf_bert(attn: MultiHeadAttention, prefix: str = "") -> dict[str, Tensor]:
    """``attn`` as Hugging Face ``BertAttention`` weights (``self.query/key/value``, ``output.dense``).

    With ``prefix="encoder.layer.3.attention."`` the keys are those of layer 3 of a ``BertModel``. The
    ``output.LayerNorm`` of ``BertSelfOutput`` is not attention and is not written.
    """
    _check_prefix(prefix)
    p = _zero_bias_if_none(_parts_of(attn))
    _require_mha_shape(p, "hf_bert", self_attention=True)
    out: dict[str, Tensor] = {}
    for name, w, b in zip(_BERT_LINEARS, (p.q, p.k, p.v, p.o), (p.bq, p.bk, p.bv, p.bo)):
        out[f"{prefix}{name}.weight"] = _fresh(w)
        out[f"{prefix}{name}.bias"] = _fresh(b)  # type: ignore[arg-type]
    return out


def from_hf_bert(
    state_dict: Mapping[str, Tensor], *, n_heads: int, prefix: str = "", scale: float | None = None
) -> MultiHeadAttention:
    """A new :class:`MultiHeadAttention` from ``BertAttention`` weights (n_heads = num_attention_heads)."""
    return _load_parts_new(_read_hf_bert(state_dict, n_heads, prefix), scale)


def load_hf_bert(
    attn: MultiHeadAttention, state_dict: Mapping[str, Tensor], *, prefix: str = ""
) -> MultiHeadAttention:
    """Copy ``BertAttention`` weights (under ``prefix``) into ``attn`` in place; returns ``attn``."""
    return _load_parts(attn, _read_hf_bert(state_dict, attn.n_heads, prefix), "hf_bert")


# ---------------------------------------------------------------------------------------------- GPT-2
def _read_gpt2(sd: Mapping[str, Tensor], n_heads: int, prefix: str) -> _Parts:
    layout = "gpt2"
    got = _under_prefix(sd, prefix, layout)
    if "c_attn.weight" not in got:
        raise LayoutError(layout, prefix, missing=["c_attn.weight"], note=f"found keys {sorted(got)}")
    _require_rank(layout, prefix, got, "c_attn.weight", 2, "[d_model, 3 d_model] (Conv1D [in, out])")
    d = got["c_attn.weight"].shape[0]  # Conv1D [in, out] = [d_model, 3 d_model]
    expected = {
        "c_attn.weight": (d, 3 * d),
        "c_attn.bias": (3 * d,),
        "c_proj.weight": (d, d),
        "c_proj.bias": (d,),
    }
    bias = _bias_keys_all_or_none(layout, prefix, got, ["c_attn.bias", "c_proj.bias"])
    _check_keys(layout, prefix, got, expected, optional=() if bias else ("c_attn.bias", "c_proj.bias"))
    dh = _check_n_heads(n_heads, d, "n_embd")
    q, k, v = got["c_attn.weight"].t().split(d, dim=0)  # (d_model, d_model) x 3, [out, in]
    o = got["c_proj.weight"].t()  # (d_model out, d_model in)
    bq = bk = bv = bo = None
    if bias:
        bq, bk, bv = got["c_attn.bias"].split(d)  # (d_model,) x 3
        bo = got["c_proj.bias"]
    return _Parts(q, k, v, o, bq, bk, bv, bo, n_heads, n_heads, dh)


def to_gpt2(attn: MultiHeadAttention, prefix: str = "") -> dict[str, Tensor]:
    """``attn`` as Hugging Face ``GPT2Attention`` weights (``c_attn``/``c_proj`` Conv1D, stored [in, out])."""
    _check_prefix(prefix)
    p = _zero_bias_if_none(_parts_of(attn))
    _require_mha_shape(p, "gpt2", self_attention=True)
    return {
        prefix + "c_attn.weight": torch.cat([p.q, p.k, p.v], dim=0).t().contiguous(),  # (d_model, 3 d_model)
        prefix + "c_attn.bias": torch.cat([p.bq, p.bk, p.bv]),  # type: ignore[list-item]  # (3 d_model,)
        prefix + "c_proj.weight": p.o.t().contiguous(),  # (d_model in, d_model out)
        prefix + "c_proj.bias": _fresh(p.bo),  # type: ignore[arg-type]
    }


def from_gpt2(
    state_dict: Mapping[str, Tensor], *, n_heads: int, prefix: str = "", scale: float | None = None
) -> MultiHeadAttention:
    """A new :class:`MultiHeadAttention` from ``GPT2Attention`` weights (``n_heads`` = n_head).

    GPT-2 attention is causal: call the layer with ``is_causal=True``. ``scale`` defaults to
    ``1 / sqrt(d_head)``; a config with ``scale_attn_by_inverse_layer_idx`` needs
    ``scale = 1 / (sqrt(d_head) * (layer_idx + 1))``.
    """
    return _load_parts_new(_read_gpt2(state_dict, n_heads, prefix), scale)


def load_gpt2(
    attn: MultiHeadAttention, state_dict: Mapping[str, Tensor], *, prefix: str = ""
) -> MultiHeadAttention:
    """Copy ``GPT2Attention`` weights (under ``prefix``) into ``attn`` in place; returns ``attn``."""
    return _load_parts(attn, _read_gpt2(state_dict, attn.n_heads, prefix), "gpt2")


# ------------------------------------------------------------------------------------------ TransformerLens
def _read_transformer_lens(sd: Mapping[str, Tensor], prefix: str) -> _Parts:
    layout = "transformer_lens"
    got = _under_prefix(sd, prefix, layout)
    if "W_Q" not in got:
        raise LayoutError(layout, prefix, missing=["W_Q"], note=f"found keys {sorted(got)}")
    if got["W_Q"].dim() != 3:
        raise LayoutError(
            layout, prefix, mismatched={"W_Q": ((-1, -1, -1), tuple(got["W_Q"].shape))},
            note="W_Q must be [n_heads, d_model, d_head]",
        )  # fmt: skip
    H, d, dh = got["W_Q"].shape
    gqa = "_W_K" in got or "_W_V" in got
    k_name, v_name, bk_name, bv_name = (
        ("_W_K", "_W_V", "_b_K", "_b_V") if gqa else ("W_K", "W_V", "b_K", "b_V")
    )
    _require_rank(layout, prefix, got, k_name, 3, "[n_kv_heads, kdim, d_head]")
    _require_rank(layout, prefix, got, v_name, 3, "[n_kv_heads, vdim, d_head]")
    Hkv = got[k_name].shape[0] if k_name in got else H
    kdim = got[k_name].shape[1] if k_name in got and got[k_name].dim() == 3 else d
    vdim = got[v_name].shape[1] if v_name in got and got[v_name].dim() == 3 else d
    expected = {
        "W_Q": (H, d, dh),
        k_name: (Hkv, kdim, dh),
        v_name: (Hkv, vdim, dh),
        "W_O": (H, dh, d),
        "b_Q": (H, dh),
        bk_name: (Hkv, dh),
        bv_name: (Hkv, dh),
        "b_O": (d,),
    }
    bias_keys = ["b_Q", bk_name, bv_name, "b_O"]
    bias = _bias_keys_all_or_none(layout, prefix, got, bias_keys)
    _check_keys(layout, prefix, got, expected, optional=() if bias else bias_keys)
    if H % Hkv != 0:
        raise LayoutError(
            layout, prefix, note=f"n_heads={H} (W_Q) is not divisible by n_kv_heads={Hkv} ({k_name})"
        )
    q = got["W_Q"].transpose(1, 2).reshape(H * dh, d)  # (H dh, d_model)
    k = got[k_name].transpose(1, 2).reshape(Hkv * dh, kdim)  # (Hkv dh, kdim)
    v = got[v_name].transpose(1, 2).reshape(Hkv * dh, vdim)  # (Hkv dh, vdim)
    o = got["W_O"].permute(2, 0, 1).reshape(d, H * dh)  # (d_model, H dh)
    bq = bk = bv = bo = None
    if bias:
        bq = got["b_Q"].reshape(H * dh)  # (H dh,)
        bk = got[bk_name].reshape(Hkv * dh)  # (Hkv dh,)
        bv = got[bv_name].reshape(Hkv * dh)  # (Hkv dh,)
        bo = got["b_O"]
    return _Parts(q, k, v, o, bq, bk, bv, bo, H, Hkv, dh)


def to_transformer_lens(attn: MultiHeadAttention, prefix: str = "") -> dict[str, Tensor]:
    """``attn`` as TransformerLens per-head tensors (``W_Q`` [n_heads, d_model, d_head] ...).

    A grouped-query layer (``n_kv_heads < n_heads``) is written as TransformerLens's
    ``GroupedQueryAttention`` stores it: ``_W_K``, ``_W_V``, ``_b_K``, ``_b_V`` with n_kv_heads heads.
    """
    _check_prefix(prefix)
    if not isinstance(attn, MultiHeadAttention):
        raise TypeError(f"attn must be a headspace MultiHeadAttention; got {type(attn).__name__}")
    gqa = attn.n_kv_heads != attn.n_heads
    k_name, v_name, bk_name, bv_name = (
        ("_W_K", "_W_V", "_b_K", "_b_V") if gqa else ("W_K", "W_V", "b_K", "b_V")
    )
    out = {
        "W_Q": _fresh(attn.W_Q),  # (H, d_model, dh)
        k_name: _fresh(attn.W_K),  # (Hkv, kdim, dh)
        v_name: _fresh(attn.W_V),  # (Hkv, vdim, dh)
        "W_O": _fresh(attn.W_O),  # (H, dh, d_model)
    }
    z = attn.W_Q.new_zeros  # TransformerLens always stores every bias: a missing one is zero
    if attn.b_Q is not None:
        out.update({"b_Q": _fresh(attn.b_Q), bk_name: _fresh(attn.b_K), bv_name: _fresh(attn.b_V)})
    else:
        out.update({"b_Q": z(attn.n_heads, attn.d_head), bk_name: z(attn.n_kv_heads, attn.d_head)})
        out[bv_name] = z(attn.n_kv_heads, attn.d_head)
    out["b_O"] = z(attn.d_model) if attn.b_O is None else _fresh(attn.b_O)
    return {prefix + k: v for k, v in out.items()}


def from_transformer_lens(
    state_dict: Mapping[str, Tensor], *, prefix: str = "", scale: float | None = None
) -> MultiHeadAttention:
    """A new :class:`MultiHeadAttention` from TransformerLens per-head tensors (sizes read from shapes)."""
    return _load_parts_new(_read_transformer_lens(state_dict, prefix), scale)


def load_transformer_lens(
    attn: MultiHeadAttention, state_dict: Mapping[str, Tensor], *, prefix: str = ""
) -> MultiHeadAttention:
    """Copy TransformerLens per-head tensors (under ``prefix``) into ``attn`` in place; returns ``attn``."""
    return _load_parts(attn, _read_transformer_lens(state_dict, prefix), "transformer_lens")
