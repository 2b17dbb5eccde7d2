"""A gated MLP's ``act(g) * u`` in place on the gate (headspace.model.gated_in_place): taken only where no
hook saw the gate and no graph needs it, and bit for bit the out-of-place values; a hook on ``hook_pre`` or
a forward hook on ``fc_gate`` keeps the gate it saw, before the activation.

Reference: the written-out ``act(x W_gate^T + b) * (x W_in^T + b)`` in plain torch ops.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from headspace.model import gated_in_place
from headspace.model.mlp import GatedFeedForward


def reference(mlp: GatedFeedForward, x: torch.Tensor) -> torch.Tensor:
    return mlp.fc_out(mlp.act(mlp.fc_gate(x)) * mlp.fc_in(x))


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "relu"])
def test_fast_path_is_the_graph_path_bit_for_bit(act: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    mlp = GatedFeedForward(13, 29, act=act, bias=True)
    x = torch.randn(3, 7, 13) * 2
    taken: list[bool] = []
    real = gated_in_place.gate_in_place
    monkeypatch.setattr("headspace.model.mlp.gate_in_place", lambda *a: taken.append(True) or real(*a))
    with torch.no_grad():
        want = reference(mlp, x)
        fast = mlp(x)  # (3, 7, 13)
    assert taken == ([] if act == "relu" else [True])  # relu has no in-place form here: the plain ops
    graph = mlp(x)  # parameters require grad: out of place
    assert graph.requires_grad and torch.equal(graph.detach(), fast) and torch.equal(fast, want)
    graph.sum().backward()
    assert mlp.fc_gate.weight.grad is not None
    assert len(taken) == (0 if act == "relu" else 1)  # the graph path did not take it


def test_hooks_keep_the_gate_they_saw() -> None:
    torch.manual_seed(1)
    mlp = GatedFeedForward(11, 17, act="gelu_tanh")
    x = torch.randn(2, 5, 11)
    with torch.no_grad():
        gate = mlp.fc_gate(x)  # (2, 5, 17): before the activation
        want = reference(mlp, x)
        seen: list[torch.Tensor] = []
        remove = mlp.hook_pre.add(lambda t, hook: seen.append(t))
        assert torch.equal(mlp(x), want) and torch.equal(seen[0], gate)
        remove()
        kept: list[torch.Tensor] = []
        handle = mlp.fc_gate.register_forward_hook(lambda m, i, out: kept.append(out))
        assert torch.equal(mlp(x), want) and torch.equal(kept[0], gate)
        handle.remove()


def test_refuses_a_broadcast_or_a_promotion() -> None:
    act, fc = nn.SiLU(), nn.Linear(3, 4)
    g = torch.randn(2, 4)
    assert gated_in_place.may_gate_in_place(act, fc, True, False, g, torch.randn(2, 4))
    assert not gated_in_place.may_gate_in_place(act, fc, True, False, g, torch.randn(1, 4))
    assert not gated_in_place.may_gate_in_place(act, fc, True, False, g, torch.randn(2, 4).double())
    assert not gated_in_place.may_gate_in_place(act, fc, True, True, g, torch.randn(2, 4))  # watched
    assert not gated_in_place.may_gate_in_place(act, fc, False, False, g, torch.randn(2, 4))  # not plain
