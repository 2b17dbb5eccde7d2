"""The tensor specs and shared metadata readers of :mod:`.gguf_families`: a spec is (GGUF part under
``blk.N.``, Hugging Face name under the layer prefix, shape key), the shape key naming sizes of
:func:`.gguf_families._dims` (``"q,h"``: heads * d_head rows of hidden columns)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .gguf_meta import GGUFError, meta_float

# (GGUF part under blk.N., Hugging Face name under the layer prefix, shape key); shape keys: see _shape
_Spec = tuple[str, str, str]


def _ln(gguf: str, hf: str) -> list[_Spec]:
    """A LayerNorm with a bias."""
    return [(f"{gguf}.weight", f"{hf}.weight", "h"), (f"{gguf}.bias", f"{hf}.bias", "h")]


_Names = Mapping[str, tuple[int, ...]]  # the file's tensors: GGUF name -> PyTorch shape


_Specs = Callable[[dict[str, Any], _Names], list[_Spec]]  # (HF config, the file's tensors) -> specs


def _globals(embed: str, norm: str, head: str, *, norm_bias: bool, head_bias: bool = False) -> _Specs:
    """The tensors outside the layers: the embedding, the final norm (``norm_bias``: with a bias) and the
    unembedding where the file has one (``output.weight``; ``head_bias``: with ``output.bias``)."""

    def specs(c: dict[str, Any], names: _Names) -> list[_Spec]:
        out: list[_Spec] = [
            ("token_embd.weight", embed, "v,h"),
            ("output_norm.weight", f"{norm}.weight", "h"),
        ]
        if norm_bias:
            out.append(("output_norm.bias", f"{norm}.bias", "h"))
        if "output.weight" in names:
            out.append(("output.weight", f"{head}.weight", "v,h"))
            if head_bias:
                out.append(("output.bias", f"{head}.bias", "v"))
        return out

    return specs


def _rope_fraction(rope_dims: int, d_head: int, path: Path) -> float:
    """``partial_rotary_factor`` f with ``int(d_head * f) == rope_dims`` (transformers' rotary width)."""
    if not 2 <= rope_dims <= d_head or rope_dims % 2:
        raise GGUFError(
            path, f"RoPE rotates {rope_dims} of {d_head} dims per head; expected an even 2..{d_head}"
        )
    f = rope_dims / d_head
    for candidate in (f, math.nextafter(f, 2.0)):
        if int(d_head * candidate) == rope_dims:
            return candidate
    raise GGUFError(path, f"no partial_rotary_factor gives {rope_dims} rotated dims of {d_head}")


def _rope(s: dict[str, Any], path: Path) -> dict[str, Any]:
    """``rope_parameters``: the base, the rotated fraction and the file's linear / YaRN scaling if any."""
    fraction = _rope_fraction(s["rope_dims"], s["d_head"], path)
    scaling = s.get("rope_scaling") or {"rope_type": "default"}
    return {**scaling, "rope_theta": s["rope_theta"], "partial_rotary_factor": fraction}


def _eps(meta: dict[str, Any], arch: str, path: Path, rms: bool) -> float:
    key = "attention.layer_norm_rms_epsilon" if rms else "attention.layer_norm_epsilon"
    return meta_float(meta, f"{arch}.{key}", path, 0.0, 1.0, 1e-5)
