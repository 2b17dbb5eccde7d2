"""Exact speculative greedy decoding (headspace.model.encdec.speculative): the same tokens as the plain
one-token loop with n-gram drafts, with drafts always wrong and with drafts always right; the verifying
forward equals the ordinary decoder forward; rollback leaves the cache as if only the accepted tokens had
been fed; the off switches (``draft=0``, ``HEADSPACE_FORCE_FALLBACK=speculative``) and a hook turn it off."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import headspace
from conftest import inputs_of
from headspace.model.encdec import speculative
from headspace.model.encdec.speculative import (
    SpeculationStats,
    fast_verify,
    ngram_draft,
    rollback,
    speculation_on,
)
from headspace.nn.kv_cache import KVCache
from headspace.pretrained.encdec.features import wav_features

KINDS = ["whisper", "bart", "marian"]
#: speculation is what these tests test: no fallback forced by the environment
pytestmark = pytest.mark.usefixtures("automatic_choices")


def _caches(m: headspace.EncoderDecoder, memory: torch.Tensor, n: int) -> tuple[list, list]:
    blocks = list(m.decoder.blocks)
    caches = [b.attn.make_kv_cache(memory.shape[0], n) for b in blocks]
    return caches, [b.cross_attn.cross_kv(memory) for b in blocks]


def test_ngram_draft_takes_the_longest_latest_match() -> None:
    assert ngram_draft([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3], 3) == [8, 5, 1]  # the latest 3-gram match
    assert ngram_draft([7, 1, 2, 6, 4, 1, 2], 5) == [6, 4, 1, 2, 6]  # the copy runs on into the draft
    assert ngram_draft([3, 5, 5, 5], 4) == [5, 5, 5, 5]  # a run drafts its continuation
    assert ngram_draft([5, 1, 2, 3, 4], 4) == []  # no earlier 2-gram
    assert ngram_draft([1, 2, 1, 2], 0) == []


@pytest.mark.parametrize("kind", KINDS)
def test_fast_verify_equals_the_ordinary_forward_and_rollback(tiny, kind: str) -> None:
    folder, _ = tiny(kind)
    m = headspace.load(folder)
    x = inputs_of(kind, batch=1)
    ids = torch.randint(3, m.config.vocab_size - 1, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        memory = m.encode(x)  # (1, Sk, d_model)
        full = m.decoder(ids, memory)  # (1, 9, d_model): every position at once, no cache
        caches, cross = _caches(m, memory, 12)
        m.decoder(ids[:, :3], None, caches=caches, cross=cross)
        got = fast_verify(m.decoder, ids[:, 3:], caches, cross, None)  # (1, 6, d_model)
        tol = 1e-5 * full.abs().max().item()
        torch.testing.assert_close(got, full[:, 3:], rtol=1e-5, atol=tol)
        rollback(caches, 5)  # keep ids 0..4; the keys of 5..8 are stale and must not be read
        again = fast_verify(m.decoder, ids[:, 5:7], caches, cross, None)  # (1, 2, d_model)
        assert caches[0].length == 7
    torch.testing.assert_close(again, full[:, 5:7], rtol=1e-5, atol=tol)


def test_rollback_refuses_what_it_cannot_undo() -> None:
    cache = KVCache(1, 2, 3, 8)
    cache.append(torch.zeros(1, 2, 4, 3), torch.zeros(1, 2, 4, 3))
    with pytest.raises(ValueError, match="rollback needs"):
        rollback([cache], 5)
    windowed = KVCache(1, 2, 3, 8, window=4)
    with pytest.raises(ValueError, match="window=4"):
        rollback([windowed], 0)
    rollback([cache], 2)
    assert cache.length == 2


@pytest.mark.parametrize("kind", KINDS)
def test_speculative_generate_equals_plain(tiny, kind: str) -> None:
    folder, _ = tiny(kind)
    m = headspace.load(folder)
    n = 18
    for seed in range(2):
        x = inputs_of(kind, batch=1, seed=seed)
        for screen in (False, True):
            plain = m.generate(x, n, eos_token_id=-1, screen=screen, draft=0).tolist()
            stats = SpeculationStats()
            got = m.generate(x, n, eos_token_id=-1, screen=screen, stats=stats).tolist()
            assert got == plain
            assert stats.steps + stats.verifies + stats.accepted == n - 1  # one token made by the prompt
        with_eos = m.generate(x, n, draft=0).tolist()
        assert m.generate(x, n).tolist() == with_eos  # the end token stops both at the same place


def _drafting(plain: list[int], right: bool) -> Callable[..., list[int]]:
    """A drafter that proposes the plain tokens after ``tokens`` (right) or each of them plus one (wrong)."""

    def draft(tokens: list[int], k: int, *_: int) -> list[int]:
        assert tokens == plain[: len(tokens)]  # only the greedy tokens ever reach the drafter
        after = plain[len(tokens) : len(tokens) + max(k, 0)]
        return after if right else [(t + 1) % 37 for t in after]

    return draft


@pytest.mark.parametrize("right", [False, True])
@pytest.mark.parametrize("kind", ["whisper", "bart"])
def test_drafts_always_wrong_or_always_right_give_the_plain_tokens(
    tiny, kind: str, right: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, _ = tiny(kind)
    m = headspace.load(folder)
    x = inputs_of(kind, batch=1, seed=2)
    for n, eos in ((19, -1), (19, None), (2, -1)):
        plain = m.generate(x, n, eos_token_id=eos, draft=0)[0].tolist()
        monkeypatch.setattr(speculative, "ngram_draft", _drafting(plain, right))
        stats = SpeculationStats()
        got = m.generate(x, n, eos_token_id=eos, draft=4, stats=stats)[0].tolist()
        monkeypatch.undo()
        assert got == plain
        if len(plain) > 3:
            assert stats.verifies > 0
            assert stats.accepted == (stats.drafted if right else 0)


def test_off_switches_and_hooks(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, _ = tiny("whisper")
    m = headspace.load(folder)
    x = inputs_of("whisper", batch=1)
    plain = m.generate(x, 12, eos_token_id=-1, draft=0)[0].tolist()
    monkeypatch.setattr(speculative, "ngram_draft", _drafting(plain, True))
    on = SpeculationStats()
    assert m.generate(x, 12, eos_token_id=-1, stats=on)[0].tolist() == plain
    assert on.verifies > 0
    off = SpeculationStats()
    assert m.generate(x, 12, eos_token_id=-1, draft=0, stats=off)[0].tolist() == plain
    monkeypatch.setenv("HEADSPACE_FORCE_FALLBACK", "speculative")
    assert m.generate(x, 12, eos_token_id=-1, stats=off)[0].tolist() == plain
    monkeypatch.delenv("HEADSPACE_FORCE_FALLBACK")
    seen: list[int] = []
    point = m.hook_points()["decoder.blocks.0.hook_resid_pre"]
    remove = point.add(lambda v, _p: seen.append(v.shape[1]))
    try:
        assert m.generate(x, 12, eos_token_id=-1, stats=off)[0].tolist() == plain
    finally:
        remove()
    assert off == SpeculationStats()  # nothing speculated
    assert seen == [1] * 12  # the start token, then one position per step: no draft seen
    assert m.generate(x.expand(2, -1, -1), 12, eos_token_id=-1, stats=off).shape == (2, 13)
    assert off == SpeculationStats()  # batch 2: the plain loop


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4"])
def test_draft_refused_in_one_line(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^draft must be None or an int >= 0 .*got") as e:
        speculation_on(bad)  # type: ignore[arg-type]
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_whisper_base_speech_speculative_equals_plain(tmp_path: Path) -> None:
    """Whisper base on espeak-ng speech that repeats its sentence (so that n-gram drafts are accepted):
    the same greedy tokens with speculation as one token per step."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("needs the espeak-ng program")
    m = headspace.load("whisper-base")
    wav = tmp_path / "speech.wav"
    text = "the quick brown fox jumps over the lazy dog. " * 3
    subprocess.run(["espeak-ng", "-w", str(wav), text], check=True)
    x = wav_features(wav, m.config.n_mels)  # (1, 80, 3000)
    prompt = torch.tensor([[50258, 50259, 50359, 50363]])  # <|startoftranscript|><|en|><|transcribe|>...
    plain = m.generate(x, 80, decoder_input_ids=prompt, draft=0)[0].tolist()
    stats = SpeculationStats()
    assert m.generate(x, 80, decoder_input_ids=prompt, stats=stats)[0].tolist() == plain
    assert plain[-1] == m.config.eos_token_id and len(plain) > 25
    assert stats.accepted > 5 and stats.verifies > 0
