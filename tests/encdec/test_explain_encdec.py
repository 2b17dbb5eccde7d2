"""``headspace explain`` on encoder-decoders (issue #40): one output token through one cross-attention
head on a tiny T5 folder (against transformers' eager cross-attention) and on Whisper base with espeak-ng
speech (22.05 kHz, resampled by the reader), with the picture of the head's pattern."""

from __future__ import annotations

import json
import shutil
import subprocess
import wave
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from tiny_tokenizer import add_tokenizer

import headspace
from headspace.analysis.lesson.cross_explain import explain_cross
from headspace.cli import cli
from headspace.pretrained.encdec.whisper_base import whisper_base_files

SENTENCE = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def t5(tiny, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    folder, theirs = tiny("t5")
    mine = tmp_path_factory.mktemp("t5tok")
    for f in folder.iterdir():
        shutil.copy(f, mine / f.name)
    add_tokenizer(mine)
    return mine, theirs


def test_t5_lesson_equals_transformers_cross_attention(t5: tuple[Path, object]) -> None:
    folder, theirs = t5
    m = headspace.load(str(folder))
    e = explain_cross(m, "w5 w9 w12 w3 w30", target="w7 w8 w20 w11", layer=1, head=2, token=2)
    assert e.outputs == [" w7", " w8", " w20", " w11"] and e.sources[-1] == "</s>"
    src = torch.tensor([[5, 9, 12, 3, 30, 1]])
    dec = torch.tensor([[0, 7, 8, 20, 11, 1]])  # the start token, the target, the end
    with torch.no_grad():
        out = theirs(input_ids=src, decoder_input_ids=dec, output_attentions=True)  # type: ignore[operator]
    want = out.cross_attentions[1][0, 2]  # [seq_dec, seq_enc]
    assert e.lesson.position == 2  # output token 2 ("w20") is predicted at the decoder's position 2
    assert torch.allclose(torch.tensor(e.lesson.pattern), want[2], atol=1e-5)
    assert torch.allclose(torch.tensor(e.pattern), want[:5], atol=1e-5)  # rows predicting w7 .. the end
    assert e.boundaries == [1.0, 2.0, 3.0, 4.0, 5.0] and e.words[0] == ("w5", 0.0, 1.0)
    assert [w for w, _, _ in e.words] == ["w5", "w9", "w12", "w3", "w30"]  # </s> is no word


def test_t5_default_head_is_the_most_consistent(t5: tuple[Path, object]) -> None:
    m = headspace.load(str(t5[0]))
    e = explain_cross(m, "w5 w9 w12 w3 w30", target="w7 w8 w20 w11")
    scores = torch.tensor(e.scores)  # [3 decoder layers, 3 heads]
    assert scores.shape == (3, 3) and e.token == 2
    assert scores[e.lesson.layer, e.lesson.head] == scores.max()
    only = explain_cross(m, "w5 w9 w12 w3 w30", target="w7 w8 w20 w11", layer=0)
    assert only.lesson.layer == 0 and scores[0, only.lesson.head] == scores[0].max()


def test_explain_command_on_t5(t5: tuple[Path, object], tmp_path: Path) -> None:
    folder = t5[0]
    args = [
        "explain",
        "--model",
        str(folder),
        "w5 w9 w12",
        "--target",
        "w7 w8",
        *"--layer 2 --head 1".split(),
    ]
    r = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "pics")])
    assert r.exit_code == 0, r.output
    assert "decoder layer 2 cross-attention head 1" in r.output and "softmax over the sources" in r.output
    assert (tmp_path / "pics" / "cross_attention_L2_H1.png").stat().st_size > 1000
    d = json.loads(CliRunner().invoke(cli, [*args, "--json", "--token", "w8"]).output)
    assert d["lesson"]["layer"] == 2 and d["token"] == 1 and abs(sum(d["lesson"]["pattern"]) - 1) < 1e-5


def test_explain_refuses_in_one_line(tiny, t5: tuple[Path, object], tmp_path: Path) -> None:
    bare = tiny("t5")[0]  # no tokenizer.json
    cases = [
        (["explain", "--model", str(bare), "w5 w6"], "no tokenizer"),
        (["explain", "--model", str(t5[0])], "explain needs a source sentence"),
        (["explain", "--model", str(t5[0]), "w5", "--precision", "bfloat16"], "run in float32 only"),
        (["explain", "--model", str(t5[0]), "w5", "--target", "w7", "--token", "w9"], "not among the output"),
        (["explain", "--model", str(t5[0]), "w5", "--layer", "3"], "layer must be in [0, 3)"),
        (["explain", "--model", "minilm", "a cat", "--target", "w7"], "--target: only for encoder-decoders"),
    ]
    for args, message in cases:
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 2 and message in r.output and len(r.output.strip().splitlines()) == 1, r.output


@pytest.fixture(scope="module")
def speech22(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """espeak-ng's own 22.05 kHz WAV of the sentence (the reader resamples it)."""
    path = tmp_path_factory.mktemp("speech") / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(path), SENTENCE], check=True)
    with wave.open(str(path)) as w:
        assert w.getframerate() == 22050
    return path


@pytest.mark.slow  # Whisper base: a transcription and three forward passes (5-50 s on 2 busy cores)
def test_explain_command_on_whisper_base(speech22: Path, tmp_path: Path) -> None:
    whisper_base_files()  # the two packages of the README's install line: missing ones fail here
    r = CliRunner().invoke(cli, ["explain", "--model", "whisper-base", str(speech22), "--token", "fox",
                                 "--json", "--out", str(tmp_path)])  # fmt: skip
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert " ".join(o.strip() for o in d["outputs"]).startswith("the quick brown fox")
    les, scores = d["lesson"], torch.tensor(d["scores"])  # [6 layers, 8 heads]
    assert d["outputs"][d["token"]] == " fox" and les["position"] == 3 + d["token"]
    assert scores.shape == (6, 8) and scores[les["layer"], les["head"]] == scores.max() > 0.5
    assert [w for w, _, _ in d["words"]][:4] == ["the", "quick", "brown", "fox"]
    seconds = d["boundaries"]
    assert seconds == sorted(seconds) and 0 <= seconds[0] and seconds[-1] < 3.0  # espeak's 2.8 s
    top = les["top"][0][0] * 0.02  # the followed query's most-weighted frame lies within the audio's words
    assert seconds[0] <= top <= seconds[-1]
    assert Path(d["picture"]).stat().st_size > 1000
    bad = CliRunner().invoke(cli, ["explain", "--model", "whisper-base", str(speech22), "--target", "x"])
    assert bad.exit_code == 2 and "leave --target out" in bad.output
