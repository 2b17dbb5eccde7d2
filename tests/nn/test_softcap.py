"""Soft-capping written once (headspace.nn.softcap): ``cap * tanh(x / cap)`` in place, a block of rows at
a time, is bit for bit transformers' ``tanh(x / cap) * cap``; out of place it keeps the autograd graph.

Reference: transformers' Gemma 2 order of operations (``x / cap``, ``tanh``, ``* cap``) in plain torch ops.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from headspace.nn import softcap
from headspace.nn.softcap import owns_output, soft_cap


def reference(x: torch.Tensor, cap: float) -> torch.Tensor:
    """transformers' Gemma 2 soft-capping: divide, tanh, multiply."""
    y = x / cap
    y = torch.tanh(y)
    return y * cap


@pytest.mark.parametrize("shape", [(3, 5, 97), (2, 4, 6, 13), (1000, 300), (7,), ()])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_in_place_blocks_are_the_reference_bit_for_bit(
    shape: tuple[int, ...], dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = (torch.randn(shape) * 40).to(dtype)
    kept, want = x.clone(), reference(x, 30.0)
    assert torch.equal(soft_cap(x, 30.0), want) and torch.equal(x, kept)  # out of place: x untouched
    # blocks of 3 rows of 97 (several blocks, a short last one) or of single rows
    monkeypatch.setattr(softcap, "SOFTCAP_BLOCK_BYTES", 3 * 97 * x.element_size())
    y = x.clone()
    out = soft_cap(y, 30.0, in_place=True)
    assert out.data_ptr() == y.data_ptr() and torch.equal(out, want)


def test_in_place_on_a_strided_tensor_caps_every_element() -> None:
    base = torch.randn(6, 20) * 9
    view = base.t()  # (20, 6), not contiguous
    want = reference(view, 2.5)
    out = soft_cap(view, 2.5, in_place=True)
    assert torch.equal(out, want) and torch.equal(base.t(), want)


def test_out_of_place_keeps_the_graph() -> None:
    x = (torch.randn(4, 9, dtype=torch.float64) * 3).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: soft_cap(t, 2.0), (x,))
    y = soft_cap(x, 2.0)
    y.sum().backward()
    assert torch.allclose(x.grad, 1 - torch.tanh(x.detach() / 2.0) ** 2)


def test_owns_output_sees_module_and_global_forward_hooks() -> None:
    lin = nn.Linear(3, 4)
    assert owns_output(None) and owns_output(lin)
    handle = lin.register_forward_hook(lambda m, i, o: None)
    assert not owns_output(lin)
    handle.remove()
    assert owns_output(lin)
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        assert not owns_output(lin) and owns_output(None)  # None: the caller's own value
    finally:
        handle.remove()
    assert owns_output(lin)
