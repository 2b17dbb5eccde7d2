"""QK-norm layers with rotary positions (OLMo 2, Gemma 3, Qwen3): the untraced path rotates the norms'
fresh q and k in place instead of into new tensors (issue 38, speed); the same values as the traced path
and the autograd path, bit for bit."""

from __future__ import annotations

import pytest
import torch

import headspace.attention.projection as projection
from headspace.attention.layer import MultiHeadAttention
from headspace.nn.positions import Rotary

D, H, HKV = 48, 4, 2  # d_head 12


def _layer(qk_norm: str, fraction: float) -> MultiHeadAttention:
    torch.manual_seed(3)
    layer = MultiHeadAttention(
        D, H, n_kv_heads=HKV, rotary=Rotary(D // H, fraction=fraction), qk_norm=qk_norm
    )
    with torch.no_grad():
        layer.q_norm.weight.normal_()
        layer.k_norm.weight.normal_()
    return layer


@pytest.mark.parametrize("qk_norm, fraction", [("head", 1.0), ("all", 1.0), ("head", 0.5)])
def test_in_place_rotation_is_the_traced_rotation_bit_for_bit(qk_norm: str, fraction: float) -> None:
    layer, x = _layer(qk_norm, fraction), torch.randn(2, 9, D)
    with torch.no_grad():
        fast = layer(x, is_causal=True)
    graph = layer(x, is_causal=True)  # autograd: rotate_fused into fresh tensors
    assert torch.equal(fast, graph.detach())
    seen = {}
    remove = layer.hook_rot_k.add(lambda t, hook: seen.setdefault("rot_k", t.clone()))
    try:
        with torch.no_grad():
            traced = layer(x, is_causal=True)  # every hook point's path
            _, k, _ = layer._heads_qkv(x, x, x, True, False, None, None, None)  # the untraced stages
    finally:
        remove()
    torch.testing.assert_close(fast, traced, rtol=0, atol=1e-5)  # sdpa against the reference maths
    assert torch.equal(seen["rot_k"].transpose(1, 2), k)  # the same rotated keys, bit for bit


def test_untraced_qk_norm_layers_rotate_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    layer, x = _layer("all", 1.0), torch.randn(2, 9, D)
    with torch.no_grad():
        want = layer(x, is_causal=True)

    def refuse(*args, **kwargs):
        raise AssertionError("rotate_fused made a fresh copy on the untraced path")

    monkeypatch.setattr(projection, "rotate_fused", refuse)
    with torch.no_grad():
        assert torch.equal(layer(x, is_causal=True), want)
    with pytest.raises(AssertionError, match="fresh copy"):
        layer(x, is_causal=True)  # autograd: the graph needs the fresh tensors
