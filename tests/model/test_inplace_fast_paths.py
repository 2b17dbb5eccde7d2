"""The untraced forward's in-place work (issue 38, speed): rotary positions turned inside the fused QKV
projection, the MLP's activation written over its linear output, the residual sums written over the
sublayers' outputs. Each is taken only where nothing watches or needs the value it overwrites; these
tests hold the fast path against the ordinary one (a hook point with a function, or autograd) and check
that values handed to hooks are never overwritten."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from headspace.attention.layer import MultiHeadAttention
from headspace.model.block import TransformerBlock
from headspace.model.mlp import FeedForward, GatedFeedForward
from headspace.nn.positions import Rotary, rotary_tables, rotate_fused
from headspace.nn.rotate_inplace import rotate_fused_

D, H, HKV = 48, 4, 2  # d_head 12


@pytest.mark.parametrize("fraction, interleaved", [(1.0, False), (0.5, False), (1 / 3, True), (1.0, True)])
def test_rotate_in_place_is_rotate_fused_bit_for_bit(fraction: float, interleaved: bool) -> None:
    torch.manual_seed(0)
    rot = Rotary(12, fraction=fraction, interleaved=interleaved)
    qkv = torch.randn(2, 7, 8, 12).transpose(1, 2)  # (batch, heads, seq, d_head): a strided view
    cos, sin = rotary_tables(rot, torch.arange(3, 10), qkv.dtype, qkv.device)
    want = rotate_fused(qkv[:, :6], cos, sin, rot)  # (2, 6, 7, 12), fresh
    untouched = qkv[:, 6:].clone()
    got = rotate_fused_(qkv[:, :6], cos, sin, rot)
    assert torch.equal(got, want) and torch.equal(qkv[:, :6], want)
    assert torch.equal(qkv[:, 6:], untouched)  # the heads after the rotated ones: not written


def _rotary_layer(fraction: float) -> MultiHeadAttention:
    torch.manual_seed(1)
    layer = MultiHeadAttention(D, H, n_kv_heads=HKV, rotary=Rotary(D // H, fraction=fraction))
    with torch.no_grad():
        layer.qkv_bias.normal_()
    return layer


@pytest.mark.parametrize("fraction", [1.0, 1 / 3])
def test_rotary_fast_path_rotates_inside_the_projection(fraction: float) -> None:
    layer, x = _rotary_layer(fraction), torch.randn(2, 9, D)
    with torch.no_grad():
        q, _, v = layer._heads_qkv(x, x, x, True, False, None, None, None)
        assert q.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()  # views of one buffer
        fast = layer(x, is_causal=True)
    graph = layer(x, is_causal=True)  # autograd: q and k rotated out of place (fresh tensors)
    torch.testing.assert_close(fast, graph.detach(), rtol=0, atol=1e-6)
    seen: dict[str, torch.Tensor] = {}
    layer.hook_rot_q.add(lambda t, hook: seen.setdefault("rot_q", t.clone()))
    with torch.no_grad():
        hooked = layer(x, is_causal=True)  # the traced path, hook_rot_q watched
    torch.testing.assert_close(fast, hooked, rtol=0, atol=1e-5)
    assert torch.equal(seen["rot_q"].transpose(1, 2), q)  # the same rotated queries, bit for bit


def _mlps() -> list[nn.Module]:
    torch.manual_seed(2)
    mlps: list[nn.Module] = [FeedForward(D, 40, act=a) for a in ("gelu", "gelu_tanh", "relu", "silu")]
    return mlps + [GatedFeedForward(D, 40, act=a, bias=True) for a in ("silu", "gelu_tanh")]


@pytest.mark.parametrize("index", range(6))
def test_mlp_in_place_activation_equals_the_hooked_path(index: int) -> None:
    mlp, x = _mlps()[index], torch.randn(3, 5, D)
    with torch.no_grad():
        fast = mlp(x)
        seen: list[torch.Tensor] = []
        mlp.hook_pre.add(lambda t, hook: seen.append(t))  # keeps the very tensor it is given
        hooked = mlp(x)
    assert torch.equal(fast, hooked)
    fc = mlp.fc_gate if hasattr(mlp, "fc_gate") else mlp.fc_in
    assert torch.equal(seen[0], fc(x).detach())  # the kept pre-activation was not overwritten
    mlp.hook_pre.clear()
    out = mlp(x)  # autograd: the activation out of place, backward runs
    out.sum().backward()
    assert torch.equal(out.detach(), fast) and mlp.fc_in.weight.grad is not None


@pytest.mark.parametrize("layout", ["pre", "parallel"])
def test_block_in_place_sums_leave_hooked_values_intact(layout: str) -> None:
    torch.manual_seed(3)
    block = TransformerBlock(D, H, 40, norm=layout, rotary=Rotary(D // H, fraction=0.5))
    x = torch.randn(2, 6, D)
    with torch.no_grad():
        fast = block(x, is_causal=True)
        kept: dict[str, torch.Tensor] = {}
        for name in ("hook_attn_out", "hook_mlp_out", "hook_resid_pre"):
            getattr(block, name).add(lambda t, hook, n=name: kept.setdefault(n, t))
        x_before = x.clone()
        hooked = block(x, is_causal=True)
        attn_out = block.attn(block.ln1(x), is_causal=True)
        mlp_in = block.ln2(x if layout == "parallel" else x + attn_out)
        mlp_out = block.mlp(mlp_in)
    torch.testing.assert_close(fast, hooked, rtol=0, atol=1e-5)
    assert torch.equal(x, x_before) and kept["hook_resid_pre"] is x  # the block's input: never written
    torch.testing.assert_close(kept["hook_attn_out"], attn_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(kept["hook_mlp_out"], mlp_out, rtol=0, atol=1e-5)
    want = x + attn_out + mlp_out  # (the pre layout: mlp_out is that of h = x + attn_out)
    torch.testing.assert_close(fast, want, rtol=0, atol=1e-5)
