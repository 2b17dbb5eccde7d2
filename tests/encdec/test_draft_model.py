"""The int8 draft model of exact speculative decoding (headspace.model.encdec.draft_model): the same greedy
tokens as one token per step whatever it drafts; its drafts are the argmax of an int8 copy of the decoder
(checked against a float64 reference of the same quantised maths); its caches follow the greedy tokens
after a rejected draft; the off switches (``draft_model=False``, ``HEADSPACE_FORCE_FALLBACK=draft_model``,
``int8``) and bad values."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import headspace
from conftest import inputs_of
from headspace.model.encdec import speculative
from headspace.model.encdec.draft_model import DraftModel, draft_model_usable
from headspace.model.encdec.screen import _fbgemm_exact
from headspace.model.encdec.speculative import MODEL_TRIAL, SpeculationStats
from headspace.pretrained.encdec.features import wav_features

KINDS = ["whisper", "bart", "marian"]
#: whisper on every run, the other two with the slow tests (each builds its tiny checkpoint: seconds)
SOME_SLOW = ["whisper", *(pytest.param(k, marks=pytest.mark.slow) for k in KINDS[1:])]
pytestmark = [pytest.mark.usefixtures("automatic_choices"), pytest.mark.kernels]  # (CI: emulated CPUs too)
#: the tests that need a draft model: none is made where fbgemm's int8 product is not exact (a CPU without
#: VNNI, or CI's emulated AVX2 pass); test_a_cpu_without_an_exact_int8_product_decodes_without_one runs there
needs_draft = pytest.mark.skipif(
    not _fbgemm_exact(), reason="no exact fbgemm int8 product here: no draft model (its fallback is tested)"
)


def _no_ngrams(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every draft from the draft model: the n-gram lookup finds nothing."""
    monkeypatch.setattr(speculative, "ngram_draft", lambda *_a, **_k: [])


def _draft(m: headspace.EncoderDecoder, x: torch.Tensor, n: int) -> DraftModel:
    blocks = list(m.decoder.blocks)
    with torch.no_grad():
        cross = [b.cross_attn.cross_kv(m.encode(x)) for b in blocks]
    d = DraftModel(m.decoder, m.tok_embed.weight, m.logits_bias, m.config.output_scale)
    d.start(m.decoder, cross, n)
    return d


@needs_draft
@pytest.mark.parametrize("kind", SOME_SLOW)
def test_draft_model_generate_equals_plain(tiny, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, _ = tiny(kind)
    m = headspace.load(folder)
    _no_ngrams(monkeypatch)
    for seed in range(1):
        x = inputs_of(kind, batch=1, seed=seed)
        for n, eos in ((17, -1), (17, None), (2, -1)):
            plain = m.generate(x, n, eos_token_id=eos, draft=0)[0].tolist()
            for k in (1, 6):
                stats = SpeculationStats()
                got = m.generate(x, n, eos_token_id=eos, draft=k, stats=stats)[0].tolist()
                assert got == plain
                if len(plain) > 3:
                    assert stats.model_drafted == stats.drafted > 0
                    assert stats.model_accepted == stats.accepted <= stats.drafted


@needs_draft
@pytest.mark.parametrize("right", [False, True])
def test_drafts_always_wrong_stop_and_always_right_go_on(
    tiny, right: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drafts that are never the model's tokens: the same tokens, and the draft model is asked no more
    once :data:`MODEL_TRIAL` of its drafted tokens were rejected (one-token steps after); drafts that
    always are: every one accepted, no one-token step."""
    folder, _ = tiny("whisper")
    m = headspace.load(folder)
    x = inputs_of("whisper", batch=1, seed=2)
    _no_ngrams(monkeypatch)
    n, k = 20, 4
    plain = m.generate(x, n, eos_token_id=-1, draft=0)[0].tolist()

    def propose(self: DraftModel, tokens: list[int], want: int) -> list[int]:
        assert tokens == plain[: len(tokens)]  # only the greedy tokens reach the draft model
        after = plain[len(tokens) : len(tokens) + want]
        return after if right else [(t + 1) % m.config.vocab_size for t in after]

    monkeypatch.setattr(DraftModel, "propose", propose)
    stats = SpeculationStats()
    assert m.generate(x, n, eos_token_id=-1, draft=k, stats=stats)[0].tolist() == plain
    if right:
        assert stats.model_accepted == stats.model_drafted > n - 1 - stats.verifies - 1
        assert stats.steps == 0
    else:
        assert stats.model_accepted == 0 and MODEL_TRIAL <= stats.model_drafted < MODEL_TRIAL + k
        assert stats.steps == n - 1 - stats.verifies


@needs_draft
@pytest.mark.parametrize("kind", SOME_SLOW)
def test_draft_stream_is_close_to_the_float32_stream(tiny, kind: str) -> None:
    """The draft's final stream over a sequence (fed in pieces: several positions, then one at a time) is
    the float32 decoder's to int8 rounding: within 5% of its largest magnitude (a wrong layout or weight
    gives an error of the order of the stream itself)."""
    folder, _ = tiny(kind)
    m = headspace.load(folder)
    x = inputs_of(kind, batch=1, seed=3)
    ids = torch.randint(3, m.config.vocab_size - 1, (1, 9), generator=torch.Generator().manual_seed(5))
    d = _draft(m, x, 12)
    with torch.no_grad():
        full = m.decoder(ids, m.encode(x))  # (1, 9, d_model)
        got = torch.cat([d._forward(ids[:, :4]), *(d._forward(ids[:, i : i + 1]) for i in range(4, 9))], 1)
    err = (got - full).abs().max() / full.abs().max()
    assert float(err) < 0.05


def _one_at_a_time(d: DraftModel, tokens: list[int]) -> None:
    """Feed ``tokens[:-1]`` one position per forward (fbgemm quantises each call's input as one tensor, so
    only forwards of one position give the same numbers whatever was fed with them)."""
    for i in range(1, len(tokens)):
        d.propose(tokens[:i], 1)


@needs_draft
def test_draft_caches_follow_the_greedy_tokens(tiny) -> None:
    """After drafts that the model rejected, the draft's caches and proposals equal a fresh draft model's
    on the same tokens (the rejected positions rolled back, the kept prefix not fed again)."""
    folder, _ = tiny("whisper")
    m = headspace.load(folder)
    x = inputs_of("whisper", batch=1, seed=1)
    used, fresh = _draft(m, x, 40), _draft(m, x, 40)
    with torch.no_grad():
        tokens = [m.config.decoder_start_token_id, 5, 9]
        _one_at_a_time(used, tokens)
        drafted = used.propose(tokens, 5)
        assert len(drafted) == 5 and used.fed == tokens + drafted[:4]
        other = (drafted[2] + 1) % m.config.vocab_size  # the model kept two drafts, then chose another
        tokens = tokens + drafted[:2] + [other]
        again = used.propose(tokens, 4)
        assert used.caches[0].length == len(tokens) + 3 and used.fed == tokens + again[:3]
        _one_at_a_time(fresh, tokens)
        assert fresh.propose(tokens, 4) == again
        n = len(tokens) + 3
        for a, b in zip(used.caches, fresh.caches, strict=True):
            assert torch.equal(a.k[:, :, :n], b.k[:, :, :n]) and torch.equal(a.v[:, :, :n], b.v[:, :, :n])
        assert used.propose(tokens + again[:1], 0) == []


@needs_draft
def test_off_switches_and_bad_values(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, _ = tiny("whisper")
    m = headspace.load(folder)
    x = inputs_of("whisper", batch=1)
    _no_ngrams(monkeypatch)
    plain = m.generate(x, 12, eos_token_id=-1, draft=0)[0].tolist()
    on = SpeculationStats()
    assert m.generate(x, 12, eos_token_id=-1, stats=on)[0].tolist() == plain
    assert on.model_drafted > 0
    assert m.__dict__["_draft_model"].cross == []  # the input's copies let go after the call
    for env in ("draft_model", "int8"):
        monkeypatch.setenv("HEADSPACE_FORCE_FALLBACK", env)
        assert not draft_model_usable(m.decoder, None)
        off = SpeculationStats()
        assert m.generate(x, 12, eos_token_id=-1, stats=off)[0].tolist() == plain
        assert off.model_drafted == 0 and off.steps == 11
    monkeypatch.delenv("HEADSPACE_FORCE_FALLBACK")
    off = SpeculationStats()
    assert m.generate(x, 12, eos_token_id=-1, draft_model=False, stats=off)[0].tolist() == plain
    assert off.model_drafted == 0 and off.steps == 11
    assert draft_model_usable(m.decoder, True)
    for bad in ("yes", 1, 0):
        with pytest.raises(ValueError, match=r"^draft_model must be None, True or False; got") as e:
            m.generate(x, 4, draft_model=bad)  # type: ignore[arg-type]
        assert "\n" not in str(e.value)


@needs_draft
@pytest.mark.slow
def test_whisper_base_plain_speech_draft_model_equals_plain(tmp_path: Path) -> None:
    """Whisper base on espeak-ng speech that does not repeat (the n-grams find little): the same greedy
    tokens with the draft model as one token per step, and most drafts accepted."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("needs the espeak-ng program")
    m = headspace.load("whisper-base")
    wav = tmp_path / "speech.wav"
    text = "Farmers came from the hills to work the new fields, and the market grew beside the bridge."
    subprocess.run(["espeak-ng", "-w", str(wav), text], check=True)
    x = wav_features(wav, m.config.n_mels)  # (1, 80, 3000)
    prompt = torch.tensor([[50258, 50259, 50359, 50363]])  # <|startoftranscript|><|en|><|transcribe|>...
    plain = m.generate(x, 60, decoder_input_ids=prompt, draft=0)[0].tolist()
    stats = SpeculationStats()
    assert m.generate(x, 60, decoder_input_ids=prompt, stats=stats)[0].tolist() == plain
    assert plain[-1] == m.config.eos_token_id and len(plain) > 15
    assert stats.model_drafted > 0 and stats.model_accepted > stats.model_drafted // 2


def test_a_cpu_without_an_exact_int8_product_decodes_without_one(
    tiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where fbgemm's int8 product is not exact (asked of the kernel), no draft model is made, and
    speculative decoding gives the same tokens from its n-gram drafts and one-token steps alone."""
    from headspace.model.encdec import draft_model

    folder, _ = tiny("whisper")
    m = headspace.load(folder)
    x = inputs_of("whisper", batch=1)
    plain = m.generate(x, 12, eos_token_id=-1, draft=0)[0].tolist()
    monkeypatch.setattr(draft_model, "_fbgemm_exact", lambda: False)
    assert not draft_model_usable(m.decoder, None) and not draft_model_usable(m.decoder, True)
    off = SpeculationStats()
    assert m.generate(x, 12, eos_token_id=-1, stats=off)[0].tolist() == plain
    assert off.model_drafted == 0
