"""masks.py: the one mask convention, the causal rule (AND, bottom-right aligned), dead rows, shapes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.testing import assert_close

from headspace import MultiHeadAttention, canonical_mask, causal_mask
from headspace import masks as masks_module

pytestmark = pytest.mark.usefixtures("single_thread")

T, F = True, False


def allowed_of(cm: masks_module.CanonicalMask, batch: int, n_heads: int, seq_q: int, seq_k: int) -> Tensor:
    """The set of (batch, head, query, key) a canonical mask lets through, dead rows counted as empty."""
    if cm.is_causal:
        allowed = causal_mask(seq_q, seq_k)[None, None]  # (1, 1, seq_q, seq_k)
    elif cm.mask is None:
        allowed = torch.ones(1, 1, seq_q, seq_k, dtype=torch.bool)
    elif cm.mask.dtype == torch.bool:
        allowed = cm.mask
    else:
        allowed = ~torch.isneginf(cm.mask)
    allowed = allowed.expand(batch, n_heads, seq_q, seq_k)
    if cm.dead_rows is not None:
        allowed = allowed & ~cm.dead_rows
    return allowed


# --- causal_mask
def test_causal_mask_square_is_the_lower_triangle() -> None:
    assert torch.equal(causal_mask(3, 3), torch.tensor([[T, F, F], [T, T, F], [T, T, T]]))


def test_causal_mask_is_aligned_bottom_right() -> None:
    # fewer queries than keys: the queries are the last positions (a KV cache decoding step)
    assert torch.equal(causal_mask(2, 4), torch.tensor([[T, T, T, F], [T, T, T, T]]))
    assert torch.equal(causal_mask(1, 5), torch.ones(1, 5, dtype=torch.bool))
    # more queries than keys: the first queries see nothing (dead rows)
    assert torch.equal(causal_mask(4, 2), torch.tensor([[F, F], [F, F], [T, F], [T, T]]))


def test_the_rule_is_documented() -> None:
    doc = masks_module.__doc__ or ""
    assert "True = may attend" in doc
    assert "logical AND" in doc and "bottom-right" in doc
    for shape in ("``[seq_q, seq_k]``", "``[batch, seq_q, seq_k]``", "``[batch, n_heads, seq_q, seq_k]``"):
        assert shape in doc


# --- canonical_mask
def test_no_mask_is_none() -> None:
    cm = canonical_mask(batch=2, n_heads=3, seq_q=5, seq_k=7)
    assert cm.mask is None and not cm.is_causal and cm.dead_rows is None


def test_causal_alone_and_square_uses_the_causal_kernel() -> None:
    cm = canonical_mask(batch=2, n_heads=3, seq_q=5, seq_k=5, is_causal=True)
    assert cm.mask is None and cm.is_causal and cm.dead_rows is None


def test_causal_non_square_becomes_a_bottom_right_mask() -> None:
    cm = canonical_mask(batch=2, n_heads=3, seq_q=2, seq_k=5, is_causal=True)
    assert not cm.is_causal and cm.dead_rows is None
    assert torch.equal(cm.mask, causal_mask(2, 5)[None, None])


def test_causal_with_more_queries_than_keys_records_dead_rows() -> None:
    cm = canonical_mask(batch=2, n_heads=3, seq_q=5, seq_k=2, is_causal=True)
    assert cm.dead_rows is not None
    assert torch.equal(cm.dead_rows[0, 0, :, 0], torch.tensor([T, T, T, F, F]))
    # dead rows are opened up (every key allowed) so that no softmax sees a row of -inf
    assert cm.mask[0, 0, :3].all()
    assert torch.equal(cm.mask[0, 0, 3:], torch.tensor([[T, F], [T, T]]))


def test_causal_and_key_padding_is_and() -> None:
    pad = torch.tensor([[T, F, T, T], [T, T, T, F]])
    cm = canonical_mask(batch=2, n_heads=3, seq_q=4, seq_k=4, key_padding=pad, is_causal=True)
    want = causal_mask(4, 4)[None, None] & pad[:, None, None, :]  # (2, 1, 4, 4)
    assert torch.equal(allowed_of(cm, 2, 3, 4, 4), want.expand(2, 3, 4, 4))


def test_causal_and_bool_mask_is_and() -> None:
    m = torch.rand(2, 3, 3, 5) > 0.3
    cm = canonical_mask(batch=2, n_heads=3, seq_q=3, seq_k=5, attn_mask=m, is_causal=True)
    want = m & causal_mask(3, 5)
    dead = ~want.any(-1, keepdim=True)
    assert torch.equal(allowed_of(cm, 2, 3, 3, 5), want & ~dead)


def test_causal_and_float_mask_keeps_values_and_blocks_the_future() -> None:
    m = torch.randn(3, 3)
    cm = canonical_mask(batch=1, n_heads=1, seq_q=3, seq_k=3, attn_mask=m, is_causal=True)
    assert cm.mask.dtype == torch.float32 and cm.dead_rows is None
    tri = causal_mask(3, 3)
    assert torch.equal(cm.mask[0, 0][tri], m[tri])
    assert torch.isneginf(cm.mask[0, 0][~tri]).all()


def test_float_mask_dead_row_is_recorded_and_opened() -> None:
    m = torch.zeros(3, 4)
    m[1] = float("-inf")
    m[2, :2] = float("-inf")
    cm = canonical_mask(batch=2, n_heads=1, seq_q=3, seq_k=4, attn_mask=m)
    assert torch.equal(cm.dead_rows[0, 0, :, 0], torch.tensor([F, T, F]))
    assert torch.isfinite(cm.mask[0, 0, 1]).all()
    assert torch.isneginf(cm.mask[0, 0, 2, :2]).all()


@pytest.mark.parametrize(
    ("shape", "canon"),
    [
        ((3, 5), (1, 1, 3, 5)),
        ((2, 3, 5), (2, 1, 3, 5)),
        ((1, 3, 5), (1, 1, 3, 5)),
        ((2, 7, 3, 5), (2, 7, 3, 5)),
        ((1, 7, 3, 5), (1, 7, 3, 5)),
        ((2, 1, 3, 5), (2, 1, 3, 5)),
        ((1, 1, 3, 5), (1, 1, 3, 5)),
        ((2, 1, 1, 5), (2, 1, 1, 5)),  # Hugging Face-style padding: kept small, broadcast where used
        ((1, 5), (1, 1, 1, 5)),
        ((2, 3, 1), (2, 1, 3, 1)),
    ],
)
def test_accepted_shapes_broadcast(shape: tuple, canon: tuple) -> None:
    m = torch.ones(shape, dtype=torch.bool)
    cm = canonical_mask(batch=2, n_heads=7, seq_q=3, seq_k=5, attn_mask=m)
    assert tuple(cm.mask.shape) == canon


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("shape", [(2, 1, 1, 5), (2, 1, 3, 1), (1, 5)])
def test_seq_broadcast_masks_equal_their_full_expansion(shape: tuple, need_weights: bool) -> None:
    # every path (SDPA, the explicit kernel) and the gradients; with is_causal; dead rows stay zero
    torch.manual_seed(3)
    layer = MultiHeadAttention(6, 3, n_kv_heads=1, kdim=7, vdim=11).double()
    q = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    k, v = torch.randn(2, 5, 7, dtype=torch.float64), torch.randn(2, 5, 11, dtype=torch.float64)
    small = torch.rand(shape) > 0.4
    full = small.expand(2, 3, 5) if small.dim() == 2 else small.expand(2, 1, 3, 5)
    for mask in (small, torch.where(small, 0.0, float("-inf")).double()):
        wide = full.clone() if mask.dtype == torch.bool else torch.where(full, 0.0, float("-inf")).double()
        got = layer(q, k, v, attn_mask=mask, is_causal=True, need_weights=need_weights)
        want = layer(q, k, v, attn_mask=wide, is_causal=True, need_weights=need_weights)
        got, want = (got, want) if need_weights else ((got,), (want,))
        for a, b in zip(got, want):
            assert_close(a, b, rtol=0, atol=1e-12)
        (ga,) = torch.autograd.grad(got[0].sum(), q)
        (gb,) = torch.autograd.grad(want[0].sum(), q)
        assert_close(ga, gb, rtol=0, atol=1e-12)
        assert torch.isfinite(ga).all()


def test_3d_mask_is_per_sample_not_per_head() -> None:
    """A 3-D mask is [batch, seq_q, seq_k]: sample b's mask applies to every head of sample b."""
    m = torch.zeros(2, 3, 5, dtype=torch.bool)
    m[0, :, 0] = True
    m[1, :, 4] = True
    cm = canonical_mask(batch=2, n_heads=7, seq_q=3, seq_k=5, attn_mask=m)
    allowed = allowed_of(cm, 2, 7, 3, 5)
    assert allowed[0, :, :, 0].all() and not allowed[0, :, :, 1:].any()
    assert allowed[1, :, :, 4].all() and not allowed[1, :, :, :4].any()


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 3),
    n_heads=st.integers(1, 3),
    seq_q=st.integers(1, 5),
    seq_k=st.integers(1, 5),
    mask_dims=st.sampled_from([0, 2, 3, 4]),
    use_padding=st.booleans(),
    is_causal=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_canonical_mask_allows_exactly_the_and_of_its_parts(
    batch: int,
    n_heads: int,
    seq_q: int,
    seq_k: int,
    mask_dims: int,
    use_padding: bool,
    is_causal: bool,
    seed: int,
) -> None:
    g = torch.Generator().manual_seed(seed)
    want = torch.ones(batch, n_heads, seq_q, seq_k, dtype=torch.bool)
    kw: dict = {"is_causal": is_causal}
    if use_padding:
        kw["key_padding"] = torch.rand(batch, seq_k, generator=g) > 0.4
        want &= kw["key_padding"][:, None, None, :]
    if mask_dims:
        shape = {2: (seq_q, seq_k), 3: (batch, seq_q, seq_k), 4: (batch, n_heads, seq_q, seq_k)}[mask_dims]
        kw["attn_mask"] = torch.rand(shape, generator=g) > 0.4
        m = kw["attn_mask"]
        want &= m if mask_dims == 4 else (m[:, None] if mask_dims == 3 else m)
    if is_causal:
        for i in range(seq_q):
            for j in range(seq_k):
                if j - i > seq_k - seq_q:
                    want[:, :, i, j] = False
    cm = canonical_mask(batch=batch, n_heads=n_heads, seq_q=seq_q, seq_k=seq_k, **kw)
    assert torch.equal(allowed_of(cm, batch, n_heads, seq_q, seq_k), want)
    dead_want = ~want.any(-1, keepdim=True)
    if cm.dead_rows is None:
        assert not dead_want.any()
    else:
        assert torch.equal(cm.dead_rows.expand_as(dead_want), dead_want)
        # every row the backends see has at least one open key
        assert (
            allowed_of(masks_module.CanonicalMask(cm.mask, cm.is_causal, None), batch, n_heads, seq_q, seq_k)
            .any(-1)
            .all()
        )


# --- canonical_mask errors (the layer-level messages are in test_attention_errors.py)
def test_causal_mask_refuses_negative_and_fractional_lengths() -> None:
    with pytest.raises(ValueError, match=r"seq_q must be an int >= 0; got -1"):
        causal_mask(-1, 3)
    with pytest.raises(ValueError, match=r"seq_k must be an int >= 0; got 4.5"):
        causal_mask(3, 4.5)
    assert causal_mask(0, 3).shape == (0, 3)


def test_canonical_mask_errors() -> None:
    base = {"batch": 2, "n_heads": 3, "seq_q": 4, "seq_k": 5}
    with pytest.raises(TypeError, match=r"attn_mask .*got dtype torch.int64"):
        canonical_mask(**base, attn_mask=torch.ones(4, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"attn_mask has shape \[5, 4\].*accepted shapes"):
        canonical_mask(**base, attn_mask=torch.ones(5, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"float.*key_padding"):
        canonical_mask(**base, attn_mask=torch.zeros(4, 5), key_padding=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"attn_mask .*torch.float16.*torch.float32"):
        canonical_mask(**base, attn_mask=torch.zeros(4, 5, dtype=torch.float16))
    with pytest.raises(
        ValueError, match=r"key_padding must have shape \[batch, seq_k\] = \[2, 5\]; got \[2, 4\]"
    ):
        canonical_mask(**base, key_padding=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attn_mask is on meta"):
        canonical_mask(**base, attn_mask=torch.ones(4, 5, dtype=torch.bool, device="meta"))


# --- the rule, through the layer
@pytest.mark.parametrize("need_weights", [False, True])
def test_layer_causal_plus_mask_equals_the_anded_mask(need_weights: bool) -> None:
    """is_causal=True with a mask == passing (mask AND bottom-right causal) without is_causal."""
    layer = MultiHeadAttention(7, 3, d_head=5, n_kv_heads=1)
    x = torch.randn(2, 3, 7)
    c = torch.randn(2, 5, 7)
    m = torch.rand(2, 3, 3, 5) > 0.3
    anded = m & causal_mask(3, 5)
    got = layer(x, c, attn_mask=m, is_causal=True, need_weights=need_weights)
    want = layer(x, c, attn_mask=anded, need_weights=need_weights)
    for a, b in zip(got if need_weights else (got,), want if need_weights else (want,)):
        assert_close(a, b)


@pytest.mark.parametrize("need_weights", [False, True])
def test_layer_causal_cross_attention_is_bottom_right(need_weights: bool) -> None:
    """3 queries over 5 keys: query i sees keys 0..i+2 (not the top-left triangle 0..i)."""
    layer = MultiHeadAttention(7, 3, d_head=5)
    x = torch.randn(2, 3, 7)
    c = torch.randn(2, 5, 7)
    _, pattern = layer(x, c, is_causal=True, need_weights=True)
    assert torch.equal(pattern[0, 0] != 0, causal_mask(3, 5))
    assert torch.equal(causal_mask(3, 5)[0], torch.tensor([T, T, T, F, F]))
    got = layer(x, c, is_causal=True, need_weights=need_weights)
    want = layer(x, c, attn_mask=causal_mask(3, 5), need_weights=need_weights)
    top_left = layer(x, c, attn_mask=torch.ones(3, 5, dtype=torch.bool).tril(), need_weights=need_weights)
    got, want, top_left = (t[0] if need_weights else t for t in (got, want, top_left))
    assert_close(got, want)
    assert not torch.allclose(got, top_left)


def test_key_padding_true_means_real_token() -> None:
    layer = MultiHeadAttention(7, 3, d_head=5)
    x = torch.randn(1, 4, 7)
    pad = torch.tensor([[T, T, F, T]])
    _, pattern = layer(x, key_padding=pad, need_weights=True)
    assert (pattern[..., 2] == 0).all() and (pattern[..., [0, 1, 3]] > 0).all()
    # the padded token's content does not matter
    x2 = x.clone()
    x2[0, 2] = 100.0
    assert_close(layer(x2, key_padding=pad)[:, [0, 1, 3]], layer(x, key_padding=pad)[:, [0, 1, 3]])


def test_bool_mask_true_means_may_attend_and_float_is_additive() -> None:
    layer = MultiHeadAttention(7, 3, d_head=5)
    x = torch.randn(1, 3, 7)
    m = torch.tensor([[T, F, T], [F, T, T], [T, T, F]])
    _, pattern = layer(x, attn_mask=m, need_weights=True)
    assert torch.equal(pattern[0, 0] != 0, m)
    additive = torch.zeros(3, 3).masked_fill(~m, float("-inf"))
    _, pattern_f = layer(x, attn_mask=additive, need_weights=True)
    assert_close(pattern_f, pattern)
    # a finite additive bias shifts the scores: adding log(2) to key 0 doubles its unnormalised weight
    bias = torch.zeros(3, 3)
    bias[:, 0] = torch.log(torch.tensor(2.0))
    _, p0 = layer(x, need_weights=True)
    _, p1 = layer(x, attn_mask=bias, need_weights=True)
    ratio = (p1[..., 0] / p1[..., 1]) / (p0[..., 0] / p0[..., 1])
    assert_close(ratio, torch.full_like(ratio, 2.0))
