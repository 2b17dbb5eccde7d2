"""A tokenizer.json for the tiny checkpoints of conftest.py (test-only helper, no tests here)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from conftest import VOCAB


def add_tokenizer(folder: Path) -> None:
    """A word-level SentencePiece-style tokenizer.json for the tiny vocabulary: ids 0..2 <pad> </s> <unk>,
    then "▁w3" .. "▁w36"; "</s>" appended to every source."""
    words = ["<pad>", "</s>", "<unk>"] + [f"▁w{i}" for i in range(3, VOCAB)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.add_special_tokens(words[:3])  # as T5's own tokenizer.json: <pad> </s> <unk> are special added tokens
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
