"""An attention layer's description (:class:`~headspace.nn.spec.AttentionSpec`) as the layer's own state.

:class:`DescribedAttention` is mixed into :class:`~headspace.MultiHeadAttention`: the layer keeps its
description as ``spec`` and reads every attribute of its maths from it at call time (``window``,
``scale``, ``softcap``, ``qk_norm``, the head counts and widths, ``dropout``). Assigning ``spec`` (or
one of those attributes, which replaces the spec's field) changes what the layer computes from then on,
and what every executor that reads the layer's description computes.

A new description must fit the layer's weights: the head counts and widths are those of ``qkv_weight``
and ``o_weight``, ``qkv_bias`` / ``out_bias`` those of the biases present, ``qk_norm`` that of the
``q_norm`` / ``k_norm`` present, ``positions`` None exactly where the layer has no rotation; and every
field must be one this layer computes (``chunk`` is refused by name; ``sink`` only where the layer
has its ``sinks`` parameter, ``gate`` only where it has its ``gate_weight``).
"""

from __future__ import annotations

import dataclasses

from ..nn.spec import AttentionSpec, refuse_unsupported

#: The attention features (:data:`~headspace.nn.spec.ATTENTION_FEATURES`) the layer's forward computes.
FORWARD_FEATURES = ("window", "softcap", "qk_norm", "bias", "sink", "gate")


class DescribedAttention:
    """The description-backed attributes of an attention layer (a mixin of ``nn.Module`` subclasses
    that set ``_spec`` first thing in ``__init__`` and own ``o_weight``, ``qkv_bias``, ``o_bias``,
    ``q_norm``, ``k_norm`` and ``rotary``)."""

    _spec: AttentionSpec

    @property
    def spec(self) -> AttentionSpec:
        """The layer's description (its ``positions`` follow a rotation assigned by hand to ``rotary``)."""
        rotary = self._modules.get("rotary")  # type: ignore[attr-defined]
        if self._spec.positions is not rotary:
            self._spec = dataclasses.replace(self._spec, positions=rotary)
        return self._spec

    @spec.setter
    def spec(self, spec: AttentionSpec) -> None:
        if not isinstance(spec, AttentionSpec):
            raise TypeError(
                f"attention spec must be a headspace.nn.spec.AttentionSpec; got {type(spec).__name__}"
            )
        refuse_unsupported(spec, "the attention forward", FORWARD_FEATURES)
        self._check_fits(spec)
        for name in ("q_norm", "k_norm"):
            norm = self._modules.get(name)  # type: ignore[attr-defined]
            if norm is not None:
                norm.eps, norm.offset = float(spec.qk_norm_eps), float(spec.qk_norm_offset)
        if spec.positions is not None:
            self._modules["rotary"] = spec.positions  # type: ignore[attr-defined]
        self._spec = spec

    def _check_fits(self, spec: AttentionSpec) -> None:
        """One-line ``ValueError`` naming the first field of ``spec`` the layer's weights do not have."""
        o_weight = self.o_weight  # type: ignore[attr-defined]  # (d_model, n_heads d_head)
        q_norm = self._modules.get("q_norm")  # type: ignore[attr-defined]
        width = None if q_norm is None else q_norm.weight.numel()  # (a per-head LayerNorm's: [H, dh])
        found = {
            "d_model": o_weight.shape[0],
            "n_heads * d_head": o_weight.shape[1],
            "qkv_bias": self.qkv_bias is not None,  # type: ignore[attr-defined]
            "out_bias": self.o_bias is not None,  # type: ignore[attr-defined]
            "positions is None": self._modules.get("rotary") is None,  # type: ignore[attr-defined]
            "qk_norm is None": q_norm is None,
            "qk_norm per-head LayerNorm": type(q_norm).__name__ == "HeadLayerNorm",
            "sink is None": self._parameters.get("sinks") is None,  # type: ignore[attr-defined]
            "gate is None": self._parameters.get("gate_weight") is None,  # type: ignore[attr-defined]
        }
        wanted = {
            "d_model": spec.d_model,
            "n_heads * d_head": spec.n_heads * spec.d_head,
            "qkv_bias": spec.qkv_bias,
            "out_bias": spec.out_bias,
            "positions is None": spec.positions is None,
            "qk_norm is None": spec.qk_norm is None,
            "qk_norm per-head LayerNorm": spec.qk_norm == "head_layernorm",
            "sink is None": spec.sink is None,
            "gate is None": spec.gate is None,
        }
        if width is not None:
            found["qk_norm width"] = width
            wanted["qk_norm width"] = spec.d_head if spec.qk_norm == "head" else spec.n_heads * spec.d_head
        for name, value in wanted.items():
            if found[name] != value:
                raise ValueError(
                    f"attention spec: {name} must be {found[name]!r}, fixed by the layer's weights; got "
                    f"{value!r} (build a new layer to change it)"
                )
        weight = self._parameters.get("qkv_weight")  # type: ignore[attr-defined]
        rows = (spec.n_heads + 2 * spec.n_kv_heads) * spec.d_head
        if weight is not None and weight.shape[0] != rows:
            raise ValueError(
                f"attention spec: (n_heads + 2 n_kv_heads) d_head must be {weight.shape[0]}, the rows of "
                f"qkv_weight; got {rows}"
            )

    def _replace(self, **changes: object) -> None:
        self.spec = dataclasses.replace(self.spec, **changes)  # type: ignore[arg-type]

    @property
    def d_model(self) -> int:
        """The width of the residual stream (the query input and the output)."""
        return self._spec.d_model

    @property
    def n_heads(self) -> int:
        """Query heads."""
        return self._spec.n_heads

    @property
    def n_kv_heads(self) -> int:
        """Key/value heads (dividing ``n_heads``)."""
        return self._spec.n_kv_heads

    @property
    def d_head(self) -> int:
        """The width of one head."""
        return self._spec.d_head

    @property
    def scale(self) -> float:
        """The scores' factor (``1 / sqrt(d_head)`` unless the description sets one)."""
        return self._spec.score_scale

    @scale.setter
    def scale(self, value: float) -> None:
        self._replace(scale=value)

    @property
    def window(self) -> int | None:
        """The sliding window (None: every earlier key)."""
        return self._spec.window

    @window.setter
    def window(self, value: int | None) -> None:
        self._replace(window=value)

    @property
    def softcap(self) -> float | None:
        """The scores' soft cap (None: none)."""
        return None if self._spec.softcap is None else float(self._spec.softcap)

    @softcap.setter
    def softcap(self, value: float | None) -> None:
        self._replace(softcap=value)

    @property
    def qk_norm(self) -> str | None:
        """``"head"``, ``"all"`` or None: the QK-norm (fixed by the ``q_norm`` / ``k_norm`` weights)."""
        return self._spec.qk_norm

    @property
    def dropout(self) -> float:
        """Dropout on the attention pattern, in [0, 1)."""
        return self._spec.dropout

    @dropout.setter
    def dropout(self, value: float) -> None:
        self._replace(dropout=value)
