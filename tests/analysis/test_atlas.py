"""The head atlas against today's per-prompt functions, run on each sequence and averaged by query count.

References: :func:`head_roles` (previous, self, entropy), the traced ``hook_pattern`` of each sequence
(first, duplicate, induction, the top-attention examples), :func:`direct_logit_attribution` on each
prefix (direct_effect, copying) and :func:`headspace.ablate` with the corpus means of :func:`mean_z`
(ablation), on random decoders and encoders (padding, several windows per document, grouped-query
attention) and on SmolLM2 and MiniLM with a short corpus.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import headspace as hs
from headspace.analysis import atlas, head_roles, mean_z
from headspace.analysis.attribution import direct_logit_attribution
from headspace.analysis.corpus import Corpus

L, H, D, V = 3, 5, 30, 23  # distinct; a small vocabulary so that tokens repeat (duplicate, induction)


def decoder(seed: int = 0, n_kv_heads: int | None = None) -> hs.Decoder:
    torch.manual_seed(seed)
    cfg = hs.ModelConfig(
        arch="decoder", vocab_size=V, d_model=D, n_layers=L, n_heads=H, d_mlp=44, max_seq_len=32, dropout=0.0,
        attn_dropout=0.0, emb_dropout=0.0, **({} if n_kv_heads is None else {"n_kv_heads": n_kv_heads}),
    )  # fmt: skip
    model = hs.Decoder(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def documents(seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g) for n in (20, 5, 11, 2)]


def windows(docs: list[torch.Tensor], window: int) -> list[torch.Tensor]:
    return [d[s : s + window] for d in docs for s in range(0, d.shape[0], window)]


def pattern_reference(model, seqs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """first, duplicate, induction and the best (weight, seq, query, key) per head, from hook_pattern."""
    n_layers = len(hs.trace_layers(model)) if hasattr(hs, "trace_layers") else L
    sums = {k: torch.zeros(n_layers, H, dtype=torch.float64) for k in ("first", "duplicate", "induction")}
    counts = {"first": 0, "duplicate": 0, "induction": 0}
    best = [[(-1.0, 0, 0, 0)] * H for _ in range(n_layers)]
    for s, t in enumerate(seqs):
        n = t.shape[0]
        with hs.trace(model, "*hook_pattern") as tr, torch.no_grad():
            model(t[None])
        i = torch.arange(n)
        dup = (t[None, :] == t[:, None]) & (i[None, :] < i[:, None])  # (n, n): [query, key]
        prev = torch.cat([torch.tensor([-1]), t[:-1]])
        ind = (prev[None, :] == t[:, None]) & (i[None, :] >= 1) & (i[None, :] <= i[:, None])
        for layer in range(n_layers):
            p = tr.pattern(layer)[0].double()  # (H, n, n)
            sums["first"][layer] += p[:, 1:, 0].sum(-1)
            sums["duplicate"][layer] += (p * dup).sum((-1, -2))
            sums["induction"][layer] += (p * ind).sum((-1, -2))
            for h in range(H):
                for q in range(1, n):
                    for k in range(1, q + 1):
                        w = float(p[h, q, k])
                        if w > best[layer][h][0] + 1e-6:
                            best[layer][h] = (w, s, q, k)
        counts["first"] += n - 1
        counts["duplicate"] += n
        counts["induction"] += n
    out = {k: sums[k] / counts[k] for k in sums}
    out["best"] = best  # type: ignore[assignment]
    return out


def roles_reference(model, seqs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """previous, self, entropy: head_roles of each sequence, weighted by its number of counted queries."""
    acc = {k: 0.0 for k in ("previous", "self", "entropy")}
    n_prev = n_all = 0
    for t in seqs:
        r = head_roles(model, t[None], chunk_size=None)
        n = t.shape[0]
        if n > 1:
            acc["previous"] = acc["previous"] + r.previous.double() * (n - 1)
        acc["self"] = acc["self"] + r.current.double() * n
        acc["entropy"] = acc["entropy"] + r.entropy.double() * n
        n_prev += n - 1
        n_all += n
    return {
        "previous": acc["previous"] / n_prev,
        "self": acc["self"] / n_all,
        "entropy": acc["entropy"] / n_all,
    }


def dla_reference(model, seqs: list[torch.Tensor], best_keys) -> tuple[torch.Tensor, torch.Tensor]:
    """direct_effect (answer: the next token) and copying (answer: the top key's token), prefix by prefix."""
    de = torch.zeros(L, H, dtype=torch.float64)
    cp = torch.zeros(L, H, dtype=torch.float64)
    n_de = n_cp = 0
    for s, t in enumerate(seqs):
        for i in range(t.shape[0]):
            prefix = t[: i + 1][None]
            cache: dict[int, torch.Tensor] = {}  # answer token -> the heads' attribution [L, H]

            def dla(a: int, prefix=prefix, cache=cache) -> torch.Tensor:
                if a not in cache:
                    cache[a] = direct_logit_attribution(model, prefix, a).heads.double()
                return cache[a]

            if i + 1 < t.shape[0]:
                de += dla(int(t[i + 1]))
                n_de += 1
            for layer in range(L):
                for h in range(H):
                    cp[layer, h] += dla(int(t[best_keys[s][layer][h, i]]))[layer, h]
            n_cp += 1
    return de / n_de, cp / n_cp


def top_keys(model, seqs):
    """Per sequence, per layer: argmax over keys >= 1 of each query's pattern row [H, n] (0 for query 0)."""
    out = []
    for t in seqs:
        with hs.trace(model, "*hook_pattern") as tr, torch.no_grad():
            model(t[None])
        per = []
        for layer in range(L):
            p = tr.pattern(layer)[0]  # (H, n, n)
            k = torch.zeros(H, t.shape[0], dtype=torch.int64)
            if t.shape[0] > 1:
                k[:, 1:] = p[:, 1:, 1:].argmax(-1) + 1
            per.append(k)
        out.append(per)
    return out


def ablation_reference(model, seqs: list[torch.Tensor]) -> torch.Tensor:
    """Corpus loss with each head mean-ablated (means over the corpus) minus the clean corpus loss."""
    means = mean_z(model, [t[None] for t in seqs])

    def loss() -> float:
        total, count = 0.0, 0
        for t in seqs:
            if t.shape[0] < 2:
                continue
            with torch.no_grad():
                logits = model(t[None])[0].double()
            total += float(F.cross_entropy(logits[:-1], t[1:], reduction="sum"))
            count += t.shape[0] - 1
        return total / count

    clean = loss()
    out = torch.zeros(L, H, dtype=torch.float64)
    for layer in range(L):
        for h in range(H):
            with hs.ablate(model, {(layer, h): "mean"}, means=means):
                out[layer, h] = loss() - clean
    return out


def check_attention_stats(model, result, seqs: list[torch.Tensor]) -> dict:
    """previous/self/entropy against head_roles, first/duplicate/induction against hook_pattern."""
    roles = roles_reference(model, seqs)
    for name in ("previous", "self", "entropy"):
        assert_close(result.stats[name], roles[name], atol=2e-6, rtol=1e-5, msg=name)
    pats = pattern_reference(model, seqs)
    for name in ("first", "duplicate", "induction"):
        assert_close(result.stats[name], pats[name], atol=2e-6, rtol=1e-5, msg=name)
    return pats


@pytest.mark.slow
def test_random_decoder_matches_per_prompt_functions() -> None:
    model = decoder()
    docs = documents()
    result = atlas(model, docs, window=12, batch_size=2, top_k=3, shard_size=3, progress=False,
                   induction_repeated=False, importance="exact")  # fmt: skip
    seqs = windows(docs, 12)
    assert result.n_sequences == len(seqs) and result.n_queries == sum(t.shape[0] for t in seqs)
    pats = check_attention_stats(model, result, seqs)
    assert float(result.stats["duplicate"].max()) > 0.01  # the corpus repeats tokens: not a trivial 0
    de, cp = dla_reference(model, seqs, top_keys(model, seqs))
    assert_close(result.stats["direct_effect"], de, atol=1e-5, rtol=1e-4)
    assert_close(result.stats["copying"], cp, atol=1e-5, rtol=1e-4)
    assert_close(result.stats["ablation"], ablation_reference(model, seqs), atol=1e-5, rtol=1e-4)
    for layer in range(L):
        for h in range(H):
            w, s, _q, k = pats["best"][layer][h]
            ex = result.examples[layer][h]["attention"][0]
            assert ex["value"] == pytest.approx(w, abs=1e-5)
            assert (ex["sequence"], ex["key_context"]["tokens"][ex["key_context"]["at"]]) == (
                s,
                str(int(seqs[s][k])),
            )
    d = result.to_dict()
    keys = ("previous", "first", "self", "entropy", "duplicate", "induction", "copying", "direct_effect")
    keys += ("ablation", "examples", "n_queries", "n_tokens", "corpus_sha256", "model", "window")
    for key in keys:
        assert key in d
    assert len(d["previous"]) == L and len(d["previous"][0]) == H
    json.dumps(d)  # plain JSON


def test_grouped_query_decoder_and_batching_agree() -> None:
    """Grouped-query attention; batch 1 and batch 4 give the same statistics (padding changes nothing)."""
    model = decoder(seed=1, n_kv_heads=1)
    docs = documents(seed=5)
    a = atlas(model, docs, window=8, batch_size=1, ablation=False, progress=False, induction_repeated=False)
    b = atlas(model, docs, window=8, batch_size=4, ablation=False, progress=False, induction_repeated=False)
    seqs = windows(docs, 8)
    roles = roles_reference(model, seqs)
    assert_close(a.stats["previous"], roles["previous"], atol=2e-6, rtol=1e-5)
    for name in ("previous", "first", "self", "entropy", "duplicate", "induction", "direct_effect"):
        assert_close(a.stats[name], b.stats[name], atol=2e-6, rtol=1e-5, msg=name)


def test_random_encoder() -> None:
    torch.manual_seed(2)
    cfg = hs.ModelConfig(
        arch="encoder", vocab_size=V, d_model=D, n_layers=L, n_heads=H, d_mlp=16, max_seq_len=32
    )
    model = hs.Encoder(cfg).eval()
    docs = documents(seed=7)
    result = atlas(model, docs, window=9, batch_size=3, progress=False)
    seqs = windows(docs, 9)
    check_attention_stats(model, result, seqs)
    d = result.to_dict()
    assert d["direct_effect"][0][0] is None and d["ablation"][0][0] is None  # encoders: no logits


def test_corpus_errors(tmp_path) -> None:
    bad = tmp_path / "c.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(ValueError, match=r'c.jsonl line 2: expected a JSON object with a "text" string'):
        list(Corpus.of(bad).documents())
    bad.write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(ValueError, match=r"line 2: expected a JSON object .* invalid JSON"):
        list(Corpus.of(bad).documents())
    latin = tmp_path / "l.txt"
    latin.write_bytes(b"caf\xe9")
    with pytest.raises(ValueError, match=r"l.txt: expected UTF-8 text; got byte 0xe9 at offset 3"):
        list(Corpus.of(latin).documents())
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        Corpus.of(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="found none"):
        Corpus.of(empty)
    with pytest.raises(TypeError, match="corpus must be a path"):
        Corpus.of(3)
    with pytest.raises(ValueError, match="window must be an int >= 2"):
        atlas(decoder(), documents(), window=1, progress=False)
    with pytest.raises(ValueError, match="longer than this model's position table"):
        atlas(decoder(), documents(), window=64, progress=False)
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "b.txt").write_text("second")
    (folder / "a.md").write_text("first")
    (folder / "skip.bin").write_bytes(b"\xff")
    (folder / "d.jsonl").write_text('{"text": "third"}\n\n{"text": "fourth"}\n')
    assert [t for _, t in Corpus.of(folder).documents()] == ["first", "second", "third", "fourth"]
    assert Corpus.of(folder).sha256() == Corpus.of(folder).sha256()


def llama_like(seed: int, **extra) -> hs.Decoder:
    """A rotary, RMSNorm (offset 1), gated-MLP, grouped-query decoder with soft-capped logits, untied."""
    torch.manual_seed(seed)
    cfg = hs.ModelConfig(
        arch="decoder", vocab_size=V, d_model=D, n_layers=L, n_heads=H, d_mlp=44, max_seq_len=32, dropout=0.0,
        attn_dropout=0.0, emb_dropout=0.0, positions="rotary", norm_kind="rmsnorm", mlp_kind="gated",
        act="silu", bias=False, tie_embeddings=False, norm_offset=1.0, final_softcap=5.0, **extra,
    )  # fmt: skip
    model = hs.Decoder(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["pre", "sandwich"])
def test_rmsnorm_rotary_decoder_matches_per_prompt_functions(norm: str, monkeypatch) -> None:
    """RMSNorm's per-position factor (the direct effects scaled after the forward), rotary layers, a
    soft-capped untied unembedding cut into chunks of 5 positions; ``sandwich`` norms ablate on hook_z
    (the attention output passes a norm), ``pre`` on hook_attn_out."""
    import headspace.analysis.atlas_ablation as atlas_ablation

    monkeypatch.setattr(atlas_ablation, "UNEMBED_POSITIONS", 5)
    model = llama_like(4, norm=norm)
    docs = documents(seed=9)
    kw = dict(window=10, batch_size=3, top_k=2, progress=False, induction_repeated=False)
    result = atlas(model, docs, importance="exact", **kw)
    seqs = windows(docs, 10)
    check_attention_stats(model, result, seqs)
    de, cp = dla_reference(model, seqs, top_keys(model, seqs))
    assert_close(result.stats["direct_effect"], de, atol=1e-5, rtol=1e-4)
    assert_close(result.stats["copying"], cp, atol=1e-5, rtol=1e-4)
    assert_close(result.stats["ablation"], ablation_reference(model, seqs), atol=1e-5, rtol=1e-4)


def test_norm_split_is_frozen_norms_scale() -> None:
    from headspace.analysis.atlas_measure import norm_split
    from headspace.analysis.causal_inputs import frozen_norm

    x = torch.randn(2, 5, D) * 3 + 1
    ln = torch.nn.LayerNorm(D)
    with torch.no_grad():
        ln.weight.add_(torch.randn(D))
    rms = llama_like(0).ln_final  # RMSNorm with an offset
    for norm in (ln, rms, None):
        w, c = norm_split(norm, x)  # (D,), (2, 5)
        scale, _ = frozen_norm(norm, x)  # (2, 5, D)
        assert w.shape == (D,) and c.shape == (2, 5)
        assert_close(w * c[..., None], scale, atol=1e-6, rtol=1e-5)


def test_pair_loss_sums_skip_padding_and_match_cross_entropy(monkeypatch) -> None:
    import headspace.analysis.atlas_ablation as atlas_ablation

    monkeypatch.setattr(atlas_ablation, "UNEMBED_POSITIONS", 3)
    model = llama_like(1)
    tokens = torch.randint(0, V, (3, 7))
    real = torch.ones(3, 7, dtype=torch.bool)
    real[1, 4:] = False
    real[2, 1:] = False  # one token: no pair
    with torch.no_grad():
        with hs.trace(model, [f"blocks.{L - 1}.hook_resid_post"]) as t:
            logits = model(tokens, real)
        sums, n = atlas_ablation._pair_loss_sums(model, t[f"blocks.{L - 1}.hook_resid_post"], tokens, real)
    assert n == 6 + 3
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="none").view(3, 6)
    pair = (real[:, :-1] & real[:, 1:]).double()
    assert_close(sums, (ce.double() * pair).sum(-1), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_gemma_style_decoder_with_sliding_windows_matches_per_prompt_functions() -> None:
    """Sandwich norms, QK-norm and sliding windows of 3 on all layers but the last (Gemma 3's layout):
    the blocks' window masks are the traced patterns' (the per-prompt references trace every layer)."""
    types = ["sliding"] * (L - 1) + ["full"]
    model = llama_like(6, norm="sandwich", qk_norm="head", sliding_window=3, layer_types=types)
    docs = documents(seed=11)
    kw = dict(window=10, batch_size=3, top_k=2, progress=False, induction_repeated=False)
    result = atlas(model, docs, importance="exact", **kw)
    seqs = windows(docs, 10)
    check_attention_stats(model, result, seqs)
    de, cp = dla_reference(model, seqs, top_keys(model, seqs))
    assert_close(result.stats["direct_effect"], de, atol=1e-5, rtol=1e-4)
    assert_close(result.stats["copying"], cp, atol=1e-5, rtol=1e-4)
    assert_close(result.stats["ablation"], ablation_reference(model, seqs), atol=1e-5, rtol=1e-4)
