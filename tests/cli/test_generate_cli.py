"""``headspace generate --model``: text printed as it comes, stopped where the model ends its turn,
control tokens left out, ``--chat`` in the model's chat template; one-line errors (exit 2)."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from headspace.cli import cli
from headspace.cli import train as cli_train


@pytest.fixture()
def runner(smollm2, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    """A click runner whose --model smollm2 is the session's loaded SmolLM2 (loaded once)."""
    real = cli_train.load_model
    monkeypatch.setattr(cli_train, "load_model", lambda spec: smollm2 if spec == "smollm2" else real(spec))
    return CliRunner()


def test_chat_prints_the_reply_alone_and_stops_at_the_end_of_the_turn(runner: CliRunner, smollm2) -> None:
    prompt = "What is the capital of France?"
    res = runner.invoke(cli, ["generate", "--model", "smollm2", "--chat", prompt, "--temperature", "0",
                              "--tokens", "16"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert res.stdout == "The capital of France is Paris.\n"  # no invented "user" / "assistant" turns
    assert res.stdout == smollm2.generate(prompt, 16, temperature=0, chat=True) + "\n"


def test_the_text_is_printed_piece_by_piece(runner: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = click.echo

    def echo(message: object = None, *args: object, **kwargs: object) -> None:
        calls.append("" if message is None else str(message))
        real(message, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(click, "echo", echo)
    prompt = "The capital of France is"
    res = runner.invoke(
        cli, ["generate", "--model", "smollm2", prompt, "--temperature", "0", "--tokens", "5"]
    )
    assert res.exit_code == 0, res.output
    assert calls[0] == prompt and len(calls) >= 4  # the prompt, then the new pieces one by one, then "\n"
    assert "".join(calls) + "\n" == res.stdout and res.stdout.startswith(prompt + " ")


def test_chat_without_a_template_or_without_a_model_is_one_line(
    runner: CliRunner, smollm2, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(smollm2, "chat_template", None)
    res = runner.invoke(cli, ["generate", "--model", "smollm2", "--chat", "hi"])
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.strip().splitlines()[-1] == (
        "error: --chat needs the model's chat template; --model smollm2 has none (no "
        "tokenizer.chat_template in its GGUF, no chat_template in its tokenizer_config.json)"
    )
    res = runner.invoke(cli, ["generate", "run_dir", "--prompt", "hi", "--chat"])
    assert res.exit_code == 2
    assert res.stderr.strip().splitlines()[-1] == (
        "error: --chat needs a pretrained model with a chat template: give --model (e.g. smollm2)"
    )
