"""Configs that only one Decoder subclass builds right.

A loader that needs its own decoder class (Gemma 4, Gemma 3n) describes its layers under a key of
``config.extra``; a plain :class:`~headspace.Decoder` built from such a config would ignore that
description and silently build another model (other head widths, no shared keys, no per-layer inputs).
:func:`refuse_wrong_decoder` is called by ``Decoder.__init__``: where ``config.extra`` holds one of the
keys of :data:`SPECIAL_DECODERS` and the class being built is not (a subclass of) the class it names, it
raises one line naming the key and the class to use.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["SPECIAL_DECODERS", "refuse_wrong_decoder"]

#: ``config.extra`` key -> (module, class) of the decoder that builds such a config.
SPECIAL_DECODERS: dict[str, tuple[str, str]] = {
    "gemma4": ("headspace.model.gemma4_model", "Gemma4Decoder"),
    "gemma3n": ("headspace.model.gemma3n_model", "Gemma3nDecoder"),
}


def refuse_wrong_decoder(config: Any, cls: type) -> None:
    """``ValueError`` where ``config.extra`` names a decoder of :data:`SPECIAL_DECODERS` that ``cls`` is
    not (nor a subclass of), or where ``cls`` has an ``EXTRA_KEY`` that ``config.extra`` lacks; nothing
    otherwise."""
    extra = getattr(config, "extra", None)
    if not isinstance(extra, dict):
        return
    own = getattr(cls, "EXTRA_KEY", None)  # a special class's own description
    if own is not None and own not in extra:
        raise ValueError(
            f"{cls.__name__} needs config.extra[{own!r}] (its layers' description, written by its loader); "
            f"got config.extra keys {sorted(extra)}"
        )
    for key, (module, name) in SPECIAL_DECODERS.items():
        if key not in extra:
            continue
        wanted = getattr(importlib.import_module(module), name)
        if not issubclass(cls, wanted):
            raise ValueError(
                f"{cls.__name__}: config.extra[{key!r}] describes a {name} (its own layers); "
                f"build it with {module}.{name}(config) or headspace.load(folder), not {cls.__name__}"
            )
