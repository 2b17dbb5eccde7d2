"""The decoding step without hook dispatch (headspace.model.encdec.fast_step): the same stream as the
ordinary cached step to float32 rounding, the same greedy tokens with it forced on and off, and never
taken while a hook is registered on the decoder (the hook then sees every step)."""

from __future__ import annotations

import pytest
import torch

import headspace
from conftest import inputs_of
from headspace.model.encdec.fast_step import fast_step, fast_step_usable


def _caches(m: headspace.EncoderDecoder, memory: torch.Tensor, n: int) -> tuple[list, list]:
    blocks = list(m.decoder.blocks)
    caches = [b.attn.make_kv_cache(memory.shape[0], n) for b in blocks]
    return caches, [b.cross_attn.cross_kv(memory) for b in blocks]


@pytest.mark.parametrize("kind", ["whisper", "bart", "marian"])
def test_fast_step_equals_the_ordinary_step(tiny, kind: str) -> None:
    folder, _ = tiny(kind)
    m = headspace.load(folder)
    assert fast_step_usable(m.decoder)
    x = inputs_of(kind, batch=2)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, m.config.vocab_size, (2, 7), generator=g)
    with torch.no_grad():
        memory = m.encode(x)  # (B, Sk, d_model)
        ours, theirs = _caches(m, memory, 7), _caches(m, memory, 7)
        for t in range(7):
            step = ids[:, t : t + 1]  # (B, 1)
            got = fast_step(m.decoder, step, ours[0], ours[1], None)
            want = m.decoder(step, None, caches=theirs[0], cross=theirs[1])
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        full = m.decoder(ids, memory)  # the uncached forward: every position at once
    torch.testing.assert_close(got[:, 0], full[:, -1], rtol=1e-4, atol=1e-4 * full.abs().max().item())


@pytest.mark.parametrize("kind", ["whisper", "bart", "marian"])
def test_generate_same_tokens_fast_on_and_off(tiny, kind: str) -> None:
    folder, _ = tiny(kind)
    m = headspace.load(folder)
    x = inputs_of(kind, batch=3)
    for screen in (False, True):
        on = m.generate(x, 10, fast=True, screen=screen)
        assert on.tolist() == m.generate(x, 10, fast=False, screen=screen).tolist()
        assert on.shape[1] > 3


def test_fast_step_not_taken_with_a_hook_or_buckets(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, _ = tiny("whisper")
    m = headspace.load(folder)
    x = inputs_of("whisper", batch=1)
    plain = m.generate(x, 6, eos_token_id=-1)  # no eos: every step runs
    seen: list[torch.Tensor] = []
    point = m.hook_points()["decoder.blocks.1.hook_mlp_out"]
    remove = point.add(lambda v, _p: seen.append(v.clone()))
    try:
        assert not fast_step_usable(m.decoder)
        hooked = m.generate(x, 6, eos_token_id=-1, fast=True)
    finally:
        remove()
    assert hooked.tolist() == plain.tolist()
    assert len(seen) == 6  # the prompt's step and the five after it, each through the hooked path
    assert fast_step_usable(m.decoder)
    t5, _ = tiny("t5")
    assert not fast_step_usable(headspace.load(t5).decoder)  # the bucket bias: the ordinary path
