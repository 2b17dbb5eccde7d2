"""Patching cross-attention heads from a clean source into a corrupt one (sentences, or audio)."""

from __future__ import annotations

import pytest
import torch

import headspace
from conftest import inputs_of
from headspace.analysis.encdec_patching import patch_cross_heads, patched_logits


@pytest.mark.parametrize("kind", ["bart", "whisper"])
def test_patching_every_cross_head_gives_the_clean_logits(tiny, kind: str) -> None:
    """The decoder reads the source only through cross-attention: every head patched = the clean run."""
    m = headspace.load(tiny(kind)[0])
    clean, corrupt = inputs_of(kind, seed=1), inputs_of(kind, seed=2)
    y = (
        torch.tensor([[2, 5, 9, 4], [2, 7, 7, 3]])
        if kind != "whisper"
        else torch.tensor([[1, 5, 9, 4], [1, 3, 3, 2]])
    )
    with torch.no_grad():
        want_clean, want_corrupt = m(clean, y), m(corrupt, y)
    assert (want_clean - want_corrupt).abs().max() > 1e-2
    c = m.config
    every = [(layer, head) for layer in range(c.n_decoder_layers) for head in range(c.n_heads)]
    torch.testing.assert_close(patched_logits(m, clean, corrupt, y, every), want_clean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(patched_logits(m, clean, corrupt, y, []), want_corrupt)
    partial = patched_logits(m, clean, corrupt, y, every[:-1])  # one head left corrupt: not the clean run
    assert (partial - want_clean).abs().max() > 1e-4


def test_sweep_measures_each_head(tiny) -> None:
    m = headspace.load(tiny("t5")[0])
    clean, corrupt = inputs_of("t5", seed=1), inputs_of("t5", seed=3)
    y = torch.tensor([[0, 5, 9], [0, 7, 3]])
    result = patch_cross_heads(m, clean, corrupt, y)
    assert result.effects.shape == (3, 3)
    with torch.no_grad():
        target = int(m(clean, y)[0, -1].argmax())
    lp = lambda logits: float(torch.log_softmax(logits[0, -1], -1)[target])  # noqa: E731
    for layer, head in [(0, 0), (2, 1)]:
        patched = patched_logits(m, clean, corrupt, y, [(layer, head)])
        assert result.effects[layer, head].item() == pytest.approx(lp(patched) - result.corrupt, abs=1e-5)
    assert result.effects.abs().max() > 0
    with pytest.raises(
        ValueError, match=r"heads must be \(decoder layer in \[0, 3\), head in \[0, 3\)\) pairs"
    ):
        patched_logits(m, clean, corrupt, y, [(3, 0)])
