"""Causal analysis: direct logit attribution, the logit lens, activation / attribution / path patching.

Identities (parts add up to the logit; patching everything restores the clean run; positions before
the first difference have no effect), pairs that measure nothing refused, the batched sweep against one
forward per site, and references no one here wrote: transformers' GPT-2 with a forward pre-hook on each
layer's output projection ``c_proj`` (its input is the concatenation of the heads' z).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

import headspace as hs
from headspace.analysis import attribution, patching
from headspace.analysis.trace import hooked, trace

transformers = pytest.importorskip("transformers")

L, H, D, V, S = 3, 5, 30, 53, 9  # distinct sizes


def decoder(seed: int = 0, dtype: torch.dtype = torch.float32) -> hs.Decoder:
    torch.manual_seed(seed)
    cfg = hs.ModelConfig(
        arch="decoder", vocab_size=V, d_model=D, n_layers=L, n_heads=H, d_mlp=44, max_seq_len=32, dropout=0.0,
        attn_dropout=0.0, emb_dropout=0.0,
    )  # fmt: skip
    model = hs.Decoder(cfg).to(dtype).eval()
    with torch.no_grad():  # non-trivial norms and biases, so every part of the attribution is exercised
        for name, p in model.named_parameters():
            if "ln" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def pair(diff_at: int = 4, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, V, (1, S), generator=g)
    corrupt = clean.clone()
    corrupt[0, diff_at] = (clean[0, diff_at] + 7) % V
    return clean, corrupt


def metric_of(model: hs.Decoder, tokens: torch.Tensor, a: int = 3, b: int = 5) -> float:
    with torch.no_grad():
        logits = model(tokens)[0, -1]
    return float(logits[a] - logits[b])


# ---------------------------------------------------------------------------------------------- DLA
@pytest.mark.parametrize("other", [None, 5])
def test_direct_attribution_parts_add_up_to_the_logit(other: int | None) -> None:
    model = decoder()
    tokens = torch.randint(0, V, (3, S), generator=torch.Generator().manual_seed(2))
    r = attribution.direct_logit_attribution(model, tokens, 3, other)
    assert r.heads.shape == (L, H) and r.mlps.shape == (L,)
    assert_close(r.per_prompt["total"], r.per_prompt["logit"], atol=1e-4, rtol=0)
    assert_close(r.total, r.logit, atol=1e-4, rtol=0)
    with torch.no_grad():
        logits = model(tokens)[:, -1]
    want = logits[:, 3] if other is None else logits[:, 3] - logits[:, 5]
    assert_close(r.per_prompt["logit"], want)


def test_direct_attribution_of_one_head_is_its_output_through_the_frozen_norm() -> None:
    model = decoder()
    tokens = torch.randint(0, V, (1, S), generator=torch.Generator().manual_seed(3))
    r = attribution.direct_logit_attribution(model, tokens, 7)
    with trace(model, names=["blocks.1.attn.hook_result", f"blocks.{L - 1}.hook_resid_post"]) as t:
        model(tokens)
    x = t[f"blocks.{L - 1}.hook_resid_post"][0, -1]  # (d_model,)
    ln = model.ln_final
    sigma = torch.sqrt(x.var(unbiased=False) + ln.eps)
    part = t.result(1)[0, -1, 2]  # head 2 of layer 1 at the last position
    want = ((part - part.mean()) / sigma * ln.weight) @ model.W_U[:, 7]
    assert_close(r.heads[1, 2], want.detach())


@pytest.mark.parametrize("norm", ["sandwich", "post_sublayer"])
def test_direct_attribution_adds_up_through_a_norm_after_the_attention(norm: str) -> None:
    """Gemma's sandwich norms and OLMo 2's post-sublayer norms sit between the heads and the residual
    add: each head's part goes through that norm frozen at the layer's output, so the parts still add up
    (before: hook_result taken as it is, Gemma-3-270M's parts summed to 9.6 of a logit of 18.3)."""
    torch.manual_seed(0)
    cfg = hs.ModelConfig(
        arch="decoder", vocab_size=V, d_model=D, n_layers=L, n_heads=H, d_mlp=44, max_seq_len=32, norm=norm,
        norm_kind="rmsnorm", norm_offset=1.0 if norm == "sandwich" else 0.0,
    )  # fmt: skip
    model = hs.Decoder(cfg).eval()
    with torch.no_grad():  # norms that are not the identity, and biases
        for name, p in model.named_parameters():
            if "ln" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.3)
    tokens = torch.randint(0, V, (3, S), generator=torch.Generator().manual_seed(2))
    r = attribution.direct_logit_attribution(model, tokens, 3, 5)
    assert_close(r.per_prompt["total"], r.per_prompt["logit"], atol=1e-4, rtol=0)
    with torch.no_grad():
        logits = model(tokens)[:, -1]
    assert_close(r.per_prompt["logit"], logits[:, 3] - logits[:, 5])


def test_logit_lens_last_row_is_the_model_prediction() -> None:
    model = decoder()
    tokens = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(4))
    lens = attribution.logit_lens(model, tokens, 11, top=3)
    assert lens.top_ids.shape == (2, L + 1, 3)
    with torch.no_grad():
        probs = torch.softmax(model(tokens)[:, -1], dim=-1)
    assert torch.equal(lens.top_ids[:, -1, 0], probs.argmax(-1))
    assert_close(lens.answer_prob[:, -1], probs[:, 11])
    assert torch.equal(lens.answer_rank[:, -1], (probs > probs[:, 11:12]).sum(-1))


def test_attribution_refuses_an_encoder() -> None:
    enc = hs.Encoder(hs.ModelConfig(arch="encoder", vocab_size=V, d_model=D, n_layers=1, n_heads=H, d_mlp=8))
    with pytest.raises(TypeError, match="needs a decoder"):
        attribution.direct_logit_attribution(enc, torch.zeros(1, 3, dtype=torch.long), 1)


# ---------------------------------------------------------------------------------------------- patching
def naive_head_patch(model: hs.Decoder, clean, corrupt, layer: int, head: int) -> float:
    """One full forward of the corrupt prompt with one head's clean z put in."""
    with trace(model, names=[f"blocks.{layer}.attn.hook_z"]) as t:
        model(clean)
    cz = t[f"blocks.{layer}.attn.hook_z"]

    def put(z, point):
        z = z.clone()
        z[:, :, head] = cz[:, :, head]
        return z

    with hooked(model, {f"blocks.{layer}.attn.hook_z": put}):
        return metric_of(model, corrupt)


@pytest.mark.parametrize("diff_at", [0, 4, S - 1])
def test_batched_head_sweep_equals_one_forward_per_site(diff_at: int) -> None:
    model = decoder()
    clean, corrupt = pair(diff_at)
    r = patching.patch(model, clean, corrupt, answer=3, other=5)
    assert r.axes == ("layer", "head") and r.first_difference == diff_at
    want = torch.tensor([[naive_head_patch(model, clean, corrupt, l, h) for h in range(H)] for l in range(L)])
    assert_close(r.patched_metric, want, atol=1e-5, rtol=1e-5)
    assert r.clean_metric == pytest.approx(metric_of(model, clean), abs=1e-5)
    assert r.corrupt_metric == pytest.approx(metric_of(model, corrupt), abs=1e-5)
    assert_close(
        r.effect, (want - r.corrupt_metric) / (r.clean_metric - r.corrupt_metric), atol=1e-4, rtol=1e-4
    )


def test_resid_mlp_and_position_sweeps_equal_single_patches() -> None:
    model = decoder()
    clean, corrupt = pair(3)
    resid = patching.patch(model, clean, corrupt, site="resid", answer=3, other=5)
    mlp = patching.patch(model, clean, corrupt, site="mlp", answer=3, other=5)
    pos = patching.patch(model, clean, corrupt, site="heads_pos", answer=3, other=5)
    assert resid.effect.shape == (L, S) and mlp.effect.shape == (L,) and pos.effect.shape == (L, H, S)
    assert torch.all(resid.effect[:, :3] == 0) and torch.all(pos.effect[:, :, :3] == 0)  # same prefix
    for layer in range(L):
        want = patching.patch_activations(
            model, clean, corrupt, f"blocks.{layer}.hook_mlp_out", answer=3, other=5
        )
        assert mlp.patched_metric[layer] == pytest.approx(want, abs=1e-5)
        with trace(model, names=[f"blocks.{layer}.hook_resid_pre"]) as t:
            model(clean)
        cx = t[f"blocks.{layer}.hook_resid_pre"]
        for position in (3, 6):

            def put(x, point, position=position, cx=cx):
                x = x.clone()
                x[:, position] = cx[:, position]
                return x

            with hooked(model, {f"blocks.{layer}.hook_resid_pre": put}):
                want = metric_of(model, corrupt)
            assert resid.patched_metric[layer, position] == pytest.approx(want, abs=1e-5)
    # a head's effect over all positions is the same head patched at every position at once, and the
    # per-position sweep of one position equals a single patch of that z slice
    layer, head, position = 1, 2, 5
    with trace(model, names=[f"blocks.{layer}.attn.hook_z"]) as t:
        model(clean)
    cz = t[f"blocks.{layer}.attn.hook_z"]

    def put_z(z, point):
        z = z.clone()
        z[:, position, head] = cz[:, position, head]
        return z

    with hooked(model, {f"blocks.{layer}.attn.hook_z": put_z}):
        want = metric_of(model, corrupt)
    assert pos.patched_metric[layer, head, position] == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("layer", range(L))
def test_patching_the_whole_clean_stream_restores_exactly_one(layer: int) -> None:
    model = decoder()
    clean, corrupt = pair(2)
    value = patching.patch_activations(
        model, clean, corrupt, f"blocks.{layer}.hook_resid_pre", answer=3, other=5
    )
    c, k = metric_of(model, clean), metric_of(model, corrupt)
    assert (value - k) / (c - k) == pytest.approx(1.0, abs=1e-5)


def test_patching_every_head_everywhere_reproduces_the_clean_metric() -> None:
    model = decoder()
    clean, corrupt = pair(5)
    value = patching.patch_activations(model, clean, corrupt, "blocks.*.attn.hook_z", answer=3, other=5)
    assert value == pytest.approx(metric_of(model, clean), abs=1e-5)


def test_patching_a_prompt_into_itself_is_refused() -> None:
    """Patching a prompt into itself changes nothing (every effect +0.000): refused, naming the arguments,
    by every function that takes clean and corrupt, rather than reported as a result."""
    model = decoder()
    clean, _ = pair()
    same = r"clean and corrupt are the same prompt: the same 9 tokens, so patching one into the other changes"
    for site in patching.SITES:
        with pytest.raises(ValueError, match=same):
            patching.patch(model, clean, clean.clone(), site=site, answer=3, other=5)
        with pytest.raises(ValueError, match=same):
            patching.attribution_patching(model, clean, clean, site=site, answer=3, other=5)
    with pytest.raises(ValueError, match=same):
        patching.patch_activations(model, clean, clean, "blocks.*.attn.hook_z", answer=3, other=5)
    with pytest.raises(ValueError, match=same):
        patching.path_patch(model, clean, clean, [(0, 1)], [(2, 0)], answer=3, other=5)


def test_an_answer_equal_to_the_other_token_is_refused() -> None:
    """logit(answer) - logit(other) with answer == other is 0 in every run: refused, naming both."""
    model = decoder()
    clean, corrupt = pair()
    same = r"answer and other are the same token \('3', id 3\): the metric logit\(answer\) - logit\(other\)"
    with pytest.raises(ValueError, match=same):
        patching.patch(model, clean, corrupt, answer=3, other=3)
    with pytest.raises(ValueError, match=same):
        patching.attribution_patching(model, clean, corrupt, answer=3, other=3)
    with pytest.raises(ValueError, match=same):
        patching.patch_activations(model, clean, corrupt, "blocks.0.hook_resid_pre", answer=3, other=3)
    with pytest.raises(ValueError, match=same):
        patching.path_patch(model, clean, corrupt, [(0, 1)], [(2, 0)], answer=3, other=3)
    with pytest.raises(ValueError, match=same):
        attribution.direct_logit_attribution(model, clean, 3, 3)
    # a metric of one's own is the caller's business; answer alone is fine
    assert patching.patch(model, clean, corrupt, answer=3).metric_name == "logit('3')"


def test_head_patching_equals_transformers_with_a_pre_hook_on_c_proj(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=61, n_positions=17, n_embd=28, n_layer=3, n_head=7,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    ref = transformers.GPT2LMHeadModel(config).eval()
    ref.save_pretrained(tmp_path / "gpt2")
    ours = hs.load_gpt2(tmp_path / "gpt2")
    g = torch.Generator().manual_seed(5)
    clean = torch.randint(0, 61, (1, 8), generator=g)
    corrupt = clean.clone()
    corrupt[0, 3] = (clean[0, 3] + 1) % 61
    r = patching.patch(ours, clean, corrupt, answer=4, other=9)
    dh = 28 // 7
    for layer, head in [(0, 0), (1, 3), (2, 6)]:
        stored: dict[str, torch.Tensor] = {}
        proj = ref.transformer.h[layer].attn.c_proj
        keep = proj.register_forward_pre_hook(
            lambda mod, args, stored=stored: stored.__setitem__("z", args[0])
        )
        with torch.no_grad():
            ref(clean)
        keep.remove()

        def swap(mod, args, stored=stored, head=head):
            z = args[0].clone()
            z[..., head * dh : (head + 1) * dh] = stored["z"][..., head * dh : (head + 1) * dh]
            return (z,)

        handle = proj.register_forward_pre_hook(swap)
        with torch.no_grad():
            logits = ref(corrupt).logits[0, -1]
        handle.remove()
        assert r.patched_metric[layer, head] == pytest.approx(float(logits[4] - logits[9]), abs=1e-4)


def test_encoder_patching_uses_the_cosine_to_the_clean_embedding() -> None:
    torch.manual_seed(0)
    enc = hs.Encoder(hs.ModelConfig(arch="encoder", vocab_size=V, d_model=D, n_layers=2, n_heads=H, d_mlp=16))
    clean, corrupt = pair(2)
    r = patching.patch(enc, clean, corrupt)
    assert r.clean_metric == pytest.approx(1.0, abs=1e-5) and r.effect.shape == (2, H)
    whole = patching.patch_activations(enc, clean, corrupt, "blocks.1.hook_resid_pre")
    assert whole == pytest.approx(1.0, abs=1e-5)
    mlp = patching.patch(enc, clean, corrupt, site="mlp")
    assert mlp.patched_metric[1] == pytest.approx(
        patching.patch_activations(enc, clean, corrupt, "blocks.1.hook_mlp_out"), abs=1e-5
    )


# ---------------------------------------------------------------------------------------------- attribution
def test_attribution_patching_is_real_patching_to_first_order() -> None:
    """Corrupt and clean differ by epsilon (the corrupt token's embedding is the clean one's plus
    epsilon noise): the estimate's error shrinks like epsilon^2, the effect like epsilon."""
    errors = []
    for eps in (1e-2, 1e-3):
        model = decoder(dtype=torch.float64)
        clean, corrupt = pair(4)
        a, b = int(clean[0, 4]), int(corrupt[0, 4])
        with torch.no_grad():
            model.tok_embed.weight[b] = model.tok_embed.weight[a] + eps * torch.randn(
                D, dtype=torch.float64, generator=torch.Generator().manual_seed(9)
            )
        real = patching.patch(model, clean, corrupt, answer=3, other=5)
        est = patching.attribution_patching(model, clean, corrupt, answer=3, other=5)
        d_real = real.patched_metric - real.corrupt_metric
        d_est = est.patched_metric - est.corrupt_metric
        errors.append(float((d_real - d_est).abs().max() / d_real.abs().max()))
    assert errors[1] < 0.2 * errors[0]  # relative error ~ epsilon: first-order agreement
    assert errors[1] < 1e-2


def test_attribution_patching_correlates_with_real_patching() -> None:
    model = decoder()
    clean, corrupt = pair(4)
    real = patching.patch(model, clean, corrupt, answer=3, other=5)
    est = patching.attribution_patching(model, clean, corrupt, answer=3, other=5)
    assert est.method == "attribution" and est.effect.shape == real.effect.shape
    assert -1.0 <= patching.correlation(real, est) <= 1.0


# ---------------------------------------------------------------------------------------------- paths
def test_path_patching_through_every_later_head_and_nothing_else() -> None:
    model = decoder()
    clean, corrupt = pair(3)
    r = patching.path_patch(model, clean, corrupt, [(0, 1)], [(2, 0)], receiver_input="v", answer=3, other=5)
    assert set(r) == {"effect", "patched_metric", "clean_metric", "corrupt_metric"}
    # a receiver below the sender is reached by nothing: the metric is the corrupt one
    low = patching.path_patch(
        model, clean, corrupt, [(2, 1)], [(0, 0)], receiver_input="q", answer=3, other=5
    )
    assert low["patched_metric"] == pytest.approx(low["corrupt_metric"], abs=1e-6)
    assert low["effect"] == pytest.approx(0.0, abs=1e-3)  # normalised by a small clean - corrupt


# ---------------------------------------------------------------------------------------------- bad input
def test_prompts_of_different_lengths_are_refused_naming_both() -> None:
    model = decoder()
    with pytest.raises(ValueError, match=r"clean has 5 tokens and corrupt 6.*same-length prompts"):
        patching.patch(
            model, torch.zeros(1, 5, dtype=torch.long), torch.zeros(1, 6, dtype=torch.long), answer=1
        )


def test_unknown_site_and_bad_metrics_are_refused() -> None:
    model = decoder()
    clean, corrupt = pair()
    with pytest.raises(
        ValueError, match=r"unknown site 'neurons'; sites: \['heads', 'heads_pos', 'resid', 'mlp'\]"
    ):
        patching.patch(model, clean, corrupt, site="neurons", answer=1)
    with pytest.raises(ValueError, match=r"must return one number per run.*got shape \[1, 53\]"):
        patching.patch(model, clean, corrupt, metric=lambda logits: logits)
    with pytest.raises(TypeError, match="must return a float tensor"):
        patching.patch(model, clean, corrupt, metric=lambda logits: "high")
    with pytest.raises(ValueError, match="pass answer"):
        patching.patch(model, clean, corrupt)


def test_an_answer_of_several_tokens_shows_how_it_tokenizes(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "Ma": 1, "##ry": 2, "John": 3}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    from headspace.pretrained import PretrainedDecoder
    from headspace.pretrained.tokenization import TextTokenizer

    pre = PretrainedDecoder(decoder(), TextTokenizer(tmp_path / "tokenizer.json"))
    with pytest.raises(
        ValueError, match=r"answer 'Mary' must be one token; it tokenizes to 2: \['Ma', '##ry'\]"
    ):
        patching.patch(
            pre, torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long), answer="Mary"
        )


def test_an_empty_prompt_is_named_in_plain_words(tmp_path: Path) -> None:
    """Which prompt is empty, and the rule (was: "every one of the clean needs at least one token")."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "Mary": 1, "John": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    from headspace.pretrained import PretrainedDecoder
    from headspace.pretrained.tokenization import TextTokenizer

    pre = PretrainedDecoder(decoder(), TextTokenizer(tmp_path / "tokenizer.json", pad_id=0))
    with pytest.raises(ValueError) as info:
        patching.patch(pre, "", "Mary", answer="Mary", other="John")
    assert str(info.value) == (
        "clean prompt is empty ('' tokenizes to no token): every prompt needs at least one token"
    )
    with pytest.raises(ValueError, match=r"^corrupt prompt is empty \('  ' tokenizes to no token\)"):
        patching.patch(pre, "Mary", "  ", answer="Mary", other="John")
    with pytest.raises(
        ValueError, match=r"^prompt 2 of 3 is empty \('' tokenizes to no token\): every prompt"
    ):
        attribution.direct_logit_attribution(pre, ["Mary John", "", "John"], "Mary")
    with pytest.raises(ValueError, match=r"^prompt is empty \(it holds no token id\): every prompt needs"):
        attribution.logit_lens(decoder(), torch.zeros(1, 0, dtype=torch.long))


# ---------------------------------------------------------------------------------------------- benchmark
@pytest.mark.slow
def test_the_patching_benchmark_runs_and_its_json_matches_its_table(tmp_path: Path, capsys, smollm2) -> None:
    """benchmarks/patching.py on SmolLM2 (one round, headspace's sweep only): a smoke run."""
    import importlib.util
    import json

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "patching.py"
    spec = importlib.util.spec_from_file_location("patching_bench", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "patching.json"
    threads = str(torch.get_num_threads())  # the script sets the thread count: keep this process's
    args = ["--rounds", "1", "--no-naive", "--no-tl", "--threads", threads, "--out", str(out)]
    assert bench.main(args) == 0
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    assert row["case"] == "headspace" and doc["n_sites"] == 270
    assert f"| headspace | {row['median_s']:.2f} |" in printed
