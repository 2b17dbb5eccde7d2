"""What the encoder-decoder converters share: the plan of one checkpoint's tensors and the loading.

A converter gives a :class:`Plan`: headspace's parameter name -> the checkpoint's tensor for everything
but attention (``names``), and each attention layer's four projections (``attention``: headspace's
module path -> the checkpoint's q/k/v/o prefixes, whose ``.weight`` [out, in] and ``.bias`` are read;
a projection without bias in the checkpoint, Whisper's k, gets zeros). ``tied``: tensors a checkpoint may
also store that must equal another one (the unembedding, each stack's copy of the shared embedding).

The folder is untrusted: config fields are type- and range-checked, then names, shapes and dtypes from
the safetensors header before any tensor is read (:mod:`headspace.pretrained.hf`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ...model.encdec import EncDecConfig, EncoderDecoder
from ...model.models import check_precision
from ..hf import (
    ConfigFields,
    check_dtypes,
    check_tensors,
    check_values,
    config_fields,
    config_problems,
    folder_tokenizer,
    load_tensors,
    open_folder,
    safetensors_header,
)

#: transformers' activation names -> headspace's.
ENCDEC_ACTS = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
               "swish": "silu", "silu": "silu"}  # fmt: skip


@dataclass(frozen=True)
class AttentionNames:
    """The checkpoint's names of one attention layer's projections (prefixes of ``.weight`` / ``.bias``);
    ``biases``: which of q, k, v, o have a bias in the checkpoint."""

    q: str
    k: str
    v: str
    o: str
    biases: tuple[bool, bool, bool, bool] = (True, True, True, True)


@dataclass
class Plan:
    """One checkpoint's tensors (module docstring)."""

    names: dict[str, str] = field(default_factory=dict)
    attention: dict[str, AttentionNames] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)
    reshape: dict[str, tuple[int, ...]] = field(default_factory=dict)


def same_heads(f: ConfigFields, pairs: list[tuple[str, str]]) -> None:
    """Each pair of config fields (the encoder's and the decoder's) must be equal; one line otherwise."""
    for a, b in pairs:
        if f.hf.get(a) != f.hf.get(b):
            raise ValueError(
                f"{f.source}: {a}={f.hf.get(a)!r} and {b}={f.hf.get(b)!r} differ; "
                "headspace's encoder-decoder has one size for both stacks"
            )


def act_of(f: ConfigFields, key: str, default: str) -> str:
    """The activation ``key`` as headspace names it (refused in one line when headspace has none)."""
    value = f.text(key, default)
    config_problems(f.hf, {key: lambda v: v in ENCDEC_ACTS}, {key: default}, f.source)
    return ENCDEC_ACTS[value]


def _expected(model: EncoderDecoder, plan: Plan) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensors and shapes the plan reads, from the model's own shapes."""
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    exp = {theirs: plan.reshape.get(ours, own[ours]) for ours, theirs in plan.names.items()}
    c = model.config
    hq = c.n_heads * c.d_head
    for names in plan.attention.values():
        for proj, has_bias in zip((names.q, names.k, names.v, names.o), names.biases):
            exp[f"{proj}.weight"] = (c.d_model, hq) if proj == names.o else (hq, c.d_model)
            if has_bias:
                exp[f"{proj}.bias"] = (c.d_model,) if proj == names.o else (hq,)
    return exp


def _attention_state(
    t: dict[str, Tensor], ours: str, n: AttentionNames, c: EncDecConfig
) -> dict[str, Tensor]:
    """One attention layer's fused storage: ``qkv_weight`` = [W_q; W_k; W_v] rows, ``o_weight``, biases."""
    hq = c.n_heads * c.d_head
    sd = {
        f"{ours}.qkv_weight": torch.cat([t[f"{p}.weight"] for p in (n.q, n.k, n.v)]),  # (3 hq, d_model)
        f"{ours}.o_weight": t[f"{n.o}.weight"],
    }
    if c.bias:
        parts = [t[f"{p}.bias"] if b else torch.zeros(hq) for p, b in zip((n.q, n.k, n.v), n.biases[:3])]
        sd[f"{ours}.qkv_bias"] = torch.cat(parts)  # (3 hq,)
        sd[f"{ours}.o_bias"] = t[f"{n.o}.bias"] if n.biases[3] else torch.zeros(c.d_model)
    return sd


def _check_tied(t: dict[str, Tensor], tied: dict[str, str], source: Path) -> None:
    for copy, original in tied.items():
        if copy in t and not torch.equal(t[copy], t[original]):
            raise ValueError(
                f"{source}: {copy} differs from {original}; headspace's encoder-decoder ties them (an untied "
                "one is not supported)"
            )


def load_encdec(
    folder: str | Path,
    read_config: Callable[[dict[str, Any], str, str], EncDecConfig],
    plan_of: Callable[[EncDecConfig], Plan],
    *,
    name: str = "",
    precision: str = "float32",
) -> EncoderDecoder:
    """An :class:`EncoderDecoder` from a checkpoint folder (``config.json``, ``model.safetensors``, an
    optional ``tokenizer.json`` kept as ``model.tokenizer``): ``read_config(hf, name, source)`` makes the
    config, ``plan_of(config)`` names its tensors. Only ``precision="float32"`` is supported yet."""
    check_precision(precision)
    if precision != "float32":
        raise ValueError(
            f"encoder-decoder models load at precision 'float32' only for now; got {precision!r}"
        )
    path, hf, weights = open_folder(folder)
    source = str(path / "config.json")
    config_fields(hf, source)
    config = read_config(hf, name or path.name, source)
    header = safetensors_header(weights)
    model = EncoderDecoder(config)
    plan = plan_of(config)
    expected = _expected(model, plan)
    tied = {k: v for k, v in plan.tied.items() if k in header.tensors}
    check_tensors(header.tensors, expected, lambda k: k in plan.tied, weights)
    check_dtypes(header.tensors, [*expected, *tied], weights)
    t = load_tensors(header, header.tensors, [*expected, *tied])
    _check_tied(t, tied, weights)
    _fill(model, plan, t)
    model.tokenizer = folder_tokenizer(path, config.pad_token_id)
    return model


def _fill(model: EncoderDecoder, plan: Plan, t: dict[str, Tensor]) -> None:
    """Load the checked tensors ``t`` (the checkpoint's names) into ``model`` by ``plan``; eval mode."""
    own = model.state_dict()
    sd = {ours: t[theirs].reshape(own[ours].shape) for ours, theirs in plan.names.items()}
    for ours, names in plan.attention.items():
        sd.update(_attention_state(t, ours, names, model.config))
    model.load_state_dict(sd, strict=True)
    model.eval()


def encdec_from_state_dict(
    config: EncDecConfig, plan_of: Callable[[EncDecConfig], Plan], tensors: Mapping[str, Tensor], source: str
) -> EncoderDecoder:
    """An :class:`EncoderDecoder` of ``config`` from a state dict in the checkpoint's naming (``tensors``,
    e.g. transformers' ``model.state_dict()``), checked as a folder's are: the names and shapes
    ``plan_of(config)`` expects (one ``ValueError`` listing the missing, unexpected and mis-shaped ones,
    its first line naming ``source``), floating point, finite, tied copies equal; converted to float32."""
    model = EncoderDecoder(config)
    plan = plan_of(config)
    where = Path(source)
    expected = _expected(model, plan)
    check_tensors(tensors, expected, lambda k: k in plan.tied, where)
    names = [*expected, *(k for k in plan.tied if k in tensors)]
    t = {k: tensors[k].detach().to("cpu") for k in names}
    check_values(t, names, where)
    t = {k: v.float() for k, v in t.items()}
    _check_tied(t, {k: plan.tied[k] for k in plan.tied if k in t}, where)
    _fill(model, plan, t)
    return model
