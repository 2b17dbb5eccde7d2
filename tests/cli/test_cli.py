"""The ``headspace`` command: in-process (click's runner) and as a subprocess, on the bundled MiniLM."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import headspace
from headspace.analysis.explain import DEFAULT_SENTENCE, explain, record, tokenize_one
from headspace.cli import causal as cli_causal
from headspace.cli import cli
from headspace.cli import lesson as cli_lesson
from headspace.cli import loader as cli_loader


@pytest.fixture(scope="module")
def minilm():
    return headspace.load("minilm")


@pytest.fixture()
def runner(minilm, monkeypatch):
    """A click runner whose --model minilm reuses the module's loaded model (loading once is enough)."""
    real = cli_lesson.load_model
    monkeypatch.setattr(cli_lesson, "load_model", lambda spec: minilm if spec == "minilm" else real(spec))
    return CliRunner()


def _run(runner: CliRunner, args: list[str]):
    return runner.invoke(cli, args, catch_exceptions=False)


def test_explain_default_names_top_heads_and_real_shapes(runner, minilm):
    res = _run(runner, ["explain"])
    assert res.exit_code == 0, res.output
    e = explain(minilm)
    out = res.output
    cfg = minilm.model.config
    # the shapes printed are the model's dimensions
    assert f"[{cfg.d_model}]" in out
    assert f"W_Q[{e.head}]: [{cfg.d_model}, {cfg.d_model // cfg.n_heads}]" in out
    assert f"[{cfg.n_heads} x {e.d_head} = {cfg.n_heads * e.d_head}]" in out
    # two labelled groups, relational heads first, each head with its role and top attended tokens
    assert out.index("relational heads") < out.index("positional heads") < out.index(f"Layer {e.layer}")
    for f in e.relational[:3]:
        assert f.focus_token in out and f"{f.flow:.3f}" in out
    for f in e.positional[:3]:
        assert f"{f.top[0].weight:.3f}" in out
    assert "previous" in out and "first" in out  # layer 0 head 2 -> "because", [CLS] sinks
    assert f"Layer {e.layer}, head {e.head} for token 10 'it'" in out  # no GQA: no key/value head note
    assert "key/value head" not in out
    # the key and value biases carry the key/value head's index, as b_Q carries the head's
    assert f"+ b_Q[{e.head}]" in out
    g = e.kv_head
    assert f"k_j = x_j W_K[{g}] + b_K[{g}], v_j = x_j W_V[{g}] + b_V[{g}] for every token j" in out
    assert "'it'" in out


def test_default_walk_is_a_head_that_sends_it_to_animal(minilm):
    """The lesson's point (README): layer 5 head 11 and layer 3 head 1 resolve "it" to "animal"; the
    previous-token head 0.2 and the [CLS] sinks must not crowd them out of the default walk."""
    e = explain(minilm)
    assert e.token == "it"
    assert (e.layer, e.head) in {(5, 11), (3, 1)}
    assert e.top[0].token == "animal"
    for layer, head in [(5, 11), (3, 1)]:
        walked = explain(minilm, layer=layer, head=head)
        assert walked.top[0].token == "animal" and walked.top[0].weight > 0.6
        f = next(f for f in e.ranking if (f.layer, f.head) == (layer, head))
        assert f.role == "relational" and f.focus_token == "animal"
        assert f in e.relational[:5]
    roles = {(f.layer, f.head): f.role for f in e.ranking}
    assert roles[(0, 2)] == "previous"  # "it" -> "because" at 1.00
    assert roles[(1, 8)] == "next"  # "it" -> "was"
    assert roles[(2, 11)] == "first"  # [CLS]


def test_explain_json_holds_the_api_numbers(runner, minilm):
    res = _run(runner, ["explain", "--json", "--layer", "3", "--head", "1"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    e = explain(minilm, layer=3, head=1)
    assert data["layer"] == 3 and data["head"] == 1 and data["token"] == "it"
    for key in ("x", "q", "k", "v", "pattern", "z", "concat", "out", "head_shares"):
        assert data[key] == getattr(e, key), key
    assert data["top"][0]["token"] == e.top[0].token
    assert data["shapes"]["q"] == [32] and data["shapes"]["x"] == [384]
    # the ranking as the terminal shows it (5 per group), every entry with its role
    shown = [*e.relational[:5], *e.positional[:5]]
    assert [(r["layer"], r["head"], r["role"]) for r in data["ranking"]] == [
        (f.layer, f.head, f.role) for f in shown
    ]
    assert data["positional"] == [[f.layer, f.head] for f in e.positional]
    assert (data["token_index"], data["occurrence"], data["occurrences"]) == (10, 1, [10])


def test_explain_says_which_occurrence_and_takes_another(runner, minilm):
    res = _run(runner, ["explain", "--token", "the", "--layer", "0", "--head", "2"])
    assert res.exit_code == 0, res.output
    assert "'the' occurs 2 times (positions 1, 7): this is occurrence 1, position 1" in res.output
    assert "--occurrence N" in res.output
    res = _run(runner, ["explain", "--token", "the", "--occurrence", "2", "--json", "--top", "1"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert (data["token_index"], data["occurrence"], data["occurrences"]) == (7, 2, [1, 7])
    assert data["tokens"][7] == "the" and len(data["ranking"]) == 2
    assert data["q"] == explain(minilm, token="the", occurrence=2, layer=data["layer"], head=data["head"]).q


def test_explain_checks_the_head_against_a_pruned_layer():
    pretrained = headspace.load("minilm")  # a copy of its own: this test prunes it
    headspace.prune_heads(pretrained, {0: list(range(6))})
    with pytest.raises(ValueError, match=r"head 8 is out of range: layer 0 has heads 0\.\.5"):
        explain(pretrained, layer=0, head=8)
    e = explain(pretrained, layer=0, head=5)
    assert (e.n_heads, len(e.head_shares)) == (6, 6)
    assert explain(pretrained, layer=1, head=8).n_heads == 12


def test_explain_numbers_follow_the_formula(minilm):
    """Every stage equals the textbook formula applied to the layer's own weights."""
    e = explain(minilm, layer=2, head=5)
    attn = minilm.model.blocks[2].attn
    W_Q, W_O = attn.W_Q.detach(), attn.W_O.detach()
    x = torch.tensor(e.x)
    q = x @ W_Q[5] + attn.b_Q[5].detach()
    torch.testing.assert_close(torch.tensor(e.q), q)
    k = torch.tensor(e.k)
    scores = k @ q / math.sqrt(attn.d_head)
    torch.testing.assert_close(torch.tensor(e.scores), scores, rtol=1e-5, atol=1e-4)  # dot of 32 terms ~10
    p = torch.softmax(torch.tensor(e.scores), dim=0)
    torch.testing.assert_close(torch.tensor(e.pattern), p)
    z = p @ torch.tensor(e.v)
    torch.testing.assert_close(torch.tensor(e.z), z)
    concat = torch.tensor(e.concat)  # (n_heads * d_head,)
    out = concat @ W_O.reshape(-1, attn.d_model) + attn.b_O.detach()
    torch.testing.assert_close(torch.tensor(e.out), out, rtol=1e-5, atol=1e-4)
    assert math.isclose(sum(e.head_shares), 1.0, rel_tol=1e-5)
    # and the attention output the model computes for this token is the same
    ids, pad = tokenize_one(minilm, DEFAULT_SENTENCE)
    outputs = []
    handle = attn.register_forward_hook(lambda m, a, o: outputs.append(o))
    try:
        with torch.inference_mode():
            minilm.model(ids, pad)
    finally:
        handle.remove()
    torch.testing.assert_close(outputs[0][0, e.token_index], torch.tensor(e.out))


def test_explain_pictures(runner, tmp_path):
    from PIL import Image

    res = _run(runner, ["explain", "--layer", "5", "--head", "11", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    names = sorted(p.name for p in tmp_path.glob("*.png"))
    assert names == sorted(
        [
            "explain_L5_H11_pattern.png",
            "explain_L5_H11_row.png",
            "explain_L5_H11_qkvz.png",
            "explain_L5_wo_shares.png",
        ]
    )
    for name in names:
        with Image.open(tmp_path / name) as im:
            im.verify()
        with Image.open(tmp_path / name) as im:
            w, h = im.size
            assert 300 <= w <= 2500 and 200 <= h <= 2500, (name, im.size)


def test_heads_json_matches_analysis_and_draws_grid(runner, minilm, tmp_path):
    from headspace.analysis import head_roles, wo_norms

    res = _run(
        runner, ["heads", "A cat sat on the mat.", "--no-importance", "--json", "--out", str(tmp_path)]
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    roles = head_roles(minilm, ["A cat sat on the mat."])
    assert data["roles"]["labels"] == roles.labels
    assert data["wo_norm"] == wo_norms(minilm).tolist()
    assert (tmp_path / "heads_patterns.png").is_file()


def test_heads_table_with_importance(runner, tmp_path):
    f = tmp_path / "s.txt"
    f.write_text("The dog barked.\nShe gave him the book.\n", encoding="utf-8")
    res = _run(runner, ["heads", "--sentences", str(f)])
    assert res.exit_code == 0, res.output
    assert "importance" in res.output and "entropy" in res.output
    assert res.output.count("\n") > 72  # one row per head (6 x 12)


@pytest.mark.slow
def test_subspaces_json_matches_analysis(runner, minilm, tmp_path):
    from headspace.analysis import subspace_overlaps

    res = _run(runner, ["subspaces", "--layer", "1", "--json", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    ov = subspace_overlaps(minilm, "q")
    (layer,) = data["layers"]
    assert layer["layer"] == 1
    torch.testing.assert_close(torch.tensor(layer["overlap"]), ov.overlap[1])
    assert layer["random_expected"] == pytest.approx(float(ov.random_expected[1]))
    assert {p.name for p in tmp_path.glob("*.png")} == {"subspaces_L1_q.png", "subspaces_L1_spectra.png"}


def test_subspaces_table_says_a_single_key_value_head_has_no_pair():
    """Gemma 3's one key/value head: --which k has no two distinct heads to compare; the table says so
    (before: 'nan' and the pair 'H0-H0 nan')."""
    from rich.console import Console

    from headspace.analysis import circuit_spectra, subspace_overlaps

    torch.manual_seed(0)
    cfg = headspace.ModelConfig(
        arch="decoder", vocab_size=11, d_model=16, n_layers=1, n_heads=4, n_kv_heads=1
    )
    model = headspace.Decoder(cfg)
    console = Console(width=200, record=True)
    for which, want in (("k", "- (1 head)"), ("q", "H")):
        ov = subspace_overlaps(model, which)
        console.print(cli_lesson._subspaces_table("tiny", [0], which, ov, circuit_spectra(model)))
        out = console.export_text()
        assert "nan" not in out and want in out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["explain", "--model", "nosuchmodel"], "unknown model 'nosuchmodel'"),
        (["explain", "--token", "zebra"], "token 'zebra' is not in the sentence; its tokens are: 0:[CLS]"),
        (["explain", "--layer", "6"], "layer 6 is out of range: valid layers are 0..5"),
        (["explain", "--head", "12"], "head 12 is out of range: valid heads are 0..11"),
        (["subspaces", "--layer", "-1"], "layer -1 is out of range: valid layers are 0..5"),
        (
            ["heads", "--sentences", "/nonexistent/sentences.txt"],
            "cannot read sentences file /nonexistent/sentences.txt",
        ),
        (
            ["heads", "--sentences", "/dev/zero"],
            "cannot read sentences file /dev/zero: a character device, not a regular file "
            "(only regular files of at most 16 MB are read)",
        ),
        (
            ["explain", "--token", "the", "--occurrence", "3"],
            "--occurrence 3 of 'the' is out of range: it occurs 2 time(s) "
            "(1 at position 1, 2 at position 7); valid occurrences are 1..2",
        ),
        (["explain", "--occurrence", "0"], "--occurrence must be a positive integer (1 or more); got 0"),
        (["explain", "--token", "3", "--occurrence", "1"], "--occurrence needs --token as text"),
        (["explain", "--top", "-3"], "--top must be a positive integer (1 or more); got -3"),
        (["explain", "--top", "0"], "--top must be a positive integer (1 or more); got 0"),
        (["explain", "\udcff"], "argument 2 is not valid UTF-8 text (its bytes: b'\\xff')"),
        (["explain", "--token", "caf\udce9"], "argument 3 is not valid UTF-8 text (its bytes: b'caf\\xe9')"),
        (["bench", "--repeats", "0"], "--repeats must be a positive integer; got 0"),
        (["explain", "--out", "/proc/x"], "--out /proc/x: cannot write in the folder '/proc'"),
        (
            ["explain", "--out", "/dev/null/x"],
            "--out /dev/null/x: cannot write in the folder '/dev/null' (Not a",
        ),
        (["heads", "--out", "/proc/x"], "--out /proc/x: cannot write in the folder '/proc'"),
        (["subspaces", "--out", "/dev/null/x"], "--out /dev/null/x: cannot write in the folder '/dev/null'"),
        (["explain", ""], "SENTENCE is empty (''); give at least one word (or leave it out for the default"),
        (["explain", " \t"], "SENTENCE is empty (' \\t'); give at least one word"),
        (["heads", ""], "SENTENCE is empty (''); give at least one word"),
        (["explain", "--token", ""], "--token is empty (''); give a token of the sentence or its index"),
    ],
    ids=lambda v: " ".join(v).encode("ascii", "backslashreplace").decode() if isinstance(v, list) else "",
)
def test_errors_are_one_line_exit_2(runner, args, needle):
    res = runner.invoke(cli, args)
    assert res.exit_code == 2, res.output
    assert needle in res.output
    assert "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1


@pytest.mark.slow
def test_subprocess_json_and_error():
    exe = [sys.executable, "-m", "headspace"]
    ok = subprocess.run(
        [*exe, "explain", "--json", "--top", "3"], capture_output=True, text=True, timeout=300
    )
    assert ok.returncode == 0, ok.stderr
    data = json.loads(ok.stdout)
    assert data["tokens"][data["token_index"]] == "it" and len(data["ranking"]) == 6  # 3 per group
    assert [r["role"] for r in data["ranking"]][:3] == ["relational"] * 3
    bad = subprocess.run(
        [*exe, "explain", "--model", "nosuchmodel"], capture_output=True, text=True, timeout=300
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().startswith("error: unknown model 'nosuchmodel'")
    assert "Traceback" not in bad.stderr


def test_load_model_reads_a_folder(tmp_path):
    """--model PATH: a folder without config.json or of another model type is a clear error."""
    with pytest.raises(cli_loader.UsageError, match=r"has no config\.json"):
        cli_loader.load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(
        cli_loader.UsageError, match=r"model_type 'mamba' is not supported; supported: \[.*'bert'.*'gpt2'"
    ):
        cli_loader.load_model(str(tmp_path))
    assert Path(headspace.pretrained.minilm_path()).is_dir()
    pm = cli_loader.load_model(str(headspace.pretrained.minilm_path()))
    assert pm.model.config.n_layers == 6


def test_record_matches_need_weights(minilm):
    ids, pad = tokenize_one(minilm, "Heads attend.")
    rec = record(minilm.model, lambda: minilm.model(ids, pad))
    x = rec["input"][0]
    _, pattern = minilm.model.blocks[0].attn(x, key_padding=pad, need_weights=True)
    torch.testing.assert_close(rec["pattern"][0], pattern.detach())


@pytest.mark.slow
def test_bench_runs_at_given_sizes(runner):
    res = _run(
        runner,
        ["bench", "--seq", "8", "--seq", "16", "--batch", "1", "--repeats", "1", "--no-memory", "--json"],
    )
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)
    assert {r["seq"] for r in rows} == {8, 16}
    assert all(r["batch"] == 1 for r in rows)
    bad = runner.invoke(cli, ["bench", "--seq", "0"])
    assert bad.exit_code == 2 and "--seq must be a positive integer; got 0" in bad.output


def test_non_utf8_argument_from_the_shell_is_one_line():
    """``headspace explain $'\\xff'``: the shell passes a byte that is not UTF-8 (Python keeps it as a
    surrogate escape, which the tokenizer cannot take)."""
    bad = subprocess.run(
        [sys.executable, "-m", "headspace", "explain", b"\xff"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.strip() == (
        "error: argument 2 is not valid UTF-8 text (its bytes: b'\\xff'); pass every argument in UTF-8"
    )


def test_unwritable_out_is_checked_before_the_model_loads(minilm, monkeypatch, tmp_path):
    def no_load(spec):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(cli_lesson, "load_model", no_load)
    for cmd in ("explain", "heads", "subspaces"):
        res = CliRunner().invoke(cli, [cmd, "--out", "/proc/x/pics"])
        assert res.exit_code == 2, res.output
        assert res.output.startswith("error: --out /proc/x/pics: cannot write in the folder '/proc' (")
        assert len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output
    (tmp_path / "file").write_text("x")
    # a folder that can be written is created when the pictures are written, and the probe leaves nothing
    monkeypatch.setattr(cli_lesson, "load_model", lambda spec: minilm)
    res = CliRunner().invoke(cli, ["subspaces", "--layer", "0", "--json", "--out", str(tmp_path / "a" / "b")])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "file"]
    assert sorted(p.name for p in (tmp_path / "a" / "b").iterdir()) == [
        "subspaces_L0_q.png",
        "subspaces_L0_spectra.png",
    ]


@pytest.mark.slow
def test_spectra_picture_tells_qk_from_ov_for_every_head(runner, minilm, monkeypatch, tmp_path):
    """One panel per head, titled with the head, two labelled lines (QK, OV), one legend, labelled axes."""
    from headspace.viz import plots

    figures = {}
    real_save = plots._save

    def keep(fig, path):
        figures[Path(path).name] = (
            [
                {
                    "title": ax.get_title(),
                    "lines": [line.get_label() for line in ax.get_lines()],
                }
                for ax in fig.axes
                if ax.get_lines()
            ],
            [t.get_text() for leg in fig.legends for t in leg.get_texts()],
            (
                fig._supxlabel.get_text() if fig._supxlabel else "",
                fig._supylabel.get_text() if fig._supylabel else "",
            ),
        )
        return real_save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    res = _run(runner, ["subspaces", "--layer", "2", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    panels, legend, (xlabel, ylabel) = figures["subspaces_L2_spectra.png"]
    assert len(panels) == 12
    for h, panel in enumerate(panels):
        assert panel["title"].startswith(f"H{h} ") and "eff. rank" in panel["title"]
        assert panel["lines"] == ["QK = W_Q W_K^T", "OV = W_V W_O"]
    assert legend == ["QK = W_Q W_K^T", "OV = W_V W_O"]
    assert "singular value index" in xlabel and "singular value" in ylabel


@pytest.mark.slow
def test_registered_shapes_are_the_models_own(minilm, smollm2):
    """registry.SHAPES lets the CLI check --layer/--head before loading: it must be the loaded shapes."""
    from headspace.pretrained.registry import MODELS, SHAPES, registered_shape

    assert set(SHAPES) == set(MODELS)
    for name, model in (("minilm", minilm), ("smollm2", smollm2)):
        cfg = model.model.config
        assert SHAPES[name] == (cfg.n_layers, cfg.n_heads), name
        assert registered_shape(name.upper()) == SHAPES[name]
    assert registered_shape("./minilm") is None and registered_shape("/some/folder") is None


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["explain", "--model", "smollm2", "--layer", "99"],
            "layer 99 is out of range: valid layers are 0..29",
        ),
        (["explain", "--model", "smollm2", "--head", "9"], "head 9 is out of range: valid heads are 0..8"),
        (["explain", "--layer", "6"], "layer 6 is out of range: valid layers are 0..5"),
        (
            ["subspaces", "--model", "smollm2", "--layer", "30"],
            "layer 30 is out of range: valid layers are 0..29",
        ),
    ],
)
def test_layer_and_head_are_checked_before_a_registered_model_loads(monkeypatch, args, needle):
    def no_load(spec):
        raise AssertionError(f"{spec} was loaded before --layer/--head were checked")

    monkeypatch.setattr(cli_lesson, "load_model", no_load)
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    assert res.output.strip() == f"error: {needle}"


@pytest.mark.parametrize(
    ("given", "meant"), [("smolm2", "smollm2"), ("SmolLM", "smollm2"), ("minlm", "minilm")]
)
def test_a_misspelled_model_name_suggests_the_registered_one(given, meant):
    res = CliRunner().invoke(cli, ["explain", "--model", given])
    assert res.exit_code == 2, res.output
    line = res.output.strip()
    assert line.startswith(f"error: unknown model {given!r} (did you mean {meant!r}?); known models:")
    assert len(line.splitlines()) == 1
    with pytest.raises(ValueError, match=rf"did you mean {meant!r}\?"):
        headspace.load(given)
    with pytest.raises(ValueError) as info:
        headspace.load("nosuchmodel")
    assert "did you mean" not in str(info.value)


def test_every_model_option_says_what_load_accepts():
    """One help string for every command's --model: the registered names, every folder model type load()
    reads, and GGUF files (heads --help used to offer 'minilm or a folder (BERT, GPT-2)' only)."""
    from headspace.cli.options import MODEL_HELP
    from headspace.pretrained.registry import FOLDER_LOADERS, MODELS

    shown = {"bert": "BERT", "gpt2": "GPT-2", "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}
    shown |= {
        "qwen3": "Qwen3",
        "gemma2": "Gemma 2",
        "gemma3_text": "Gemma 3",
        "olmo2": "OLMo 2",
        "smollm3": "SmolLM3",
        "mixtral": "Mixtral",
        "qwen2_moe": "Qwen2-MoE",
        "qwen3_moe": "Qwen3-MoE",
        "olmoe": "OLMoE",
        "gpt_oss": "gpt-oss",
        "qwen3_next": "Qwen3-Next",  # issue 39's hybrids
        "qwen3_5_text": "Qwen3.5",
        "llama4_text": "Llama 4",  # issue 39
        "diffllama": "DiffLlama",
    }
    shown |= {"t5": "T5", "bart": "BART", "marian": "Marian", "whisper": "Whisper"}  # Python only (#40)
    shown |= {  # issue 38's rotary families
        "phi3": "Phi-3", "gemma": "Gemma,", "granite": "Granite", "olmo": "OLMo,", "olmo3": "OLMo 3",
        "exaone4": "EXAONE 4", "seed_oss": "Seed-OSS", "gpt_neox": "GPT-NeoX", "stablelm": "StableLM",
        "cohere": "Cohere", "phi": "Phi-2", "gptj": "GPT-J", "opt": "OPT", "gpt_neo": "GPT-Neo",
        "gpt_bigcode": "GPT-BigCode", "roberta": "RoBERTa", "xlm-roberta": "XLM-RoBERTa",
        "camembert": "CamemBERT", "modernbert": "ModernBERT", "falcon": "Falcon", "bloom": "BLOOM",
        "mpt": "MPT", "gemma4_text": "Gemma 4", "gemma3n_text": "Gemma 3n", "deepseek_v2": "DeepSeek V2",
        "deepseek_v3": "and V3",
    }  # fmt: skip
    assert set(FOLDER_LOADERS) <= set(shown), "a new folder model type: name it in MODEL_HELP"
    for kind in FOLDER_LOADERS:
        assert shown[kind] in MODEL_HELP, kind
    for name in MODELS:
        assert f"'{name}'" in MODEL_HELP, name
    assert ".gguf file" in MODEL_HELP
    with_model = {}
    for name, command in cli.commands.items():
        for param in command.params:
            if "--model" in getattr(param, "opts", []):
                with_model[name] = param.help
    assert {"explain", "heads", "subspaces", "view", "patch", "attribute"} <= set(with_model)
    for name, text in with_model.items():
        assert text.startswith(MODEL_HELP), name
    assert "decoder" in with_model["patch"].removeprefix(MODEL_HELP)
    res = CliRunner().invoke(cli, ["heads", "--help"])
    assert res.exit_code == 0 and "Qwen2" in res.output and "smollm2" in res.output


def test_load_reads_a_gguf_file_and_refuses_other_files(tmp_path, monkeypatch):
    from headspace.pretrained import registry

    calls = []
    monkeypatch.setattr(registry, "load_gguf", lambda path, precision: calls.append((path, precision)) or "m")
    (tmp_path / "tiny.GGUF").write_bytes(b"GGUF")
    assert headspace.load(tmp_path / "tiny.GGUF", precision="bfloat16") == "m"
    assert calls == [(tmp_path / "tiny.GGUF", "bfloat16")]
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"is a file, not a model folder: .*a \.gguf file"):
        headspace.load(str(tmp_path / "notes.txt"))


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["patch", "--answer", " Mary", "--other", " Mary"],
            "--answer and --other are the same token (' Mary'): logit(answer) - logit(other) is then 0",
        ),
        (
            ["patch", "--clean", "When Mary left", "--corrupt", "When Mary left"],
            "--clean and --corrupt are the same prompt ('When Mary left'): patching one into the other "
            "changes nothing",
        ),
        (
            ["attribute", "The capital of France is", "--answer", " Paris", "--other", " Paris"],
            "--answer and --other are the same token (' Paris')",
        ),
    ],
)
def test_patch_and_attribute_refuse_pairs_that_measure_nothing(monkeypatch, args, needle):
    """Before: every effect +0.000 and exit 0. Refused before the model loads."""

    def no_load(spec):
        raise AssertionError("the model was loaded before the pair was checked")

    monkeypatch.setattr(cli_causal, "load_model", no_load)
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    line = res.output.strip()
    assert line.startswith(f"error: {needle}") and len(line.splitlines()) == 1
