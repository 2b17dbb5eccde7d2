"""``headspace.trace`` and ``headspace.ablate`` on an encoder-decoder: every hook point by its module path,
cross-attention heads included."""

from __future__ import annotations

import pytest
import torch

import headspace
from conftest import SIZES, inputs_of
from headspace.trace import attention_layers


@pytest.mark.parametrize("kind", ["t5", "whisper"])
def test_trace_records_every_stack(tiny, kind: str) -> None:
    m = headspace.load(tiny(kind)[0])
    x = inputs_of(kind)
    y = torch.randint(0, SIZES[kind]["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(7))
    with torch.no_grad(), headspace.trace(m) as t:
        logits = m(x, y)
    want, cache = m.run_with_cache(x, y)
    assert torch.equal(logits, want)
    for name in ("encoder.blocks.1.attn.hook_pattern", "decoder.blocks.2.attn.hook_scores",
                 "decoder.blocks.0.cross_attn.hook_pattern", "decoder.blocks.1.cross_attn.hook_result",
                 "decoder.blocks.2.hook_cross_out"):  # fmt: skip
        assert torch.equal(t[name], cache[name]), name
    seq_k = x.shape[1] if kind != "whisper" else x.shape[2] // 2
    assert t["decoder.blocks.0.cross_attn.hook_pattern"].shape == (2, m.config.n_heads, 5, seq_k)


def test_ablating_a_cross_attention_head(tiny) -> None:
    """headspace.ablate on a cross-attention head (by its index in attention_layers) equals the model with
    that head's rows of W_O zeroed."""
    m = headspace.load(tiny("bart")[0])
    x = inputs_of("bart")
    y = torch.randint(0, SIZES["bart"]["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(8))
    paths = [name for name, _ in attention_layers(m)]
    index = paths.index("decoder.blocks.1.cross_attn")
    with torch.no_grad():
        clean = m(x, y)
        with headspace.ablate(m, [(index, 2)]):
            ablated = m(x, y)
        layer = m.decoder.blocks[1].cross_attn
        saved = layer.W_O[2].clone()
        layer.W_O[2] = 0.0
        try:
            reference = m(x, y)
        finally:
            layer.W_O[2] = saved
    assert (ablated - clean).abs().max() > 1e-3
    torch.testing.assert_close(ablated, reference, atol=1e-5, rtol=1e-5)
