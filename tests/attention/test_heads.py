"""Head views, FactoredMatrix (against the dense product), ablate() and prune_heads()."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import headspace as hs
from headspace import FactoredMatrix, MultiHeadAttention, ablate, prune_heads
from headspace.attention.circuits import effective_rank
from headspace.attention.pruning import shrink_attention


def small_encoder(n_heads: int = 7, n_kv_heads: int | None = None, bias: bool = True) -> hs.Encoder:
    cfg = hs.ModelConfig(
        arch="encoder",
        vocab_size=37,
        d_model=n_heads * 5,
        n_layers=2,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        d_mlp=23,
        max_seq_len=16,
        bias=bias,
    )
    model = hs.Encoder(cfg).eval()
    with torch.no_grad():  # non-zero biases, so "bias handled" is really tested
        for block in model.blocks:
            if block.attn.qkv_bias is not None:
                block.attn.qkv_bias.normal_()
                block.attn.o_bias.normal_()
    return model


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------ FactoredMatrix


def test_head_circuits_are_factored_views_of_the_layer() -> None:
    attn = MultiHeadAttention(d_model=35, n_heads=7, n_kv_heads=7)
    head = attn.heads[3]
    qk, ov = head.qk(), head.ov()
    assert isinstance(qk, FactoredMatrix) and isinstance(ov, FactoredMatrix)
    assert qk.shape == (35, 35) and qk.inner_dim == 5
    torch.testing.assert_close(qk.AB, attn.W_Q[3] @ attn.W_K[3].T)
    torch.testing.assert_close(ov.dense(), attn.W_V[3] @ attn.W_O[3])
    with torch.no_grad():  # views: writing the layer changes the circuit
        attn.W_O[3].zero_()
    assert torch.count_nonzero(head.ov().AB) == 0


def test_head_circuits_with_gqa_use_the_shared_kv_head() -> None:
    attn = MultiHeadAttention(d_model=30, n_heads=6, n_kv_heads=2)  # group size 3
    for h in range(6):
        torch.testing.assert_close(attn.heads[h].qk().AB, attn.W_Q[h] @ attn.W_K[h // 3].T)
        torch.testing.assert_close(attn.heads[h].ov().AB, attn.W_V[h // 3] @ attn.W_O[h])


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 11),
    n=st.integers(1, 11),
    r=st.integers(1, 7),
    batch=st.sampled_from([(), (3,), (2, 3)]),
)
def test_factored_svd_norms_match_the_dense_product(m: int, n: int, r: int, batch: tuple) -> None:
    g = torch.Generator().manual_seed(m * 100 + n * 10 + r)
    A = torch.randn(*batch, m, r, generator=g, dtype=torch.float64)
    B = torch.randn(*batch, r, n, generator=g, dtype=torch.float64)
    fm = FactoredMatrix(A, B)
    dense = A @ B
    assert fm.shape == dense.shape
    U, S, Vh = fm.svd()
    k = min(m, n, r)
    assert U.shape == (*batch, m, k) and S.shape == (*batch, k) and Vh.shape == (*batch, k, n)
    torch.testing.assert_close(U @ torch.diag_embed(S) @ Vh, dense)
    torch.testing.assert_close(S, torch.linalg.svdvals(dense)[..., :k])
    torch.testing.assert_close(fm.singular_values, S)
    torch.testing.assert_close(
        U.transpose(-2, -1) @ U, torch.eye(k, dtype=torch.float64).expand(*batch, k, k)
    )
    torch.testing.assert_close(fm.norm("fro"), torch.linalg.matrix_norm(dense, "fro"))
    torch.testing.assert_close(fm.norm("nuc"), torch.linalg.matrix_norm(dense, "nuc"))
    torch.testing.assert_close(fm.norm("spectral"), torch.linalg.matrix_norm(dense, 2))


def test_factored_products_transpose_and_indexing() -> None:
    A, B = torch.randn(3, 11, 5, dtype=torch.float64), torch.randn(3, 5, 13, dtype=torch.float64)
    C, D = torch.randn(3, 13, 2, dtype=torch.float64), torch.randn(3, 2, 7, dtype=torch.float64)
    f, g = FactoredMatrix(A, B), FactoredMatrix(C, D)
    X = torch.randn(13, 4, dtype=torch.float64)
    Y = torch.randn(6, 11, dtype=torch.float64)
    torch.testing.assert_close((f @ g).AB, A @ B @ C @ D)
    assert (f @ g).inner_dim == 2  # keeps the smaller inner dimension
    torch.testing.assert_close((f @ X).AB, A @ B @ X)
    torch.testing.assert_close((Y @ f).AB, Y @ A @ B)
    torch.testing.assert_close(f.T.AB, (A @ B).transpose(-2, -1))
    torch.testing.assert_close(f[1].AB, A[1] @ B[1])
    with pytest.raises(IndexError, match="no batch axes"):
        _ = f[1][0]


def test_factored_eigenvalues_match_the_dense_ones() -> None:
    A, B = torch.randn(9, 3, dtype=torch.float64), torch.randn(3, 9, dtype=torch.float64)
    fm = FactoredMatrix(A, B)
    ev = fm.eigenvalues()
    assert ev.shape == (3,)
    dense = torch.linalg.eigvals(A @ B)
    top = dense[dense.abs().argsort(descending=True)[:3]]  # the 6 others are 0
    torch.testing.assert_close(
        torch.sort(ev.real).values, torch.sort(top.real).values, atol=1e-9, rtol=1e-9
    )  # float64 eigensolvers differ in the last bits
    torch.testing.assert_close(
        dense.abs().sort().values[:6], torch.zeros(6, dtype=torch.float64), atol=1e-9, rtol=0
    )


def test_effective_rank_known_values() -> None:
    assert float(effective_rank(torch.tensor([3.0, 0.0, 0.0]))) == pytest.approx(1.0)
    assert float(effective_rank(torch.tensor([2.0, 2.0, 2.0, 2.0]))) == pytest.approx(4.0)
    assert float(effective_rank(torch.zeros(3))) == 0.0
    assert float(effective_rank(torch.tensor([2.0, 1.0]), "stable")) == pytest.approx(5 / 4)
    fm = FactoredMatrix(torch.randn(8, 2), torch.randn(2, 8))
    assert 1.0 <= float(fm.effective_rank()) <= 2.0 + 1e-6


def test_factored_matrix_bad_input() -> None:
    with pytest.raises(ValueError, match=r"same r.*A \[4, 3\], B \[2, 5\]"):
        FactoredMatrix(torch.randn(4, 3), torch.randn(2, 5))
    with pytest.raises(TypeError, match="A must be a tensor"):
        FactoredMatrix([[1.0]], torch.randn(1, 1))
    with pytest.raises(ValueError, match="at least 2 dims"):
        FactoredMatrix(torch.randn(4), torch.randn(4, 2))
    with pytest.raises(ValueError, match="do not broadcast"):
        FactoredMatrix(torch.randn(2, 4, 3), torch.randn(5, 3, 4))
    with pytest.raises(ValueError, match="kind must be"):
        FactoredMatrix(torch.randn(4, 3), torch.randn(3, 4)).norm("max")
    with pytest.raises(ValueError, match="square"):
        FactoredMatrix(torch.randn(4, 3), torch.randn(3, 5)).eigenvalues()


# ------------------------------------------------------------------------------------------ ablate


def test_zero_ablation_removes_exactly_the_head_contribution() -> None:
    attn = MultiHeadAttention(d_model=35, n_heads=7).eval()
    with torch.no_grad():
        attn.o_bias.normal_()
    x = torch.randn(2, 3, 35)
    with hs.trace(attn, "hook_result") as t:
        full = attn(x)
    with ablate(attn, {(0, 4): "zero"}):
        ablated = attn(x)
    torch.testing.assert_close(ablated, full - t["hook_result"][:, :, 4])
    torch.testing.assert_close(attn(x), full)  # hooks removed on exit
    assert not attn.hooks_active


def test_mean_ablation_default_and_given_means() -> None:
    attn = MultiHeadAttention(d_model=35, n_heads=7).eval()
    x = torch.randn(2, 3, 35)
    with hs.trace(attn, ["hook_z", "hook_result"]) as t:
        full = attn(x)
    z4 = t["hook_z"][:, :, 4]  # (2, 3, 5)
    mean = z4.mean(dim=(0, 1))
    with ablate(attn, {(0, 4): "mean"}):
        got = attn(x)
    want = full - t["hook_result"][:, :, 4] + mean @ attn.W_O[4]
    torch.testing.assert_close(got, want)
    given_mean = torch.randn(5)
    with ablate(attn, {(0, 4): "mean"}, means={(0, 4): given_mean}):
        got = attn(x)
    torch.testing.assert_close(got, full - t["hook_result"][:, :, 4] + given_mean @ attn.W_O[4])


def test_ablate_on_a_model_by_layer_and_list_form() -> None:
    model = small_encoder()
    tokens = torch.randint(0, 37, (2, 11))
    base = model(tokens)
    with ablate(model, [(1, 2), (0, 6)]):
        a = model(tokens)
    with ablate(model, {(1, 2): "zero", (0, 6): "zero"}):
        b = model(tokens)
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, base)
    torch.testing.assert_close(model(tokens), base)


def test_ablate_checks_means_before_the_block_runs() -> None:
    model = small_encoder()  # d_head 5
    with pytest.raises(
        ValueError, match=r"means\[\(0, 1\)\] must broadcast to \[batch, seq_q, d_head=5\].*got shape \[4\]"
    ):
        with ablate(model, {(0, 1): "mean"}, means={(0, 1): torch.zeros(4)}):
            pass
    with pytest.raises(TypeError, match=r"means\[\(0, 1\)\] must be a float tensor.*got list"):
        with ablate(model, {(0, 1): "mean"}, means={(0, 1): [0.0] * 5}):
            pass
    with pytest.raises(TypeError, match=r"must be a float tensor.*got dtype torch.int64"):
        with ablate(model, {(0, 1): "mean"}, means={(0, 1): torch.zeros(5, dtype=torch.long)}):
            pass
    for block in model.blocks:
        assert not block.attn.hooks_active


def test_factored_matrix_refuses_mixed_or_integer_factors_and_bad_products() -> None:
    A, B = torch.randn(3, 7), torch.randn(7, 5)
    with pytest.raises(TypeError, match=r"A and B must share dtype and device.*float32.*float64"):
        FactoredMatrix(A, B.double())
    with pytest.raises(TypeError, match=r"A must be a floating-point tensor; got dtype torch.int64"):
        FactoredMatrix(A.long(), B.long())
    m = FactoredMatrix(A, B)  # [3, 5]
    with pytest.raises(ValueError, match=r"inner sizes differ \(\[3, 5\] @ \[11, 2\], 5 != 11\)"):
        m @ torch.randn(11, 2)
    with pytest.raises(ValueError, match=r"inner sizes differ \(\[2, 7\] @ \[3, 5\], 7 != 3\)"):
        torch.randn(2, 7) @ m
    assert (m @ torch.randn(5, 2)).shape == (3, 2) and (torch.randn(2, 3) @ m).shape == (2, 5)
    bad = FactoredMatrix(
        A, B.clone().index_put_((torch.tensor([0]), torch.tensor([1])), torch.tensor(float("nan")))
    )
    for decompose in (lambda: bad.svd(), lambda: bad.singular_values, lambda: bad.norm()):
        with pytest.raises(
            ValueError, match=r"FactoredMatrix B has 1 NaN/Inf values of 35 \(shape \[7, 5\]\)"
        ):
            decompose()


def test_ablate_bad_input() -> None:
    model = small_encoder()
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\).*got 2"):
        with ablate(model, {(2, 0): "zero"}):
            pass
    with pytest.raises(ValueError, match=r"head must be an int in \[0, 7\) for layer 1; got 7"):
        with ablate(model, {(1, 7): "zero"}):
            pass
    with pytest.raises(ValueError, match=r"must be one of \('zero', 'mean'\); got 'half'"):
        with ablate(model, {(0, 0): "half"}):
            pass
    with pytest.raises(TypeError, match=r"\(layer, head\) pairs"):
        with ablate(model, {0: "zero"}):
            pass
    with pytest.raises(TypeError, match=r"nn\.Module"):
        with ablate(object(), {(0, 0): "zero"}):
            pass
    for block in model.blocks:
        assert not block.attn.hooks_active


# ------------------------------------------------------------------------------------------ pruning


@pytest.mark.parametrize("bias", [True, False])
def test_pruning_equals_zero_ablation_and_shrinks_the_weights(bias: bool) -> None:
    model = small_encoder(bias=bias)
    tokens = torch.randint(0, 37, (2, 11))
    drop = {0: [1, 4], 1: [6]}
    with ablate(model, [(layer, h) for layer, hs_ in drop.items() for h in hs_]):
        want = model(tokens)
    before = n_params(model)
    kept = prune_heads(model, drop)
    assert kept == {0: [0, 2, 3, 5, 6], 1: [0, 1, 2, 3, 4, 5]}
    per_head = 4 * 35 * 5 + (3 * 5 if bias else 0)  # W_Q, W_K, W_V, W_O blocks and b_Q, b_K, b_V
    assert before - n_params(model) == 3 * per_head
    a0, a1 = model.blocks[0].attn, model.blocks[1].attn
    assert (a0.n_heads, a0.n_kv_heads, a1.n_heads) == (5, 5, 6)
    assert a0.qkv_weight.shape == (3 * 5 * 5, 35) and a0.o_weight.shape == (35, 25)
    assert a0.W_Q.shape == (5, 35, 5) and a0.W_O.shape == (5, 5, 35)
    torch.testing.assert_close(model(tokens), want)


def test_pruned_heads_keep_their_weights() -> None:
    attn = MultiHeadAttention(d_model=35, n_heads=7)
    W_Q, W_O = attn.W_Q.detach().clone(), attn.W_O.detach().clone()
    prune_heads(attn, {0: [0, 3]})
    torch.testing.assert_close(attn.W_Q.detach(), W_Q[[1, 2, 4, 5, 6]], rtol=0, atol=0)
    torch.testing.assert_close(attn.W_O.detach(), W_O[[1, 2, 4, 5, 6]], rtol=0, atol=0)


def test_pruning_gqa_whole_groups_and_equal_groups() -> None:
    model = small_encoder(n_heads=6, n_kv_heads=2)  # heads 0-2 read kv 0, heads 3-5 read kv 1
    tokens = torch.randint(0, 37, (2, 11))
    with ablate(model, [(0, 3), (0, 4), (0, 5), (1, 0), (1, 3)]):
        want = model(tokens)
    prune_heads(model, {0: [3, 4, 5], 1: [0, 3]})
    a0, a1 = model.blocks[0].attn, model.blocks[1].attn
    assert (a0.n_heads, a0.n_kv_heads) == (3, 1)  # the whole group went with its kv head
    assert (a1.n_heads, a1.n_kv_heads, a1.group_size) == (4, 2, 2)  # one head from each group
    torch.testing.assert_close(model(tokens), want)


def test_pruning_refuses_unequal_groups_and_all_heads_before_changing_anything() -> None:
    model = small_encoder(n_heads=6, n_kv_heads=2)
    before = n_params(model)
    with pytest.raises(ValueError, match=r"heads\[1\]: .*unequal.*\{0: 2, 1: 3\}"):
        prune_heads(model, {0: [0, 1, 2], 1: [0]})
    assert n_params(model) == before  # layer 0 was valid but nothing was changed
    with pytest.raises(ValueError, match=r"all 6 heads of layer 0"):
        prune_heads(model, {0: list(range(6))})
    with pytest.raises(ValueError, match=r"head must be an int in \[0, 6\)"):
        prune_heads(model, {0: [6]})
    with pytest.raises(TypeError, match=r"heads\[0\] must be a list"):
        prune_heads(model, {0: 3})
    with pytest.raises(ValueError, match="at least one head"):
        shrink_attention(model.blocks[0].attn, [])


def test_pruned_model_is_rebuilt_by_its_config_and_its_checkpoint_loads(tmp_path) -> None:
    import json

    from headspace.train.checkpoint import load_checkpoint, load_weights_into, save_checkpoint

    model = small_encoder().eval()
    config = model.config
    tokens = torch.randint(0, 37, (2, 11))
    with ablate(model, [(0, 1), (0, 4), (0, 5), (1, 6)]):
        want = model(tokens)
    prune_heads(model, {0: [1, 4]})
    assert prune_heads(model, {0: [3], 1: [6]}) == {0: [0, 1, 2, 4], 1: [0, 1, 2, 3, 4, 5]}
    # the second call named layer 0's current head 3, which was head 5 before any pruning
    assert model.config.pruned_heads == {0: [1, 4, 5], 1: [6]}
    assert config.pruned_heads == {}  # the config the model was built from is not mutated
    assert model.config.n_heads == 7 and model.blocks[0].attn.n_heads == 4
    torch.testing.assert_close(model(tokens), want)

    again = hs.Encoder(hs.ModelConfig.from_dict(json.loads(json.dumps(model.config.to_dict())))).eval()
    assert [b.attn.n_heads for b in again.blocks] == [4, 6]
    again.load_state_dict(model.state_dict())  # strict: every name and shape agrees
    torch.testing.assert_close(again(tokens), want)

    save_checkpoint(tmp_path, 3, config={"model": model.config.to_dict()}, model=model)
    ckpt = load_checkpoint(tmp_path)
    restored = hs.Encoder(hs.ModelConfig.from_dict(ckpt.config["model"])).eval()
    load_weights_into(restored, ckpt)
    torch.testing.assert_close(
        restored(tokens), model(tokens), rtol=0, atol=0
    )  # the same weights, bit for bit


def test_pruning_updates_a_loaded_models_config() -> None:
    from headspace.pretrained import PretrainedEncoder

    enc = PretrainedEncoder(small_encoder(), None)
    prune_heads(enc, {1: [0, 2]})
    assert enc.config is enc.model.config and enc.config.pruned_heads == {1: [0, 2]}
    # a layer already changed behind the config's back is not recorded (the config cannot say it)
    other = small_encoder()
    shrink_attention(other.blocks[0].attn, [0, 1, 2])
    prune_heads(other, {1: [0]})
    assert other.config.pruned_heads == {} and other.blocks[1].attn.n_heads == 6


def test_pruning_refuses_a_torch_layout_layer_and_names_the_way_out() -> None:
    from headspace import compat, layouts

    mha = compat.MultiheadAttention(35, 7, batch_first=True).eval()
    x = torch.randn(2, 3, 35)
    before = mha(x, x, x, need_weights=False)[0]
    with pytest.raises(
        ValueError, match=r"heads\[0\]: .*compat\.MultiheadAttention.*cannot lose heads.*from_torch_mha"
    ):
        prune_heads(mha, {0: [1]})
    torch.testing.assert_close(mha(x, x, x, need_weights=False)[0], before, rtol=0, atol=0)  # untouched
    layer = layouts.from_torch_mha(mha.state_dict(), n_heads=7).eval()  # the way out the message names
    with ablate(layer, [(0, 1)]):
        want = layer(x)
    prune_heads(layer, {0: [1]})
    torch.testing.assert_close(layer(x), want)


def test_pruning_cross_attention_layer() -> None:
    attn = MultiHeadAttention(d_model=35, n_heads=7, kdim=11, vdim=13).eval()
    x, c = torch.randn(2, 3, 35), torch.randn(2, 5, 11)
    v = torch.randn(2, 5, 13)
    with ablate(attn, [(0, 2)]):
        want = attn(x, c, v)
    prune_heads(attn, {0: [2]})
    assert attn.k_weight.shape == (30, 11) and attn.v_weight.shape == (30, 13)
    torch.testing.assert_close(attn(x, c, v), want)


def test_head_views_need_only_the_headed_layer_protocol() -> None:
    """heads.py knows the layer only as HeadedLayer: the layer satisfies it, and any object that does
    gets the same views and circuits (so heads imports nothing from the layer, not even for types)."""
    import ast
    import inspect

    import headspace.heads as heads_module
    from headspace.heads import Head, HeadedLayer

    tree = ast.parse(inspect.getsource(heads_module))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"layer", "compat", "headspace.attention.layer", "headspace.attention"}, imported

    torch.manual_seed(0)
    attn = MultiHeadAttention(d_model=3 * 5, n_heads=3, qkv_bias=True)
    assert isinstance(attn, HeadedLayer)

    class Plain:
        """Hand-made per-head tensors, no MultiHeadAttention: W_Q [H, d_model, dh] etc."""

        n_heads, d_model, d_head, group_size = 3, 15, 5, 1
        W_Q, W_K, W_V, W_O = attn.W_Q.clone(), attn.W_K.clone(), attn.W_V.clone(), attn.W_O.clone()
        b_Q, b_K, b_V = attn.b_Q.clone(), attn.b_K.clone(), attn.b_V.clone()

    plain = Plain()
    assert isinstance(plain, HeadedLayer)
    for h in range(3):
        ours, theirs = attn.heads[h], Head(plain, h)
        torch.testing.assert_close(theirs.qk(augmented=True).AB, ours.qk(augmented=True).AB, rtol=0, atol=0)
        torch.testing.assert_close(theirs.ov().AB, ours.ov().AB, rtol=0, atol=0)
        expected = attn.W_Q[h] @ attn.W_K[h].T  # (d_model, d_model), by hand
        torch.testing.assert_close(theirs.qk().AB, expected)
