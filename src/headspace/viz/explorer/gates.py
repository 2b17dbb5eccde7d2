"""The explorer's gate view: each gated head's output gate (Qwen3-Next, Qwen3.5 full-attention layers).

A gated layer multiplies each head's ``z_h`` by ``sigmoid(x W_G[h] + b_G[h])`` before ``W_O``
(:mod:`headspace.attention.gates`). The page stores, per gated layer::

    gate        [seq, n_heads, width]   hook_gate: the gate of each token and head (width d_head for an
                                        elementwise gate, 1 for a headwise one), this run's values
    gate_mean   [seq, n_heads]          its mean over the width (what the head lets through, 0..1)
    gate_kind   "elementwise" / "headwise"
    gate_label  one line saying what the numbers are and that per-head views hold them frozen

and nothing for a layer without a gate. The traced ``z`` (``hook_z``) is the gated z.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

#: The hook point of an output gate.
GATE_HOOK = "hook_gate"


def traced_gate(t: Any, name: str) -> Tensor | None:
    """Layer ``name``'s traced gate [seq, n_heads, width] (batch 1 dropped, float32), or None without one."""
    key = f"{name}.{GATE_HOOK}"
    return t[key][0].float() if key in t else None


def gate_label(kind: str) -> str:
    """The page's one-line label of a gated layer's gate view."""
    what = "one gate per feature of z_h" if kind == "elementwise" else "one gate per head"
    return (
        f"output gate sigmoid(x W_G[h]) ({kind}: {what}), multiplying z_h before W_O; per-head views "
        "(DLA, patching) hold it frozen at this run's value"
    )


def gate_fields(gate: Tensor | None, pack: Any, dtype: str) -> dict[str, Any]:
    """The page fields of a layer's gate (module docstring): {} without a gate. ``gate`` [seq, n_heads,
    width]; ``pack(tensor, dtype)`` packs an array for the page."""
    if gate is None:
        return {}
    kind = "elementwise" if gate.shape[-1] > 1 else "headwise"
    return {
        "gate": pack(gate, dtype),
        "gate_mean": pack(gate.mean(-1), "float32"),  # (seq, n_heads)
        "gate_kind": kind,
        "gate_label": gate_label(kind),
    }
