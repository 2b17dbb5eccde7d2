"""Text data: tokenisation at char and byte level, windows, and clear refusals of bad files."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
import torch

from headspace.train.data import decode, encode, load_text
from headspace.train.tasks import batch_generator

TEXT = "héllo wörld, attention is all you need. " * 3


def _write(tmp_path: Path, data: bytes, name: str = "data.txt") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_char_level_round_trip_and_split(tmp_path: Path) -> None:
    data = load_text(_write(tmp_path, TEXT.encode()), level="char", seq_len=7)
    assert data.vocab == "".join(sorted(set(TEXT)))
    assert data.train.numel() + data.val.numel() == len(TEXT)
    assert data.decode(torch.cat([data.train, data.val])) == TEXT
    assert data.val.numel() == max(8, round(len(TEXT) * 0.1))


def test_the_checksum_of_the_content_is_recorded(tmp_path: Path) -> None:
    p = _write(tmp_path, TEXT.encode())
    data = load_text(p, seq_len=7)
    digest = hashlib.sha256(TEXT.encode()).hexdigest()
    assert data.sha256 == digest and data.describe()["sha256"] == digest
    p.write_bytes(TEXT[::-1].encode())
    assert load_text(p, seq_len=7).describe()["sha256"] != digest  # same length, other content


def test_byte_level_counts_utf8_bytes(tmp_path: Path) -> None:
    data = load_text(_write(tmp_path, TEXT.encode()), level="byte", seq_len=7)
    raw = TEXT.encode()
    assert data.vocab is None and data.vocab_size == 256
    assert data.train.numel() + data.val.numel() == len(raw) > len(TEXT)  # é, ö take two bytes
    assert decode(torch.cat([data.train, data.val]), "byte", None) == TEXT


def test_windows_predict_the_next_token(tmp_path: Path) -> None:
    data = load_text(_write(tmp_path, TEXT.encode()), seq_len=5)
    b = data.sample(batch_generator(0, 3), 3)
    assert b.tokens.shape == (3, 5) and b.targets.shape == (3, 5)
    assert torch.equal(b.tokens[:, 1:], b.targets[:, :-1])
    text = data.decode(data.train)
    for row in range(3):
        window = data.decode(torch.cat([b.tokens[row], b.targets[row, -1:]]))
        assert window in text
    again = data.sample(batch_generator(0, 3), 3)
    assert torch.equal(b.tokens, again.tokens)


def test_unknown_characters_are_listed() -> None:
    with pytest.raises(ValueError, match=r"characters the model never saw in training: \['z'\]"):
        encode("abz", "char", "ab")
    with pytest.raises(ValueError, match=r"never saw in training: \['x', '😀'\]; known characters: ''"):
        encode("😀x😀", "char", "")


def test_encoding_is_the_plain_lookup_of_every_character_and_byte() -> None:
    """The vectorised encoder against a dict lookup: astral characters, lone surrogates, repeats."""
    g = torch.Generator().manual_seed(0)
    alphabet = "ab \n\té€😀\U0010ffff\ud800"
    text = "".join(alphabet[i] for i in torch.randint(0, len(alphabet), (5000,), generator=g).tolist())
    vocab = "".join(sorted(set(text)))
    ids = encode(text, "char", vocab)
    assert ids.dtype == torch.long and ids.tolist() == [vocab.index(c) for c in text]
    assert encode("", "char", vocab).tolist() == [] and encode("", "char", vocab).dtype == torch.long
    assert encode("abca", "char", "abca").tolist() == [3, 1, 2, 3]  # a repeated character: the last id
    clean = text.replace("\ud800", "")
    assert encode(clean, "byte", None).tolist() == list(clean.encode("utf-8"))
    assert decode(encode(clean, "byte", None), "byte", None) == clean


@pytest.mark.parametrize(
    "content, words",
    [
        (b"", "is empty"),
        (b"abc\x00def" * 20, "is binary, not text (a NUL byte at offset 3)"),
        (b"abc\xff\xfedef" * 20, "is not UTF-8 text (invalid byte 0xff at offset 3)"),
        (b"short", "is too short: 5 char tokens, but seq_len=16 needs at least 34"),
    ],
)
def test_bad_files_are_refused_naming_the_file(tmp_path: Path, content: bytes, words: str) -> None:
    p = _write(tmp_path, content)
    with pytest.raises(ValueError) as info:
        load_text(p, seq_len=16)
    assert words in str(info.value)
    assert str(p) in str(info.value)


def test_missing_file_and_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_text(tmp_path / "nope.txt")
    with pytest.raises(ValueError, match="is not a regular file"):
        load_text(tmp_path)
    with pytest.raises(ValueError, match=r"level must be one of \['char', 'byte'\]; got 'word'"):
        load_text(_write(tmp_path, TEXT.encode()), level="word")
    with pytest.raises(ValueError, match="seq_len must be an int >= 1; got 0"):
        load_text(_write(tmp_path, TEXT.encode()), seq_len=0)


@pytest.mark.parametrize("bad", ["0.1", None, True, [0.1]])
def test_val_fraction_of_the_wrong_type_is_named(tmp_path: Path, bad: object) -> None:
    with pytest.raises(
        TypeError, match=rf"val_fraction must be a float in \(0, 1\); got {re.escape(repr(bad))}"
    ):
        load_text(_write(tmp_path, TEXT.encode()), val_fraction=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"val_fraction must be in \(0, 1\); got nan"):
        load_text(_write(tmp_path, TEXT.encode()), val_fraction=float("nan"))
