"""A model's layer and head counts before it loads, so that ``--layer`` / ``--head`` are checked first.

:func:`known_shape` reads what costs nothing: the registry's table for a registered name
(:func:`headspace.pretrained.registry.registered_shape`), else a checkpoint folder's ``config.json``
(its text only, no weights). A ``.gguf`` file or anything unreadable gives None: its shape is checked
once the model has loaded, in the same words (:func:`.errors.check_index`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import check_index

#: The largest config.json read (bytes): a real one is a few kB.
MAX_CONFIG_BYTES = 1 << 20

#: config.json keys of the layer and head counts (Hugging Face names; GPT-2 has its own).
_LAYER_KEYS = ("num_hidden_layers", "n_layer")
_HEAD_KEYS = ("num_attention_heads", "n_head")


def _first_int(config: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _folder_shape(folder: Path) -> tuple[int, int] | None:
    """(n_layers, n_heads) from ``folder/config.json`` (or its ``text_config``), else None; a hybrid's
    n_heads is its widest layer's (the softmax heads or the Gated DeltaNet value heads)."""
    path = folder / "config.json"
    try:
        if not path.is_file() or path.stat().st_size > MAX_CONFIG_BYTES:
            return None
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # the loader says what is wrong with it, in its own words
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")
    for part in (config, text if isinstance(text, dict) else {}):
        layers, heads = _first_int(part, _LAYER_KEYS), _first_int(part, _HEAD_KEYS)
        linear = _first_int(part, ("linear_num_value_heads",))  # a hybrid's DeltaNet heads (Qwen3-Next)
        if layers is not None and heads is not None:
            return layers, max(heads, linear or 0)  # the widest layer's; each layer checks its own
    return None


def known_shape(spec: str) -> tuple[int, int] | None:
    """(n_layers, n_heads) of ``--model spec`` known without loading it, else None (see the module)."""
    from ..pretrained.registry import registered_shape

    shape = registered_shape(spec)
    if shape is not None:
        return shape
    folder = Path(spec)
    return _folder_shape(folder) if folder.is_dir() else None


def check_loaded_shape(
    pretrained: Any, layer: int | None, head: int | None = None, *, from_end: bool = False
) -> None:
    """``--layer`` / ``--head`` against the loaded model's config, in :func:`check_before_loading`'s words
    (for the models whose shape was not known before they loaded)."""
    config = pretrained.model.config
    check_index("layer", layer, config.n_layers, from_end=from_end)
    check_index("head", head, config.n_heads, from_end=from_end)


def check_before_loading(
    model_spec: str, layer: int | None, head: int | None = None, *, from_end: bool = False
) -> None:
    """``--layer`` / ``--head`` against the model's shape, before it loads (when :func:`known_shape`
    knows it; a layer with fewer heads after pruning is checked by the analysis); ``from_end``: negative
    indices count from the end."""
    if layer is None and head is None:
        return
    shape = known_shape(model_spec)
    if shape is not None:
        check_index("layer", layer, shape[0], from_end=from_end)
        check_index("head", head, shape[1], from_end=from_end)
