"""`headspace train`, `plot-run` and `generate`: a text model end to end, and one-line errors (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from headspace.cli import cli
from headspace.train import generate_text, load_run

TEXT = "the quick brown fox jumps over the lazy dog. " * 40

SMALL = [
    "--layers",
    "1",
    "--heads",
    "2",
    "--d-model",
    "16",
    "--batch-size",
    "4",
    "--warmup",
    "2",
    "--no-progress",
]


def _invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def text_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("text")
    data = root / "fox.txt"
    data.write_text(TEXT)
    run = root / "run"
    result = _invoke("train", "--data", str(data), "--seq-len", "16", "--steps", "12", "--eval-every", "6",
                     "--eval-batch", "8", *SMALL, "--out", str(run))  # fmt: skip
    assert result.exit_code == 0, result.output
    return run


def test_text_run_logs_eval_and_per_head_metrics(text_run: Path) -> None:
    rows = [json.loads(line) for line in (text_run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 6, 12]
    for key in ("entropy", "role_previous", "wo_norm", "ablation_loss"):
        assert len(evals[-1][key]) == 1 and len(evals[-1][key][0]) == 2, key
    record = json.loads((text_run / "config.json").read_text())
    assert record["data"]["vocab"] == "".join(sorted(set(TEXT)))


def test_text_run_writes_the_summary_its_help_promises(text_run: Path) -> None:
    """train --help promises summary.json; a text run wrote none (no accuracy to report). It holds the
    final held-out loss, the last training loss, the steps and the time."""
    import math

    assert "summary.json" in _invoke("train", "--help").output
    s = json.loads((text_run / "summary.json").read_text())
    rows = [json.loads(line) for line in (text_run / "metrics.jsonl").read_text().splitlines()]
    last_eval = next(r for r in reversed(rows) if r["kind"] == "eval")
    last_train = next(r for r in reversed(rows) if r["kind"] == "train")
    assert s["task"] == "text" and s["steps"] == 12 == s["steps_this_process"] and s["level"] == "char"
    assert (s["n_layers"], s["n_heads"], s["d_model"], s["seq_len"]) == (1, 2, 16, 16)
    assert s["loss"] == last_eval["loss"] and s["train_loss"] == last_train["loss"]
    assert s["bits_per_token"] == pytest.approx(s["loss"] / math.log(2))
    assert s["perplexity"] == pytest.approx(math.exp(s["loss"]))
    assert s["parameters"] > 0 and 0 < s["train_seconds"] <= s["seconds"] and s["tokens_per_s"] > 0
    assert not list(text_run.glob("*.tmp")) and not list(text_run.glob(".*tmp*"))  # written atomically


def test_generate_continues_the_prompt_with_known_characters(text_run: Path) -> None:
    result = _invoke("generate", str(text_run), "--prompt", "the ", "--tokens", "20", "--seed", "1")
    assert result.exit_code == 0, result.output
    out = result.stdout.rstrip("\n")  # the text; a native build starting says so on stderr
    assert out.startswith("the ") and len(out) == 24
    assert set(out) <= set(TEXT)
    # the command is the library call; greedy decoding equals argmax over the model's own logits
    greedy = generate_text(text_run, "the ", max_new_tokens=5, temperature=0.0)
    model, record = load_run(text_run)
    vocab = record["data"]["vocab"]
    import torch

    ids = torch.tensor([[vocab.index(c) for c in "the "]])
    for _ in range(5):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert greedy == "".join(vocab[i] for i in ids[0].tolist())


def test_plot_run_writes_a_png(text_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "plot.png"
    result = _invoke("plot-run", str(text_run), "--out", str(out))
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "content, words",
    [
        (b"", "is empty"),
        (b"ab", "is too short: 2 char tokens"),
        (b"\x89PNG\r\n\x1a\n\x00\x00", "is binary, not text"),
    ],
)
def test_bad_data_files_are_one_line_errors(tmp_path: Path, content: bytes, words: str) -> None:
    data = tmp_path / "d.txt"
    data.write_bytes(content)
    result = CliRunner().invoke(
        cli, ["train", "--data", str(data), "--out", str(tmp_path / "r"), "--no-progress"]
    )
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0] and str(data) in lines[0]
    assert "Traceback" not in result.output


def test_config_and_folder_errors_are_one_line(text_run: Path, tmp_path: Path) -> None:
    bad = CliRunner().invoke(cli, ["train", "--heads", "3", "--out", str(tmp_path / "x"), "--no-progress"])
    assert bad.exit_code == 2 and "d_model=64 must be divisible by n_heads=3" in bad.output
    taken = CliRunner().invoke(cli, ["train", *SMALL, "--steps", "3", "--out", str(text_run)])
    assert taken.exit_code == 2 and "already holds another run" in taken.output
    assert len(taken.output.strip().splitlines()) == 1
    resume = CliRunner().invoke(cli, ["train", *SMALL, "--steps", "3", "--out", str(text_run), "--resume"])
    assert resume.exit_code == 2 and "differing fields" in resume.output and "train.task" in resume.output
    missing = CliRunner().invoke(cli, ["generate", str(tmp_path), "--prompt", "a"])
    assert missing.exit_code == 2 and "holds no checkpoint" in missing.output
    plot = CliRunner().invoke(cli, ["plot-run", str(tmp_path)])
    assert plot.exit_code == 2 and "holds no metrics.jsonl" in plot.output
    unknown = CliRunner().invoke(cli, ["generate", str(text_run), "--prompt", "QQ"])
    assert unknown.exit_code == 2 and "never saw in training" in unknown.output


def _one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    return lines[0]


@pytest.mark.parametrize("out", ["/proc/x", "/dev/null/x"])
def test_unwritable_run_folder_is_refused_before_training(out: str, monkeypatch) -> None:
    import headspace.train.loop as loop

    def no_train(*args, **kwargs):
        raise AssertionError("training started before --out was checked")

    monkeypatch.setattr(loop, "train", no_train)
    line = _one_line_error(CliRunner().invoke(cli, ["train", "--out", out, "--no-progress"]))
    folder = str(Path(out).parent)
    assert line.startswith(f"error: --out {out}: cannot write in the folder {folder!r} (")
    assert line.endswith("(No such file or directory)" if out.startswith("/proc") else "(Not a directory)")


def test_unwritable_plot_path_is_one_line(text_run: Path) -> None:
    line = _one_line_error(CliRunner().invoke(cli, ["plot-run", str(text_run), "--out", "/proc/x.png"]))
    assert "--out /proc/x.png: cannot write in the folder '/proc'" in line
    line = _one_line_error(CliRunner().invoke(cli, ["plot-run", str(text_run), "--out", "/dev/null/x.png"]))
    assert "--out /dev/null/x.png: '/dev/null' is a file, not a folder" in line


@pytest.mark.parametrize("seed", ["99999999999999999999", "-1", str(2**63)])
def test_seeds_outside_the_generator_range_are_refused(seed: str, text_run: Path, tmp_path: Path) -> None:
    expected = f"--seed must be in 0..{2**63 - 1} (2**63 - 1); got {seed}"
    line = _one_line_error(CliRunner().invoke(cli, ["train", "--seed", seed, "--out", str(tmp_path / "r")]))
    assert line == f"error: {expected}"
    assert not (tmp_path / "r").exists()
    line = _one_line_error(
        CliRunner().invoke(cli, ["generate", str(text_run), "--prompt", "a", "--seed", seed])
    )
    assert line == f"error: {expected}"


def test_the_largest_seed_is_taken(text_run: Path) -> None:
    result = _invoke("generate", str(text_run), "--prompt", "the ", "--tokens", "3", "--seed", str(2**63 - 1))
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("the ")
