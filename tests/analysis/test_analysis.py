"""headspace.analysis on small models with planted structure, and on the pretrained MiniLM."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import headspace as hs
from headspace import MultiHeadAttention, analysis
from headspace.analysis import (
    circuit_spectra,
    head_importance,
    head_mixing,
    head_roles,
    overlap_matrix,
    principal_angles,
    random_overlap,
    roles_from_patterns,
    subspace_overlap,
    subspace_overlaps,
    wo_norms,
)

SEQ = 11


# ------------------------------------------------------------------------------------------ planted roles


def planted_role_layer() -> MultiHeadAttention:
    """4 heads of width 11 over inputs x_i = e_i (position one-hot, dims 0..10) + e_11 (a constant).

    head 0 attends to the previous token, head 1 to the next, head 2 to itself, head 3 to the first.
    """
    attn = MultiHeadAttention(d_model=44, n_heads=4, d_head=SEQ, bias=False)
    c = 10.0
    with torch.no_grad():
        for W in (attn.W_Q, attn.W_K, attn.W_V):
            W.zero_()
        eye = torch.eye(SEQ)
        attn.W_Q[0][:SEQ] = c * eye  # q_i = c u_i
        attn.W_K[0][: SEQ - 1, 1:] = c * eye[:-1, :-1]  # k_j = c u_{j+1}: q_i . k_j large iff j = i - 1
        attn.W_Q[1][:SEQ] = c * eye
        attn.W_K[1][1:SEQ, : SEQ - 1] = c * eye[:-1, :-1]  # k_j = c u_{j-1}: large iff j = i + 1
        attn.W_Q[2][:SEQ] = c * eye
        attn.W_K[2][:SEQ] = c * eye  # k_j = c u_j: large iff j = i
        attn.W_Q[3][SEQ, 0] = c  # q_i = c u_0 for every i (the constant dim)
        attn.W_K[3][0, 0] = c  # k_0 = c u_0, other keys 0
        attn.W_V.copy_(torch.randn_like(attn.W_V))
    return attn


def positions(batch: int) -> torch.Tensor:
    x = torch.zeros(batch, SEQ, 44)
    x[:, :, :SEQ] = torch.eye(SEQ)
    x[:, :, SEQ] = 1.0
    return x


def test_planted_heads_get_their_role_labels() -> None:
    attn = planted_role_layer()
    roles = head_roles(attn, positions(2))
    assert roles.labels == [["previous", "next", "current", "first"]]
    assert float(roles.previous[0, 0]) > 0.99 and float(roles.next[0, 1]) > 0.99
    assert float(roles.current[0, 2]) > 0.99 and float(roles.first[0, 3]) > 0.99
    assert roles.threshold == analysis.roles.DEFAULT_THRESHOLD
    assert roles.n_queries == 2 * SEQ
    assert roles.entropy.shape == (1, 4) and float(roles.entropy[0, 2]) < 0.01
    assert roles.heads_with("previous") == [(0, 0)]


def test_roles_ignore_padding_and_use_the_last_real_token() -> None:
    attn = planted_role_layer()
    pad = torch.ones(2, SEQ, dtype=torch.bool)
    pad[1, 8:] = False  # sample 1 has 8 real tokens
    roles = head_roles(attn, positions(2), key_padding=pad)
    assert roles.labels == [["previous", "next", "current", "first"]]
    assert roles.n_queries == SEQ + 8
    # the next-token head at the last real token of sample 1 has no next real token to attend to
    assert float(roles.next[0, 1]) > 0.99


def test_roles_from_hand_made_patterns() -> None:
    S = 5
    prev = torch.zeros(S, S)
    prev[0, 0] = 1.0
    prev[torch.arange(1, S), torch.arange(S - 1)] = 1.0  # query i -> key i - 1
    uniform = torch.full((S, S), 1.0 / S)
    last = torch.zeros(S, S)
    last[:, S - 1] = 1.0
    pattern = torch.stack([prev, uniform, last])[None]  # (1, 3, S, S)
    roles = roles_from_patterns([pattern], threshold=0.5)
    assert roles.labels == [["previous", "mixed", "last"]]
    torch.testing.assert_close(roles.previous[0], torch.tensor([1.0, 1.0 / S, 0.0]))
    torch.testing.assert_close(roles.last[0], torch.tensor([0.0, 1.0 / S, 1.0]))
    torch.testing.assert_close(roles.entropy[0], torch.tensor([0.0, math.log(S), 0.0]))
    # the threshold decides between a label and "mixed"
    assert roles_from_patterns([pattern], threshold=0.1).labels == [["previous", "previous", "last"]]


@settings(max_examples=25, deadline=None)
@given(length=st.integers(2, 7), n_pad=st.integers(1, 4), left=st.booleans(), heads=st.sampled_from([1, 3]))
def test_roles_of_a_padded_sequence_equal_those_of_its_real_tokens(
    length: int, n_pad: int, left: bool, heads: int
) -> None:
    g = torch.Generator().manual_seed(length * 100 + n_pad * 10 + heads)
    real_pattern = torch.softmax(torch.randn(1, heads, length, length, generator=g) * 3, dim=-1)
    S = length + n_pad
    pad = torch.zeros(1, S, dtype=torch.bool)
    pos = slice(n_pad, S) if left else slice(0, length)
    pad[0, pos] = True
    padded = torch.rand(1, heads, S, S, generator=g)  # garbage on padded query rows
    padded[..., :, ~pad[0]] = 0.0  # padding keys are never attended
    padded[:, :, pos, pos] = real_pattern
    want = roles_from_patterns([real_pattern])
    got = roles_from_patterns([padded], pad)
    for name in (*analysis.TARGETS, "entropy"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), equal_nan=True)
    assert got.labels == want.labels and got.n_queries == want.n_queries == length


def test_roles_bad_input() -> None:
    with pytest.raises(ValueError, match=r"threshold must be a number in \(0, 1\]; got 1.5"):
        roles_from_patterns([torch.ones(1, 1, 2, 2)], threshold=1.5)
    with pytest.raises(ValueError, match=r"patterns\[0\] must be \[batch, n_heads, seq, seq\]"):
        roles_from_patterns([torch.ones(2, 2)])
    with pytest.raises(ValueError, match="seq_q == seq_k"):
        roles_from_patterns([torch.ones(1, 1, 2, 3)])
    with pytest.raises(TypeError, match=r"has no \.tokenize"):
        head_roles(planted_role_layer(), ["a sentence"])
    with pytest.raises(
        ValueError, match=r"key_padding must have shape \[batch, seq\] = \[2, 11\]; got \[2, 5\]"
    ):
        head_roles(planted_role_layer(), positions(2), key_padding=torch.ones(2, 5, dtype=torch.bool))


def test_roles_from_patterns_refuses_mismatched_layers_bad_padding_and_nan() -> None:
    p2 = torch.softmax(torch.randn(2, 7, 3, 3), dim=-1)  # batch 2, heads 7, seq 3
    p5 = torch.softmax(torch.randn(5, 7, 3, 3), dim=-1)
    with pytest.raises(
        ValueError,
        match=r"patterns\[1\] \(layer 1\) has batch 5, seq 3 .* patterns\[0\] \(layer 0\) has batch 2",
    ):
        roles_from_patterns([p2, p5])
    with pytest.raises(ValueError, match=r"patterns\[1\] \(layer 1\) has batch 2, seq 5"):
        roles_from_patterns([p2, torch.softmax(torch.randn(2, 7, 5, 5), dim=-1)])
    with pytest.raises(TypeError, match=r"key_padding must be a bool tensor .*got dtype torch.int64"):
        roles_from_patterns([p2], key_padding=torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match=r"key_padding must be a bool tensor .*got list"):
        roles_from_patterns([p2], key_padding=[[True] * 3] * 2)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"key_padding must have shape \[batch, seq\] = \[2, 3\] .*got \[3, 2\]"
    ):
        roles_from_patterns([p2], key_padding=torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(
        TypeError, match=r"patterns must be a list of .* got a single tensor of shape \[2, 2, 7, 3, 3\]"
    ):
        roles_from_patterns(torch.stack([p2, p2]))  # type: ignore[arg-type]
    nan = p2.clone()
    nan[1, 6, 2, 0] = float("nan")
    with pytest.raises(
        ValueError, match=r"patterns\[1\] \(layer 1\) has 1 non-finite values \(NaN/Inf\) of 126"
    ):
        roles_from_patterns([p2, nan])
    roles = roles_from_patterns(list(torch.stack([p2, p2]).unbind(0)))  # the fix the message suggests
    assert len(roles.labels) == 2


# ------------------------------------------------------------------------------------------ subspaces


def test_identical_W_Q_overlap_one_orthogonal_zero() -> None:
    attn = MultiHeadAttention(d_model=35, n_heads=7)
    with torch.no_grad():
        basis = torch.linalg.qr(torch.randn(35, 35)).Q
        attn.W_Q[0] = basis[:, :5]
        attn.W_Q[1] = basis[:, :5]  # identical
        attn.W_Q[2] = basis[:, 5:10]  # orthogonal to head 0
        attn.W_Q[3] = basis[:, :5] @ torch.randn(5, 5)  # same subspace, other basis
        attn.W_Q[4] = torch.cat([basis[:, :2], basis[:, 10:13]], dim=1)  # shares 2 of 5 directions
    M = overlap_matrix(attn, "q")
    assert M.shape == (7, 7)
    torch.testing.assert_close(M.diagonal(), torch.ones(7))
    torch.testing.assert_close(M[0, 1], torch.tensor(1.0))
    torch.testing.assert_close(M[0, 2], torch.tensor(0.0))
    torch.testing.assert_close(M[0, 3], torch.tensor(1.0))
    torch.testing.assert_close(M[0, 4], torch.tensor(2.0 / 5))
    torch.testing.assert_close(M, M.T)
    angles = principal_angles(attn.W_Q[0].detach(), attn.W_Q[4].detach())
    torch.testing.assert_close(angles, torch.tensor([0.0, 0.0, math.pi / 2, math.pi / 2, math.pi / 2]))


def test_principal_angles_known_planes_and_overlap() -> None:
    theta = 0.3
    e = torch.eye(3, dtype=torch.float64)
    A = e[:, :2]
    B = torch.stack([e[:, 0], math.cos(theta) * e[:, 1] + math.sin(theta) * e[:, 2]], dim=1)
    torch.testing.assert_close(principal_angles(A, B), torch.tensor([0.0, theta], dtype=torch.float64))
    torch.testing.assert_close(
        subspace_overlap(A, B), torch.tensor((1 + math.cos(theta) ** 2) / 2, dtype=torch.float64)
    )
    assert torch.isnan(subspace_overlap(A, torch.zeros(3, 2, dtype=torch.float64)))
    with pytest.raises(ValueError, match=r"same space.*A \[3, 2\], B \[4, 2\]"):
        principal_angles(A, torch.zeros(4, 2, dtype=torch.float64))


def test_random_overlap_expectation_matches_sampling() -> None:
    d, p, q, n = 35, 5, 7, 400
    g = torch.Generator().manual_seed(1)
    Qa = torch.linalg.qr(torch.randn(n, d, p, generator=g, dtype=torch.float64)).Q  # (n, d, p)
    Qb = torch.linalg.qr(torch.randn(n, d, q, generator=g, dtype=torch.float64)).Q  # (n, d, q)
    values = (Qa.transpose(1, 2) @ Qb).pow(2).sum(dim=(1, 2)) / min(p, q)  # (n,)
    torch.testing.assert_close(values[0], subspace_overlap(Qa[0], Qb[0]))
    expected = random_overlap(d, p, q)
    assert expected == pytest.approx(7 / 35)
    sem = float(values.std()) / math.sqrt(n)
    assert abs(float(values.mean()) - expected) < 4 * sem  # the sample mean sits within 4 standard errors
    with pytest.raises(ValueError, match="cannot exceed"):
        random_overlap(4, 5, 1)


def test_subspace_overlaps_per_layer_gqa_and_json(tmp_path) -> None:
    cfg = hs.ModelConfig(
        arch="decoder", vocab_size=37, d_model=30, n_layers=2, n_heads=6, n_kv_heads=2, max_seq_len=16
    )
    model = hs.Decoder(cfg)
    q = subspace_overlaps(model, "q")
    k = subspace_overlaps(model, "k")
    o = subspace_overlaps(model, "o")
    assert q.overlap.shape == (2, 6, 6) and k.overlap.shape == (2, 2, 2) and o.overlap.shape == (2, 6, 6)
    torch.testing.assert_close(q.random_expected, torch.tensor([5 / 30, 5 / 30]))
    torch.testing.assert_close(q.rank, torch.full((2, 6), 5.0))
    torch.testing.assert_close(q.overlap[1], overlap_matrix(model.blocks[1].attn, "q"))
    off = q.overlap[0][~torch.eye(6, dtype=torch.bool)]
    torch.testing.assert_close(q.mean_offdiag[0], off.mean())
    path = tmp_path / "sub" / "ov.json"
    written = k.to_json(path)  # with a path: the file is written and its Path returned, not the text
    assert written == path and isinstance(written, Path)
    data = json.loads(path.read_text())
    assert data == json.loads(k.to_json())
    assert data["kind"] == "subspace_overlaps" and data["which"] == "k"
    assert len(data["overlap"]) == 2 and len(data["overlap"][0]) == 2
    with pytest.raises(ValueError, match=r"which must be one of \('q', 'k', 'v', 'o'\); got 'x'"):
        subspace_overlaps(model, "x")


def test_circuit_spectra_match_dense_circuits_and_copying_head() -> None:
    attn = MultiHeadAttention(d_model=35, n_heads=7, n_kv_heads=7)
    with torch.no_grad():  # head 2 copies: W_V W_O is a positive projection
        attn.W_V[2] = torch.linalg.qr(torch.randn(35, 5)).Q
        attn.W_O[2] = 3.0 * attn.W_V[2].T
        attn.W_O[4] = 0.0
    spec = circuit_spectra(attn)
    for h in range(7):
        dense_qk = (attn.W_Q[h] @ attn.W_K[h].T).detach().double()
        dense_ov = (attn.W_V[h] @ attn.W_O[h]).detach().double()
        torch.testing.assert_close(spec.qk_singular_values[0, h], torch.linalg.svdvals(dense_qk)[:5].float())
        torch.testing.assert_close(spec.ov_norm[0, h], torch.linalg.matrix_norm(dense_ov).float())
    torch.testing.assert_close(spec.ov_copying[0, 2], torch.tensor(1.0))
    torch.testing.assert_close(spec.ov_effective_rank[0, 2], torch.tensor(5.0))
    assert float(spec.ov_norm[0, 4]) == 0.0 and math.isnan(float(spec.ov_copying[0, 4]))
    assert json.loads(spec.to_json())["ov_copying"][0][4] is None  # NaN -> null


def test_qk_ov_circuits_are_gqa_aware() -> None:
    attn = MultiHeadAttention(d_model=30, n_heads=6, n_kv_heads=2)
    qk, ov = analysis.qk_circuit(attn), analysis.ov_circuit(attn)
    assert qk.shape == (6, 30, 30) and ov.shape == (6, 30, 30)
    for h in range(6):
        torch.testing.assert_close(qk[h].AB, attn.heads[h].qk().AB)
        torch.testing.assert_close(ov[h].AB, attn.heads[h].ov().AB)
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 1\)"):
        analysis.qk_circuit(attn, 1)


def test_head_angles_between_heads_and_layers_gqa_aware() -> None:
    cfg = hs.ModelConfig(
        arch="encoder", vocab_size=37, d_model=30, n_layers=2, n_heads=6, n_kv_heads=2, max_seq_len=16
    )
    model = hs.Encoder(cfg)
    a0, a1 = model.blocks[0].attn, model.blocks[1].attn
    with torch.no_grad():
        a1.W_Q[4] = a0.W_Q[1] @ torch.randn(5, 5)  # same subspace in another layer
    angles = analysis.head_angles(model, (0, 1), (1, 4), "q")
    torch.testing.assert_close(angles, torch.zeros(5))
    torch.testing.assert_close(
        analysis.head_angles(model, (0, 0), (0, 2), "k"), torch.zeros(5)
    )  # one kv head
    want = principal_angles(a0.W_K[0].detach(), a0.W_K[1].detach())
    torch.testing.assert_close(analysis.head_angles(model, (0, 0), (0, 3), "k"), want)
    want = principal_angles(a0.W_O[0].detach().T, a1.W_O[5].detach().T)
    torch.testing.assert_close(analysis.head_angles(model, (0, 0), (1, 5), "o"), want)
    with pytest.raises(ValueError, match=r"b: head must be an int in \[0, 6\) for layer 1; got 6"):
        analysis.head_angles(model, (0, 0), (1, 6))
    with pytest.raises(TypeError, match=r"a must be a \(layer, head\) pair"):
        analysis.head_angles(model, 0, (1, 1))


def test_analysis_of_a_pruned_model_pads_missing_heads_with_nan() -> None:
    cfg = hs.ModelConfig(arch="encoder", vocab_size=37, d_model=35, n_layers=2, n_heads=7, max_seq_len=16)
    model = hs.Encoder(cfg).eval()
    hs.prune_heads(model, {1: [0, 3]})
    tokens = torch.randint(0, 37, (2, 11))
    roles = head_roles(model, tokens)
    assert [len(row) for row in roles.labels] == [7, 5]
    assert torch.isnan(roles.previous[1, 5:]).all() and not torch.isnan(roles.previous[1, :5]).any()
    spec = circuit_spectra(model)
    assert spec.qk_norm.shape == (2, 7) and torch.isnan(spec.qk_norm[1, 5:]).all()
    ov = subspace_overlaps(model, "q")
    assert ov.overlap.shape == (2, 7, 7) and torch.isnan(ov.overlap[1, 5:]).all()
    mix = head_mixing(model, tokens)
    torch.testing.assert_close(mix.share[1, ..., :5].sum(-1), torch.ones(2, 11))
    imp = head_importance(model, tokens, progress=False)
    assert int(torch.isnan(imp.scores).sum()) == 2
    data = json.loads(roles.to_json())
    assert data["previous"][1][5] is None


# ------------------------------------------------------------------------------------------ mixing


def test_zeroed_W_O_block_gets_zero_share_and_shares_sum_to_one() -> None:
    attn = MultiHeadAttention(d_model=35, n_heads=7)
    with torch.no_grad():
        attn.W_O[3] = 0.0
    x = torch.randn(2, 3, 35)
    mix = head_mixing(attn, x)
    assert mix.share.shape == (1, 2, 3, 7) and mix.mean_share.shape == (1, 7)
    assert torch.count_nonzero(mix.share[..., 3]) == 0 and torch.count_nonzero(mix.projection[..., 3]) == 0
    assert float(mix.wo_norm[0, 3]) == 0.0 and float(mix.mean_share[0, 3]) == 0.0
    torch.testing.assert_close(mix.share.sum(-1), torch.ones(1, 2, 3))
    torch.testing.assert_close(mix.projection.sum(-1), torch.ones(1, 2, 3))
    with hs.trace(attn, "hook_result") as t:
        attn(x)
    norms = t["hook_result"].norm(dim=-1)  # (2, 3, 7)
    torch.testing.assert_close(mix.share[0], norms / norms.sum(-1, keepdim=True))
    torch.testing.assert_close(wo_norms(attn)[0], attn.W_O.detach().norm(dim=(1, 2)))


def test_mixing_mean_share_uses_only_real_tokens() -> None:
    cfg = hs.ModelConfig(arch="encoder", vocab_size=37, d_model=35, n_layers=2, n_heads=7, max_seq_len=16)
    model = hs.Encoder(cfg).eval()
    tokens = torch.randint(0, 37, (2, 11))
    pad = torch.ones(2, 11, dtype=torch.bool)
    pad[0, 5:] = False
    mix = head_mixing(model, tokens, key_padding=pad)
    want = torch.cat([mix.share[:, 0, :5], mix.share[:, 1]], dim=1).mean(1)  # (n_layers, n_heads)
    torch.testing.assert_close(mix.mean_share, want)
    assert torch.equal(mix.tokens, tokens) and torch.equal(mix.key_padding, pad)


def test_subspace_functions_refuse_integer_nan_and_a_model_for_a_layer() -> None:
    with pytest.raises(
        TypeError, match=r"A must be a floating-point tensor .*got dtype torch.int64 \(shape \[11, 5\]\)"
    ):
        analysis.orthonormal_basis(torch.ones(11, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"A has 1 non-finite values \(NaN/Inf\) of 55"):
        analysis.orthonormal_basis(
            torch.randn(11, 5).index_put_((torch.tensor(3), torch.tensor(2)), torch.tensor(float("nan")))
        )
    B = torch.randn(11, 3)
    B[0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"B has 1 non-finite values \(NaN/Inf\) of 33 \(shape \[11, 3\]\)"):
        principal_angles(torch.randn(11, 5), B)
    with pytest.raises(ValueError, match=r"A has 55 non-finite values"):
        principal_angles(torch.full((11, 5), float("nan")), torch.randn(11, 3))
    with pytest.raises(ValueError, match=r"A has 55 non-finite values"):
        subspace_overlap(torch.full((11, 5), float("nan")), torch.randn(11, 3))
    enc = hs.Encoder(
        hs.ModelConfig(
            arch="encoder", vocab_size=37, d_model=35, n_layers=2, n_heads=7, d_mlp=23, max_seq_len=19
        )
    )
    with pytest.raises(
        TypeError, match=r"attn must be one MultiHeadAttention layer .*got Encoder .*subspace_overlaps"
    ):
        overlap_matrix(enc)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"attn must be one MultiHeadAttention layer"):
        analysis.head_subspaces(enc, "q")  # type: ignore[arg-type]
    with torch.no_grad():
        enc.blocks[1].attn.W_Q[2, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"W_Q has 1 non-finite values"):
        subspace_overlaps(enc, "q")
    # integer matrices stay accepted where they were: principal_angles works in float64 inside
    assert principal_angles(torch.eye(11, 2, dtype=torch.long), torch.eye(11, 3)).tolist() == [0.0, 0.0]


# ------------------------------------------------------------------------------------------ importance


def small_decoder() -> hs.Decoder:
    cfg = hs.ModelConfig(
        arch="decoder", vocab_size=37, d_model=35, n_layers=2, n_heads=7, d_mlp=23, max_seq_len=16
    )
    model = hs.Decoder(cfg).eval()
    with torch.no_grad():
        model.blocks[1].attn.W_O[5] = 0.0  # this head writes nothing: importance exactly 0
        for block in model.blocks:
            block.attn.o_bias.normal_()
    return model


@torch.no_grad()
def lm_loss(model: hs.Decoder, tokens: torch.Tensor) -> float:
    """Float32 mean next-token loss (the importance code sums in float64)."""
    logits = model(tokens)
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 37), tokens[:, 1:].reshape(-1)))


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_decoder_importance_is_the_loss_change_of_each_ablation(mode: str) -> None:
    model = small_decoder()
    tokens = torch.randint(0, 37, (2, 11))
    imp = head_importance(model, tokens, mode=mode, progress=False)
    assert imp.metric == "loss" and imp.mode == mode and imp.scores.shape == (2, 7)
    assert imp.baseline == pytest.approx(lm_loss(model, tokens), rel=1e-6)
    means = analysis.mean_z(model, tokens) if mode == "mean" else None
    for layer, head in [(0, 0), (1, 3), (1, 6)]:  # the batched result equals one ablate() run per head
        with hs.ablate(model, {(layer, head): mode}, means=means):
            want = lm_loss(model, tokens) - imp.baseline
        # abs: a float32 loss near 3.6 is resolved to ~4e-7, and the score is a difference of two losses
        assert float(imp.scores[layer, head]) == pytest.approx(want, rel=1e-5, abs=2e-6)
    if mode == "zero":
        # zero up to float32 rounding: the ablated layer runs the explicit path, the baseline the fused one
        assert float(imp.scores[1, 5]) == pytest.approx(0.0, abs=1e-6)
        assert abs(float(imp.scores[1, 5])) < 1e-3 * float(imp.scores.nan_to_num().abs().max())
    assert not any(b.attn.hooks_active for b in model.blocks)


def test_importance_callable_metric_heads_subset_and_bad_input() -> None:
    model = small_decoder()
    tokens = torch.randint(0, 37, (2, 11))

    def neg_loss(m: hs.Decoder) -> float:
        return -lm_loss(m, tokens)

    imp = head_importance(model, metric=neg_loss, heads=[(0, 1), (1, 5)], progress=False)
    assert imp.metric == "neg_loss"
    assert int(torch.isnan(imp.scores).sum()) == 12
    ref = head_importance(model, tokens, heads=[(0, 1)], progress=False)
    # float32 (neg_loss) against float64 (built-in) sums: a float32 loss near 3.6 is resolved to ~4e-7
    assert float(imp.scores[0, 1]) == pytest.approx(-float(ref.scores[0, 1]), abs=2e-6)
    assert imp.ranking()[0][:2] in [(0, 1), (1, 5)]
    with pytest.raises(ValueError, match=r"heads: \(2, 0\) is not a \(layer, head\)"):
        head_importance(model, tokens, heads=[(2, 0)], progress=False)
    with pytest.raises(ValueError, match="mode must be one of"):
        head_importance(model, tokens, mode="max", progress=False)
    with pytest.raises(ValueError, match="metric must be one of"):
        head_importance(model, tokens, metric="bleu", progress=False)
    with pytest.raises(ValueError, match="inputs are needed"):
        head_importance(model, progress=False)


def small_encoder() -> hs.Encoder:
    cfg = hs.ModelConfig(
        arch="encoder", vocab_size=37, d_model=35, n_layers=2, n_heads=7, d_mlp=23, max_seq_len=19
    )
    return hs.Encoder(cfg).eval()


def test_loss_metric_is_refused_for_an_encoder() -> None:
    enc = small_encoder()
    tokens = torch.randint(0, 37, (2, 3))
    with pytest.raises(
        ValueError,
        match=r"metric='loss' is a decoder metric.*got model Encoder \(arch='encoder'\).*metric='cosine'",
    ):
        head_importance(enc, tokens, metric="loss", progress=False)
    assert head_importance(enc, tokens, heads=[(0, 1)], progress=False).metric == "cosine"  # auto


def test_importance_heads_as_lists_and_bad_heads() -> None:
    enc = small_encoder()
    tokens = torch.randint(0, 37, (2, 3))
    as_lists = head_importance(enc, tokens, heads=[[0, 1], [1, 6]], progress=False)
    as_tuples = head_importance(enc, tokens, heads=[(0, 1), (1, 6)], progress=False)
    torch.testing.assert_close(as_lists.scores, as_tuples.scores, equal_nan=True)
    assert int(torch.isnan(as_lists.scores).sum()) == 12
    with pytest.raises(
        TypeError,
        match=r"heads\[0\] must be a \(layer, head\) pair of ints; got 0 \(for one head pass heads=\[",
    ):
        head_importance(enc, tokens, heads=(0, 1), progress=False)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"heads\[1\] must be a \(layer, head\) pair of ints; got \(0, 1, 2\)"
    ):
        head_importance(enc, tokens, heads=[(0, 1), (0, 1, 2)], progress=False)  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"heads must be a list of \(layer, head\) pairs"):
        head_importance(enc, tokens, heads=3, progress=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"heads: \(0, 7\) is not a \(layer, head\)"):
        head_importance(enc, tokens, heads=[[0, 7]], progress=False)


def test_mean_z_refuses_inputs_without_a_real_token() -> None:
    enc = small_encoder()
    tokens = torch.randint(0, 37, (2, 3))
    none_real = torch.zeros(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"no real token was given \(key_padding is all False"):
        analysis.mean_z(enc, tokens, key_padding=none_real)
    with pytest.raises(ValueError, match=r"no real token was given"):
        head_importance(enc, tokens, key_padding=none_real, mode="mean", progress=False)
    one_real = none_real.clone()
    one_real[1, 2] = True
    assert analysis.mean_z(enc, tokens, key_padding=one_real)[(0, 0)].shape == (5,)


def test_importance_restores_training_mode() -> None:
    model = small_decoder().train()
    head_importance(model, torch.randint(0, 37, (2, 5)), heads=[(0, 0)], progress=False)
    assert model.training and all(b.training for b in model.blocks)


# ------------------------------------------------------------------------------------------ MiniLM

SENTENCES = ["The cat sat on the mat.", "Heads attend."]


@pytest.fixture(scope="module")
def minilm():
    return hs.load("minilm")


@pytest.mark.slow
def test_minilm_roles_importance_overlaps_are_computed_and_reproducible(minilm) -> None:
    roles = [head_roles(minilm, SENTENCES) for _ in range(2)]
    imps = [head_importance(minilm, SENTENCES, progress=False) for _ in range(2)]
    overlaps = [subspace_overlaps(minilm, "q") for _ in range(2)]
    for a, b in (roles, imps, overlaps):
        assert a.to_dict() == b.to_dict()
    r, imp, ov = roles[0], imps[0], overlaps[0]
    assert r.previous.shape == (6, 12) and len(r.labels) == 6 and all(len(row) == 12 for row in r.labels)
    assert imp.scores.shape == (6, 12) and not torch.isnan(imp.scores).any()
    assert ov.overlap.shape == (6, 12, 12)
    torch.testing.assert_close(ov.random_expected, torch.full((6,), 32 / 384))
    # what the pretrained model learned (not constructed here): layer 0 head 2 is a previous-token head
    assert r.labels[0][2] == "previous"
    # learned heads are not random: their W_Q subspaces overlap more than random 32-dim subspaces would
    assert bool((ov.mean_offdiag > ov.random_expected).all())


def test_minilm_importance_equals_encode_with_the_head_ablated(minilm) -> None:
    imp = head_importance(minilm, SENTENCES, heads=[(0, 2), (5, 11)], progress=False)
    ref = minilm.encode(SENTENCES)
    for layer, head in [(0, 2), (5, 11)]:
        with hs.ablate(minilm, {(layer, head): "zero"}):
            e = minilm.encode(SENTENCES)
        cos = torch.nn.functional.cosine_similarity(e.double(), ref.double(), dim=-1).mean()
        assert float(imp.scores[layer, head]) == pytest.approx(1.0 - float(cos), rel=1e-5, abs=1e-7)


def test_minilm_mixing_and_json(minilm) -> None:
    mix = head_mixing(minilm, SENTENCES)
    tokens, _ = minilm.tokenize(SENTENCES)
    assert mix.share.shape == (6, 2, tokens.shape[1], 12)
    torch.testing.assert_close(mix.share.sum(-1), torch.ones(6, 2, tokens.shape[1]))
    data = json.loads(mix.to_json())
    assert data["kind"] == "head_mixing" and len(data["wo_norm"]) == 6


def test_minilm_refuses_the_decoder_loss_metric(minilm) -> None:
    with pytest.raises(
        ValueError, match=r"metric='loss' is a decoder metric.*got model Encoder \(arch='encoder'\)"
    ):
        head_importance(minilm, SENTENCES, metric="loss", progress=False)
