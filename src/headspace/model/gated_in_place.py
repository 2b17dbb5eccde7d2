"""A gated MLP's hidden units ``act(g) * u`` computed in place on the gate ``g`` where nothing else holds it.

``g = x W_gate + b_gate`` is a fresh result of ``fc_gate``; when no hook saw it (``hook_pre`` without a
function, no forward hook on ``fc_gate``), no autograd graph needs it and the activation has an in-place
form (GELU, exact or tanh, and SiLU), ``act_(g).mul_(u)`` overwrites it instead of allocating two more
[batch, seq, d_mlp] tensors: the same kernels on the same values, so bit for bit ``act(g) * u``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.softcap import owns_output


def may_gate_in_place(
    act: nn.Module, fc_gate: nn.Module, plain: bool, gate_watched: bool, g: Tensor, u: Tensor
) -> bool:
    """Whether :func:`gate_in_place` may overwrite ``g`` [batch, seq, d_mlp]: ``act`` has an in-place form,
    ``g`` came straight from ``fc_gate`` (``plain``: an ``nn.Linear`` on plain float weights, so its
    output is a fresh ``F.linear`` result) with no forward hook and no hook function on ``hook_pre``
    (``gate_watched``), no graph needs it, and ``u`` has its shape and dtype (no broadcast, no promotion)."""
    if type(act) not in (nn.GELU, nn.SiLU) or gate_watched or not plain or not owns_output(fc_gate):
        return False
    if torch.is_grad_enabled() and (g.requires_grad or u.requires_grad):
        return False
    return g.shape == u.shape and g.dtype == u.dtype and g.device == u.device


def gate_in_place(act: nn.Module, g: Tensor, u: Tensor) -> Tensor:
    """``act(g) * u`` written into ``g`` (returned): ``act`` an ``nn.GELU`` or ``nn.SiLU``; shapes
    [batch, seq, d_mlp] both (:func:`may_gate_in_place` checked)."""
    if type(act) is nn.GELU:
        torch.ops.aten.gelu_(g, approximate=act.approximate)
    else:
        F.silu(g, inplace=True)
    return g.mul_(u)
