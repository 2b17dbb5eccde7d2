"""Learned attention sinks (gpt-oss) on MultiHeadAttention, against transformers' own gpt-oss eager
attention on the same q, k, v and sink logits; the editable parameter, hook_sink, and the executors
that lack sinks refusing them by name."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

import headspace as hs
from headspace.attention.sinks import sink_mass
from headspace.model.block import TransformerBlock

pytestmark = pytest.mark.usefixtures("single_thread")

D, H, HKV, DH, S = 24, 4, 2, 6, 9


def layer_with_sinks() -> hs.MultiHeadAttention:
    torch.manual_seed(5)
    attn = hs.MultiHeadAttention(D, H, d_head=DH, n_kv_heads=HKV, window=4, sink="learned").eval()
    with torch.no_grad():
        attn.sinks.copy_(torch.randn(H) * 2)
    return attn


def test_pattern_and_output_equal_transformers_gpt_oss_eager() -> None:
    attn = layer_with_sinks()
    x = torch.randn(2, S, D)
    with torch.no_grad(), hs.trace(attn, names=["hook_q", "hook_k", "hook_v", "hook_pattern", "hook_z",
                                                  "hook_sink"]) as t:  # fmt: skip
        out, pattern = attn(x, x, x, need_weights=True, is_causal=True)
        fast = attn(x, x, x, is_causal=True)  # untraced: the same maths (no fused kernel has sinks)
    q, k, v = (t[n].transpose(1, 2) for n in ("hook_q", "hook_k", "hook_v"))  # (B, heads, S, dh)
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    allowed = (j <= i) & (j > i - 4)  # causal, window 4
    mask = torch.zeros(S, S).masked_fill(~allowed, float("-inf"))[None, None]
    module = SimpleNamespace(sinks=attn.sinks.detach(), num_key_value_groups=H // HKV, training=False)
    want_z, want_p = eager_attention_forward(module, q, k, v, mask, scaling=DH**-0.5)
    torch.testing.assert_close(pattern, want_p, atol=1e-6, rtol=0)
    torch.testing.assert_close(t["hook_pattern"], want_p, atol=1e-6, rtol=0)
    torch.testing.assert_close(t["hook_z"], want_z, atol=1e-6, rtol=0)
    torch.testing.assert_close(fast, out, atol=1e-6, rtol=0)
    sink = t["hook_sink"]  # (B, H, S): rows sum to 1 - sink, and the sink took mass
    assert sink.shape == (2, H, S) and float(sink.min()) > 0
    torch.testing.assert_close(pattern.sum(-1), 1 - sink, atol=1e-6, rtol=0)
    torch.testing.assert_close(sink, sink_mass(pattern))
    with torch.no_grad():  # the sinks are an editable parameter: a very negative one takes no mass
        attn.sinks.fill_(-1e4)
        _, plain = attn(x, x, x, need_weights=True, is_causal=True)
    torch.testing.assert_close(plain.sum(-1), torch.ones(2, H, S))


def test_a_block_with_sinks_has_the_python_step_and_a_layer_without_refuses_the_field() -> None:
    torch.manual_seed(6)
    model = hs.Decoder(hs.ModelConfig(arch="decoder", vocab_size=31, d_model=D, n_layers=1, n_heads=H,
                                      max_seq_len=32)).eval()  # fmt: skip
    block = model.blocks[0]
    spec = dataclasses.replace(
        block.spec, attention=dataclasses.replace(block.spec.attention, sink="learned")
    )
    with pytest.raises(
        ValueError, match=r"attention spec: sink is None must be True, fixed by the layer.s weights"
    ):
        block.attn.spec = spec.attention  # the layer has no sink logits
    sunk = TransformerBlock.from_spec(spec)
    assert sunk.attn.sinks.shape == (H,) and sunk.decode_supported  # (tests/pretrained/test_moe_families.py)
