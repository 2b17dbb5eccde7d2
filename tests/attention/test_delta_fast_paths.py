"""The Gated DeltaNet's fast paths (headspace.attention.delta_chunk, the channels-last convolution) against
the reference ops they replace and transformers' torch fallback; the autograd path keeps the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as qn

import headspace as hs
from headspace.attention.delta_chunk import fast_chunk_rule
from headspace.attention.delta_net import GatedDeltaNet, causal_depthwise_conv
from headspace.attention.delta_rule import chunk_rule, reference_chunk_rule
from headspace.kernels import cpu
from headspace.kernels.denormals import flushed_denormals, flushing_denormals
from headspace.nn.delta_spec import DeltaNetSpec

pytestmark = pytest.mark.usefixtures("single_thread")


def inputs(seq: int, hk: int, hv: int, dk: int, dv: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    q, k = torch.randn(2, seq, hk, dk), torch.randn(2, seq, hk, dk)
    v = torch.randn(2, seq, hv, dv)
    return [q, k, v, -torch.rand(2, seq, hv), torch.rand(2, seq, hv)]


# d_k 16 and 4: 1 / sqrt(d_k) a power of two (folded into the norm); 5: not (applied after it)
@pytest.mark.parametrize(
    ("seq", "hk", "hv", "dk", "dv"), [(128, 2, 4, 16, 8), (70, 3, 3, 5, 7), (9, 1, 2, 4, 3)]
)
def test_the_fast_rule_equals_the_reference_and_transformers(
    seq: int, hk: int, hv: int, dk: int, dv: int
) -> None:
    q, k, v, g, beta = inputs(seq, hk, hv, dk, dv)
    state = torch.randn(2, hv, dk, dv)
    kept = state.clone()
    for start in (None, state):
        want, want_state = qn.torch_chunk_gated_delta_rule(
            q,
            k,
            v,
            g=g,
            beta=beta,
            initial_state=start,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        got, got_state = fast_chunk_rule(q, k, v, g, beta, start)
        ref, ref_state = reference_chunk_rule(q, k, v, g, beta, start)
        assert got.shape == want.shape and got.is_contiguous() and got_state.shape == want_state.shape
        # the same ops on the same values, in the same order: equal bit for bit (d_k 5 scales after the norm)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        torch.testing.assert_close(got_state, want_state, atol=0, rtol=0)
        torch.testing.assert_close(got, ref, atol=0, rtol=0)
        torch.testing.assert_close(got_state, ref_state, atol=0, rtol=0)
    assert torch.equal(state, kept)  # the state given is read, not written


def test_chunk_rule_takes_the_reference_where_autograd_records() -> None:
    q, k, v, g, beta = inputs(70, 2, 4, 16, 8)
    v.requires_grad_(True)
    out, state = chunk_rule(q, k, v, g, beta)  # the reference (differentiable): the fast one writes out=
    assert out.grad_fn is not None
    (out.sum() + state.sum()).backward()
    assert v.grad is not None and bool(v.grad.abs().sum() > 0)
    with torch.no_grad():
        fast, fast_state = chunk_rule(q, k, v, g, beta)
    torch.testing.assert_close(out.detach(), fast, atol=0, rtol=0)
    torch.testing.assert_close(state.detach(), fast_state, atol=0, rtol=0)


@pytest.mark.parametrize("seq", [1, 2, 3, 4, 11])
def test_the_channels_last_convolution_is_conv1d_bit_for_bit(seq: int) -> None:
    torch.manual_seed(3)
    channels, taps = 13, 4
    x, weight = torch.randn(2, seq, channels), torch.randn(channels, taps)
    want = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), padding=taps - 1, groups=channels)[..., :seq]
    torch.testing.assert_close(causal_depthwise_conv(x, weight), want.transpose(1, 2), atol=0, rtol=0)


def test_the_layer_hooked_differentiable_and_fast_paths_agree() -> None:
    torch.manual_seed(4)
    layer = GatedDeltaNet(DeltaNetSpec(20, 2, 4, 4, 6, conv_kernel=3, norm_eps=1e-6)).eval()
    x = torch.randn(2, 67, 20)  # a chunk and a padded one
    with torch.no_grad():
        fast = layer(x)  # the channels-last convolution and the fast rule
        names = [
            "hook_q",
            "hook_k",
            "hook_v",
            "hook_gate",
            "hook_beta",
            "hook_state",
            "hook_o",
        ]
        with hs.trace(layer, names=names) as t:
            hooked = layer(x)
    graph = layer(x.clone().requires_grad_(True))  # conv1d and the reference rule, under autograd
    torch.testing.assert_close(hooked, fast, atol=0, rtol=0)
    # (conv1d recording a graph runs another kernel than without: equal to float32 rounding only)
    torch.testing.assert_close(graph.detach(), fast, atol=1e-6, rtol=0)
    # the hook points saw the fast path's values: the convolution's q, k, v and the rule's output
    with torch.no_grad():
        q, k, v = layer._conv_qkv(x, None)
    for name, want in (("hook_q", q), ("hook_k", k), ("hook_v", v)):
        torch.testing.assert_close(t[name], want, atol=0, rtol=0)
    o, state = fast_chunk_rule(q, k, v, t["hook_gate"], t["hook_beta"])
    torch.testing.assert_close(t["hook_o"], o, atol=0, rtol=0)
    torch.testing.assert_close(t["hook_state"], state, atol=0, rtol=0)


def test_denormals_are_flushed_in_the_rule_only_and_the_fallback_keeps_them() -> None:
    assert not flushing_denormals()  # torch's default
    with flushed_denormals():
        assert flushing_denormals() == torch.set_flush_denormal(True)  # on where torch can
    assert not flushing_denormals()  # and off again
    with cpu.force_fallback("denormals"), flushed_denormals():
        assert not flushing_denormals()
    torch.set_flush_denormal(True)
    try:
        if flushing_denormals():  # on before the block: left on after it
            with flushed_denormals():
                pass
            assert flushing_denormals()
    finally:
        torch.set_flush_denormal(False)
    # strong decays (log decays to -300 within a chunk): the reference makes denormal floats there
    q, k, v, g, beta = inputs(128, 2, 4, 16, 8)
    g = g * 10.0
    want, want_state = reference_chunk_rule(q, k, v, g, beta)
    got, got_state = fast_chunk_rule(q, k, v, g, beta)
    with cpu.force_fallback("denormals"):
        kept, kept_state = fast_chunk_rule(q, k, v, g, beta)
    assert not flushing_denormals()
    for a, b in ((got, want), (kept, want), (got_state, want_state), (kept_state, want_state)):
        torch.testing.assert_close(a, b, atol=1e-37, rtol=0)  # what differs is below 2^-126
