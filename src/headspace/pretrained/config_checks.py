"""Checks on ``config.json`` fields shared by the converters: sane bounds, and fields read nowhere.

Bounds. A converter builds a few lists with one entry per layer and, for rotary models, a table of
``head_dim / 2`` frequencies while it reads a config, before the parameter count the config implies is
compared with what the weights hold (:func:`headspace.pretrained.hf.check_parameter_count`). So that an
absurd value (``num_hidden_layers: 2**63``) is refused at once in one line instead of exhausting memory,
the layer count is at most :data:`MAX_LAYERS` and a head's width at most :data:`MAX_HEAD_DIM`, both far
above any model's (real models have at most a few hundred layers and heads of at most 256 features).

Fields read nowhere. transformers lets a ``rope_scaling`` object replace the ``rope_parameters`` it sits
beside (``LlamaConfig(rope_parameters=plain, rope_scaling=yarn)`` applies yarn); headspace reads one
spelling, so a ``rope_scaling`` that says something else than ``rope_parameters`` is refused by name
(:func:`refuse_rope_scaling_beside_parameters`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["MAX_HEAD_DIM", "MAX_LAYERS", "at_most", "refuse_rope_scaling_beside_parameters"]

#: The most layers a ``config.json`` may claim (a million layers still reach the parameter count's
#: message, which names what the file holds).
MAX_LAYERS = 1 << 20
#: The most features a head may have (``head_dim``, or ``hidden_size / num_attention_heads``).
MAX_HEAD_DIM = 1 << 20


def at_most(source: str, key: str, value: Any, maximum: int) -> Any:
    """``value`` (the field ``key``, already read as an int >= 1, or None) when at most ``maximum``;
    else ``ValueError``: ``"{source}: {key} must be an int >= 1 and <= {maximum}; got {value}"``."""
    if value is not None and value > maximum:
        raise ValueError(
            f"{source}: {key} must be an int >= 1 and <= {maximum}; got {value} (more than any model "
            "has: refused before anything is built)"
        )
    return value


def _rope_settings(d: Mapping[str, Any], with_theta: bool) -> dict[str, Any]:
    """A RoPE object in one spelling: ``type`` as ``rope_type`` (default ``"default"``); ``rope_theta``
    kept only ``with_theta``."""
    out = {k: v for k, v in d.items() if k != "type" and (with_theta or k != "rope_theta")}
    out.setdefault("rope_type", d.get("type", "default"))
    return out


def refuse_rope_scaling_beside_parameters(
    hf: Mapping[str, Any], params: Mapping[str, Any] | None, source: str
) -> None:
    """Refuse a non-null ``hf["rope_scaling"]`` beside ``rope_parameters`` unless it repeats ``params``.

    ``params``: the ``rope_parameters`` object that applies to the layers ``rope_scaling`` would change
    (Gemma 3's full-attention layers; the whole object for a Llama), or None where there is none (then
    ``rope_scaling`` is the one read, and nothing is refused here). A ``rope_scaling`` equal to it (``type``
    read as ``rope_type``; ``rope_theta`` compared only where ``rope_scaling`` gives one) is a harmless
    duplicate. Anything else raises ``ValueError`` naming both fields: transformers would apply
    ``rope_scaling`` over ``rope_parameters``.
    """
    scaling = hf.get("rope_scaling")
    if scaling is None or params is None:
        return
    if not isinstance(scaling, dict):
        raise ValueError(f"{source}: rope_scaling must be null or an object; got {scaling!r:.80}")
    with_theta = "rope_theta" in scaling
    if _rope_settings(scaling, with_theta) == _rope_settings(params, with_theta):
        return
    raise ValueError(
        f"{source}: rope_scaling={scaling!r:.120} differs from rope_parameters={dict(params)!r:.120}; "
        "transformers applies rope_scaling over rope_parameters, headspace reads rope_parameters only: "
        "remove rope_scaling, or write its settings into rope_parameters (supported rope types: "
        "default, linear, llama3)"
    )
