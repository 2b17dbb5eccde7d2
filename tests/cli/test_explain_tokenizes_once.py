"""``explain`` tokenizes its sentence once (issue 37; it used to run the tokenizer three times per command:
the command's token list, explain's own token list, and explain's ids). Counted at the tokenizer itself
(the ``tokenizers`` object under headspace's TextTokenizer), on a real checkpoint folder."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import headspace
from headspace.analysis.lesson.explain import explain, tokenize_sentence
from headspace.cli import cli
from headspace.cli import lesson as cli_lesson

TEXT = "When Mary and John went to the store, John gave a drink to"


class CountingTokenizer:
    """The ``tokenizers.Tokenizer`` it wraps, each encoding call (``encode``, ``encode_batch``) noted."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.calls = tok, []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.tok, name)
        if name not in ("encode", "encode_batch"):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return attr(*args, **kwargs)

        return counted


def _counted(folder: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, CountingTokenizer]:
    pretrained = headspace.load(str(folder))
    counter = CountingTokenizer(pretrained.tokenizer._tok)
    monkeypatch.setattr(pretrained.tokenizer, "_tok", counter)
    return pretrained, counter


def test_the_token_strings_are_those_of_the_ids(tiny_gpt2: Callable[..., Path], monkeypatch) -> None:
    pretrained, counter = _counted(tiny_gpt2(), monkeypatch)
    sent = tokenize_sentence(pretrained, TEXT)
    assert counter.calls == ["encode_batch"]
    assert sent.tokens == pretrained.tokenizer.tokens(TEXT)  # what the second call used to give
    assert sent.ids.shape == (1, len(sent.tokens))


def test_explain_tokenizes_once(tiny_gpt2: Callable[..., Path], monkeypatch) -> None:
    pretrained, counter = _counted(tiny_gpt2(), monkeypatch)
    e = explain(pretrained, TEXT, "John", layer=1, head=2)
    assert len(counter.calls) == 1, counter.calls
    assert e.tokens[e.token_index] == "ĠJohn" and e.occurrence == 1
    with pytest.raises(ValueError, match="tokenized holds the sentence 'other'"):
        explain(pretrained, TEXT, "John", tokenized=tokenize_sentence(pretrained, "other"))


def test_the_explain_command_tokenizes_once(tiny_gpt2: Callable[..., Path], monkeypatch) -> None:
    pretrained, counter = _counted(tiny_gpt2(), monkeypatch)
    monkeypatch.setattr(cli_lesson, "load_model", lambda spec: pretrained)
    res = CliRunner().invoke(cli, ["explain", TEXT, "--token", "John", "--model", "gpt2", "--json"])
    assert res.exit_code == 0, res.output
    assert len(counter.calls) == 1, counter.calls
