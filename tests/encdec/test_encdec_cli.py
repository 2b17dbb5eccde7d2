"""``headspace patch``, ``attribute``, ``why`` and ``atlas`` on encoder-decoders (issue #40): the numbers
the commands print equal the Python functions' on the same inputs (and transformers' eager forward where
it gives them), on tiny T5 and BART folders and on Whisper base with espeak-ng speech."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from tiny_tokenizer import add_tokenizer

import headspace
from headspace.analysis.atlas.cross import cross_atlas
from headspace.analysis.causal.encdec_dla import encdec_logit_attribution
from headspace.analysis.causal.encdec_patching import patch_cross_heads, patched_logits
from headspace.analysis.circuits.encdec_why import why_cross_score
from headspace.cli import cli

CLEAN, CORRUPT, TARGET = "w5 w9 w12 w3", "w6 w20 w13 w4", "w7 w8 w20"
SRC_CLEAN = torch.tensor([[5, 9, 12, 3, 1]])  # the tokenizer appends </s> (id 1)
SRC_CORRUPT = torch.tensor([[6, 20, 13, 4, 1]])
DEC = torch.tensor([[0, 7, 8, 20]])  # T5's start token, then the target
FOLLOWED = torch.tensor([7, 8, 20, 1])  # predicted at decoder rows 0..3: the target and the end


def _with_tokenizer(tiny, kind: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    folder, theirs = tiny(kind)
    mine = tmp_path_factory.mktemp(f"{kind}tok")
    for f in folder.iterdir():
        shutil.copy(f, mine / f.name)
    add_tokenizer(mine)
    return mine, theirs


@pytest.fixture(scope="module")
def t5(tiny, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    return _with_tokenizer(tiny, "t5", tmp_path_factory)


@pytest.fixture(scope="module")
def bart(tiny, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    return _with_tokenizer(tiny, "bart", tmp_path_factory)


def _run(args: list[str]) -> dict:
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def _logprob(logits: torch.Tensor) -> float:
    """The followed tokens' summed log-probability at rows 0..3 of ``logits`` [1, 4, vocab]."""
    return float(torch.log_softmax(logits[0].double(), -1).gather(-1, FOLLOWED[:, None]).sum())


def test_patch_command_on_t5_equals_patch_cross_heads(t5: tuple[Path, object], tmp_path: Path) -> None:
    folder, theirs = t5
    args = ["patch", "--model", str(folder), "--clean", CLEAN, "--corrupt", CORRUPT, "--target", TARGET]
    d = _run([*args, "--json", "--top", "4"])
    with torch.no_grad():  # transformers' eager forward gives the two runs' metrics
        want_clean = _logprob(theirs(input_ids=SRC_CLEAN, decoder_input_ids=DEC).logits)  # type: ignore[operator]
        want_corrupt = _logprob(theirs(input_ids=SRC_CORRUPT, decoder_input_ids=DEC).logits)  # type: ignore[operator]
    assert abs(d["clean_metric"] - want_clean) < 1e-4 and abs(d["corrupt_metric"] - want_corrupt) < 1e-4
    m = headspace.load(str(folder))
    r = patch_cross_heads(m, SRC_CLEAN, SRC_CORRUPT, DEC, lambda lg: _logprob(lg))
    effects = torch.tensor(d["cross_heads_patch_effect"])  # [3 decoder layers, 3 heads]
    assert effects.shape == (3, 3) and torch.allclose(effects, r.effects, atol=1e-5)
    gap = r.clean - r.corrupt
    assert torch.allclose(torch.tensor(d["restored"]), r.effects / gap, atol=1e-5)
    assert d["output"] == [" w7", " w8", " w20"] and len(d["top"]) == 4
    best = divmod(int(r.effects.abs().argmax()), 3)
    assert (d["top"][0]["site"]["layer"], d["top"][0]["site"]["head"]) == best
    text = CliRunner().invoke(cli, [*args, "--out", str(tmp_path)])
    assert text.exit_code == 0, text.output
    line = f"decoder layer {best[0]:>2} cross head {best[1]:>2}  effect {float(r.effects[best]):+9.3f}"
    assert line in text.output and f"clean {r.clean:+.3f}, corrupt {r.corrupt:+.3f}" in text.output
    assert (tmp_path / "patch_cross_heads.png").stat().st_size > 1000


def test_patch_command_follows_bart_greedy_output(bart: tuple[Path, object]) -> None:
    folder = bart[0]
    d = _run(["patch", "--model", str(folder), "--clean", CLEAN, "--corrupt", CORRUPT, "--json"])
    m = headspace.load(str(folder))
    src = torch.tensor(m.tokenizer.encode_ids([CLEAN]))
    start = m.config.decoder_start_token_id
    out = m.generate(src, 32, decoder_input_ids=torch.tensor([[start]]))[0].tolist()
    text = out[1:-1] if out[-1] == m.config.eos_token_id else out[1:]
    assert d["output"] == [m.tokenizer.token_text(m.tokenizer.token_of(t)) for t in text]
    dec, follow = torch.tensor([[start, *text]]), torch.tensor([*text, m.config.eos_token_id])

    def metric(logits: torch.Tensor) -> float:
        return float(torch.log_softmax(logits[0].float(), -1).gather(-1, follow[:, None]).sum())

    corrupt = torch.tensor(m.tokenizer.encode_ids([CORRUPT]))
    r = patch_cross_heads(m, src, corrupt, dec, metric)
    assert torch.allclose(torch.tensor(d["cross_heads_patch_effect"]), r.effects, atol=1e-5)


def test_attribute_command_on_t5_adds_up_to_transformers_logit(t5: tuple[Path, object]) -> None:
    folder, theirs = t5
    d = _run(["attribute", "--model", str(folder), CLEAN, "--target", TARGET, "--answer", "w8", "--json"])
    with torch.no_grad():
        want = theirs(input_ids=SRC_CLEAN, decoder_input_ids=DEC).logits[0, 1]  # type: ignore[operator]
    assert d["index"] == 1 and d["token"] == 8 and d["position"] == 1  # " w8" is predicted at row 1
    assert abs(d["logit"] - float(want[8])) <= 1e-4 * float(want.abs().max())
    a = encdec_logit_attribution(headspace.load(str(folder)), SRC_CLEAN, DEC, 8, position=1)
    assert torch.allclose(torch.tensor(d["cross_heads"]), a.cross_heads, atol=1e-6)
    assert torch.allclose(torch.tensor(d["self_heads"]), a.self_heads, atol=1e-6)
    assert abs(d["total"] - d["logit"]) <= 1e-4 * float(want.abs().max())
    top = d["top_heads"][0]
    assert abs(top["attribution"]) == max(
        abs(float(a.cross_heads.abs().max())), float(a.self_heads.abs().max())
    )
    by_index = _run(
        ["attribute", "--model", str(folder), CLEAN, "--target", TARGET, "--answer", "2", "--json"]
    )
    assert by_index["token"] == 20 and by_index["position"] == 2


def test_why_command_on_t5_cross_head(t5: tuple[Path, object]) -> None:
    folder, theirs = t5
    args = ["why", "--model", str(folder), CLEAN, "--target", TARGET, *"--layer 2 --head 1 --token 2".split()]
    d = _run([*args, "--json"])
    with torch.no_grad():
        out = theirs(input_ids=SRC_CLEAN, decoder_input_ids=DEC, output_attentions=True)  # type: ignore[operator]
    pattern = out.cross_attentions[2][0, 1, 2]  # [seq_enc]
    assert d["key"] == int(pattern.argmax()) and abs(d["pattern"] - float(pattern.max())) < 1e-5
    s = why_cross_score(headspace.load(str(folder)), SRC_CLEAN, DEC, layer=2, head=1, query=2, key=d["key"])
    assert torch.allclose(torch.tensor(d["matrix"]), s.matrix, atol=1e-6) and abs(d["score"] - s.score) < 1e-6
    assert d["query_token"] == " w8" and d["key_source"] == [" w5", " w9", " w12", " w3", "</s>"][d["key"]]
    r = CliRunner().invoke(cli, [*args, "--key", "0"])
    assert r.exit_code == 0, r.output
    assert (
        "decoder layer 2 cross-attention head 1: query position 2 (reads ' w8') -> source position 0"
        in r.output
    )


def test_atlas_command_on_t5_sentence_pairs(t5: tuple[Path, object], tmp_path: Path) -> None:
    folder = t5[0]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(f"{CLEAN}\t{TARGET}\n\nw3 w4 w30 w31\tw9 w10 w11 w12\n", encoding="utf-8")
    (corpus / "b.txt").write_text("w11 w12 w13\n", encoding="utf-8")  # a source alone: the greedy output
    r = CliRunner().invoke(
        cli, ["atlas", "--model", str(folder), "--corpus", str(corpus), "--out", str(tmp_path / "o")]
    )
    assert r.exit_code == 0, r.output
    d = json.loads((tmp_path / "o" / "cross_atlas.json").read_text(encoding="utf-8"))
    items = [(CLEAN, TARGET), ("w3 w4 w30 w31", "w9 w10 w11 w12"), "w11 w12 w13"]
    want = cross_atlas(headspace.load(str(folder)), items)
    assert d["kind"] == "cross_atlas" and d["n_inputs"] == 3
    assert torch.allclose(torch.tensor(d["entropy"]), want.entropy, atol=1e-6)
    assert torch.allclose(torch.tensor(d["monotonic"]), want.monotonic, atol=1e-6)
    layer, head = want.ranking()[0]
    assert (
        f"decoder layer {layer:>2} head {head:>2}  monotonic {float(want.monotonic[layer, head]):.3f}"
        in r.output
    )


def test_commands_refuse_in_one_line(
    tiny, t5: tuple[Path, object], bart: tuple[Path, object], tmp_path: Path
) -> None:
    f, b, bare = str(t5[0]), str(bart[0]), str(tiny("t5")[0])
    (tmp_path / "empty").mkdir()
    cases = [
        (["patch", "--model", f], "patch needs --clean and --corrupt"),
        (
            ["patch", "--model", f, "--clean", "w5", "--corrupt", "w6", "--site", "mlp"],
            "--site mlp: patch on",
        ),
        (
            ["patch", "--model", f, "--clean", "w5", "--corrupt", "w6", "--answer", "w7"],
            "--answer: patch on an",
        ),
        (["patch", "--model", f, "--clean", "w5", "--corrupt", "w6", "--precision", "int8"], "float32 only"),
        (["patch", "--model", bare, "--clean", "w5", "--corrupt", "w6"], "no tokenizer"),
        (["patch", "--model", "smollm2", "--target", "w7"], "--target: only for encoder-decoders"),
        (["attribute", "--model", f], "attribute needs a source sentence"),
        (
            ["attribute", "--model", f, "w5", "--target", "w7", "--answer", "w9"],
            "not among the output tokens",
        ),
        (["attribute", "--model", b, "w5 w6", "--target", "w7"], "needs a pre-LN model (T5, Whisper)"),
        (
            ["why", "--model", f, "w5", *"--layer 3 --head 0".split()],
            "layer 3 is out of range: valid layers are 0..2",
        ),
        (["why", "--model", b, "w5", *"--layer 0 --head 0".split()], "needs a pre-LN model"),
        (
            ["atlas", "--model", f, "--corpus", str(tmp_path / "empty"), "--out", str(tmp_path / "o")],
            "a folder without .txt files",
        ),
        (
            [
                "atlas",
                "--model",
                f,
                "--corpus",
                str(tmp_path / "empty"),
                "--out",
                str(tmp_path),
                "--window",
                "8",
            ],
            "--window: atlas on an encoder-decoder",
        ),
    ]
    for args, message in cases:
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 2 and message in r.output and len(r.output.strip().splitlines()) == 1, (
            args,
            r.output,
        )


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """espeak-ng's WAV files of two sentences (22.05 kHz; the reader resamples them)."""
    folder = tmp_path_factory.mktemp("speech")
    paths = (folder / "clean.wav", folder / "corrupt.wav")
    for path, sentence in zip(paths, ("the quick brown fox", "a lazy dog sleeps")):
        subprocess.run(["espeak-ng", "-w", str(path), sentence], check=True)
    return paths


@pytest.mark.slow  # Whisper base: 48 patched decoder runs, five loads (5 min on the loaded 2 cores)
def test_commands_on_whisper_base(speech: tuple[Path, Path], tmp_path: Path) -> None:
    from headspace.pretrained.encdec.features import wav_features

    clean, corrupt = speech
    d = _run(["patch", "--model", "whisper-base", "--clean", str(clean), "--corrupt", str(corrupt), "--json"])
    m = headspace.load("whisper-base")
    prompt, text = m.prompt(), m.transcribe_ids(clean)
    assert "".join(d["output"]).strip().lower().startswith("the quick brown fox")
    feats, other = wav_features(clean), wav_features(corrupt)  # [1, 80, 3000] each
    dec, follow = torch.tensor([[*prompt, *text]]), torch.tensor([*text, m.config.eos_token_id])
    rows = slice(len(prompt) - 1, dec.shape[1])

    def metric(logits: torch.Tensor) -> float:
        return float(torch.log_softmax(logits[0, rows].float(), -1).gather(-1, follow[:, None]).sum())

    with torch.no_grad():
        assert abs(d["clean_metric"] - metric(m(feats, dec))) < 1e-3
        assert abs(d["corrupt_metric"] - metric(m(other, dec))) < 1e-3
    for t in d["top"][:2]:
        site = (t["site"]["layer"], t["site"]["head"])
        want = metric(patched_logits(m, feats, other, dec, [site])) - d["corrupt_metric"]
        assert abs(t["effect"] - want) < 1e-3
    a = _run(["attribute", "--model", "whisper-base", str(clean), "--answer", "fox", "--json"])
    assert a["answer"] == " fox" and abs(a["total"] - a["logit"]) < 1e-3 * max(1.0, abs(a["logit"]))
    w = _run(["why", "--model", "whisper-base", str(clean), *"--layer 3 --head 1 --json".split()])
    assert abs(w["total"] - w["score"]) < 1e-3 * max(1.0, abs(w["score"])) and w["key_source"].endswith("s")
    at = CliRunner().invoke(cli, ["atlas", "--model", "whisper-base", "--corpus", str(clean.parent),
                                  "--out", str(tmp_path / "atlas")])  # fmt: skip
    assert at.exit_code == 0, at.output
    got = json.loads((tmp_path / "atlas" / "cross_atlas.json").read_text(encoding="utf-8"))
    want = cross_atlas(m, [str(clean), str(corrupt)])  # the folder's WAV files in name order
    assert got["corpus"] == [str(clean), str(corrupt)] and got["n_inputs"] == 2
    assert torch.allclose(torch.tensor(got["monotonic"]), want.monotonic, atol=1e-5)
    assert torch.allclose(torch.tensor(got["entropy"]), want.entropy, atol=1e-5)
    (tmp_path / "bad.wav").write_bytes(b"RIFF not a wave file")
    bad = CliRunner().invoke(cli, ["patch", "--model", "whisper-base", "--clean", str(tmp_path / "bad.wav"),
                                   "--corrupt", str(corrupt)])  # fmt: skip
    assert (
        bad.exit_code == 2
        and "not a readable PCM WAV file" in bad.output
        and len(bad.output.splitlines()) == 1
    )


def test_patch_cross_heads_runs_the_encoder_once_per_input(t5: tuple[Path, object]) -> None:
    """The patched runs reuse the corrupt source's encoder output: the encoder runs a fixed number of
    times (clean, corrupt, the clean z, the corrupt memory), not once more per head (Whisper's encoder on
    30 s of audio is most of a run); the effects equal those of full patched runs."""
    m = headspace.load(str(t5[0]))
    runs = []
    m.encoder.register_forward_hook(lambda *_: runs.append(1))
    r = patch_cross_heads(m, SRC_CLEAN, SRC_CORRUPT, DEC, _logprob)
    assert len(runs) == 4  # 3 decoder layers x 3 heads patched
    for layer, head in [(0, 0), (2, 1)]:
        full = _logprob(patched_logits(m, SRC_CLEAN, SRC_CORRUPT, DEC, [(layer, head)])) - r.corrupt
        assert abs(float(r.effects[layer, head]) - full) < 1e-6
