"""T5, BART, Marian and Whisper on headspace's EncoderDecoder equal transformers' eager forward on the same
tiny random weights: logits within 1e-4 of their largest magnitude, every attention pattern (encoder self,
decoder self, cross) within 1e-5."""

from __future__ import annotations

import pytest
import torch

import headspace
from conftest import FAMILIES, SIZES, inputs_of
from headspace.model.encdec import EncoderDecoder


def _reference(ref: object, kind: str, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None) -> object:
    key = "input_features" if kind == "whisper" else "input_ids"
    kw = {key: x, "decoder_input_ids": y, "output_attentions": True}
    if mask is not None:
        kw["attention_mask"] = mask
    with torch.no_grad():
        return ref(**kw)


@pytest.mark.parametrize("kind", FAMILIES)
def test_logits_and_patterns_equal_transformers(tiny, kind: str) -> None:
    folder, ref = tiny(kind)
    m = headspace.load(folder)
    assert isinstance(m, EncoderDecoder)
    x = inputs_of(kind)
    y = torch.randint(0, SIZES[kind]["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(5))
    out = _reference(ref, kind, x, y, None)
    logits, cache = m.run_with_cache(x, y)
    scale = out.logits.abs().max()
    assert (logits - out.logits).abs().max() <= 1e-4 * scale
    c = m.config
    for i in range(c.n_encoder_layers):
        got = cache[f"encoder.blocks.{i}.attn.hook_pattern"]
        torch.testing.assert_close(got, out.encoder_attentions[i], atol=1e-5, rtol=0)
    for i in range(c.n_decoder_layers):
        torch.testing.assert_close(
            cache[f"decoder.blocks.{i}.attn.hook_pattern"], out.decoder_attentions[i], atol=1e-5, rtol=0
        )
        cross = cache[f"decoder.blocks.{i}.cross_attn.hook_pattern"]
        assert cross.shape == out.cross_attentions[i].shape  # [batch, n_heads, seq_dec, seq_enc]
        torch.testing.assert_close(cross, out.cross_attentions[i], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["t5", "bart", "marian"])
def test_padded_source_equals_transformers(tiny, kind: str) -> None:
    """A padded source row: the encoder's padding is masked in its self-attention and in cross-attention."""
    folder, ref = tiny(kind)
    m = headspace.load(folder)
    x = inputs_of(kind)
    mask = torch.ones_like(x)
    mask[1, 6:] = 0
    y = torch.randint(0, SIZES[kind]["vocab_size"], (2, 4), generator=torch.Generator().manual_seed(6))
    out = _reference(ref, kind, x, y, mask)
    logits, cache = m.run_with_cache(x, y, mask)
    assert (logits - out.logits).abs().max() <= 1e-4 * out.logits.abs().max()
    cross = cache["decoder.blocks.0.cross_attn.hook_pattern"]
    assert float(cross[1, :, :, 6:].abs().max()) == 0.0
    torch.testing.assert_close(cross, out.cross_attentions[0], atol=1e-5, rtol=0)


def test_marian_positions_are_transformers_sinusoids(tiny) -> None:
    folder, ref = tiny("marian")
    m = headspace.load(folder)
    table = ref.model.encoder.embed_positions.weight
    torch.testing.assert_close(m.encoder.embed.sinusoid, table, atol=1e-6, rtol=0)


def test_hook_points_of_every_attention_layer(tiny) -> None:
    folder, _ = tiny("bart")
    points = headspace.load(folder).hook_points()
    for stage in ("q", "k", "v", "scores", "pattern", "z", "result"):
        assert f"encoder.blocks.1.attn.hook_{stage}" in points
        assert f"decoder.blocks.2.attn.hook_{stage}" in points
        assert f"decoder.blocks.2.cross_attn.hook_{stage}" in points


def test_whisper_from_a_transformers_state_dict(tiny) -> None:
    """A state dict in transformers' naming (the in-memory model's, proj_out included) loads directly."""
    from headspace.pretrained.encdec import whisper_from_state_dict

    _, ref = tiny("whisper")
    m = whisper_from_state_dict(ref.config.to_dict(), ref.state_dict())
    x = inputs_of("whisper")
    y = torch.tensor([[1, 5, 7, 9], [1, 3, 3, 2]])
    with torch.no_grad():
        want = ref(input_features=x, decoder_input_ids=y).logits
        got = m(x, y)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    broken = dict(ref.state_dict())
    broken["model.encoder.conv2.weight"] = broken["model.encoder.conv2.weight"][:, :, :2]
    with pytest.raises(ValueError, match=r"whisper state dict does not match .*1 mis-shaped"):
        whisper_from_state_dict(ref.config.to_dict(), broken)
    broken = dict(ref.state_dict())
    broken["model.decoder.layers.0.fc1.bias"] = torch.full_like(
        broken["model.decoder.layers.0.fc1.bias"], float("nan")
    )
    with pytest.raises(ValueError, match=r"model.decoder.layers.0.fc1.bias' has 41 NaN/Inf"):
        whisper_from_state_dict(ref.config.to_dict(), broken)


@pytest.mark.parametrize("kind", ["t5", "t5-relu"])
def test_t5_offsets_past_max_distance_equal_transformers(tiny, kind: str) -> None:
    """Offsets beyond relative_attention_max_distance share the last bucket, in both stacks."""
    folder, ref = tiny(kind)
    m = headspace.load(folder)
    g = torch.Generator().manual_seed(9)
    x = torch.randint(3, 36, (1, 29), generator=g)
    y = torch.randint(0, 37, (1, 23), generator=g)
    out = _reference(ref, kind, x, y, None)
    logits, cache = m.run_with_cache(x, y)
    assert (logits - out.logits).abs().max() <= 1e-4 * out.logits.abs().max()
    torch.testing.assert_close(
        cache["encoder.blocks.0.attn.hook_pattern"], out.encoder_attentions[0], atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        cache["decoder.blocks.1.attn.hook_pattern"], out.decoder_attentions[1], atol=1e-5, rtol=0
    )
    far = m.encoder.rel_bias.bucket(torch.tensor([-28, 28, -15, 15]))
    assert far.tolist()[:2] == far.tolist()[2:]  # past max_distance: the same bucket each way
