"""head_importance through the batched engine: the numbers of one ablate() run per head.

The reference is computed here by hand: the model run under ``headspace.ablate`` for each head, the
metric written out with torch (float64 cross-entropy; cosine of masked-mean embeddings).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import headspace as hs
from headspace import analysis
from headspace.analysis import ablation, head_importance, patching

V = 37


def rotary_decoder() -> hs.Decoder:
    cfg = hs.ModelConfig(
        arch="decoder", vocab_size=V, d_model=35, n_layers=3, n_heads=7, n_kv_heads=1, d_head=6, d_mlp=23,
        max_seq_len=32, positions="rotary", norm_kind="rmsnorm", mlp_kind="gated", act="silu", bias=False,
    )  # fmt: skip
    return hs.Decoder(cfg).eval()


def encoder() -> hs.Encoder:
    cfg = hs.ModelConfig(
        arch="encoder", vocab_size=V, d_model=35, n_layers=3, n_heads=5, d_mlp=23, max_seq_len=32
    )
    model = hs.Encoder(cfg).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.o_bias.normal_()
    return model


@torch.no_grad()
def loss_by_hand(model: hs.Decoder, tokens: torch.Tensor, real: torch.Tensor) -> float:
    logits = model(tokens, key_padding=real).double()  # (b, seq, V)
    ce = F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")  # (b, seq - 1)
    pair = (real[:, :-1] & real[:, 1:]).double()
    return float((ce * pair).sum() / pair.sum())


@torch.no_grad()
def cosine_by_hand(model: hs.Encoder, tokens: torch.Tensor, real: torch.Tensor, ref: torch.Tensor) -> float:
    w = real.double()[:, :, None]  # (b, seq, 1)
    e = (model(tokens, key_padding=real).double() * w).sum(1) / w.sum(1)  # (b, d_model)
    return float(F.cosine_similarity(e, ref, dim=-1).mean())


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_decoder_with_padding_rotary_gqa_equals_one_ablate_per_head(mode: str) -> None:
    model = rotary_decoder()
    tokens = torch.randint(0, V, (3, 11))
    real = torch.ones(3, 11, dtype=torch.bool)
    real[1, 8:] = False
    imp = head_importance(model, tokens, key_padding=real, mode=mode, max_rows=13, progress=False)
    base = loss_by_hand(model, tokens, real)
    assert imp.baseline == pytest.approx(base, rel=1e-9, abs=1e-9)
    means = analysis.mean_z(model, tokens, key_padding=real) if mode == "mean" else None
    for layer in range(3):
        for head in (0, 3, 6):
            with hs.ablate(model, {(layer, head): mode}, means=means):
                want = loss_by_hand(model, tokens, real)
            assert float(imp.ablated[layer, head]) == pytest.approx(want, rel=1e-6, abs=1e-6)
            assert float(imp.scores[layer, head]) == pytest.approx(want - base, rel=1e-4, abs=2e-6)


def test_encoder_with_padding_equals_one_ablate_per_head() -> None:
    model = encoder()
    tokens = torch.randint(0, V, (2, 9))
    real = torch.ones(2, 9, dtype=torch.bool)
    real[0, 5:] = False
    imp = head_importance(model, tokens, key_padding=real, heads=[(0, 4), (1, 0), (2, 3)], progress=False)
    assert imp.metric == "cosine" and imp.baseline == 1.0
    with torch.no_grad():
        w = real.double()[:, :, None]
        ref = (model(tokens, key_padding=real).double() * w).sum(1) / w.sum(1)  # (b, d_model)
    for layer, head in [(0, 4), (1, 0), (2, 3)]:
        with hs.ablate(model, {(layer, head): "zero"}):
            want = cosine_by_hand(model, tokens, real, ref)
        assert float(imp.ablated[layer, head]) == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert int(torch.isnan(imp.scores).sum()) == 15 - 3


def test_engine_runs_and_equals_the_whole_model_path(monkeypatch: pytest.MonkeyPatch) -> None:
    model = rotary_decoder()
    tokens = torch.randint(0, V, (2, 10))
    joined: list[list[int]] = []
    original = patching.run_from_layers
    monkeypatch.setattr(
        patching, "run_from_layers", lambda m, j, *a, **k: joined.append(sorted(j)) or original(m, j, *a, **k)
    )
    engine = head_importance(model, tokens, progress=False)
    assert joined == [[0, 1, 2]]  # one pass: every layer's copies joined the batch at their block
    monkeypatch.setattr(ablation, "_engine_applies", lambda *a: False)
    whole = head_importance(model, tokens, progress=False)
    torch.testing.assert_close(engine.ablated, whole.ablated, rtol=1e-6, atol=1e-6)


def test_next_token_loss_is_float64_cross_entropy() -> None:
    logits = torch.randn(3, 5, 101) * 7
    targets = torch.randint(0, 101, (3, 5))
    want = F.cross_entropy(logits.double().transpose(1, 2), targets, reduction="none")
    torch.testing.assert_close(ablation.next_token_loss(logits, targets), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("vocab", [101, 256, 300])
def test_next_token_loss_blocked_and_in_place(vocab: int) -> None:
    logits = torch.randn(3, 5, vocab) * 7
    targets = torch.randint(0, vocab, (3, 5))
    want = F.cross_entropy(logits.double().transpose(1, 2), targets, reduction="none")
    exact = ablation.next_token_loss(logits, targets)
    scratch = logits.clone()
    blocked = ablation.next_token_loss(scratch, targets, overwrite=True, block=128)
    torch.testing.assert_close(blocked, want, rtol=0, atol=1e-6)
    assert torch.equal(ablation.next_token_loss(logits.clone(), targets, overwrite=True), exact)
    assert not torch.equal(scratch, logits)  # overwrite: the logits' memory held the exponentials
    with pytest.raises(ValueError, match="block must be a positive int"):
        ablation.next_token_loss(logits, targets, block=0)


@pytest.mark.slow
def test_smollm2_heads_equal_one_ablate_per_head(smollm2) -> None:
    sentence = "The cat sat on the mat."
    heads = [(17, 5)]
    imp = head_importance(smollm2, sentence, heads=heads, progress=False)
    tokens, real = smollm2.tokenize_padded([sentence])
    base = loss_by_hand(smollm2.model, tokens, real)
    assert imp.baseline == pytest.approx(base, rel=1e-7)
    for layer, head in heads:
        with hs.ablate(smollm2, {(layer, head): "zero"}):
            want = loss_by_hand(smollm2.model, tokens, real)
        assert float(imp.scores[layer, head]) == pytest.approx(want - base, rel=1e-4, abs=1e-5)


def test_softcapped_decoder_equals_one_ablate_per_head() -> None:
    """The engine's logits are the Decoder's own: final soft-capping included (it was left out)."""
    cfg = hs.ModelConfig(
        arch="decoder", vocab_size=V, d_model=35, n_layers=2, n_heads=7, n_kv_heads=1, d_head=6, d_mlp=23,
        max_seq_len=32, positions="rotary", norm_kind="rmsnorm", mlp_kind="gated", act="silu", bias=False,
        final_softcap=1.0,
    )  # fmt: skip
    model = hs.Decoder(cfg).eval()
    tokens = torch.randint(0, V, (2, 9))
    real = torch.ones(2, 9, dtype=torch.bool)
    assert ablation._plain_unembedding(model) is None  # the logits come from Decoder.unembed
    imp = head_importance(model, tokens, heads=[(0, 3), (1, 6)], progress=False)
    for layer, head in [(0, 3), (1, 6)]:
        with hs.ablate(model, {(layer, head): "zero"}):
            want = loss_by_hand(model, tokens, real)
        assert float(imp.ablated[layer, head]) == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_engine_runs_a_decoders_copies_without_the_last_position(monkeypatch: pytest.MonkeyPatch) -> None:
    """Causal attention: the last position reaches no position the loss reads, so the copies drop it; an
    encoder's copies keep every position."""
    shapes: list[tuple[int, int]] = []
    original = patching.run_from_layers

    def spy(m, joins, *a, **k):
        shapes.extend((j.shape[1], int(k.get("separate", False))) for j in joins.values())
        return original(m, joins, *a, **k)

    monkeypatch.setattr(patching, "run_from_layers", spy)
    head_importance(rotary_decoder(), torch.randint(0, V, (2, 10)), progress=False)
    assert shapes and set(shapes) == {(9, 1)}
    shapes.clear()
    head_importance(encoder(), torch.randint(0, V, (2, 10)), progress=False)
    assert shapes and set(shapes) == {(10, 1)}


def test_loss_needs_two_real_tokens_before_any_run(monkeypatch: pytest.MonkeyPatch) -> None:
    model = rotary_decoder()
    monkeypatch.setattr(patching, "run_from_layers", lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(ValueError, match="at least two real tokens"):
        head_importance(model, torch.randint(0, V, (3, 1)), progress=False)
    real = torch.zeros(2, 5, dtype=torch.bool)
    real[:, 0] = True
    with pytest.raises(ValueError, match="at least two real tokens"):
        head_importance(model, torch.randint(0, V, (2, 5)), key_padding=real, progress=False)


@torch.no_grad()
def test_run_from_layers_separate_equals_one_call_per_block() -> None:
    """``separate=True``: the joining rows run apart (hooks counted from 0 in their call), the same
    stream to float32 rounding."""
    model = rotary_decoder()
    tokens = torch.randint(0, V, (2, 8))
    with analysis.trace(model, "blocks.*.hook_resid_pre") as t:
        model(tokens)
    joins = {l: t[f"blocks.{l}.hook_resid_pre"].repeat(n, 1, 1) for l, n in ((0, 2), (2, 3))}
    calls: list[tuple[int, int, int]] = []

    def hooks(layer: int, first: int, n: int) -> dict:
        calls.append((layer, first, n))

        def zero_head(z: torch.Tensor, point) -> torch.Tensor:
            z = z.clone()
            z[first : first + n, :, 1] = 0.0
            return z

        return {"attn.hook_z": zero_head}

    def kwargs(layer: int, runs: int) -> dict:
        return {"is_causal": True, "positions": torch.arange(8)}

    one = patching.run_from_layers(model, joins, hooks, kwargs)
    assert calls == [(0, 0, 4), (2, 4, 6)]
    calls.clear()
    apart = patching.run_from_layers(model, joins, hooks, kwargs, separate=True)
    assert calls == [(0, 0, 4), (2, 0, 6)]
    torch.testing.assert_close(apart, one, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("tile", "rows"), [(4096, 512), (64, 5), (100, 1), (1, 7)])
def test_unembedded_loss_is_float64_cross_entropy(tile: int, rows: int) -> None:
    h = torch.randn(23, 35)
    weight = torch.randn(300, 35) * 0.5
    targets = torch.randint(0, 300, (23,))
    logits = h @ weight.t()  # (23, 300)
    want = F.cross_entropy(logits.double(), targets, reduction="none")
    got = ablation.unembedded_loss(h, weight, targets, tile=tile, rows=rows)
    assert got.dtype == torch.float64 and got.shape == (23,)
    # float32 rounding of the logits (products of other shapes than the reference's)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * float(logits.abs().max()) + 1e-6)
    assert ablation.unembedded_loss(h[:0], weight, targets[:0]).shape == (0,)
    with pytest.raises(ValueError, match="tile must be a positive int"):
        ablation.unembedded_loss(h, weight, targets, tile=0)
    with pytest.raises(ValueError, match=r"targets must be word ids in \[0, 300\)"):
        ablation.unembedded_loss(h, weight, targets + 300)
