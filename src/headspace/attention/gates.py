"""Output gates (Qwen3-Next, Qwen3.5): each head's output is gated elementwise before W_O.

    z_h = softmax(q_h k_h^T * scale + mask) v_h * sigmoid(x W_G[h] + b_G[h])
    out = sum_h z_h W_O[h] + b_O

``gate="elementwise"``: ``W_G`` [n_heads, d_model, d_head], one gate per feature of z_h (Qwen3-Next's
``q_proj`` computes q and the gate together, interleaved per head); ``"headwise"``: ``W_G`` [n_heads,
d_model, 1], one gate per head. The gate makes the OV circuit nonlinear in the input: a head's output
is ``W_O``-linear in the gated z only, so per-head analyses read ``hook_z`` (the gated z, the input of
``W_O``) and ``hook_result`` (``z_h W_O[h]``): direct logit attribution and patching of a head are
exact with the gate frozen at the value of the run that z came from. ``hook_gate`` [batch, seq_q,
n_heads, d_head] (``d_head`` 1 for ``"headwise"``) sees ``sigmoid(x W_G[h] + b_G[h])``; what a hook
returns there replaces the gate.

Storage: ``gate_weight`` [n_heads * width, d_model] in ``nn.Linear``'s [out, in] layout (width ``d_head``
or 1), ``gate_bias`` [n_heads * width] where the layer has q/k/v biases.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.hooks import HookPoint


def gate_width(gate: str, d_head: int) -> int:
    """The features one head's gate has: ``d_head`` (``"elementwise"``) or 1 (``"headwise"``)."""
    return d_head if gate == "elementwise" else 1


def add_gate(
    layer: nn.Module, gate: str | None, bias: bool, factory: dict[str, Any]
) -> tuple[HookPoint, ...]:
    """Register ``layer.gate_weight`` [n_heads * width, d_model] (Xavier-uniform), ``layer.gate_bias``
    [n_heads * width] (zeros; None without ``bias``) and ``layer.hook_gate`` (None each without ``gate``);
    returns the new hook points. ``gate``: None, ``"elementwise"`` or ``"headwise"``."""
    if gate is None:
        for name in ("gate_weight", "gate_bias"):
            layer.register_parameter(name, None)
        layer.register_module("hook_gate", None)
        return ()
    rows = layer.n_heads * gate_width(gate, layer.d_head)  # type: ignore[attr-defined]
    weight = torch.empty(rows, layer.d_model, **factory)  # type: ignore[attr-defined]
    nn.init.xavier_uniform_(weight)
    layer.register_parameter("gate_weight", nn.Parameter(weight))
    layer.register_parameter("gate_bias", nn.Parameter(torch.zeros(rows, **factory)) if bias else None)
    layer.register_module("hook_gate", HookPoint())  # [batch, seq_q, n_heads, width]
    return (layer.hook_gate,)  # type: ignore[return-value]


def gate_of(layer: nn.Module, x: Tensor) -> Tensor | None:
    """``sigmoid(x W_G + b_G)`` [batch, seq_q, n_heads, width] through ``hook_gate`` (None where the
    layer has no gate), from the query input x [batch, seq_q, d_model]."""
    weight = layer._parameters.get("gate_weight")
    if weight is None:
        return None
    B, S, _ = x.shape
    H = layer.n_heads  # type: ignore[attr-defined]
    g = F.linear(x, weight, layer.gate_bias).sigmoid_().reshape(B, S, H, -1)  # (B, S, H, width): in place
    point = layer.hook_gate
    return point(g) if point.active else g  # type: ignore[operator]


def gated(z: Tensor, gate: Tensor | None) -> Tensor:
    """z [batch, seq_q, n_heads, d_head] times the gate [batch, seq_q, n_heads, width] (z where None)."""
    return z if gate is None else z * gate


def W_G(layer: nn.Module) -> Tensor | None:
    """The gate's per-head weights [n_heads, d_model, width] (right-multiplication: ``x W_G[h]``), a view
    of ``gate_weight``: writing into it (under ``torch.no_grad()``) changes the layer; None without gate."""
    weight = layer._parameters.get("gate_weight")
    if weight is None:
        return None
    H = layer.n_heads  # type: ignore[attr-defined]
    return weight.view(H, -1, weight.shape[1]).transpose(1, 2)  # (H, d_model, width)


def b_G(layer: nn.Module) -> Tensor | None:
    """The gate's per-head biases [n_heads, width] (a view), or None."""
    bias = layer._parameters.get("gate_bias")
    return None if bias is None else bias.view(layer.n_heads, -1)  # type: ignore[attr-defined]  # (H, width)
