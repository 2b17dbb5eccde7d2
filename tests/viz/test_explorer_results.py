"""Saved patching and attribution results on the explorer page (its fifth view), without a browser.

The page data must hold the result's numbers exactly as saved, from the result objects, their
``to_json(path)`` files and the ``headspace patch/attribute --json`` output alike; files are untrusted
input (bad ones are one-line errors naming the file), and a result of another model shape is refused.
tests/viz/test_explorer_browser.py draws the heatmap in Chromium and reads a value by hovering.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from headspace.analysis import patching
from headspace.analysis.attribution import direct_logit_attribution, logit_lens
from headspace.cli import cli
from headspace.model.models import Decoder, ModelConfig
from headspace.viz.explorer import Explorer, load_results, render_page, result_views
from headspace.viz.explorer.results import MAX_RESULT_BYTES, ResultView, check_views_fit, prompt_of

pytestmark = pytest.mark.usefixtures("single_thread")

# distinct sizes: 2 layers x 6 heads (2 key/value heads), d_head 6, 7 tokens, vocab 53
N_LAYERS, N_HEADS, SEQ, VOCAB = 2, 6, 7, 53
ANSWER, OTHER = 5, 7


def rotary_decoder() -> Decoder:
    torch.manual_seed(4)
    config = ModelConfig(
        arch="decoder", vocab_size=VOCAB, d_model=36, n_layers=N_LAYERS, n_heads=N_HEADS, n_kv_heads=2,
        d_head=6, positions="rotary", norm_kind="rmsnorm", mlp_kind="gated", act="silu", bias=False,
    )  # fmt: skip
    return Decoder(config).eval()


@pytest.fixture(scope="module")
def model() -> Decoder:
    return rotary_decoder()


@pytest.fixture(scope="module")
def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    clean = torch.tensor([[3, 11, 13, 17, 19, 23, 29]])  # (1, 7)
    corrupt = clean.clone()
    corrupt[0, 3] = 31  # they differ from position 3 on
    return clean, corrupt


@pytest.fixture(scope="module")
def results(model: Decoder, prompts: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    clean, corrupt = prompts
    out: dict[str, Any] = {
        site: patching.patch(model, clean, corrupt, site=site, answer=ANSWER, other=OTHER)
        for site in patching.SITES
    }
    out["attribution"] = patching.attribution_patching(model, clean, corrupt, answer=ANSWER, other=OTHER)
    out["dla"] = direct_logit_attribution(model, clean, ANSWER, OTHER)
    out["lens"] = logit_lens(model, clean, ANSWER)
    return out


def test_page_data_holds_every_sites_effect_exactly(model: Decoder, prompts, results) -> None:
    clean, _ = prompts
    sites = [results[s] for s in patching.SITES]
    page = Explorer(model, clean, results=sites)
    views = page.data["results"]
    assert [v["name"] for v in views] == [f"patching: {s}" for s in patching.SITES]
    heads, heads_pos, resid, mlp = views
    r = results["heads"]
    assert heads["values"] == r.effect.tolist()  # float32 -> float64 exactly, as to_json writes them
    assert heads["rows"] == ["L0", "L1"] and heads["cols"] == [f"H{h}" for h in range(N_HEADS)]
    assert (heads["row_axis"], heads["col_axis"], heads["link"]) == ("layer", "head", "layer_head")
    assert (heads["n_layers"], heads["n_heads"], heads["scale"]) == (N_LAYERS, N_HEADS, "diverging")
    facts = dict(heads["facts"])
    assert (
        facts["clean metric"] == f"{r.clean_metric:+.4g}"
        and facts["corrupt metric"] == f"{r.corrupt_metric:+.4g}"
    )
    assert facts["metric"] == r.metric_name
    (top_label, top_value), *_ = heads["top"]
    (layer, head), value = r.top(1)[0]
    assert (top_label, top_value) == (f"L{layer} H{head}", value)
    # heads_pos: one row per (layer, head), one column per position
    e = results["heads_pos"].effect  # (L, H, S)
    assert heads_pos["values"] == e.reshape(N_LAYERS * N_HEADS, SEQ).tolist()
    assert heads_pos["rows"][N_HEADS + 1] == "L1 H1" and heads_pos["link"] == "layer_head_rows"
    assert heads_pos["cols"] == [str(i) for i in range(SEQ)]  # no tokenizer: positions
    assert resid["values"] == results["resid"].effect.tolist() and resid["col_axis"] == "position"
    assert mlp["values"] == [[v] for v in results["mlp"].effect.tolist()] and mlp["cols"] == ["MLP"]
    # positions before the first difference are exactly 0 in the page too
    assert all(row[:3] == [0.0, 0.0, 0.0] for row in resid["values"])
    assert page.data["format"] == "headspace-explorer/3"
    assert '"results":[' in page.html


def test_attribution_patching_dla_and_lens_views(model: Decoder, prompts, results) -> None:
    clean, _ = prompts
    page = Explorer(model, clean, results=[results["attribution"], results["dla"], results["lens"]])
    attr, dla, lens = page.data["results"]
    assert attr["name"] == "attribution patching: heads" and attr["unit"].endswith("(estimated)")
    assert attr["values"] == results["attribution"].effect.tolist()
    d = results["dla"]
    assert dla["cols"] == [*(f"H{h}" for h in range(N_HEADS)), "MLP"]  # no b_O in a bias-free model
    for layer in range(N_LAYERS):
        assert dla["values"][layer] == [*d.heads[layer].tolist(), float(d.mlps[layer])]
    parts = sum(sum(row) for row in dla["values"]) + float(d.embed) + float(d.norm_bias)
    assert parts == pytest.approx(float(d.logit), abs=1e-5)  # the page's parts add up to the logit
    facts = dict(dla["facts"])
    assert facts["the model's value"] == f"{float(d.logit):+.4g}" and "add up" in facts["sum of the parts"]
    L = results["lens"]
    assert lens["rows"] == ["embed", "after L0", "after L1"] and lens["scale"] == "sequential"
    assert [row[0] for row in lens["values"]] == L.answer_prob[0].tolist()
    assert [row[1] for row in lens["values"]] == L.top_probs[0, :, 0].tolist()
    assert f"rank {int(L.answer_rank[0, 1])}" in lens["notes"][1][0]


def test_json_files_give_the_same_views_as_the_objects(results, tmp_path: Path) -> None:
    for name in ("heads", "heads_pos", "resid", "mlp", "attribution", "dla", "lens"):
        r = results[name]
        path = r.to_json(tmp_path / f"{name}.json")
        assert load_results(path) == result_views(r) == result_views(r.to_dict()) == result_views(str(path))
        assert all(isinstance(v, ResultView) for v in load_results(path))
    both = tmp_path / "both.json"  # a list of results in one file
    both.write_text(json.dumps([results["heads"].to_dict(), results["dla"].to_dict()]))
    assert [v["kind"] for v in load_results(both)] == ["patching", "direct_logit_attribution"]
    views = load_results(both)
    assert result_views(views) == views  # views already read pass through as they are


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gpt2(tmp_path_factory.mktemp("models") / "gpt2")


def test_command_line_json_is_read_too(gpt2_folder: Path, tmp_path: Path) -> None:
    """``headspace patch --json`` and ``headspace attribute --json`` (another layout than to_dict) on a
    GPT-2 folder with a word tokenizer: their files give the numbers they printed."""
    folder = gpt2_folder
    runner = CliRunner()
    out = runner.invoke(cli, ["patch", "--model", str(folder), "--json"])
    assert out.exit_code == 0, out.output
    saved = json.loads(out.output)
    (tmp_path / "patch.json").write_text(out.output)
    (view,) = load_results(tmp_path / "patch.json")
    assert view["values"] == saved["head_patch_effect"] and view["kind"] == "patching"
    assert dict(view["facts"])["clean metric"] == f"{saved['clean_metric']:+.4g}"
    assert prompt_of([view]) == "When Mary and John went to the store, John gave a drink to"
    args = ["attribute", "When Mary and John went", "--answer", " to", "--model", str(folder), "--json"]
    out = runner.invoke(cli, args)
    assert out.exit_code == 0, out.output
    saved = json.loads(out.output)
    (tmp_path / "attribute.json").write_text(out.output)
    dla, lens = load_results(tmp_path / "attribute.json")
    assert [row[:-1] for row in dla["values"]] == saved["head_attribution"]
    assert [row[-1] for row in dla["values"]] == saved["mlp_attribution"]
    assert [row[0] for row in lens["values"]] == [r["answer_prob"] for r in saved["logit_lens"]]
    assert prompt_of([dla]) == "When Mary and John went"


WORDS = "<|endoftext|> When Mary and John went to the store , gave a drink".split()


def tiny_gpt2(folder: Path) -> Path:
    """A 3-layer x 7-head GPT-2 saved by transformers, with a word-level byte-level tokenizer."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder.mkdir(parents=True)
    vocab: dict[str, int] = {}
    for w in WORDS:
        vocab[w] = len(vocab)
        if not w.startswith("<"):
            vocab["\u0120" + w] = len(vocab)  # "Ġword": the word after a space
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(vocab), n_positions=32, n_embd=28, n_layer=3, n_head=7,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(str(folder))
    return folder


def test_view_command_shows_a_saved_result(gpt2_folder: Path, tmp_path: Path) -> None:
    """``headspace view --result FILE`` (the page opens on the result's clean prompt)."""
    folder = gpt2_folder
    runner = CliRunner()
    out = runner.invoke(cli, ["patch", "--model", str(folder), "--json", "--site", "resid"])
    assert out.exit_code == 0, out.output
    (tmp_path / "resid.json").write_text(out.output)
    saved = json.loads(out.output)
    page = tmp_path / "page.html"
    out = runner.invoke(cli, ["view", "--model", str(folder), "--result", str(tmp_path / "resid.json"),
                              "-o", str(page)])  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "with 1 saved result view(s): patching: resid" in out.output
    data = page_data(page)
    (v,) = data["results"]
    assert v["values"] == saved["resid_patch_effect"] and v["cols"] == saved["tokens"]
    assert data["sentence"] == "When Mary and John went to the store, John gave a drink to"
    # a bad file is refused before any model is loaded, in one line, exit code 2
    (tmp_path / "bad.json").write_text('{"kind": "patching", "site": "nowhere"}')
    out = runner.invoke(cli, ["view", "--model", "no-such-model", "--result", str(tmp_path / "bad.json"),
                              "-o", str(page)])  # fmt: skip
    assert out.exit_code == 2 and "site" in out.output and "nowhere" in out.output
    assert len(out.output.strip().splitlines()) == 1
    # a result of another model shape: named, exit code 2
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**saved, "resid_patch_effect": saved["resid_patch_effect"][:2]}))
    out = runner.invoke(cli, ["view", "--model", str(folder), "--result", str(other), "-o", str(page)])
    assert out.exit_code == 2 and "2 layers" in out.output and "3 layers" in out.output


def page_data(path: Path) -> dict[str, Any]:
    text = path.read_text(encoding="utf-8")
    start = text.index('<script type="application/json" id="explorer-data">') + len(
        '<script type="application/json" id="explorer-data">'
    )
    return json.loads(text[start : text.index("</script>", start)])


def test_a_result_of_another_model_shape_is_refused(model: Decoder, prompts, results) -> None:
    clean, _ = prompts
    d = results["heads"].to_dict()
    d["effect"] = d["effect"] + [d["effect"][0]]  # 3 layers
    with pytest.raises(ValueError, match=r"3 layers x 6 heads, but the page shows 2 layers x 6 heads"):
        Explorer(model, clean, results=[d])
    d = results["heads"].to_dict()
    d["effect"] = [row[:4] for row in d["effect"]]
    with pytest.raises(ValueError, match=r"2 layers x 4 heads"):
        check_views_fit(result_views(d), N_LAYERS, N_HEADS)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kind": "roles"}, "unknown result kind 'roles'"),
        ({"site": "nowhere"}, "'site' must be one of"),
        ({"effect": [[1.0, 2.0], [3.0]]}, "ragged"),
        ({"effect": [[1.0, "x"]]}, "must hold numbers"),
        ({"effect": [[1.0, True]]}, "must hold numbers"),
        ({"effect": []}, "must be a 2-d array"),
        ({"effect": [1.0, 2.0]}, "must be a 2-d array"),
        ({"axes": ["layer", "position"]}, "'axes' of site 'heads'"),
        ({"method": "guess"}, "'method' must be"),
        ({"clean_metric": "high"}, "must hold numbers"),
        ({"tokens": [1, 2]}, "'tokens' must be a list of strings"),
    ],
)
def test_malformed_results_name_the_field(
    results, change: dict[str, Any], message: str, tmp_path: Path
) -> None:
    d = {**results["heads"].to_dict(), **change}
    d.pop("head_patch_effect")
    with pytest.raises(ValueError, match=message):
        result_views(d)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=rf"^{path}: .*{message}"):  # the file, then the problem
        load_results(path)


def test_bad_files_are_refused_with_the_file_named(tmp_path: Path) -> None:
    cases = {
        "not-json.json": b"{not json",
        "nan.json": b'{"kind": "patching", "site": "heads", "effect": [[NaN]]}',
        "latin1.json": '{"kind": "caf\xe9"}'.encode("latin-1"),
        "empty-list.json": b"[]",
        "number.json": b"3",
        "deep.json": b"[" * 100 + b"]" * 100,
    }
    for name, data in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(ValueError, match=rf"^{path}"):
            load_results(path)
    with pytest.raises(ValueError, match="a folder, not a regular file"):
        load_results(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such result file"):
        load_results(tmp_path / "missing.json")
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="named pipe"):  # never opened, so never blocks
        load_results(fifo)
    big = tmp_path / "big.json"
    with big.open("wb") as f:
        f.truncate(MAX_RESULT_BYTES + 1)
    with pytest.raises(ValueError, match="at most 64 MB"):
        load_results(big)
    with pytest.raises(TypeError, match="results must be"):
        result_views(42)
    with pytest.raises(TypeError, match=r"results\[0\] must be"):
        result_views([42])


def test_markup_in_saved_tokens_stays_text(model: Decoder, prompts, results) -> None:
    clean, _ = prompts
    d = results["resid"].to_dict()
    d["tokens"] = ["</script><script>alert(1)</script>", *(f"<b>{i}</b>" for i in range(SEQ - 1))]
    d["metric_name"] = "<img src=x onerror=alert(2)>"
    page = Explorer(model, clean, results=[d])
    text = render_page(page.data)
    assert text.count("</script>") == 2  # the data element's and the code element's closing tags only
    assert "<img src=x" not in text and "<b>0</b>" not in text
    assert page.data["results"][0]["cols"][0] == d["tokens"][0]  # the text itself, escaped only in transit


def test_no_results_means_no_view(model: Decoder, prompts) -> None:
    clean, _ = prompts
    page = Explorer(model, clean)
    assert page.data["results"] == []
    assert 'id="view-results" class="panel" hidden' in page.html
