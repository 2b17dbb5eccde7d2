"""The loader of the families whose tensors a function renames (absolute, ALiBi and parallel families).

Each family module gives ``FAMILIES: {model_type: (config reader, renamer)}``; :func:`family_kind` checks a
``config.json``'s ``model_type`` against it, and :func:`load_renamed` loads a folder: the config, a meta
Decoder for the shapes the weights must have, every tensor checked from the safetensors headers before
any payload is read (:func:`~headspace.pretrained.family_frame.read_renamed`), then the weights in place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from ..model.config import ModelConfig
from .family_frame import folder_headers, open_family, read_renamed
from .hf import ConfigFields, folder_tokenizer
from .llama import _meta_decoder, _wrap
from .wrappers import PretrainedDecoder

__all__ = ["family_kind", "load_renamed"]

#: ``renamer(tensors, config)``: the file's tensors ({name: tensor}, popped) -> the Decoder's state dict.
Renamer = Callable[[dict[str, Tensor], ModelConfig], dict[str, Tensor]]
#: ``fill(state dict, expected shapes)``: completes the state dict in place (e.g. norms without weights).
Filler = Callable[[dict[str, Tensor], dict[str, tuple[int, ...]]], None]


def family_kind(f: ConfigFields, families: Mapping[str, Any]) -> str:
    """``f``'s ``model_type``, which must be a key of ``families``; a quantized checkpoint is refused.
    ValueErrors begin with ``f.source``."""
    kind = f.text("model_type", None, allow_none=True)
    if kind not in families:
        raise ValueError(
            f"{f.source}: model_type={kind!r} is not supported here; supported: {list(families)}"
        )
    if f.hf.get("quantization_config") is not None:
        raise ValueError(f"{f.source} has a quantization_config: quantized checkpoints are not supported")
    return str(kind)


def load_renamed(
    folder: str | Path,
    read_config: Callable[[dict[str, Any], str, str], ModelConfig],
    renamers: Mapping[str, Renamer],
    *,
    name: str = "",
    precision: str = "float32",
    ignorable: Callable[[str], bool] = lambda k: False,
    fill: Filler | None = None,
) -> PretrainedDecoder:
    """A folder of a renamed family onto a Decoder.

    ``read_config(hf, name, source)`` makes the config (``extra["model_type"]`` naming its renamer in
    ``renamers``); the renamed tensors (completed by ``fill``) must be exactly the Decoder's state dict,
    names and shapes, checked from the headers before any tensor is read; names ``ignorable`` accepts
    may be left over (reported as ignored).
    """
    opened = open_family(folder, precision)
    path = opened.path
    config = read_config(opened.hf, name or path.name, opened.config_file)
    config.extra["source"] = str(path)
    model = _meta_decoder(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    renamer = renamers[str(config.extra["model_type"])]

    def rename(t: dict[str, Tensor]) -> dict[str, Tensor]:
        sd = renamer(t, config)
        if fill is not None:
            fill(sd, expected)
        return sd

    sd, ignored = read_renamed(folder_headers(path), rename, expected, ignorable)
    model.load_state_dict(sd, strict=True, assign=True)
    return _wrap(model, config, folder_tokenizer(path, config.pad_token_id), ignored).to_precision(precision)
