"""Everything else works on Llama-family decoders: trace (rotary hook points by short name), ablate,
prune_heads (whole key/value groups), head roles, importance, mixing, subspaces at the key/value-head
level, generation, and the commands (explain, heads, subspaces, patch, attribute) on SmolLM2."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from click.testing import CliRunner
from torch.testing import assert_close

import headspace as hs
from headspace import analysis


def rotary_decoder() -> hs.Decoder:
    torch.manual_seed(0)
    cfg = hs.ModelConfig(
        arch="decoder", vocab_size=41, d_model=36, n_layers=2, n_heads=6, n_kv_heads=3, d_mlp=20,
        max_seq_len=32, positions="rotary", norm_kind="rmsnorm", mlp_kind="gated", act="silu",
        qkv_bias=True, out_bias=False, mlp_bias=False, dropout=0.0, attn_dropout=0.0, emb_dropout=0.0,
    )  # fmt: skip
    return hs.Decoder(cfg).eval()


def test_trace_reaches_the_rotary_hook_points_by_short_name() -> None:
    model = rotary_decoder()
    tokens = torch.randint(0, 41, (2, 7))
    with hs.trace(model) as t:
        model(tokens)
    assert t.act("rot_q", 1).shape == (2, 7, 6, 6) and t.act("rot_k", 1).shape == (2, 7, 3, 6)
    assert_close(t.head("rot_k", 1, 5), t.act("rot_k", 1)[:, :, 2])  # query head 5 reads kv head 2
    assert "rot_q" in t.layer(0)


def test_pruning_a_whole_key_value_group_equals_ablating_it() -> None:
    model = rotary_decoder()
    tokens = torch.randint(0, 41, (2, 7))
    with hs.ablate(model, {(0, 2): "zero", (0, 3): "zero"}), torch.no_grad():
        want = model(tokens)
    hs.prune_heads(model, {0: [2, 3]})  # query heads 2 and 3 are kv head 1's whole group
    attn = model.blocks[0].attn
    assert (attn.n_heads, attn.n_kv_heads) == (4, 2)
    with torch.no_grad():
        assert_close(model(tokens), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="unequal numbers of query heads"):
        hs.prune_heads(model, {1: [0]})  # half a group


def test_analyses_run_on_a_rotary_gqa_decoder() -> None:
    model = rotary_decoder()
    tokens = torch.randint(0, 41, (2, 7))
    roles = analysis.head_roles(model, tokens)
    assert len(roles.labels) == 2 and len(roles.labels[0]) == 6
    mix = analysis.head_mixing(model, tokens)
    assert mix.mean_share.shape == (2, 6)
    imp = analysis.head_importance(model, tokens, metric="loss")
    assert imp.scores.shape == (2, 6)
    kv = analysis.subspace_overlaps(model, "k")
    assert kv.overlap.shape[-1] == 3  # key subspaces per key/value head, not per query head
    planes = analysis.rotary_planes(model, tokens)
    assert planes is not None


@pytest.fixture(scope="module")
def runner(smollm2, request):
    """A click runner whose --model smollm2 reuses the session's loaded SmolLM2."""
    from headspace.cli import loader

    mp = pytest.MonkeyPatch()
    real = loader.load_model
    for name in ("headspace.cli.lesson", "headspace.cli.causal", "headspace.cli.view", "headspace.cli.train"):
        module = importlib.import_module(name)  # (headspace.cli.view is also the name of a command)
        mp.setattr(module, "load_model", lambda spec: smollm2 if spec == "smollm2" else real(spec))
    request.addfinalizer(mp.undo)
    return CliRunner()


def _run(runner: CliRunner, args: list[str]):
    from headspace.cli import cli

    res = runner.invoke(cli, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.output


@pytest.mark.slow
def test_explain_on_smollm2_shows_the_shared_key_value_head(runner) -> None:
    sentence = "The cat sat on the mat because it was tired"
    out = json.loads(_run(runner, ["explain", "--model", "smollm2", sentence, "--token", "it", "--json"]))
    assert out["n_heads"] == 9 and out["n_kv_heads"] == 3
    args = ["explain", "--model", "smollm2", sentence, "--layer", "3", "--head", "4", "--token", "it"]
    text = _run(runner, args)
    assert "key/value head 1" in text


@pytest.mark.slow
def test_heads_and_subspaces_on_smollm2(runner, tmp_path) -> None:
    sentences = tmp_path / "s.txt"
    sentences.write_text("The cat sat on the mat.\nHeads attend to tokens.\n")
    out = _run(runner, ["heads", "--model", "smollm2", "--sentences", str(sentences), "--no-importance"])
    assert "29" in out  # the last layer is listed
    out = _run(runner, ["subspaces", "--model", "smollm2", "--layer", "2"])
    assert "W_Q subspace overlap" in out


@pytest.mark.slow
def test_patch_and_attribute_commands_on_smollm2(runner, tmp_path) -> None:
    data = json.loads(_run(runner, ["patch", "--model", "smollm2", "--json", "--out", str(tmp_path)]))
    assert len(data["head_patch_effect"]) == 30 and len(data["head_patch_effect"][0]) == 9
    assert data["clean_metric"] > data["corrupt_metric"]
    assert (tmp_path / "patch_heads.png").stat().st_size > 1000
    text = _run(runner, ["attribute", "--model", "smollm2", "The capital of France is", "--answer", " Paris"])
    assert "logit lens" in text and "top 10 heads" in text


@pytest.mark.slow
def test_explain_on_smollm2_by_default_walks_the_rotation_on_a_repeated_phrase(runner) -> None:
    from headspace.core.defaults import DECODER_SENTENCE

    out = json.loads(_run(runner, ["explain", "--model", "smollm2", "--json"]))
    assert out["sentence"] == DECODER_SENTENCE
    assert out["token_index"] == len(out["tokens"]) - 1 and out["occurrence"] == 2  # the second "cat"
    # the copying heads look at "sat", the word after the first "The cat" (and the model's next token)
    assert out["top"][0]["token"].strip("Ġ ") == "sat"
    q, q_rot = out["q"], out["q_rot"]
    assert len(q_rot) == out["d_head"] == 64 and out["rope_theta"] == 100000.0 and out["rotary_dim"] == 64
    assert abs(sum(v * v for v in q) - sum(v * v for v in q_rot)) < 1e-3 * sum(v * v for v in q)
    text = _run(runner, ["explain", "--model", "smollm2"])
    assert "2b. rotary positions (RoPE, base 100000)" in text and "q_rot = q R(15)" in text
    assert "scores q_rot.k_rot_j / sqrt(64)" in text and "shared by query heads" in text
    # a sentence of one's own: a decoder follows its last token
    mine = json.loads(_run(runner, ["explain", "--model", "smollm2", "One two three four", "--json"]))
    assert mine["token_index"] == len(mine["tokens"]) - 1


@pytest.mark.slow
def test_subspaces_on_smollm2_shows_the_rotary_planes(runner) -> None:
    from headspace.analysis.rotary import LABELS

    data = json.loads(_run(runner, ["subspaces", "--model", "smollm2", "--layer", "4", "--json"]))
    planes = data["rotary_planes"]
    assert planes["split_tokens"] > 50 and [r["layer"] for r in planes["layers"]] == [4]
    row = planes["layers"][0]
    assert len(row["wavelengths"]) == 32 and len(row["share"]) == 9 and len(row["share"][0]) == 32
    for h in range(9):  # each head's shares of |score| add up to 1, slow + fast too
        assert abs(sum(row["share"][h]) + row["passthrough"][h] - 1) < 1e-9
        assert abs(row["slow"][h] + row["fast"][h] - 1) < 1e-9 and row["labels"][h] in LABELS
    text = _run(runner, ["subspaces", "--model", "smollm2", "--layer", "4"])
    assert "rotary planes" in text and "most positional head" in text


@pytest.mark.slow
def test_smollm2_tokens_are_printed_readably_everywhere(runner, smollm2, tmp_path, monkeypatch) -> None:
    """Byte-level BPE's "Ġcat" prints as "␣cat" in explain, its pictures, heads' pattern grid, attribute,
    patch and the explorer's labels; --json keeps the API's strings."""
    from headspace.viz import plots
    from headspace.viz.explorer import Explorer

    labels: dict[str, list[str]] = {}

    def keep(name):
        def fake(*args, **kwargs):
            labels[name] = list(kwargs.get("row_labels") or args[1])
            return tmp_path / f"{name}.png"

        return fake

    for name in ("plot_pattern", "plot_attention_row", "plot_vectors", "plot_pattern_grid"):
        monkeypatch.setattr(plots, name, keep(name))
    sentence = "The cat sat on the mat.\nThe cat"
    text = _run(runner, ["explain", "--model", "smollm2", sentence, "--out", str(tmp_path), "--top", "2"])
    assert "Ġ" not in text and "Ċ" not in text
    assert "tokens: The ␣cat ␣sat ␣on ␣the ␣mat . ↵ The ␣cat" in text
    assert "for token 9 '␣cat'" in text
    for name in ("plot_pattern", "plot_attention_row", "plot_vectors"):
        assert labels[name] == ["The", "␣cat", "␣sat", "␣on", "␣the", "␣mat", ".", "↵", "The", "␣cat"], name
    data = json.loads(_run(runner, ["explain", "--model", "smollm2", sentence, "--json"]))
    assert data["tokens"][1] == "Ġcat" and data["tokens"][7] == "Ċ"  # the tokenizer's own pieces
    _run(runner, ["heads", "--model", "smollm2", "A cat sat.", "--no-importance", "--out", str(tmp_path)])
    assert labels["plot_pattern_grid"] == ["A", "␣cat", "␣sat", "."]
    text = _run(runner, ["attribute", "--model", "smollm2", "The capital of France is", "--answer", " Paris",
                         "--other", " London", "--top", "2"])  # fmt: skip
    assert "logit('␣Paris') - logit('␣London')" in text and "' Paris'" not in text and "Ġ" not in text
    assert "top: '␣" in text
    clean, corrupt = "When Mary and John went, John gave it to", "When Mary and John went, Mary gave it to"
    args = [
        "patch",
        "--model",
        "smollm2",
        "--clean",
        clean,
        "--corrupt",
        corrupt,
        "--site",
        "resid",
        "--top",
        "3",
    ]
    text = _run(runner, args)
    assert "metric logit('␣Mary') - logit('␣John'):" in text and "Ġ" not in text
    assert "pos 6 '␣John'" in text  # the position where the prompts differ
    page = Explorer(smollm2, "The cat sat")
    assert page.data["tokens"] == ["The", "␣cat", "␣sat"]


@pytest.mark.slow
def test_attribute_ranks_count_from_one(runner, smollm2, tmp_path) -> None:
    """The answer's rank in attribute's table and --json is 1 for the top token (LogitLens counts from 0);
    the explorer reads the command's file to the same page as the LogitLens object's."""
    from headspace.analysis.attribution import logit_lens
    from headspace.viz.explorer import load_results, result_views

    prompt = "The capital of France is"
    lens = logit_lens(smollm2, prompt, " Paris")
    data = json.loads(
        _run(runner, ["attribute", "--model", "smollm2", prompt, "--answer", " Paris", "--json"])
    )
    ranks = [row["answer_rank"] for row in data["logit_lens"]]
    assert ranks == [int(r) + 1 for r in lens.answer_rank[0]]
    assert ranks[-1] == 1  # SmolLM2's own prediction is " Paris"
    text = _run(runner, ["attribute", "--model", "smollm2", prompt, "--answer", " Paris", "--top", "1"])
    last = [line for line in text.splitlines() if line.strip().startswith("layer 29")]
    assert last and "answer rank      1  " in last[0]
    (tmp_path / "attribute.json").write_text(json.dumps(data))
    _, from_cli = load_results(tmp_path / "attribute.json")
    (from_api,) = result_views(lens)
    assert from_cli["notes"] == from_api["notes"]


@pytest.mark.slow
def test_heads_on_smollm2_shows_each_heads_induction_score(runner, smollm2) -> None:
    """A decoder's heads table has the induction score (JSON roles.induction, null before), the score of
    analysis.induction_scores; heads reaching the threshold are labelled induction."""
    data = json.loads(_run(runner, ["heads", "--model", "smollm2", "--no-importance", "--json"]))
    roles = data["roles"]
    expected = analysis.induction_scores(smollm2)
    assert (
        roles["induction"] is not None and len(roles["induction"]) == 30 and len(roles["induction"][0]) == 9
    )
    assert_close(torch.tensor(roles["induction"]), expected)
    strong = [(i, h) for i in range(30) for h in range(9) if float(expected[i, h]) >= roles["threshold"]]
    assert strong and all(roles["labels"][i][h] == "induction" for i, h in strong)
    text = _run(runner, ["heads", "--model", "smollm2", "--no-importance"])
    header = next(line for line in text.splitlines() if "entropy" in line)
    assert "induction" in header and "|W_O[h]|" in header
    minilm = json.loads(_run(runner, ["heads", "--no-importance", "--json"]))
    assert minilm["roles"]["induction"] is None  # an encoder: no induction score


@pytest.mark.slow
def test_generate_continues_a_prompt_with_a_pretrained_decoder(runner, smollm2, monkeypatch) -> None:
    """generate --model smollm2 "PROMPT" (the run-folder form is tests/cli/test_train_cli.py's)."""
    from headspace.cli import cli

    monkeypatch.setenv("HEADSPACE_NATIVE", "0")  # no background build of the native step for 4 tokens
    prompt = "The capital of France is"
    out = _run(runner, ["generate", "--model", "smollm2", prompt, "--tokens", "4", "--temperature", "0"])
    assert out == smollm2.generate(prompt, 4, temperature=0) + "\n"
    assert out.startswith(prompt + " Paris")
    same = _run(
        runner, ["generate", "--model", "smollm2", "--prompt", prompt, "--tokens", "4", "--temperature", "0"]
    )
    assert same == out
    for args, needle in [
        (["generate", "--model", "smollm2", "a", "--prompt", "b"], "give the prompt once"),
        (["generate", "--model", "smollm2"], "give the text to continue"),
        (["generate", "--model", "smollm2", " "], "the prompt is empty"),
        (["generate"], "give a training run folder"),
    ]:
        res = runner.invoke(cli, args)
        assert res.exit_code == 2, res.output
        assert needle in res.output and len(res.output.strip().splitlines()) == 1
