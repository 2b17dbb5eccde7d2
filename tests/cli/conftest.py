"""Fixtures of the command-line tests: a tiny GPT-2 checkpoint folder (word-level tokenizer that knows
the IOI templates, so ``circuit``, ``why`` and ``patch`` run in a second) and the loaded SmolLM2."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import headspace

NAMES = "Mary John Tom James Dan Sarah Paul Anna".split()


def write_tiny_gpt2(folder: Path, n_layer: int = 2, n_head: int = 3, n_embd: int = 24) -> Path:
    """A GPT-2 saved by transformers into ``folder``, with a word-level tokenizer knowing the IOI
    templates' words, each with and without a leading space (``Mary`` and ``ĠMary``)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from headspace.analysis.tasks import IOI_TEMPLATES

    words = {"<|endoftext|>"} | set(NAMES)
    for t in IOI_TEMPLATES:
        for mark in ("{A}", "{B}", "{S}"):
            t = t.replace(mark, "")
        words |= set(t.replace(",", " , ").replace(".", " . ").split())
    vocab: dict[str, int] = {}
    for w in sorted(words):
        vocab[w] = len(vocab)
        vocab["\u0120" + w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=len(vocab), n_positions=40, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(str(folder))
    return folder


@pytest.fixture()
def tiny_gpt2(tmp_path: Path) -> Callable[..., Path]:
    """``tiny_gpt2(n_layer=2, n_head=3)``: a new tiny GPT-2 folder under ``tmp_path``."""
    made: list[Path] = []

    def make(n_layer: int = 2, n_head: int = 3, n_embd: int = 24) -> Path:
        folder = write_tiny_gpt2(tmp_path / f"gpt2-{len(made)}", n_layer, n_head, n_embd)
        made.append(folder)
        return folder

    return make


@pytest.fixture(scope="module")
def smollm2_model():
    return headspace.load("smollm2")
