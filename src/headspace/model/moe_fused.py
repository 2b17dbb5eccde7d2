"""The experts' gate and up projections in one buffer, so that each expert's two input products are one.

:class:`~headspace.model.moe.MixtureOfExperts` keeps ``experts_gate`` and ``experts_in`` [E, d_mlp,
d_model] as two parameters (their names, shapes and values are what every view and analysis reads). It
lays them out as the two halves of one buffer ``B`` [E, 2, d_mlp, d_model]::

    experts_gate = B[:, 0]        experts_in = B[:, 1]        (views: strides (2 d_mlp d_model, d_model, 1))

so that expert ``e``'s rows ``[W_gate[e]; W_in[e]]`` are one contiguous matrix ``G_e`` [2 d_mlp, d_model]
(:func:`gate_in_rows`: ``B`` read as [E, 2 d_mlp, d_model], no copy) and::

    [x W_gate[e] | x W_in[e]] = x G_e^T          one product [n, 2 d_mlp] instead of two [n, d_mlp]

as transformers' ``gate_up_proj`` [E, 2 d_mlp, d_model] computes it. The module builds its parameters so
and lays them out again after a ``load_state_dict(..., assign=True)`` (:func:`lay_out_gate_in`: the
loaders assign stacked tensors); any other layout (parameters replaced, ``.to(dtype)``, the bfloat16
carriers of :mod:`~headspace.model.moe_precision`) is detected at each call and runs the two products.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["gate_in_rows", "lay_out_gate_in"]


def gate_in_rows(gate: Tensor, up: Tensor) -> Tensor | None:
    """``B`` [E, 2 d_mlp, d_model] (a view: ``[:, :d_mlp]`` is ``gate``, ``[:, d_mlp:]`` is ``up``) where
    ``gate`` and ``up`` [E, d_mlp, d_model] are the two halves of one buffer [E, 2, d_mlp, d_model] (module
    docstring), plain tensors of one dtype and device; None for any other layout."""
    if type(gate) not in (nn.Parameter, Tensor) or type(up) not in (nn.Parameter, Tensor):
        return None
    if gate.dim() != 3 or up.shape != gate.shape or up.dtype != gate.dtype or up.device != gate.device:
        return None
    e, dm, d = gate.shape
    strides = (2 * dm * d, d, 1)
    if gate.stride() != strides or up.stride() != strides or gate.device.type == "meta":
        return None
    if up.untyped_storage().data_ptr() != gate.untyped_storage().data_ptr():
        return None
    if up.storage_offset() != gate.storage_offset() + dm * d:
        return None
    return gate.as_strided((e, 2 * dm, d), strides)  # (E, 2 d_mlp, d_model)


def lay_out_gate_in(gate: Tensor, up: Tensor) -> tuple[nn.Parameter, nn.Parameter]:
    """``gate`` and ``up`` [E, d_mlp, d_model] copied into one new buffer [E, 2, d_mlp, d_model]: the two
    parameters that are its halves (same values, dtype, device and ``requires_grad``)."""
    e, dm, d = gate.shape
    buffer = torch.empty(e, 2, dm, d, dtype=gate.dtype, device=gate.device)  # (E, 2, d_mlp, d_model)
    with torch.no_grad():
        buffer[:, 0].copy_(gate)
        buffer[:, 1].copy_(up)
    return (
        nn.Parameter(buffer[:, 0], requires_grad=gate.requires_grad),
        nn.Parameter(buffer[:, 1], requires_grad=up.requires_grad),
    )
