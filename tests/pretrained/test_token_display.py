"""How tokens are printed: one convention (tokenization.readable_token) for every command and the explorer.

Byte-level BPE (GPT-2, SmolLM2) marks a leading space with "Ġ" and stores other bytes as stand-in
characters; SentencePiece marks it with "▁" and falls back to byte tokens "<0x0A>"; WordPiece has no
space mark. All print as their text with a space as ␣ and a newline as ↵.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from headspace.cli.options import TOKENS_HELP
from headspace.pretrained.tokenization import WHITESPACE_MARKS, TextTokenizer, readable_token


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (" cat", "␣cat"),
        ("cat", "cat"),
        ("\n", "↵"),
        ("\t", "⇥"),
        ("  ", "␣␣"),
        ("\xa0x", "\\xa0x"),  # a no-break space: an escape, not a plain space
        ("\r", "\\r"),
        (" café —", "␣café␣—"),
        ("[CLS]", "[CLS]"),
    ],
)
def test_readable_token(text: str, shown: str) -> None:
    assert readable_token(text) == shown


def test_the_help_says_what_readable_token_does() -> None:
    for ch, mark in WHITESPACE_MARKS.items():
        assert readable_token(ch) == mark and mark in TOKENS_HELP
    assert "Ġ" in TOKENS_HELP and "▁" in TOKENS_HELP


def _byte_level(path: Path) -> TextTokenizer:
    words = ["<|endoftext|>", "The", "Ġcat", "Ċ", "ĠcafÃ©", "ĠÃ", "ľ", "Ġ"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>"])
    tok.save(str(path))
    return TextTokenizer(path)


def test_byte_level_pieces_are_their_text(tmp_path: Path) -> None:
    tok = _byte_level(tmp_path / "tokenizer.json")
    cases = {
        "Ġcat": " cat",
        "The": "The",
        "Ċ": "\n",
        "ĠcafÃ©": " café",
        "Ġ": " ",
        "ĠÃ": " \\xc3",  # the first byte of "Ü": an incomplete character, its byte escaped
        "ľ": "\\x9c",
        "<|endoftext|>": "<|endoftext|>",
        "<|im_start|>": "<|im_start|>",
    }
    for piece, text in cases.items():
        assert tok.token_text(piece) == text, piece
    assert [tok.readable(p) for p in ("Ġcat", "Ċ", "ĠÃ")] == ["␣cat", "↵", "␣\\xc3"]
    assert [tok.readable(p) for p in tok.tokens("The cat")] == ["The", "␣cat"]


def test_sentencepiece_and_wordpiece_pieces(tmp_path: Path) -> None:
    vocab = {"<unk>": 0, "▁cat": 1, "<0x0A>": 2, "▁the": 3}
    sp = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    sp.normalizer = normalizers.Replace(" ", "▁")
    sp.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    sp.save(str(tmp_path / "sp.json"))
    tok = TextTokenizer(tmp_path / "sp.json")
    assert [tok.readable(p) for p in ("▁cat", "<0x0A>", "<unk>")] == ["␣cat", "↵", "<unk>"]
    wp = Tokenizer(models.WordPiece({"[UNK]": 0, "play": 1, "##ing": 2}, unk_token="[UNK]"))
    wp.pre_tokenizer = pre_tokenizers.Whitespace()
    wp.decoder = decoders.WordPiece()
    wp.save(str(tmp_path / "wp.json"))
    bert = TextTokenizer(tmp_path / "wp.json")
    assert [bert.readable(p) for p in bert.tokens("playing")] == ["play", "##ing"]  # BERT's pieces stay


def test_a_token_as_printed_can_be_given_back_to_explain() -> None:
    """explain prints SmolLM2's "Ġcat" as "␣cat"; --token ␣cat (copied from the output) finds it."""
    from headspace.analysis.explain import find_token

    assert find_token(["The", "Ġcat", "Ġsat"], "␣cat") == 1 == find_token(["The", "Ġcat"], "cat")
