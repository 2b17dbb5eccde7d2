"""Which attention layers the one-head walk of ``headspace explain`` and the explorer page can show.

Both recompute a head as ``scores = q k^T * scale`` (after the rotation), ``pattern = softmax(scores)``,
``z_h = pattern v_g(h)`` [d_head] and ``out = sum_h z_h W_O[h]``. Two attention fields break that
recipe, and a layer with one of them is refused in one line naming the field (never drawn wrongly):

* ``latent`` (DeepSeek's multi-head latent attention): keys and values are read from a shared latent,
  only the last ``qk_rope_head_dim`` features of q and k rotate, and v is ``v_head_dim`` wide;
* ``differential`` (DiffLlama): each head weighs its pair's two value heads ([2 d_head]), and a pair's
  output is ``(1 - lambda_init) RMSNorm(z_j - lambda z_{j + n_heads/2})``, not one head's ``z_h W_O[h]``;
* ``temperature`` (Llama 4's NoPE layers): the query at position ``p`` is scaled by ``t(p)`` after
  ``hook_q`` (:mod:`headspace.attention.temperature`), so the scores are not ``q k^T * scale``.

* ``kv_source`` (Gemma 3n / 4): the layer has no keys and values of its own; it reads an earlier layer's.

``latent``, ``differential`` and ``kv_source`` need more than the plain hook points to record every
layer's q, k, v, z for a ranking (:data:`RECORDED_FIELDS`): ``explain`` records it
(:mod:`headspace.analysis.lesson.mechanism_walks`) and walks them exactly, with a step each
(``"latent"``, ``"differential"``, ``"kv_source"``); a tempered layer is walked too (its
``"temperature"`` step gives ``t(p)`` and the untempered scores). The explorer page, which recomputes
scores from q and k, refuses ``latent`` and ``temperature`` by name.
"""

from __future__ import annotations

from typing import Any

#: attention field -> why the one-head walk is not what such a layer computes
UNWALKED_FIELDS = {
    "latent": "keys and values come from a shared latent and only part of q and k rotates "
    "(multi-head latent attention)",
    "differential": "each head's output is its pair's p_1 - lambda p_2 through a norm "
    "(differential attention), not z_h W_O[h]",
    "temperature": "each query is scaled by its position's t(p) after hook_q (Llama 4's NoPE layers)",
    "kv_source": "its keys and values are another layer's (Gemma 3n / 4 layers sharing keys and values)",
}
#: the fields whose layers need more than the plain hook points to record q, k, v, z for a ranking
RECORDED_FIELDS = ("latent", "differential", "kv_source")


def unwalked_field(attn: Any, fields: tuple[str, ...] = tuple(UNWALKED_FIELDS)) -> str | None:
    """The first of ``fields`` (of :data:`UNWALKED_FIELDS`) set in ``attn.spec`` (an attention layer),
    else None."""
    spec = getattr(attn, "spec", None)
    for field in fields:
        if getattr(spec, field, None) is not None:
            return field
    return None


def refuse_unwalked(attn: Any, what: str, fields: tuple[str, ...] = tuple(UNWALKED_FIELDS)) -> None:
    """One-line ``ValueError`` where ``attn`` has one of ``fields`` (of :data:`UNWALKED_FIELDS`) set:
    ``what`` (the walk ``q k^T -> softmax -> z_h W_O[h]`` of one head) is not what that layer computes."""
    field = unwalked_field(attn, fields)
    if field is not None:
        raise ValueError(
            f"{what} shows scores = q k^T * scale, softmax and z_h W_O[h] per head; this layer's "
            f"attention field {field!r} is set: {UNWALKED_FIELDS[field]}"
        )
