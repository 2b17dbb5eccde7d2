"""Greedy generation with the caches: the same tokens as transformers' generate(do_sample=False); each
decoder layer's cross keys and values are computed once per input, never by the per-step attention."""

from __future__ import annotations

import pytest
import torch

import headspace
from conftest import FAMILIES, inputs_of

NEW = 12


def _hf_greedy_config(ref: object, eos: int) -> object:
    """transformers' greedy search with no logits processor: the model's own forced and suppressed tokens
    cleared (they would be merged in: BART forces eos at the end)."""
    c = ref.config
    for name in ("forced_bos_token_id", "forced_eos_token_id", "begin_suppress_tokens", "suppress_tokens"):
        setattr(ref.generation_config, name, None)
    return transformers.GenerationConfig(
        max_new_tokens=NEW, do_sample=False, num_beams=1, decoder_start_token_id=c.decoder_start_token_id,
        eos_token_id=eos, pad_token_id=c.pad_token_id, forced_bos_token_id=None, forced_eos_token_id=None,
        no_repeat_ngram_size=0, min_length=0, bos_token_id=None, use_cache=False,
    )  # fmt: skip


def _hf_greedy(ref: object, kind: str, x: torch.Tensor, eos: int) -> torch.Tensor:
    """GenerationMixin.generate itself (Whisper's own generate adds its timestamp and language logic)."""
    key = "input_features" if kind == "whisper" else "input_ids"
    with torch.no_grad():
        return transformers.GenerationMixin.generate(
            ref, **{key: x}, generation_config=_hf_greedy_config(ref, eos)
        )


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_tokens_equal_transformers(tiny, kind: str) -> None:
    folder, ref = tiny(kind)
    m = headspace.load(folder)
    x = inputs_of(kind, batch=3)
    for eos in (m.config.eos_token_id, 5):  # the config's eos, and another stopping token
        want = _hf_greedy(ref, kind, x, eos)
        got = m.generate(x, NEW, eos_token_id=eos)
        assert got.tolist() == want.tolist()
        assert got.shape[1] > 3  # (greedy ran several steps)


def _no_eos(m: object, x: torch.Tensor) -> torch.Tensor:
    saved = m.config
    m.config = type(saved)(**{**saved.__dict__, "eos_token_id": None})
    try:
        return m.generate(x, NEW)
    finally:
        m.config = saved


@pytest.mark.parametrize("kind", ["t5", "whisper"])
def test_cross_keys_and_values_computed_once(tiny, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, _ = tiny(kind)
    m = headspace.load(folder)
    calls: dict[int, int] = {}
    for i, block in enumerate(m.decoder.blocks):
        original = block.cross_attn.cross_kv

        def counted(memory: torch.Tensor, i: int = i, original=original) -> tuple[torch.Tensor, torch.Tensor]:
            calls[i] = calls.get(i, 0) + 1
            return original(memory)

        monkeypatch.setattr(block.cross_attn, "cross_kv", counted)
        # the traced forward (which projects the encoder output again) must not run while generating
        monkeypatch.setattr(block.cross_attn, "forward", lambda *a, **k: pytest.fail("cross forward ran"))
    x = inputs_of(kind, batch=2)
    tokens = _no_eos(m, x)
    assert tokens.shape == (2, NEW + 1)
    assert calls == dict.fromkeys(range(len(m.decoder.blocks)), 1)


@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_cached_steps_equal_full_forward(tiny, kind: str) -> None:
    """Each cached step's logits equal the uncached forward's last row (self-attention KV cache, T5's
    decoder buckets at the step's position)."""
    folder, _ = tiny(kind)
    m = headspace.load(folder)
    x = inputs_of(kind, batch=2)
    tokens = _no_eos(m, x)
    with torch.no_grad():
        full = m(x, tokens)  # (B, T, V)
    assert torch.equal(full[:, :-1].argmax(-1), tokens[:, 1:])


def test_generate_refuses_bad_arguments(tiny) -> None:
    folder, _ = tiny("bart")
    m = headspace.load(folder)
    x = inputs_of("bart")
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0; got -1"):
        m.generate(x, -1)
    with pytest.raises(ValueError, match=r"decoder_input_ids must have batch 2"):
        m.generate(x, 3, decoder_input_ids=torch.zeros(3, 1, dtype=torch.long))
    with pytest.raises(
        ValueError, match=r"a prompt of 1 tokens and max_new_tokens=40 need 41 positions; the decoder has 40"
    ):
        m.generate(x, 40)
    with pytest.raises(ValueError, match=r"do not fit this model's 40 positions"):
        m.decode(torch.zeros(1, 41, dtype=torch.long), m.encode(x[:1]))


@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_greedy_with_a_padded_source_equals_transformers(tiny, kind: str) -> None:
    folder, ref = tiny(kind)
    m = headspace.load(folder)
    x = inputs_of(kind, batch=3)
    mask = torch.ones_like(x)
    mask[0, 5:] = 0
    mask[2, 7:] = 0
    gen = _hf_greedy_config(ref, m.config.eos_token_id)
    with torch.no_grad():
        want = transformers.GenerationMixin.generate(
            ref, input_ids=x, attention_mask=mask, generation_config=gen
        )
    got = m.generate(x, NEW, attention_mask=mask)
    assert got.tolist() == want.tolist()
