"""YaRN, dynamic NTK and LongRoPE as ``config.json`` has them, ready for ``Rotary``.

transformers reads two numbers of these scalings from the config rather than from ``rope_parameters``:
``max_position_embeddings`` (dynamic NTK's reference length; YaRN's and LongRoPE's ``factor`` when it
is missing) and, for Phi-3's older configs, a top-level ``original_max_position_embeddings``. This module
puts them into the scaling dict, and maps the older type names ("su" and Phi-3's "yarn" are LongRoPE
there). Dynamic NTK is meant to run past the config's length: its context is
``floor(max_position_embeddings * factor)`` unless ``max_seq_len`` asks for less.
"""

from __future__ import annotations

import math
from typing import Any

from ..nn.rope_scaling import EXTENDED_ROPE_TYPES
from .hf import ConfigFields


def extend_rope(
    scaling: dict[str, Any] | None,
    f: ConfigFields,
    context: int,
    max_seq_len: int | None,
    *,
    longrope_aliases: bool = False,
) -> tuple[dict[str, Any] | None, int]:
    """(scaling with the config's lengths added, the model's context) for a YaRN / dynamic / LongRoPE
    ``scaling``; ``(scaling, context)`` unchanged for any other. ``longrope_aliases``: Phi-3's rule that
    ``rope_type`` "su" and "yarn" mean "longrope"."""
    if scaling is None:
        return None, context
    out = dict(scaling)
    rope_type = out.get("rope_type", out.get("type"))
    if longrope_aliases and rope_type in ("su", "yarn"):
        rope_type = "longrope"
        out.pop("type", None)
        out["rope_type"] = rope_type
    if rope_type not in EXTENDED_ROPE_TYPES:
        return out, context
    limit = f.integer("max_position_embeddings", context)
    out.setdefault("max_position_embeddings", limit)
    if rope_type == "longrope" and out.get("original_max_position_embeddings") is None:
        out["original_max_position_embeddings"] = f.integer("original_max_position_embeddings", limit)
    if rope_type == "dynamic" and max_seq_len is None:
        factor = out.get("factor")
        if isinstance(factor, (int, float)) and not isinstance(factor, bool) and math.isfinite(factor):
            context = max(context, math.floor(limit * factor))
    return out, context
