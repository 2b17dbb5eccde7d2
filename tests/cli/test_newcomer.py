"""What a newcomer reads on the command line (issue 41) and the one path of its errors (issue 37).

The head ``explain`` walks sends the token to another content word; repeated tokens carry their
positions; the walk fits 100 columns; ``why`` prints tokens as ␣-marked text; ``circuit`` prints every
head and says where a list is cut; ``heads`` names its sentences and explains its columns; ``patch``
warns about an answer the model would not write; options behave alike (output folders, missing inputs,
a layer out of range before the model loads); every library error becomes one line, exit code 2.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from headspace.analysis.content_tokens import content_positions, is_content_token
from headspace.cli import causal as cli_causal
from headspace.cli import circuits as cli_circuits
from headspace.cli import cli
from headspace.cli import lesson as cli_lesson
from headspace.cli.errors import one_line, reported
from headspace.core.errors import UsageError

TROPHY = "The trophy didn't fit in the suitcase because it was too big"


def _no_load(spec: str):
    raise AssertionError(f"the model {spec!r} was loaded before the arguments were checked")


@pytest.fixture()
def with_smollm2(smollm2_model, monkeypatch):
    """The commands' ``--model smollm2`` answered by the module's loaded SmolLM2 (loaded once)."""
    for module in (cli_lesson, cli_circuits, cli_causal):
        real = module.load_model
        monkeypatch.setattr(
            module, "load_model", lambda spec, real=real: smollm2_model if spec == "smollm2" else real(spec)
        )
    return smollm2_model


def _ok(args: list[str]) -> str:
    res = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.output


def _refused(args: list[str]) -> str:
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    assert "Traceback" not in res.output
    return lines[0]


# ---------------------------------------------------------------------------------------- explain
def test_content_tokens_are_words_not_function_words_pieces_or_the_token_itself() -> None:
    tokens = ["The", "Ġtrophy", "Ġdidn", "'t", "Ġfit", "Ġin", "Ġthe", "Ġsuit", "case", "Ġbecause", "Ġit"]
    assert [t for t in tokens if is_content_token(t)] == ["Ġtrophy", "Ġfit", "Ġsuit", "case"]
    # "case" continues "Ġsuit": the word is counted once, at its first piece; "it" is the query
    assert content_positions(tokens, 10, set()) == [1, 4, 7]
    # another occurrence of the query's own word is not content; nor is a special token
    assert content_positions(["[CLS]", "cat", "sat", "cat", "[SEP]"], 3, {0, 4}) == [2]
    assert content_positions(["play", "##ing", "dog"], 2, set()) == [0]  # BERT's later piece "##ing"


def test_explain_on_smollm2_walks_a_head_that_sends_it_to_a_content_word(with_smollm2) -> None:
    """Before: layer 28 head 6, whose largest flow went to "'t"; now a head whose top key is "trophy"
    (layer 25 head 2 and layer 16 head 3 send "it" there)."""
    d = json.loads(_ok(["explain", "--model", "smollm2", TROPHY, "--token", "it", "--json"]))
    top = d["top"][0]
    assert (d["layer"], d["head"]) != (28, 6)
    assert top["token"] == "Ġtrophy", d["top"]
    assert d["ranking"][0]["role"] == "relational" and d["ranking"][0]["focus_token"] == "Ġtrophy"
    # every relational head's top key is a content word, never a function word or a piece like 't
    for f in d["ranking"]:
        if f["role"] == "relational":
            assert is_content_token(f["top"][0]["token"]), f


def test_explain_shows_repeated_tokens_with_their_positions_and_fits_100_columns(with_smollm2) -> None:
    out = _ok(["explain", "--model", "smollm2"])  # "The cat sat on the mat. The dog sat on the rug. The cat"
    assert re.search(r"␣sat@2 0\.\d\d", out) and re.search(r"␣sat@9 0\.\d\d", out), out
    assert "top attended: ␣sat@" in out
    lines = out.splitlines()
    too_long = [line for line in lines if len(line) > 100]
    assert not too_long, too_long
    # the steps and their captions start at column 0, one after the other, none cut in two
    steps = [line[:2] for line in lines if re.match(r"^[1-7][.ab]", line)]
    assert steps == ["1.", "2.", "2b", "3.", "4.", "5.", "6.", "7."], steps
    assert any("100000^(-2p/64)" in line for line in lines)
    for line in lines:  # a vector is printed whole, on one line
        if re.search(r"\[[+-]\d", line):
            assert line.rstrip().endswith("...]") or line.rstrip().endswith("]"), line


# -------------------------------------------------------------------------------------------- why
def test_why_prints_tokens_with_the_space_mark_not_in_quotes(tiny_gpt2) -> None:
    folder = tiny_gpt2()
    text = "When Mary and John went to the store, John gave a drink to"
    out = _ok(["why", "--model", str(folder), text, "--layer", "1", "--head", "2"])
    first = out.splitlines()[0]
    assert re.match(r"layer 1 head 2: query 13 ␣to -> key \d+ \S+$", first), first
    assert "'" not in first
    words = [line for line in out.splitlines() if "query side:" in line]
    assert words and any("␣" in w for w in words), words
    assert not re.search(r"'\s?\w+'", out), out  # no token in quotes (' to', 'went')
    assert re.search(r"top 5 pairs of parts \(\d+ more with --top N or --json\):", out)


# ---------------------------------------------------------------------------------------- circuit
def test_circuit_prints_every_head_and_says_how_many_edges_are_left_out(tiny_gpt2, tmp_path) -> None:
    folder = tiny_gpt2(n_layer=4, n_head=10, n_embd=40)
    out_dir = tmp_path / "circ"
    args = ["circuit", "--model", str(folder), "--pairs", "4", "--method", "eap", "--edges", "3000"]
    out = _ok([*args, "--out", str(out_dir)])
    summary = json.loads((out_dir / "circuit.json").read_text())
    heads = set()
    for s, r, _ in summary["edges"]:
        for name in (s, r.split(".")[0]):
            if re.fullmatch(r"L\d+H\d+", name):
                heads.add(name)
    assert len(heads) > 30  # more than the old cut
    line = next(line for line in out.splitlines() if line.startswith("heads in the circuit"))
    printed = line.split(": ", 1)[1].split(", ")
    assert set(printed) == heads and line.startswith(f"heads in the circuit ({len(heads)}): ")
    n = len(summary["edges"])
    assert f"top 10 of the {n} edges kept ({n - 10} more in circuit.json):" in out


# ------------------------------------------------------------------------------------------ heads
def test_heads_names_its_sentences_and_explains_its_columns(tmp_path) -> None:
    sentences = [f"Sentence number {i} is about a cat." for i in range(5)]
    path = tmp_path / "s.txt"
    path.write_text("\n".join(sentences) + "\n")
    out = _ok(["heads", "--sentences", str(path), "--no-importance"])
    assert "measured on 5 sentence(s) (2 more with --json):" in out
    for s in sentences[:3]:
        assert repr(s) in out
    assert repr(sentences[3]) not in out
    for column in ("prev, self, next, first, last:", "entropy:", "role:", "importance:", "|W_O[h]|:"):
        assert column in out, column
    out = _ok(["heads", "--mode", "mean"])
    assert (
        "importance: 1 - the mean cosine of the sentence embeddings when the head's z is mean-ablated" in out
    )


# ------------------------------------------------------------------------------------------ patch
def test_patch_warns_about_an_answer_the_model_would_not_write(tiny_gpt2) -> None:
    folder = str(tiny_gpt2())
    res = CliRunner().invoke(cli, ["patch", "--model", folder, "--answer", "Mary", "--top", "2"])
    assert res.exit_code == 0, res.output
    warning = [line for line in res.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warning) == 1, res.stderr
    assert "--answer 'Mary' is the token Mary" in warning[0]
    assert "the model writes that word as ␣Mary" in warning[0] and "pass --answer ' Mary'" in warning[0]
    res = CliRunner().invoke(cli, ["patch", "--model", folder, "--answer", " Mary", "--top", "2"])
    assert res.exit_code == 0 and "warning" not in res.stderr, res.stderr


# ------------------------------------------------------------------------------- options alike
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["heads", "--sentences", "{m}"], "sentences file {m} (--sentences)"),
        (["atlas", "--corpus", "{m}", "--out", "{tmp}/a"], "corpus {m} (--corpus)"),
        (["circuit", "--task", "{m}", "--out", "{tmp}/c"], "task file {m} (--task)"),
        (["view", "--result", "{m}", "-o", "{tmp}/p.html"], "result file {m} (--result)"),
        (["train", "--data", "{m}", "--out", "{tmp}/r"], "data file {m} (--data)"),
        (["plot-run", "{m}"], "run folder {m} (RUN_DIR)"),
    ],
    ids=lambda v: v[0] if isinstance(v, list) else "",
)
def test_a_missing_input_gets_the_same_line_everywhere(args, needle, tmp_path, monkeypatch) -> None:
    for module in (cli_lesson, cli_circuits, cli_causal):
        monkeypatch.setattr(module, "load_model", _no_load)
    missing = str(tmp_path / "missing.txt")
    line = _refused([a.format(m=missing, tmp=tmp_path) for a in args])
    assert line.startswith("error: cannot read " + needle.format(m=missing) + ": no such "), line
    kinds = r"no such (file|folder|file or folder); it must be (a regular file|a folder|a file or a folder)$"
    assert re.search(kinds, line), line


def test_a_layer_out_of_range_is_refused_before_the_model_loads(tiny_gpt2, monkeypatch) -> None:
    for module in (cli_lesson, cli_circuits, cli_causal):
        monkeypatch.setattr(module, "load_model", _no_load)
    expected = "error: layer 99 is out of range: valid layers are 0..29"
    assert _refused(["why", "--model", "smollm2", "--layer", "99", "--head", "0"]).startswith(expected)
    assert _refused(["explain", "--model", "smollm2", "--layer", "99"]) == expected
    assert _refused(["subspaces", "--model", "smollm2", "--layer", "99"]) == expected
    folder = str(tiny_gpt2())  # a checkpoint folder: its config.json says 2 layers, 3 heads
    assert _refused(["why", "--model", folder, "--layer", "2", "--head", "0"]).startswith(
        "error: layer 2 is out of range: valid layers are 0..1"
    )
    assert _refused(["explain", "--model", folder, "--head", "3"]) == (
        "error: head 3 is out of range: valid heads are 0..2"
    )


def test_every_command_creates_its_output_folder(tmp_path) -> None:
    """One rule (docs/cli.md): a new output folder is created, with its parents, by every command;
    ``view -o`` refused a missing folder while ``atlas --out`` created one."""
    page = tmp_path / "new" / "deeper" / "page.html"
    out = _ok(["view", "A cat sat.", "-o", str(page)])
    assert page.is_file() and f"wrote {page}" in out
    _ok(["subspaces", "--layer", "0", "--json", "--out", str(tmp_path / "x" / "y")])
    assert (tmp_path / "x" / "y" / "subspaces_L0_q.png").is_file()
    line = _refused(["view", "A cat sat.", "-o", "/proc/no/such/page.html"])
    assert "cannot write in the folder '/proc'" in line


# ------------------------------------------------------------------------------- one error path
def test_library_errors_become_one_line_in_one_place(monkeypatch, tmp_path) -> None:
    import headspace.analysis.decomposition as decomposition

    for error in (
        ValueError("bad value\nsecond line"),
        KeyError("no such key"),
        OSError(5, "I/O error", "f"),
    ):

        def fail(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(decomposition, "score_decomposition", fail)
        line = _refused(["why", "--layer", "1", "--head", "0"])
        assert line == "error: " + {"ValueError": "bad value; second line", "KeyError": "no such key",
                                    "OSError": "f: I/O error"}[type(error).__name__]  # fmt: skip
    # a bug of another kind is not dressed up as a user error
    monkeypatch.setattr(decomposition, "score_decomposition", lambda *a, **k: 1 / 0)
    res = CliRunner().invoke(cli, ["why", "--layer", "1", "--head", "0"])
    assert isinstance(res.exception, ZeroDivisionError)
    source = (Path(cli_circuits.__file__)).read_text()
    assert "from .causal import _run" not in source and not hasattr(cli_causal, "_run")


def test_reported_maps_the_error_types_and_lets_pipes_and_tracebacks_through(monkeypatch) -> None:
    with pytest.raises(UsageError, match=r"^--result: x\.json: No such file"):
        with reported("--result"):
            raise FileNotFoundError(2, "No such file or directory", "x.json")
    with pytest.raises(BrokenPipeError):
        with reported():
            raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setenv("HEADSPACE_TRACEBACK", "1")
    with pytest.raises(ValueError, match="kept"):
        with reported():
            raise ValueError("kept")
    assert one_line(ValueError("a\n\n  b ")) == "a; b" and one_line(ValueError()) == "ValueError"
