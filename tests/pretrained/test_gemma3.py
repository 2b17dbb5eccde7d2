"""Gemma-3-270M on headspace's layers against transformers' Gemma3ForCausalLM on the same GGUF file.

Reference: ``Gemma3ForCausalLM.from_pretrained(folder, gguf_file=..., dtype=torch.float32)`` with eager
attention, on the four chunks concatenated (tests/conftest.py loads it once per session). headspace reads
the chunks itself (``load("gemma3")``: found through package metadata, SHA-256 checked). Tolerances, from
the issue: logits <= 1e-3 max abs, on an input longer than the sliding window (>= 1,400 tokens, where the
15 sliding layers and the 3 full ones differ) and on a left-padded batch; every head's pattern <= 5e-5.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

import headspace as hs
from headspace.pretrained.gguf_format import GGUFError, read_gguf

pytestmark = pytest.mark.slow  # the whole module (pyproject.toml: -m slow runs it)

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n\treturn fibonacci(n - 1) + fibonacci(n - 2)",
    "Les feuilles mortes se ramassent à la pelle; Ñandú, naïve café, Straße",
    "東京は日本の首都です。 Москва — столица России.",
    "Emoji 🙂🚀👩‍💻 and    spaces\tand tabs\n\n\nand newlines",
    "<start_of_turn>user\nWhat is 2 + 2?<end_of_turn>\n<start_of_turn>model\n",
    "  leading spaces, 1234567890 and 3.14159, <unused0> and <bos> in text",
    "A",
]


def _long_ids(model, n: int) -> torch.Tensor:
    """[1, n] token ids of real text (the standard library's json package source), longer than a window."""
    text = "".join(p.read_text(encoding="utf-8") for p in sorted(Path(json.__file__).parent.glob("*.py")))
    ids, _ = model.tokenize_padded([text])  # [1, seq]
    assert ids.shape[1] >= n
    return ids[:, :n]


def test_gemma3_is_the_documented_model(gemma3) -> None:
    from headspace.pretrained.registry import registered_shape

    c = gemma3.config
    assert registered_shape("gemma3") == registered_shape("Gemma3-270M") == (c.n_layers, c.n_heads)
    assert (c.n_layers, c.n_heads, c.n_kv_heads, c.d_model, c.d_head, c.d_mlp) == (18, 4, 1, 640, 256, 2048)
    assert c.vocab_size == 262144 and c.sliding_window == 512 and c.qk_norm == "head"
    assert [i for i, t in enumerate(c.layer_types) if t == "full"] == [5, 11, 17]
    assert c.rope_local_theta == 10000.0 and c.rope_theta == 1e6 and c.query_pre_attn_scalar == 256
    attn = gemma3.model.blocks[0].attn
    assert attn.W_Q.shape == (4, 640, 256) and attn.W_K.shape == (1, 640, 256)
    # one key/value head for the four query heads: every head's W_K is the same storage
    assert {attn.heads[h].W_K.data_ptr() for h in range(4)} == {attn.W_K[0].data_ptr()}


def test_weights_equal_transformers(gemma3, gemma3_hf) -> None:
    """Every tensor, bit for bit: dequantisation, norms stored as 1 + w, W_Q / W_K rows not permuted."""
    from headspace.pretrained.llama import _layout

    ref = gemma3_hf.state_dict()
    ours = gemma3.model.state_dict()
    for name, theirs in _layout(gemma3.config, "model."):
        want = torch.cat([ref[n] for n in theirs]) if len(theirs) > 1 else ref[theirs[0]]
        assert torch.equal(ours[name], want), name


def test_tokenizer_ids_equal_transformers(gemma3, gemma3_hf_tokenizer) -> None:
    for text in TEXTS:
        want = gemma3_hf_tokenizer(text).input_ids
        got = gemma3.tokenizer.encode_ids([text])[0]
        assert got == want, text
        assert got[0] == 2  # BOS added, as the file says
        assert gemma3_hf_tokenizer.decode(got, skip_special_tokens=True) == gemma3.tokenizer.decode(got)


def test_logits_longer_than_the_window_equal_transformers(gemma3, gemma3_hf) -> None:
    """1,400 tokens: the logits of the last 160 positions (each 888+ tokens past the window, where the 15
    sliding layers and the 3 full ones differ; the 262,144-row unembedding of all 1,400 would dominate
    the test's time) and every head's whole pattern."""
    ids = _long_ids(gemma3, 1400)
    keep = 160
    with torch.no_grad():
        want = gemma3_hf(ids, output_attentions=True, logits_to_keep=keep)
        with hs.trace(gemma3.model, names="*.attn.hook_pattern") as t:
            h = gemma3.model.hidden_states(ids)  # [1, 1400, 640]
        got = h[:, -keep:] @ gemma3.model.tok_embed.weight.T  # [1, keep, vocab]: the tied unembedding
    assert want.logits.shape == got.shape
    assert (got - want.logits).abs().max() <= 1e-3
    worst = max(float((t.pattern(i) - want.attentions[i]).abs().max()) for i in range(18))
    assert worst <= 5e-5
    # the window is real: a sliding layer gives no weight 512 or more positions back, a full one does
    assert float(t.pattern(0)[0, :, 1399, :888].abs().max()) == 0.0
    assert float(t.pattern(5)[0, :, 1399, :888].sum()) > 0.0


def test_left_padded_batch_equals_transformers(gemma3, gemma3_hf) -> None:
    rows = gemma3.tokenizer.encode_ids(TEXTS[:4])
    tokens, real = gemma3.tokenizer.pad(rows, side="left", fill_id=0)  # (batch, seq) x 2
    positions = (real.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        want = gemma3_hf(tokens, attention_mask=real.long(), position_ids=positions).logits
        got = gemma3.model(tokens, real, positions=positions)
    assert (got - want)[real].abs().max() <= 1e-3  # real positions only: padded ones are never read


def test_greedy_generation_equals_transformers(gemma3, gemma3_hf) -> None:
    ids = gemma3.tokenizer.pad(gemma3.tokenizer.encode_ids(["The capital of France is"]), side="left")[0]
    with torch.no_grad():
        want = gemma3_hf.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    got = gemma3.model.generate(ids, 16, temperature=0)
    assert torch.equal(got, want)


def test_chunks_are_checked_against_the_recorded_sha256(gemma3_parts) -> None:
    parts, digest = gemma3_parts
    assert [p.name[-6:] for p in parts] == ["part00", "part01", "part02", "part03"]
    wrong = ("0" if digest[0] != "0" else "1") + digest[1:]
    with pytest.raises(GGUFError, match=f"SHA-256 is {digest}, but {wrong} was expected"):
        read_gguf(parts, sha256=wrong)
    with pytest.raises(ValueError, match="64 hexadecimal digits"):
        read_gguf(parts, sha256="abc")
    with pytest.raises(GGUFError, match="SHA-256 is"):  # the parts out of order are another file
        read_gguf([parts[1], parts[0], *parts[2:]], sha256=digest)


def test_the_lesson_walks_qk_norm_the_layer_base_and_the_window(gemma3) -> None:
    """``headspace explain --model gemma3``'s walk: q normalised, then rotated with that layer's base;
    the scores are the rotated, normalised q and k over sqrt(256); the window is named."""
    from headspace.analysis.explain import explain

    for layer, base in ((4, 10000.0), (5, 1e6)):
        e = explain(gemma3, "The cat sat on the mat because it was tired", "tired", layer=layer, head=2)
        assert e.qk_norm == "head" and e.rope_theta == base
        assert e.window == (512 if layer == 4 else None)
        q_rot, k_rot = torch.tensor(e.q_rot), torch.tensor(e.k_rot)  # [256], [seq, 256]
        assert abs(float(q_rot.norm()) - float(torch.tensor(e.q_normed).norm())) < 1e-3  # a rotation
        assert torch.allclose(k_rot @ q_rot / 16.0, torch.tensor(e.scores), atol=1e-4)  # 1 / sqrt(256)


def test_the_benchmark_measures_both_models_side_by_side(gemma3, gemma3_hf, capsys) -> None:
    """benchmarks/gemma3.py's measurement on the session's two models, tiny: every case for both, the
    same greedy tokens at batch 1 and 8 (the full run: python benchmarks/gemma3.py)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gemma3.py"
    spec = importlib.util.spec_from_file_location("bench_gemma3_script", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cases = module.measure(gemma3, gemma3_hf, rounds=1, new_tokens=2, prefill=16)
    assert set(cases) == {"decode_b1", "decode_b8", "prefill_16"}
    for name in ("decode_b1", "decode_b8"):
        assert cases[name]["same_tokens"] is True
        assert cases[name]["headspace"]["tokens_per_s"] > 0 and cases[name]["hf"]["tokens_per_s"] > 0
    assert cases["prefill_16"]["headspace"]["median"] > 0


def test_attribute_command_adds_up_through_the_sandwich_norms(gemma3, monkeypatch) -> None:
    """``headspace attribute --model gemma3``: each head reaches the stream through its layer's
    ``ln_attn_out``, so its part is taken through that norm and the parts add up to the logit (before,
    taken as ``hook_result`` alone: 9.6 of a logit of 18.3). The session's model, so no load (~3 s)."""
    from click.testing import CliRunner

    from headspace.cli import causal as cli_causal
    from headspace.cli import cli

    monkeypatch.setattr(cli_causal, "load_model", lambda spec: gemma3)
    args = ["attribute", "--model", "gemma3", "The capital of France is", "--answer", " Paris", "--json"]
    res = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert abs(data["total"] - data["logit"]) <= 1e-3 and data["logit"] > 10
    # the head that patching restores the answer with (headspace patch: L12H2 +0.93) writes it directly too
    assert (12, 2) in [(h["layer"], h["head"]) for h in data["top_heads"][:2]]


def test_the_qk_circuit_gives_gemmas_scores_only_at_the_frozen_norm_scales(gemma3) -> None:
    """``head.qk(i - j)`` has the QK-norm gains (1 + w) folded in; times the run's norm scales (one
    per token and head, ``qk_norm_scales``) and 1 / sqrt(256) it is the traced score, on a sliding layer
    (base 10,000) and a full one (base 1e6)."""
    ids = gemma3.tokenize(["The cat sat on the mat because it was tired"])  # [1, 11]
    for layer in (4, 5):
        block = gemma3.model.blocks[layer]
        attn = block.attn
        names = [
            f"blocks.{layer}.hook_resid_pre",
            *(f"blocks.{layer}.attn.hook_{n}" for n in "q k scores".split()),
        ]
        with torch.no_grad(), hs.trace(gemma3.model, names=names) as t:
            gemma3.model.hidden_states(ids)  # [1, 11, 640]: no unembedding needed
            x = block.ln1(t[f"blocks.{layer}.hook_resid_pre"])[0]  # [11, 640]: the attention's input
            s_q, s_k = attn.qk_norm_scales(t[f"blocks.{layer}.attn.hook_q"], t[f"blocks.{layer}.attn.hook_k"])
            for h, i, j in ((2, 10, 3), (0, 7, 7)):
                raw = x[i] @ attn.heads[h].qk(i - j).AB @ x[j]
                score = float(t[f"blocks.{layer}.attn.hook_scores"][0, h, i, j])
                assert abs(float(raw * s_q[0, i, h] * s_k[0, j, 0]) / 16.0 - score) < 1e-3
                assert abs(float(raw) / 16.0 - score) > 0.1  # not without the scales


def test_why_splits_gemmas_score_exactly(gemma3) -> None:
    """``headspace why --model gemma3``'s decomposition: the parts reach layer 5 through the sandwich
    norms and meet at the frozen QK-norm scales, so they add up to the traced score (before: 7.30 of
    13.94 for this head, query and key)."""
    from headspace.analysis.decomposition import score_decomposition

    r = score_decomposition(gemma3, "The cat sat on the mat because it was tired", 5, 2)
    assert r.key == 0 and r.score > 10  # the head parks on <bos>
    assert abs(r.total - r.score) < 1e-3


def test_heads_subspaces_patch_and_view_run_on_gemma3(gemma3, monkeypatch, tmp_path: Path) -> None:
    """The lesson's other commands on Gemma 3 (the session's model, so no load): ``heads`` (roles,
    induction and the ablation importance of all 72 heads), ``subspaces`` of the one shared key head,
    ``patch`` per head, and ``view``'s page, each with the model's 18 x 4 heads."""
    from click.testing import CliRunner

    from headspace.cli import causal as cli_causal
    from headspace.cli import cli
    from headspace.cli import lesson as cli_lesson

    cli_view = importlib.import_module("headspace.cli.view")  # the package's `view` is the command
    for module in (cli_causal, cli_lesson, cli_view):
        monkeypatch.setattr(module, "load_model", lambda spec: gemma3)
    run = CliRunner()

    def ok(args: list[str]) -> str:
        res = run.invoke(cli, args, catch_exceptions=False)
        assert res.exit_code == 0, res.output
        return res.output

    heads = json.loads(
        ok(["heads", "--model", "gemma3", "The cat sat on the mat because it was tired", "--json"])
    )
    scores = torch.tensor(heads["importance"]["scores"])  # (layers, heads): the ablation importance
    assert scores.shape == (18, 4) and scores.isfinite().all() and scores.abs().max() > 0
    assert torch.tensor(heads["roles"]["previous"]).shape == (18, 4)
    sub = json.loads(ok(["subspaces", "--model", "gemma3", "--which", "k", "--layer", "5", "--json"]))
    (layer5,) = sub["layers"]
    assert layer5["overlap"] == [[1.0]] and layer5["mean_offdiag"] is None  # one key head: no pairs
    patch = json.loads(ok(["patch", "--model", "gemma3", "--json"]))  # the default IOI pair
    assert torch.tensor(patch["head_patch_effect"]).shape == (18, 4)
    assert patch["clean_metric"] > patch["corrupt_metric"] and patch["top"]
    page = tmp_path / "page.html"
    out = ok(["view", "--model", "gemma3", "The cat sat on the mat", "-o", str(page)])
    assert "18 layers" in out and page.stat().st_size > 0
