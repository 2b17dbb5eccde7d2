"""The atlas defects of issue 42, each held by a test that failed on 5223863.

Weights fingerprinted by their bytes (CLI with a replaced GGUF, a resumed run with other weights, the
Python API after in-place edits); links in a corpus folder not followed; one run per output folder;
each document read and tokenised once, in bounded pieces, nothing read past ``max_tokens``; one-line
errors for deep JSON, a full disk (the sealed shards kept, the rerun resuming), an empty corpus, a lone
surrogate and a forged shard; a damaged shard named on stderr; a user's own ``atlas.json`` left alone.

Text corpora run on the tiny Llama GGUF of ``tests/pretrained/test_gguf.py`` (a real byte-level BPE
tokenizer with a BOS token, two layers); token corpora on a small random decoder.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import headspace as hs
from headspace.analysis import atlas
from headspace.analysis.corpus import Corpus
from headspace.cli import cli

# The helpers added with the fixes are imported inside the tests that use them, so that on the code
# before them each test fails on its own defect, not on an import.
A = importlib.import_module("headspace.analysis.atlas.run")  # the module (the package exports the function)
C = importlib.import_module("headspace.analysis.corpus")
_spec = importlib.util.spec_from_file_location(
    "atlas_tiny_gguf", Path(__file__).resolve().parents[1] / "pretrained" / "test_gguf.py"
)
_gguf_tests = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(_gguf_tests)  # type: ignore[union-attr]
write_tiny_llama = _gguf_tests.write_tiny_llama

V = 23
TEXT = "the world turns, and the world is 12 worlds in one. " * 3


def decoder(seed: int = 0) -> hs.Decoder:
    torch.manual_seed(seed)
    cfg = hs.ModelConfig(
        arch="decoder", vocab_size=V, d_model=30, n_layers=2, n_heads=5, d_mlp=44, max_seq_len=32,
        dropout=0.0, attn_dropout=0.0, emb_dropout=0.0,
    )  # fmt: skip
    return hs.Decoder(cfg).eval()


def token_docs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, V, (n,), generator=g) for n in (20, 5, 11, 9)]


KW: dict[str, Any] = dict(
    window=8, batch_size=2, shard_size=1, top_k=2, progress=False, induction_repeated=False
)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny(gguf_path: Path) -> Any:
    return hs.load(str(gguf_path))


def _cli(out: Path, model: Path, corpus: Path, *extra: str) -> Any:
    args = ["atlas", "--model", str(model), "--corpus", str(corpus), "--out", str(out), "--window", "16"]
    return CliRunner().invoke(cli, [*args, "--shard-size", "1", "--batch-size", "2", *extra])


def _one_error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in output, output
    return lines[0]


# ------------------------------------------------------------------------------ 1. the weights' fingerprint
def test_weights_sha256_follows_every_byte_of_the_weights() -> None:
    from headspace.analysis.atlas_guard import weights_sha256

    model = decoder()
    first = weights_sha256(model)
    assert first == weights_sha256(decoder()) and first != weights_sha256(decoder(seed=1))
    p = model.blocks[1].attn.o_weight
    kept = p.detach().clone()
    with torch.no_grad():
        p[0, 0] += 1.0
    second = weights_sha256(model)
    version = p._version
    p.data.copy_(kept)  # an edit through .data does not move p._version: the bytes are what counts
    assert p._version == version
    assert second != first and weights_sha256(model) == first


@pytest.mark.parametrize("edit", ["in_place", "through_data"])
def test_python_api_refuses_shards_after_in_place_weight_edits(edit: str, tmp_path: Path) -> None:
    model = decoder()
    before = atlas(model, token_docs(), out=tmp_path, **KW)
    if edit == "in_place":
        with torch.no_grad():
            model.blocks[0].attn.o_weight.mul_(1.5)
    else:
        model.blocks[0].attn.o_weight.data.mul_(1.5)
    with pytest.raises(ValueError) as refused:
        atlas(model, token_docs(), out=tmp_path, **KW)
    from headspace.analysis.atlas_guard import weights_sha256

    old, new = before.to_dict()["weights_sha256"], weights_sha256(model)
    assert old != new and "\n" not in str(refused.value)
    assert f"stats-000000.json: a shard of a model with other weights (weights SHA-256 {old})" in str(
        refused.value
    )
    assert f"this model's weights have SHA-256 {new}" in str(refused.value)


def test_a_resumed_run_with_other_weights_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    measure, calls = A.measure_batch, []

    def killed_after_two(*args: Any, **kwargs: Any) -> None:
        if len(calls) == 2:
            raise KeyboardInterrupt  # the run stops there, as a kill would stop it
        calls.append(1)
        measure(*args, **kwargs)

    monkeypatch.setattr(A, "measure_batch", killed_after_two)
    with pytest.raises(KeyboardInterrupt):
        atlas(decoder(), token_docs(), out=tmp_path, **KW)
    monkeypatch.setattr(A, "measure_batch", measure)
    assert len(list((tmp_path / "shards").glob("stats-*.json"))) == 2
    with pytest.raises(ValueError, match="a shard of a model with other weights"):
        atlas(decoder(seed=1), token_docs(), out=tmp_path, **KW)
    atlas(decoder(), token_docs(), out=tmp_path, **KW)  # the same weights resume


def test_cli_refuses_a_replaced_model_file(gguf_path: Path, tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(gguf_path.read_bytes())
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT)
    out = tmp_path / "o"
    first = _cli(out, model, corpus, "--no-ablation")
    assert first.exit_code == 0, first.output
    again = _cli(out, model, corpus, "--no-ablation")  # the same weights: every shard read back
    assert again.exit_code == 0, again.output
    write_tiny_llama(model, seed=1)  # other weights under the same path
    refused = _cli(out, model, corpus, "--no-ablation")
    assert refused.exit_code == 2, refused.output
    line = _one_error_line(refused.output)
    from headspace.analysis.atlas_guard import weights_sha256

    old, new = weights_sha256(hs.load(str(gguf_path)).model), weights_sha256(hs.load(str(model)).model)
    assert new != old and json.loads((out / "atlas.json").read_text())["weights_sha256"] == old
    assert "a shard of a model with other weights" in line and old in line and new in line


# ------------------------------------------------------------------------------------- 2. links not followed
def test_a_link_in_a_corpus_folder_is_not_followed(tiny: Any, tmp_path: Path) -> None:
    folder, outside = tmp_path / "corpus", tmp_path / "outside"
    folder.mkdir()
    outside.mkdir()
    (folder / "a.txt").write_text("the world")
    (outside / "secret.txt").write_text("12 12 12 12 12 12 12 12 12")
    (outside / "secret.jsonl").write_text(json.dumps({"text": "12 12 12"}) + "\n")
    (folder / "link.txt").symlink_to(outside / "secret.txt")
    (folder / "link.jsonl").symlink_to(outside / "secret.jsonl")
    assert [name for name, _ in Corpus.of(folder).documents()] == ["a.txt"]
    result = atlas(tiny, folder, window=16, top_k=2, progress=False, ablation=False, induction_repeated=False)
    d = result.to_dict()
    examples = [e for row in d["examples"] for head in row for kind in head.values() for e in kind]
    assert examples and {e["document"] for e in examples} == {"a.txt"}
    tokens = {t for e in examples for c in ("query_context", "key_context") for t in e[c]["tokens"]}
    assert "12" not in tokens and "link" not in json.dumps(d)
    assert result.n_tokens == tiny.tokenize_padded(["the world"])[0].shape[1]


# ----------------------------------------------------------------------------------- 3. one run per folder
def test_a_second_run_on_a_locked_folder_is_refused(
    gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inside, go, measure = threading.Event(), threading.Event(), A.measure_batch
    first_thread: list[threading.Thread] = []

    def held(*args: Any, **kwargs: Any) -> None:
        if threading.current_thread() in first_thread:
            inside.set()
            assert go.wait(60)
        measure(*args, **kwargs)

    monkeypatch.setattr(A, "measure_batch", held)
    results: list[Any] = []
    first = threading.Thread(
        target=lambda: results.append(atlas(decoder(), token_docs(), out=tmp_path, **KW))
    )
    first_thread.append(first)
    first.start()
    try:
        assert inside.wait(60)
        with pytest.raises(
            ValueError, match=rf"another atlas run is writing this folder \(pid {os.getpid()} on"
        ):
            atlas(decoder(), token_docs(), out=tmp_path, **{**KW, "window": 16})
        corpus = tmp_path / "c.txt"  # the command line too: one line, exit code 2
        corpus.write_text(TEXT)
        second = _cli(tmp_path, gguf_path, corpus, "--no-ablation")
        assert second.exit_code == 2
        assert "another atlas run is writing this folder" in _one_error_line(second.output)
    finally:
        go.set()
        first.join(60)
    assert len(results) == 1 and (tmp_path / ".atlas.lock").is_file()
    atlas(decoder(), token_docs(), out=tmp_path, **KW)  # the lock went with the first run


# ---------------------------------------------------------------- 4. read once, tokenised once, bounded
class CountingTokenizer:
    """A ``tokenizers.Tokenizer`` stand-in that records every text it encodes."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.texts = inner, []

    def encode(self, text: str, **kwargs: Any) -> Any:
        self.texts.append(text)
        return self.inner.encode(text, **kwargs)

    def encode_batch(self, texts: list[str], **kwargs: Any) -> Any:
        self.texts.extend(texts)
        return self.inner.encode_batch(texts, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
def counted(gguf_path: Path) -> Any:
    model = hs.load(str(gguf_path))
    model.tokenizer._tok = CountingTokenizer(model.tokenizer._tok)
    return model


def test_text_pieces_cut_before_whitespace_and_join_to_the_text() -> None:
    from headspace.analysis.corpus import text_pieces

    text = "ab  cd\nef " * 40 + "x" * 50
    for n in (1, 3, 7, 64):
        pieces = list(text_pieces(text, n))
        assert "".join(pieces) == text and all(len(p) <= n for p in pieces)
        if n >= 7:  # room for a run of spaces and a word: every cut is before whitespace (or in the x's)
            assert all(p[0].isspace() or p[0] == "x" for p in pieces[1:])


def test_a_long_document_is_tokenised_once_in_bounded_pieces(counted: Any) -> None:
    from headspace.analysis.corpus import document_tokens

    doc = "the world, 12 worlds   in\none.\n\n " * 300  # ~10,000 characters
    whole = counted.tokenize_padded([doc])[0][0]
    counted.tokenizer._tok.texts.clear()
    pieces = document_tokens(counted, doc, max_chars=1000)
    assert torch.equal(pieces, whole)  # byte-level BPE: the same tokens as the whole text
    seen = [t for t in counted.tokenizer._tok.texts if t != "a"]  # "a": the probe for the special tokens
    assert "".join(seen) == doc and max(map(len, seen)) <= 1000


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    reads: list[str] = []
    read = C.read_regular_file

    def counting_read(path: Any, **kwargs: Any) -> bytes:
        reads.append(Path(path).name)
        return read(path, **kwargs)

    monkeypatch.setattr(C, "read_regular_file", counting_read)
    return reads


def test_atlas_reads_and_tokenises_each_document_once(
    counted: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "corpus"
    folder.mkdir()
    texts = ["the world " * 30, "12 in one " * 3, "the one"]
    (folder / "a.txt").write_text(texts[0])
    (folder / "b.md").write_text(texts[1])
    (folder / "c.jsonl").write_text(json.dumps({"text": texts[2]}) + "\n")
    reads = _count_reads(monkeypatch)
    tok = counted.tokenizer._tok
    tok.texts.clear()
    result = atlas(counted, folder, window=16, shard_size=2, top_k=2, progress=False, out=tmp_path / "o")
    assert reads == ["a.txt", "b.md", "c.jsonl"]  # each file read once, in both passes and the examples
    assert tok.texts == texts  # each document tokenised once
    assert result.n_sequences > 4 and result.clean_loss is not None


def test_nothing_is_read_or_tokenised_past_max_tokens(
    counted: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("the world " * 2000)  # 20,000 characters
    (folder / "b.txt").write_text("never read")
    reads = _count_reads(monkeypatch)
    kw: dict[str, Any] = dict(window=16, max_tokens=40, top_k=2, progress=False, ablation=False)
    result = atlas(counted, folder, **kw)
    assert reads == ["a.txt"] and result.n_tokens == 40
    tok = counted.tokenizer._tok
    tok.texts.clear()
    again = atlas(counted, folder, **kw, max_piece_chars=100)
    assert sum(len(t) for t in tok.texts if t != "a") <= 300  # a few pieces of 100, not 20,000 characters
    assert torch.equal(again.stats["previous"], result.stats["previous"])


def test_token_ids_of_a_run_with_out_live_in_a_mapped_file_that_is_removed(
    counted: Any, tmp_path: Path
) -> None:
    from headspace.analysis.corpus import read_windows

    texts = ["the world " * 40, "12 in one " * 9]
    read = read_windows(counted, Corpus.of(texts), 16, spill=(tmp_path, 0))
    maps = Path("/proc/self/maps")
    if maps.exists():  # Linux: the ids are pages of the (removed) file, not the process's own memory
        assert f"{tmp_path / '.atlas-tokens-0.tmp'} (deleted)" in maps.read_text()
    assert not list(tmp_path.glob(".atlas-tokens*"))
    whole = [counted.tokenize_padded([t])[0][0] for t in texts]
    assert torch.equal(torch.cat([w.tokens.long() for w in read.windows]), torch.cat(whole))
    kw: dict[str, Any] = dict(window=16, top_k=2, progress=False, ablation=False)
    on_disk = atlas(counted, texts, out=tmp_path / "o", **kw).to_dict()
    assert json.dumps(on_disk, sort_keys=True) == json.dumps(
        atlas(counted, texts, **kw).to_dict(), sort_keys=True
    )
    assert not list((tmp_path / "o").glob(".atlas-tokens*"))


# ------------------------------------------------------------------------------------- 5. one-line errors
def test_json_nested_100000_deep_names_the_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "c.jsonl"
    bad.write_text('{"text": "ok"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ValueError, match=r"c.jsonl line 2: expected a JSON object .*nested deeper"):
        list(Corpus.of(bad).documents())


def test_a_lone_surrogate_names_the_file_and_line(tiny: Any, tmp_path: Path) -> None:
    bad = tmp_path / "c.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "a\\ud800b"}\n')
    with pytest.raises(
        ValueError, match=r'c.jsonl line 2: "text": expected valid Unicode.*U\+D800 at character 1'
    ):
        atlas(tiny, bad, window=8, progress=False, ablation=False, induction_repeated=False)
    with pytest.raises(ValueError, match=r"corpus\[1\]: expected valid Unicode"):
        atlas(tiny, ["ok", "\udc80"], window=8, progress=False, ablation=False, induction_repeated=False)


def test_an_empty_corpus_is_refused(tiny: Any, gguf_path: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"expected some text to measure; got 2 document\(s\), all empty"):
        atlas(tiny, ["", "  "], window=8, progress=False, induction_repeated=False)
    with pytest.raises(ValueError, match="expected some text to measure"):
        atlas(decoder(), [torch.zeros(0, dtype=torch.int64)], window=8, progress=False)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    done = _cli(tmp_path / "o", gguf_path, empty)
    assert done.exit_code == 2 and "got 0 document(s), none" in _one_error_line(done.output)
    assert not (tmp_path / "o" / "atlas.json").exists()


def _reseal(path: Path, edit: Any) -> None:
    obj = json.loads(path.read_text())
    edit(obj["state"])
    obj["sha256"] = hashlib.sha256(json.dumps(obj["state"], sort_keys=True).encode()).hexdigest()
    path.write_text(json.dumps(obj))


def test_a_forged_shard_naming_a_missing_sequence_is_refused_naming_it(tmp_path: Path) -> None:
    atlas(decoder(), token_docs(), out=tmp_path, **KW)
    shard = tmp_path / "shards" / "stats-000001.json"

    def forge(state: dict[str, Any]) -> None:
        state["top"]["attention"][0][0][0][1] = 999

    _reseal(shard, forge)
    with pytest.raises(
        ValueError, match=r"stats-000001.json: a sealed shard this run cannot use \(names sequence 999"
    ):
        atlas(decoder(), token_docs(), out=tmp_path, **KW)
    _reseal(shard, lambda state: state.pop("counts"))
    with pytest.raises(
        ValueError, match=r"stats-000001.json: a sealed shard this run cannot use \(lacks 'counts'\)"
    ):
        atlas(decoder(), token_docs(), out=tmp_path, **KW)


def test_a_full_disk_is_one_line_and_the_rerun_resumes(
    gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT)
    reference = _cli(tmp_path / "ref", gguf_path, corpus)
    assert reference.exit_code == 0, reference.output
    write, writes = A.write_atomic, []

    def full_after_three(path: Any, data: Any, **kwargs: Any) -> Any:
        if len(writes) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        writes.append(path)
        return write(path, data, **kwargs)

    monkeypatch.setattr(A, "write_atomic", full_after_three)
    out = tmp_path / "o"
    failed = _cli(out, gguf_path, corpus)
    assert failed.exit_code == 1
    line = _one_error_line(failed.output)
    assert line.startswith(
        f"error: {out / 'shards' / 'stats-000003.json'}: cannot write this shard (No space"
    )
    assert "the shards sealed before it" in line and "resume" in line
    monkeypatch.setattr(A, "write_atomic", write)
    measure, calls = A.measure_batch, []
    monkeypatch.setattr(A, "measure_batch", lambda *a, **k: calls.append(1) or measure(*a, **k))
    rerun = _cli(out, gguf_path, corpus)
    assert rerun.exit_code == 0, rerun.output
    n_shards = len(list((out / "shards").glob("stats-*.json")))
    assert len(calls) == n_shards - 3  # the three sealed shards were read back
    assert (out / "atlas.json").read_bytes() == (tmp_path / "ref" / "atlas.json").read_bytes()

    def read_only(path: Any, data: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(A, "write_atomic", read_only)  # every shard sealed: only atlas.json is written
    last = _cli(out, gguf_path, corpus)
    assert last.exit_code == 1
    line = _one_error_line(last.output)
    assert line.startswith(f"error: {out}: cannot write atlas.json and atlas.html (Read-only file system)")
    assert (out / "atlas.json").read_bytes() == (tmp_path / "ref" / "atlas.json").read_bytes()


# ------------------------------------------------------------------------------------------ 6. observations
def test_a_damaged_shard_is_named_on_stderr_and_computed_again(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    want = atlas(decoder(), token_docs(), out=tmp_path, **KW).to_dict()
    shard = tmp_path / "shards" / "stats-000002.json"
    shard.write_bytes(shard.read_bytes()[:-20])
    capsys.readouterr()
    again = atlas(decoder(), token_docs(), out=tmp_path, **KW).to_dict()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"atlas: {shard} is damaged" in err[0] and "computing that shard again" in err[0]
    assert json.dumps(again, sort_keys=True) == json.dumps(want, sort_keys=True)


@pytest.mark.parametrize("name", ["atlas.json", "atlas.html"])
def test_a_users_own_atlas_file_is_not_overwritten(name: str, gguf_path: Path, tmp_path: Path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT)
    out = tmp_path / "o"
    out.mkdir()
    mine = out / name
    mine.write_text('{"my": "notes"}\n')
    done = _cli(out, gguf_path, corpus, "--no-ablation")
    assert done.exit_code == 2
    assert f"{name} there is not a head atlas headspace wrote" in _one_error_line(done.output)
    assert mine.read_text() == '{"my": "notes"}\n'
