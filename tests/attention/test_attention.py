"""MultiHeadAttention against references: a float64 per-head loop written from the formula, its own two
paths (sdpa and explicit), torch.nn.MultiheadAttention, gradcheck, hypothesis, and a hand-checked case.

Shapes use distinct primes where they can (batch=2, seq_q=3, seq_k=5, d_model=7, d_head=5, kdim=11,
vdim=13) so that a swapped axis fails; the head counts must divide each other (n_heads=6 with 6, 2 or 1
key/value heads).
"""

from __future__ import annotations

import copy
import itertools
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.testing import assert_close

from headspace import MultiHeadAttention

B, SQ, SK, D_MODEL, D_HEAD, KDIM, VDIM, N_HEADS = 2, 3, 5, 7, 5, 11, 13, 6
HEAD_CONFIGS = {"mha": 6, "gqa": 2, "mqa": 1}  # n_kv_heads for n_heads=6

pytestmark = pytest.mark.usefixtures("single_thread")


# --- helpers
def randomize_(layer: MultiHeadAttention, generator: torch.Generator | None = None) -> MultiHeadAttention:
    """Fill every parameter with normal noise of std 1/sqrt(fan_in), biases too (so none of them is zero)."""
    with torch.no_grad():
        for p in layer.parameters():
            fan_in = p.shape[-1] if p.dim() == 2 else 4
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) / math.sqrt(fan_in))
    return layer


def make_layer(
    n_kv_heads: int = N_HEADS,
    *,
    kdim: int | None = None,
    vdim: int | None = None,
    bias: bool = True,
    dtype: torch.dtype = torch.float32,
    d_model: int = D_MODEL,
    n_heads: int = N_HEADS,
    d_head: int = D_HEAD,
) -> MultiHeadAttention:
    layer = MultiHeadAttention(
        d_model, n_heads, d_head=d_head, n_kv_heads=n_kv_heads, kdim=kdim, vdim=vdim, bias=bias, dtype=dtype
    )
    return randomize_(layer)


def reference_attention(
    layer: MultiHeadAttention,
    query: Tensor,
    key: Tensor | None = None,
    value: Tensor | None = None,
    *,
    key_padding: Tensor | None = None,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
) -> tuple[Tensor, Tensor]:
    """The layer's formula in float64, one head at a time, written independently of headspace's code.

    Returns (out [batch, seq_q, d_model], pattern [batch, n_heads, seq_q, seq_k]) in float64. A query
    with no key it may attend to gets an all-zero pattern row (so z_h = 0 there).
    """
    f64 = torch.float64
    x = query.detach().to(f64)
    c = x if key is None else key.detach().to(f64)
    cv = c if value is None else value.detach().to(f64)
    batch, seq_q, _ = x.shape
    seq_k = c.shape[1]
    H, Hkv, dh = layer.n_heads, layer.n_kv_heads, layer.d_head

    allowed = torch.ones(batch, H, seq_q, seq_k, dtype=torch.bool)
    additive = torch.zeros(batch, H, seq_q, seq_k, dtype=f64)
    if key_padding is not None:
        allowed &= key_padding[:, None, None, :]
    if attn_mask is not None:
        m = attn_mask
        if m.dim() == 2:
            m = m[None, None]  # (1, 1, seq_q, seq_k)
        elif m.dim() == 3:
            m = m[:, None]  # (batch, 1, seq_q, seq_k)
        if m.dtype == torch.bool:
            allowed &= m
        else:
            additive = additive + m.to(f64)
    if is_causal:
        i = torch.arange(seq_q)[:, None]  # (seq_q, 1)
        j = torch.arange(seq_k)[None, :]  # (1, seq_k)
        allowed &= j <= i + (seq_k - seq_q)  # bottom-right aligned: query i is position i + seq_k - seq_q

    def param(t: Tensor | None, shape: tuple[int, ...]) -> Tensor:
        return torch.zeros(shape, dtype=f64) if t is None else t.detach().to(f64)

    W_Q, W_K, W_V, W_O = (w.detach().to(f64) for w in (layer.W_Q, layer.W_K, layer.W_V, layer.W_O))
    b_Q = param(layer.b_Q, (H, dh))
    b_K = param(layer.b_K, (Hkv, dh))
    b_V = param(layer.b_V, (Hkv, dh))
    b_O = param(layer.b_O, (layer.d_model,))

    out = torch.zeros(batch, seq_q, layer.d_model, dtype=f64)
    pattern = torch.zeros(batch, H, seq_q, seq_k, dtype=f64)
    for h in range(H):
        g = h // (H // Hkv)
        q = x @ W_Q[h] + b_Q[h]  # (batch, seq_q, d_head)
        k = c @ W_K[g] + b_K[g]  # (batch, seq_k, d_head)
        v = cv @ W_V[g] + b_V[g]  # (batch, seq_k, d_head)
        scores = q @ k.transpose(1, 2) * layer.scale + additive[:, h]  # (batch, seq_q, seq_k)
        scores = scores.masked_fill(~allowed[:, h], float("-inf"))
        live = torch.isfinite(scores).any(dim=-1, keepdim=True)  # (batch, seq_q, 1)
        p = torch.softmax(scores.masked_fill(~live, 0.0), dim=-1) * live  # dead rows -> 0
        pattern[:, h] = p
        out += (p @ v) @ W_O[h]
    return out + b_O, pattern


def inputs_for(mode: str, *, seq_q: int = SQ, seq_k: int = SK, dtype: torch.dtype = torch.float32) -> dict:
    """query/key/value for 'self', 'cross_dims' (kdim, vdim differ from d_model) or 'cross_same'."""
    x = torch.randn(B, seq_q, D_MODEL, dtype=dtype)
    if mode == "self":
        return {"query": x, "key": None, "value": None}
    kd, vd = (KDIM, VDIM) if mode == "cross_dims" else (D_MODEL, D_MODEL)
    return {
        "query": x,
        "key": torch.randn(B, seq_k, kd, dtype=dtype),
        "value": torch.randn(B, seq_k, vd, dtype=dtype),
    }


def mask_kwargs(kind: str, seq_q: int, seq_k: int, n_heads: int = N_HEADS) -> dict[str, Any]:
    """Mask arguments of one kind of the equivalence grid; random bool masks include dead rows."""
    pad = torch.rand(B, seq_k) > 0.3
    pad[:, -1] = True  # at least one real token per sample (fully padded samples are tested separately)
    bool4 = torch.rand(B, n_heads, seq_q, seq_k) > 0.4
    bool4[0, 1, 0] = False  # a dead row
    floatm = torch.randn(seq_q, seq_k).masked_fill(torch.rand(seq_q, seq_k) > 0.6, float("-inf"))
    floatm[-1] = float("-inf")  # a dead row in the additive mask
    kinds: dict[str, dict[str, Any]] = {
        "none": {},
        "key_padding": {"key_padding": pad},
        "bool_2d": {"attn_mask": torch.rand(seq_q, seq_k) > 0.4},
        "bool_3d": {"attn_mask": torch.rand(B, seq_q, seq_k) > 0.4},
        "bool_4d": {"attn_mask": bool4},
        "float_additive": {"attn_mask": floatm},
        "causal": {"is_causal": True},
        "causal_padding": {"is_causal": True, "key_padding": pad},
        "causal_mask": {"is_causal": True, "attn_mask": bool4},
        "causal_float": {"is_causal": True, "attn_mask": floatm},
    }
    return kinds[kind]


def call(layer: MultiHeadAttention, inputs: dict, **kw: Any) -> Any:
    return layer(inputs["query"], inputs["key"], inputs["value"], **kw)


def grads_of(layer: MultiHeadAttention, inputs: dict, weight: Tensor, **kw: Any) -> list[Tensor]:
    """Gradients of sum(out * weight) w.r.t. every input tensor and parameter."""
    leaves = [t for t in inputs.values() if t is not None] + list(layer.parameters())
    for t in inputs.values():
        if t is not None:
            t.requires_grad_(True)
    out = call(layer, inputs, **kw)
    out = out[0] if isinstance(out, tuple) else out
    return list(torch.autograd.grad((out * weight).sum(), leaves))


# --- defaults
def test_defaults_are_the_textbook_configuration() -> None:
    attn = MultiHeadAttention()
    assert (attn.d_model, attn.n_heads, attn.d_head, attn.n_kv_heads) == (512, 8, 64, 8)
    assert attn.W_Q.shape == (8, 512, 64)
    assert attn.W_K.shape == attn.W_V.shape == (8, 512, 64)
    assert attn.W_O.shape == (8, 64, 512)
    assert attn.scale == pytest.approx(1 / 8)
    x = torch.randn(2, 3, 512)
    out, pattern = attn(x, need_weights=True)
    assert out.shape == (2, 3, 512)
    assert pattern.shape == (2, 8, 3, 3)


def test_shapes_with_distinct_primes() -> None:
    attn = make_layer(2, kdim=KDIM, vdim=VDIM)
    assert attn.W_Q.shape == (N_HEADS, D_MODEL, D_HEAD)
    assert attn.W_K.shape == (2, KDIM, D_HEAD)
    assert attn.W_V.shape == (2, VDIM, D_HEAD)
    assert attn.W_O.shape == (N_HEADS, D_HEAD, D_MODEL)
    assert attn.b_Q.shape == (N_HEADS, D_HEAD) and attn.b_K.shape == attn.b_V.shape == (2, D_HEAD)
    inp = inputs_for("cross_dims")
    out, pattern = call(attn, inp, need_weights=True)
    assert out.shape == (B, SQ, D_MODEL)
    assert pattern.shape == (B, N_HEADS, SQ, SK)  # per head, never averaged


# --- the grid
MASK_KINDS = [
    "none",
    "key_padding",
    "bool_2d",
    "bool_3d",
    "bool_4d",
    "float_additive",
    "causal",
    "causal_padding",
    "causal_mask",
    "causal_float",
]


@pytest.mark.parametrize("mode", ["self", "cross_dims", "cross_same"])
@pytest.mark.parametrize("heads", list(HEAD_CONFIGS))
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_equivalence_grid(kind: str, heads: str, mode: str) -> None:
    """sdpa path == explicit path == float64 reference, outputs, patterns and gradients."""
    kd, vd = (KDIM, VDIM) if mode == "cross_dims" else (None, None)
    layer = make_layer(HEAD_CONFIGS[heads], kdim=kd, vdim=vd)
    inp = inputs_for(mode)
    seq_k = SQ if mode == "self" else SK
    kw = mask_kwargs(kind, SQ, seq_k)

    fast = call(layer, inp, **kw)
    slow, pattern = call(layer, inp, need_weights=True, **kw)
    ref_out, ref_pattern = reference_attention(layer, **inp, **kw)
    assert_close(fast, ref_out.float())
    assert_close(slow, ref_out.float())
    assert_close(pattern, ref_pattern.float())
    assert pattern.shape == (B, N_HEADS, SQ, seq_k)

    weight = torch.randn(B, SQ, D_MODEL)
    g_fast = grads_of(layer, inp, weight, **kw)
    g_slow = grads_of(layer, inp, weight, need_weights=True, **kw)
    for a, b in zip(g_fast, g_slow):
        assert torch.isfinite(a).all()
        assert_close(a, b)


def test_reference_float64_layer_matches_to_double_precision() -> None:
    """In float64 the layer and the per-head loop agree to ~1e-12, on both paths, with GQA and masks."""
    layer = make_layer(2, kdim=KDIM, vdim=VDIM, dtype=torch.float64)
    inp = inputs_for("cross_dims", dtype=torch.float64)
    kw = {"is_causal": True, "key_padding": torch.tensor([[True, False, True, True, True], [True] * 5])}
    ref_out, ref_pattern = reference_attention(layer, **inp, **kw)
    out, pattern = call(layer, inp, need_weights=True, **kw)
    assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    assert_close(pattern, ref_pattern, rtol=1e-12, atol=1e-12)
    assert_close(call(layer, inp, **kw), ref_out, rtol=1e-12, atol=1e-12)


def test_layer_second_derivatives_with_and_without_the_pattern() -> None:
    # need_weights=True is differentiable to any order (the explicit kernel's create_graph backward);
    # the fast path is torch's SDPA, whose CPU flash kernel has none: torch's math kernel gives them
    from torch.nn.attention import SDPBackend, sdpa_kernel

    layer = MultiHeadAttention(6, 3, d_head=2, n_kv_heads=1).double()  # grouped-query: 3 heads, 1 kv
    randomize_(layer)
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    pad = torch.tensor([[True, True, True, False, False], [True] * 5])

    def with_pattern(x: Tensor) -> tuple[Tensor, Tensor]:
        return layer(x, x, x, key_padding=pad, is_causal=True, need_weights=True)

    assert torch.autograd.gradgradcheck(with_pattern, (x,))
    with sdpa_kernel(SDPBackend.MATH):
        assert torch.autograd.gradgradcheck(lambda x: layer(x, x, x, key_padding=pad, is_causal=True), (x,))


def test_need_weights_changes_neither_scaling_nor_masks_with_custom_scale() -> None:
    layer = MultiHeadAttention(D_MODEL, N_HEADS, d_head=D_HEAD, n_kv_heads=3, scale=0.37)
    randomize_(layer)
    inp = inputs_for("self")
    kw = {"is_causal": True, "attn_mask": torch.rand(SQ, SQ) > 0.3}
    ref_out, ref_pattern = reference_attention(layer, **inp, **kw)
    assert layer.scale == 0.37
    assert_close(call(layer, inp, **kw), ref_out.float())
    out, pattern = call(layer, inp, need_weights=True, **kw)
    assert_close(out, ref_out.float())
    assert_close(pattern, ref_pattern.float())


def test_pattern_rows_sum_to_one_or_zero() -> None:
    layer = make_layer(2)
    inp = inputs_for("cross_same")
    mask = torch.rand(B, SQ, SK) > 0.5
    mask[1, 2] = False  # dead row
    _, pattern = call(layer, inp, attn_mask=mask, need_weights=True)
    sums = pattern.sum(-1)  # (batch, n_heads, seq_q)
    live = mask.any(-1)[:, None, :].expand_as(sums)
    assert_close(sums[live], torch.ones_like(sums[live]))
    assert (pattern[1, :, 2] == 0).all()
    assert (pattern[~mask[:, None].expand_as(pattern)] == 0).all()


@pytest.mark.parametrize("heads", list(HEAD_CONFIGS))
def test_key_as_value_and_explicit_self_attention(heads: str) -> None:
    """attn(x, c) (value defaults to key: one fused K/V projection) and attn(x, x, x) match the reference."""
    layer = make_layer(HEAD_CONFIGS[heads])
    x, c = torch.randn(B, SQ, D_MODEL), torch.randn(B, SK, D_MODEL)
    ref_kv, _ = reference_attention(layer, x, c, c, is_causal=True)
    ref_self, _ = reference_attention(layer, x, is_causal=True)
    for nw in (False, True):
        got_kv = layer(x, c, is_causal=True, need_weights=nw)
        got_self = layer(x, x, x, is_causal=True, need_weights=nw)
        assert_close(got_kv[0] if nw else got_kv, ref_kv.float())
        assert_close(got_self[0] if nw else got_self, ref_self.float())
        assert_close(got_self[0] if nw else got_self, layer(x, is_causal=True))


# --- by hand
def test_arange_weights_by_hand() -> None:
    """Two one-hot tokens, two heads of width 1 (scale = 1), weights from arange: every number by hand.

    W_Q = W_K = W_V = arange(4).view(2, 2, 1): head 0 maps token 0 -> 0, token 1 -> 1; head 1 maps
    token 0 -> 2, token 1 -> 3. So q = k = v = [0, 1] (head 0) and [2, 3] (head 1), scores q_i k_j:
    head 0 [[0, 0], [0, 1]], head 1 [[4, 6], [6, 9]]. W_O = arange(4).view(2, 1, 2): head 0 writes
    z * [0, 1], head 1 writes z * [2, 3].
    """
    attn = MultiHeadAttention(d_model=2, n_heads=2, bias=False, dtype=torch.float64)
    assert attn.d_head == 1 and attn.scale == 1.0
    with torch.no_grad():
        a = torch.arange(4, dtype=torch.float64)
        attn.W_Q.copy_(a.view(2, 2, 1))
        attn.W_K.copy_(a.view(2, 2, 1))
        attn.W_V.copy_(a.view(2, 2, 1))
        attn.W_O.copy_(a.view(2, 1, 2))
    x = torch.eye(2, dtype=torch.float64)[None]  # (1, 2 tokens, d_model=2): one-hot tokens

    e = math.e
    p0 = [[1 / 2, 1 / 2], [1 / (1 + e), e / (1 + e)]]  # softmax of [0, 0] and [0, 1]
    p1 = [[1 / (1 + e**2), e**2 / (1 + e**2)], [1 / (1 + e**3), e**3 / (1 + e**3)]]  # [4, 6], [6, 9]
    z0 = [p[1] * 1 for p in p0]  # v = [0, 1]
    z1 = [p[0] * 2 + p[1] * 3 for p in p1]  # v = [2, 3]
    expected = torch.tensor([[[z1[i] * 2, z0[i] + z1[i] * 3] for i in range(2)]], dtype=torch.float64)
    expected_pattern = torch.tensor([[p0, p1]], dtype=torch.float64)

    out, pattern = attn(x, need_weights=True)
    assert_close(pattern, expected_pattern)
    assert_close(out, expected)
    assert_close(attn(x), expected)

    # causal: query 0 sees only key 0, so its pattern is [1, 0] in both heads and z = v_0
    expected_causal = torch.tensor(
        [[[2 * 2, 0 + 2 * 3], [z1[1] * 2, z0[1] + z1[1] * 3]]], dtype=torch.float64
    )
    assert_close(attn(x, is_causal=True), expected_causal)
    out_c, pattern_c = attn(x, is_causal=True, need_weights=True)
    assert_close(out_c, expected_causal)
    assert_close(pattern_c[0, :, 0], torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=torch.float64))


# --- gradcheck
@pytest.mark.parametrize("need_weights", [False, True])
def test_gradcheck_cross_gqa_masked(need_weights: bool) -> None:
    """float64 gradcheck on inputs and every parameter; distinct primes; GQA, cross dims, dead row."""
    torch.manual_seed(1)
    layer = MultiHeadAttention(7, 3, d_head=2, n_kv_heads=1, kdim=11, vdim=13, dtype=torch.float64)
    randomize_(layer)
    names = [n for n, _ in layer.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for p in layer.parameters()]
    x = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    c = torch.randn(2, 5, 11, dtype=torch.float64, requires_grad=True)
    cv = torch.randn(2, 5, 13, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, 3, 5) > 0.4
    mask[0, 1] = False  # a dead row: zero output, zero (finite) gradient

    def f(x: Tensor, c: Tensor, cv: Tensor, *ps: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        out = torch.func.functional_call(
            layer, dict(zip(names, ps)), (x, c, cv), {"attn_mask": mask, "need_weights": need_weights}
        )
        return out  # with need_weights: (out, pattern), so gradients through the pattern are checked too

    assert torch.autograd.gradcheck(f, (x, c, cv, *params))


@pytest.mark.parametrize("need_weights", [False, True])
def test_gradcheck_self_causal_padding(need_weights: bool) -> None:
    torch.manual_seed(2)
    layer = MultiHeadAttention(5, 3, d_head=2, dtype=torch.float64)
    randomize_(layer)
    names = [n for n, _ in layer.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for p in layer.parameters()]
    x = torch.randn(2, 7, 5, dtype=torch.float64, requires_grad=True)
    pad = torch.tensor([[False, True, True, True, False, True, True], [True] * 7])  # row 0 of sample 0 dead

    def f(x: Tensor, *ps: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        kw = {"key_padding": pad, "is_causal": True, "need_weights": need_weights}
        return torch.func.functional_call(layer, dict(zip(names, ps)), (x,), kw)

    assert torch.autograd.gradcheck(f, (x, *params))


@pytest.mark.parametrize("need_weights", [False, True])
def test_gradcheck_learned_additive_mask(need_weights: bool) -> None:
    """A float mask that requires grad (a learned positional bias) gets correct gradients on both paths;
    -inf entries (blocked, one dead row) stay out of the finite-difference check by construction."""
    torch.manual_seed(3)
    layer = randomize_(MultiHeadAttention(5, 3, d_head=2, n_kv_heads=1, dtype=torch.float64))
    x = torch.randn(2, 3, 5, dtype=torch.float64)
    c = torch.randn(2, 7, 5, dtype=torch.float64)
    bias = torch.randn(3, 3, 7, dtype=torch.float64, requires_grad=True)  # per head: [n_heads, seq_q, seq_k]
    blocked = torch.zeros(3, 3, 7, dtype=torch.bool)
    blocked[1, 2] = True  # head 1, query 2: a dead row
    blocked[0, :, 4] = True

    def f(bias: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        m = bias.masked_fill(blocked, float("-inf"))[None]  # (1, n_heads, seq_q, seq_k)
        return layer(x, c, attn_mask=m, need_weights=need_weights)

    assert torch.autograd.gradcheck(f, (bias,))
    out = f(bias)
    (g,) = torch.autograd.grad((out[0] if need_weights else out).sum(), [bias])
    assert (g[blocked] == 0).all()


# --- hypothesis
@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 3),
    seq_q=st.integers(1, 5),
    seq_k=st.integers(1, 6),
    n_kv_heads=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 2]),
    d_head=st.integers(1, 4),
    cross=st.booleans(),
    mask_dims=st.sampled_from([0, 2, 3, 4]),
    use_padding=st.booleans(),
    is_causal=st.booleans(),
    density=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_paths_agree_on_random_shapes_and_masks(
    batch: int,
    seq_q: int,
    seq_k: int,
    n_kv_heads: int,
    group: int,
    d_head: int,
    cross: bool,
    mask_dims: int,
    use_padding: bool,
    is_causal: bool,
    density: float,
    seed: int,
) -> None:
    """Random shapes and bool masks (dead rows and fully padded samples included): both paths equal the
    float64 reference, and gradients are finite and equal on both paths."""
    g = torch.Generator().manual_seed(seed)
    n_heads = n_kv_heads * group
    d_model = 3
    if not cross:
        seq_k = seq_q
    layer = randomize_(
        MultiHeadAttention(d_model, n_heads, d_head=d_head, n_kv_heads=n_kv_heads, kdim=4 if cross else None),
        g,
    )
    x = torch.randn(batch, seq_q, d_model, generator=g, requires_grad=True)
    c = torch.randn(batch, seq_k, 4, generator=g, requires_grad=True) if cross else None
    cv = torch.randn(batch, seq_k, d_model, generator=g, requires_grad=True) if cross else None
    kw: dict[str, Any] = {"is_causal": is_causal}
    if use_padding:
        kw["key_padding"] = torch.rand(batch, seq_k, generator=g) < density
    if mask_dims:
        shape = {2: (seq_q, seq_k), 3: (batch, seq_q, seq_k), 4: (batch, n_heads, seq_q, seq_k)}[mask_dims]
        kw["attn_mask"] = torch.rand(shape, generator=g) < density

    ref_out, ref_pattern = reference_attention(layer, x, c, cv, **kw)
    leaves = [t for t in (x, c, cv) if t is not None] + list(layer.parameters())
    weight = torch.randn(batch, seq_q, d_model, generator=g)
    fast = layer(x, c, cv, **kw)
    slow, pattern = layer(x, c, cv, need_weights=True, **kw)
    assert_close(fast, ref_out.float())
    assert_close(slow, ref_out.float())
    assert_close(pattern, ref_pattern.float())
    g_fast = torch.autograd.grad((fast * weight).sum(), leaves)
    g_slow = torch.autograd.grad((slow * weight).sum(), leaves)
    for a, b in zip(g_fast, g_slow):
        assert torch.isfinite(a).all() and torch.isfinite(b).all()
        # two float32 sums of the same terms in different orders: their difference scales with the
        # gradient's size (a weight gradient sums batch x seq terms; seen 1.3e-5 apart at |g| ~ 0.3)
        scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
        assert_close(a, b, rtol=1e-5, atol=2e-5 * scale)


# --- long sequences (the explicit kernel's per-head band blocks)
@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_long_sequence_paths_agree(n_kv_heads: int) -> None:
    """seq 613: one head's pattern (613^2 floats = 1.5 MB) exceeds the explicit kernel's block, so it runs
    in bands of queries; outputs, patterns and gradients still match sdpa and the float64 reference."""
    seq = 613
    layer = randomize_(MultiHeadAttention(6, 4, d_head=3, n_kv_heads=n_kv_heads))
    x = torch.randn(2, seq, 6, requires_grad=True)
    pad = torch.ones(2, seq, dtype=torch.bool)
    pad[1, :17] = False  # left padding: the first 17 queries of sample 1 are dead under causality
    kw = {"key_padding": pad, "is_causal": True}
    fast = layer(x, **kw)
    slow, pattern = layer(x, need_weights=True, **kw)
    ref_out, ref_pattern = reference_attention(layer, x, **kw)
    assert_close(fast, ref_out.float())
    assert_close(slow, ref_out.float())
    assert_close(pattern, ref_pattern.float())
    weight = torch.randn(2, seq, 6)
    leaves = [x, *layer.parameters()]
    g_fast = torch.autograd.grad((fast * weight).sum(), leaves)
    g_slow = torch.autograd.grad((slow * weight).sum(), leaves)
    # gradient truth: the same layer in float64
    layer64 = copy.deepcopy(layer).double()
    x64 = x.detach().double().requires_grad_(True)
    out64 = layer64(x64, **kw)
    g64 = torch.autograd.grad((out64 * weight.double()).sum(), [x64, *layer64.parameters()])
    for a, b, c in zip(g_fast, g_slow, g64):
        # the parameter gradients are float32 sums over 2 x 613 positions of terms up to ~100: their error
        # scales with the largest entry, not with each entry, hence an atol relative to that entry
        tol = {"rtol": 1.3e-6, "atol": max(1e-5, 2e-6 * c.abs().max().item())}
        assert_close(a, c.float(), **tol)
        assert_close(b, c.float(), **tol)


# --- low precision
@pytest.mark.parametrize(
    ("dtype", "tol"),
    [
        # bf16 keeps 8 significant bits (relative step 2^-8 = 0.4%); the ~10 rounded ops of a forward
        # accumulate to 1-2% on outputs of order 1, hence 3e-2
        (torch.bfloat16, 3e-2),
        # fp16 keeps 11 bits (step 0.05%): same reasoning, 5e-3
        (torch.float16, 5e-3),
    ],
)
def test_half_precision_paths_match_float64(dtype: torch.dtype, tol: float) -> None:
    layer = make_layer(2, dtype=dtype)
    layer64 = copy.deepcopy(layer).double()
    x = torch.randn(B, 5, D_MODEL, dtype=dtype)
    pad = torch.tensor([[True] * 5, [False, False, True, True, True]])  # row 0, 1 of sample 1 dead
    kw = {"key_padding": pad, "is_causal": True}
    want = layer64(x.double(), **kw)
    for nw in (False, True):
        res = layer(x, need_weights=nw, **kw)
        out = res[0] if nw else res
        assert out.dtype == dtype
        assert_close(out.double(), want, rtol=tol, atol=tol)
        assert_close(out[1, :2], layer.b_O.detach().expand(2, D_MODEL), rtol=0, atol=0)


# --- dead rows
DEAD_ROW_CASES = {
    "bool_row": lambda sq, sk: {
        "attn_mask": torch.ones(sq, sk, dtype=torch.bool).index_fill_(0, torch.tensor([1]), False)
    },
    "float_row": lambda sq, sk: {
        "attn_mask": torch.zeros(sq, sk).index_fill_(0, torch.tensor([1]), float("-inf"))
    },
    "causal_more_queries_than_keys": lambda sq, sk: {"is_causal": True},
    "padding_whole_sample": lambda sq, sk: {"key_padding": torch.tensor([[True] * sk, [False] * sk])},
    "padding_and_mask": lambda sq, sk: {
        "key_padding": torch.tensor([[True, True] + [False] * (sk - 2), [True] * sk]),
        "attn_mask": torch.tensor([[False, False] + [True] * (sk - 2)] * sq),
    },
}


@pytest.mark.parametrize("path", ["sdpa", "explicit", "traced", "dropout_sdpa", "dropout_explicit"])
@pytest.mark.parametrize("case", list(DEAD_ROW_CASES))
def test_dead_rows_give_zeros_and_finite_grads(case: str, path: str) -> None:
    """A query with nothing to attend to: z = 0 (so out = b_O), pattern row 0, finite gradients, on every
    path: sdpa, explicit (need_weights), traced (a hook is active) and both with dropout in training."""
    seq_q, seq_k = 5, 3
    layer = make_layer(2)
    need_weights = path in ("explicit", "traced", "dropout_explicit")
    if path.startswith("dropout"):
        layer.dropout = 0.5
        layer.train()
    if path == "traced":
        layer.hook_pattern.add(lambda t, hp: None)
    x = torch.randn(B, seq_q, D_MODEL, requires_grad=True)
    c = torch.randn(B, seq_k, D_MODEL, requires_grad=True)
    kw = DEAD_ROW_CASES[case](seq_q, seq_k)
    _, ref_pattern = reference_attention(layer, x, c, **kw)
    dead = ref_pattern.sum(-1) == 0  # (batch, n_heads, seq_q): the rows the reference calls dead
    assert dead.any()
    dead_query = dead.all(dim=1)  # (batch, seq_q): dead in every head -> the output there is exactly b_O

    res = layer(x, c, need_weights=need_weights, **kw)
    out = res[0] if need_weights else res
    assert torch.isfinite(out).all()
    assert_close(out[dead_query], layer.b_O.detach().expand_as(out[dead_query]), rtol=0, atol=0)
    if need_weights:
        assert (res[1][dead] == 0).all()
    gx, gc, *gp = torch.autograd.grad(out.pow(2).sum(), [x, c, *layer.parameters()])
    for gr in (gx, gc, *gp):
        assert torch.isfinite(gr).all()
    assert (gx[dead_query] == 0).all()  # a dead query row does not depend on its own input


@pytest.mark.parametrize("need_weights", [False, True])
def test_fully_padded_sample_leaves_the_others_unchanged(need_weights: bool) -> None:
    """Sample 1 fully padded: samples 0 and 2 get the same outputs and gradients as without it."""
    layer = make_layer(2)
    x = torch.randn(3, SQ, D_MODEL)
    pad = torch.tensor([[True, True, False], [False, False, False], [True, False, True]])
    weight = torch.randn(3, SQ, D_MODEL)
    keep = torch.tensor([0, 2])

    def run(x: Tensor, pad: Tensor, weight: Tensor) -> tuple[Tensor, list[Tensor]]:
        x = x.clone().requires_grad_(True)
        res = layer(x, key_padding=pad, is_causal=True, need_weights=need_weights)
        out = res[0] if need_weights else res
        grads = torch.autograd.grad((out * weight).sum(), [x, *layer.parameters()])
        return out, list(grads)

    weight_others = weight.clone()
    weight_others[1] = 0  # the loss sees only samples 0 and 2
    out_all, grads_all = run(x, pad, weight_others)
    out_two, grads_two = run(x[keep], pad[keep], weight[keep])
    assert_close(out_all[keep], out_two)
    assert_close(grads_all[0][keep], grads_two[0])
    assert (grads_all[0][1] == 0).all()
    for a, b in zip(grads_all[1:], grads_two[1:]):
        assert_close(a, b)
    assert_close(out_all[1], layer.b_O.detach().expand(SQ, D_MODEL), rtol=0, atol=0)


# --- KV cache
@pytest.mark.parametrize("heads", list(HEAD_CONFIGS))
@pytest.mark.parametrize("chunks", [[1] * 7, [3, 1, 2, 1], [7]])
def test_kv_cache_decoding_equals_full_causal_forward(heads: str, chunks: list[int]) -> None:
    layer = make_layer(HEAD_CONFIGS[heads]).eval()
    x = torch.randn(B, 7, D_MODEL)
    with torch.no_grad():
        full, full_pattern = layer(x, is_causal=True, need_weights=True)
        cache = layer.make_kv_cache(B, capacity=11)
        outs, start = [], 0
        for n in chunks:
            outs.append(layer(x[:, start : start + n], kv_cache=cache, is_causal=True))
            start += n
        assert cache.length == 7
        assert_close(torch.cat(outs, dim=1), full)

        # the explicit path reads the same cache: the last token's pattern is the full pattern's last row
        cache.reset()
        layer(x[:, :6], kv_cache=cache, is_causal=True)
        last, last_pattern = layer(x[:, 6:], kv_cache=cache, is_causal=True, need_weights=True)
        assert_close(last, full[:, 6:])
        assert_close(last_pattern, full_pattern[:, :, 6:])


@settings(max_examples=25, deadline=None)
@given(
    n_kv_heads=st.sampled_from([1, 2, 3, 6]),
    cuts=st.lists(st.integers(1, 7), min_size=1, max_size=4, unique=True),
    left_pad=st.integers(0, 3),
    need_weights=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_kv_cache_random_chunks(
    n_kv_heads: int, cuts: list[int], left_pad: int, need_weights: bool, seed: int
) -> None:
    """Any split of 8 positions into chunks, any GQA grouping, left padding: decoding == full causal."""
    g = torch.Generator().manual_seed(seed)
    layer = randomize_(MultiHeadAttention(D_MODEL, N_HEADS, d_head=D_HEAD, n_kv_heads=n_kv_heads), g).eval()
    seq = 8
    x = torch.randn(B, seq, D_MODEL, generator=g)
    pad = torch.ones(B, seq, dtype=torch.bool)
    pad[0, :left_pad] = False
    bounds = [0, *sorted(cuts), seq]
    with torch.no_grad():
        full = layer(x, is_causal=True, key_padding=pad)
        cache = layer.make_kv_cache(B, capacity=seq)
        outs = []
        for a, b in itertools.pairwise(bounds):
            res = layer(
                x[:, a:b], kv_cache=cache, is_causal=True, key_padding=pad[:, :b], need_weights=need_weights
            )
            outs.append(res[0] if need_weights else res)
    assert_close(torch.cat(outs, dim=1), full)


def test_kv_cache_decoding_with_hooks_active() -> None:
    """The traced path decodes with the cache too; hook_k sees only the new positions."""
    layer = make_layer(2).eval()
    x = torch.randn(B, 5, D_MODEL)
    seen: list[tuple[int, ...]] = []
    layer.hook_k.add(lambda t, hp: seen.append(tuple(t.shape)))
    with torch.no_grad():
        full = layer(x, is_causal=True)
        cache = layer.make_kv_cache(B, capacity=5)
        outs = [layer(x[:, :2], kv_cache=cache, is_causal=True)]
        outs += [layer(x[:, t : t + 1], kv_cache=cache, is_causal=True) for t in range(2, 5)]
    assert_close(torch.cat(outs, dim=1), full)
    assert seen == [(B, 5, 2, D_HEAD), (B, 2, 2, D_HEAD)] + [(B, 1, 2, D_HEAD)] * 3


def test_kv_cache_with_left_padding() -> None:
    """key_padding covers every cached position; decoding a left-padded batch equals the full forward."""
    layer = make_layer(3).eval()
    x = torch.randn(B, 6, D_MODEL)
    pad = torch.tensor([[False, False, True, True, True, True], [True] * 6])
    with torch.no_grad():
        full = layer(x, is_causal=True, key_padding=pad)
        cache = layer.make_kv_cache(B, capacity=6)
        outs = [layer(x[:, :2], kv_cache=cache, is_causal=True, key_padding=pad[:, :2])]
        for t in range(2, 6):
            outs.append(layer(x[:, t : t + 1], kv_cache=cache, is_causal=True, key_padding=pad[:, : t + 1]))
    assert_close(torch.cat(outs, dim=1), full)


def test_kv_cache_decoding_with_grad_matches_full_gradients() -> None:
    layer = make_layer(2)
    x = torch.randn(B, 5, D_MODEL)
    weight = torch.randn(B, 5, D_MODEL)
    full_grads = torch.autograd.grad((layer(x, is_causal=True) * weight).sum(), list(layer.parameters()))
    cache = layer.make_kv_cache(B, capacity=5)
    outs = [layer(x[:, t : t + 1], kv_cache=cache, is_causal=True) for t in range(5)]
    dec_grads = torch.autograd.grad((torch.cat(outs, 1) * weight).sum(), list(layer.parameters()))
    for a, b in zip(dec_grads, full_grads):
        assert_close(a, b)
    assert not cache.k.requires_grad  # the preallocated storage holds values, not graph


def test_kv_cache_capacity_and_reset() -> None:
    layer = make_layer()
    cache = layer.make_kv_cache(B, capacity=4)
    assert (cache.capacity, cache.batch, cache.length) == (4, B, 0)
    assert cache.k.shape == (B, N_HEADS, 4, D_HEAD) and cache.k.dtype == layer.o_weight.dtype
    with torch.no_grad():
        layer(torch.randn(B, 4, D_MODEL), kv_cache=cache, is_causal=True)
        assert cache.length == 4
        cache.reset()
        x = torch.randn(B, 2, D_MODEL)
        assert_close(layer(x, kv_cache=cache, is_causal=True), layer(x, is_causal=True))


# --- strides
@pytest.mark.parametrize("need_weights", [False, True])
def test_noncontiguous_and_broadcast_inputs_equal_contiguous(need_weights: bool) -> None:
    layer = make_layer(2, kdim=KDIM, vdim=VDIM)
    q = torch.randn(D_MODEL, SQ, B).permute(2, 1, 0)  # (B, SQ, D_MODEL), transposed strides
    k = torch.randn(1, SK, KDIM).expand(B, SK, KDIM)  # stride 0 over batch
    v = torch.randn(B, 2 * SK, VDIM)[:, ::2]  # every other position
    mask = (torch.rand(SK, SQ) > 0.3).t()  # (SQ, SK), non-contiguous
    pad = torch.tensor([True, True, False, True, True]).expand(B, SK)  # stride 0
    assert not q.is_contiguous() and k.stride(0) == 0 and not v.is_contiguous() and not mask.is_contiguous()
    kw = {"attn_mask": mask, "key_padding": pad, "need_weights": need_weights}
    got = layer(q, k, v, **kw)
    want = layer(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        **{**kw, "attn_mask": mask.contiguous(), "key_padding": pad.contiguous()},
    )
    if need_weights:
        assert_close(got[0], want[0])
        assert_close(got[1], want[1])
    else:
        assert_close(got, want)


def test_self_attention_with_expanded_query() -> None:
    layer = make_layer(3)
    x = torch.randn(1, SQ, D_MODEL).expand(B, SQ, D_MODEL)
    for nw in (False, True):
        got = layer(x, is_causal=True, need_weights=nw)
        want = layer(x.contiguous(), is_causal=True, need_weights=nw)
        assert_close(got[0] if nw else got, want[0] if nw else want)


# --- empty
@pytest.mark.parametrize("need_weights", [False, True])
def test_batch_zero_and_query_length_zero_give_empty_outputs(need_weights: bool) -> None:
    layer = make_layer(2, kdim=KDIM, vdim=VDIM)
    cases = [
        (torch.randn(0, SQ, D_MODEL), torch.randn(0, SK, KDIM), torch.randn(0, SK, VDIM), (0, SQ), SK),
        (torch.randn(B, 0, D_MODEL), torch.randn(B, SK, KDIM), torch.randn(B, SK, VDIM), (B, 0), SK),
    ]
    for q, k, v, (b, sq), sk in cases:
        res = layer(q, k, v, need_weights=need_weights, is_causal=True)
        out = res[0] if need_weights else res
        assert out.shape == (b, sq, D_MODEL)
        if need_weights:
            assert res[1].shape == (b, N_HEADS, sq, sk)
    selfl = make_layer()
    res = selfl(torch.randn(B, 0, D_MODEL), need_weights=need_weights)  # self-attention, empty sequence
    assert (res[0] if need_weights else res).shape == (B, 0, D_MODEL)


# --- dropout
def _dropout_probe(p: float, n_batch: int = 64) -> tuple[MultiHeadAttention, Tensor]:
    """A layer whose output *is* its (dropped-out) pattern: one head, one-hot tokens, W_V = W_O = I.

    With x_j = e_j and W_V = I, v_j = e_j, so z_i = sum_j w_ij e_j = w_i, and W_O = I copies it out.
    """
    s = 7
    layer = MultiHeadAttention(s, 1, d_head=s, bias=False, dropout=p)
    with torch.no_grad():
        layer.W_Q.copy_(torch.randn(1, s, s) * 0.5)
        layer.W_K.copy_(torch.randn(1, s, s) * 0.5)
        layer.W_V.copy_(torch.eye(s)[None])
        layer.W_O.copy_(torch.eye(s)[None])
    x = torch.eye(s)[None].expand(n_batch, s, s)
    return layer, x


def test_dropout_has_no_effect_in_eval() -> None:
    layer, x = _dropout_probe(0.5)
    layer.eval()
    out, pattern = layer(x, need_weights=True)
    assert_close(out, pattern[:, 0])  # the probe really outputs its pattern
    assert_close(layer(x), out)
    assert_close(layer(x), layer(x))


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("p", [0.5, 0.999])
def test_dropout_in_training_drops_pattern_entries(p: float, need_weights: bool) -> None:
    """In training each pattern entry is kept with probability 1 - p and scaled by 1 / (1 - p)."""
    layer, x = _dropout_probe(p)
    with torch.no_grad():
        _, pattern = layer.eval()(x, need_weights=True)
        layer.train()
        res = layer(x, need_weights=need_weights)
    out = res[0] if need_weights else res
    if need_weights:
        assert_close(res[1], pattern)  # the returned pattern is the softmax, before dropout
    expected_kept = pattern[:, 0] / (1 - p)
    dropped = out == 0
    # every entry is either dropped or the scaled pattern entry
    assert_close(out[~dropped], expected_kept[~dropped])
    n = out.numel()  # 64 * 7 * 7 = 3136 independent Bernoulli draws
    frac = dropped.float().mean().item()
    assert abs(frac - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-3, (frac, p)


def test_dropout_zero_in_training_equals_eval() -> None:
    layer, x = _dropout_probe(0.0)
    assert_close(layer.train()(x), layer.eval()(x))


# --- hooks
def test_hooks_traced_path_equals_untraced_and_results_sum_to_output() -> None:
    layer = make_layer(2)
    inp = inputs_for("self")
    kw = {"is_causal": True, "key_padding": torch.tensor([[True, False, True], [True, True, True]])}
    plain = call(layer, inp, **kw)
    seen: dict[str, Tensor] = {}
    removers = [
        getattr(layer, name).add(lambda t, hp, name=name: seen.__setitem__(name, t))
        for name in ("hook_q", "hook_k", "hook_v", "hook_scores", "hook_pattern", "hook_z", "hook_result")
    ]
    traced = call(layer, inp, **kw)
    for r in removers:
        r()
    assert not layer.hooks_active
    assert_close(traced, plain)
    assert seen["hook_q"].shape == (B, SQ, N_HEADS, D_HEAD)
    assert seen["hook_k"].shape == seen["hook_v"].shape == (B, SQ, 2, D_HEAD)
    assert seen["hook_pattern"].shape == seen["hook_scores"].shape == (B, N_HEADS, SQ, SQ)
    assert seen["hook_z"].shape == (B, SQ, N_HEADS, D_HEAD)
    assert seen["hook_result"].shape == (B, SQ, N_HEADS, D_MODEL)
    assert_close(seen["hook_result"].sum(2) + layer.b_O, plain)
    _, ref_pattern = reference_attention(layer, **inp, **kw)
    assert_close(seen["hook_pattern"], ref_pattern.float())


def test_hook_replacing_a_value_patches_the_output() -> None:
    """Zeroing head 4's z through hook_z equals zeroing its W_O block."""
    layer = make_layer(3)
    x = torch.randn(B, SQ, D_MODEL)

    def ablate(z: Tensor, hp: object) -> Tensor:
        z = z.clone()
        z[:, :, 4] = 0
        return z

    remove = layer.hook_z.add(ablate)
    patched = layer(x)
    remove()
    with torch.no_grad():
        layer.W_O[4].zero_()
    assert_close(patched, layer(x))


# --- torch MHA
def torch_mha_pair(bias: bool, cross_dims: bool) -> tuple[torch.nn.MultiheadAttention, MultiHeadAttention]:
    """torch MHA and a headspace layer with the same weights (copied in the test, not via layouts.py)."""
    E, H = 15, 3  # d_head = 5
    kd, vd = (KDIM, VDIM) if cross_dims else (None, None)
    ref = torch.nn.MultiheadAttention(E, H, bias=bias, batch_first=True, kdim=kd, vdim=vd)
    ours = MultiHeadAttention(E, H, kdim=kd, vdim=vd, bias=bias)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape) / math.sqrt(p.shape[-1] if p.dim() == 2 else 4))
        if cross_dims:
            ours.q_weight.copy_(ref.q_proj_weight)
            ours.k_weight.copy_(ref.k_proj_weight)
            ours.v_weight.copy_(ref.v_proj_weight)
        else:
            ours.qkv_weight.copy_(ref.in_proj_weight)  # [3E, E] is exactly headspace's fused layout
        ours.o_weight.copy_(ref.out_proj.weight)
        if bias:
            ours.qkv_bias.copy_(ref.in_proj_bias)
            ours.o_bias.copy_(ref.out_proj.bias)
    return ref, ours


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("mode", ["self", "cross_same", "cross_dims"])
@pytest.mark.parametrize(
    "masks", ["none", "key_padding", "bool_mask", "float_mask", "causal", "per_head_mask"]
)
def test_matches_torch_multihead_attention(bias: bool, mode: str, masks: str) -> None:
    E, H = 15, 3
    ref, ours = torch_mha_pair(bias, mode == "cross_dims")
    seq_k = SQ if mode == "self" else SK
    x = torch.randn(B, SQ, E, requires_grad=True)
    if mode == "self":
        k = v = x
    else:
        kd, vd = (KDIM, VDIM) if mode == "cross_dims" else (E, E)
        k = torch.randn(B, seq_k, kd, requires_grad=True)
        v = torch.randn(B, seq_k, vd, requires_grad=True)
    # masks without dead rows: torch MHA gives NaN there, headspace zeros (tested elsewhere)
    real = torch.ones(B, seq_k, dtype=torch.bool)
    real[0, 0] = False
    allowed = torch.rand(SQ, seq_k) > 0.4
    allowed[:, -1] = True
    allowed_h = torch.rand(B, H, SQ, seq_k) > 0.4
    allowed_h[..., -1] = True
    additive = torch.randn(SQ, seq_k)
    torch_kw: dict[str, Any] = {}
    our_kw: dict[str, Any] = {}
    if masks == "key_padding":
        torch_kw["key_padding_mask"] = ~real  # torch: True = ignore
        our_kw["key_padding"] = real  # headspace: True = real token
    elif masks == "bool_mask":
        torch_kw["attn_mask"] = ~allowed
        our_kw["attn_mask"] = allowed
    elif masks == "float_mask":
        torch_kw["attn_mask"] = additive
        our_kw["attn_mask"] = additive
    elif masks == "causal":
        torch_kw["attn_mask"] = ~torch.ones(SQ, seq_k, dtype=torch.bool).tril(seq_k - SQ)
        torch_kw["is_causal"] = True
        our_kw["is_causal"] = True
    elif masks == "per_head_mask":
        torch_kw["attn_mask"] = ~allowed_h.reshape(B * H, SQ, seq_k)  # (batch * n_heads, seq_q, seq_k)
        our_kw["attn_mask"] = allowed_h
    want, want_pattern = ref(x, k, v, need_weights=True, average_attn_weights=False, **torch_kw)
    key, value = (None, None) if mode == "self" else (k, v)
    got_fast = ours(x, key, value, **our_kw)
    got, got_pattern = ours(x, key, value, need_weights=True, **our_kw)
    assert_close(got_fast, want)
    assert_close(got, want)
    assert_close(got_pattern, want_pattern)

    weight = torch.randn(B, SQ, E)
    leaves_in = [x] if mode == "self" else [x, k, v]
    if mode == "cross_dims":
        ref_w = [ref.q_proj_weight, ref.k_proj_weight, ref.v_proj_weight]
        our_w = [ours.q_weight, ours.k_weight, ours.v_weight]
    else:
        ref_w, our_w = [ref.in_proj_weight], [ours.qkv_weight]
    # (torch's need_weights=False path treats is_causal as top-left aligned for seq_q != seq_k, ignoring
    # attn_mask; the need_weights=True path uses the mask we pass, so gradients come from that one)
    g_ref = torch.autograd.grad((want * weight).sum(), [*leaves_in, *ref_w, ref.out_proj.weight])
    g_ours = torch.autograd.grad((got_fast * weight).sum(), [*leaves_in, *our_w, ours.o_weight])
    for a, b in zip(g_ours, g_ref):
        assert_close(a, b)
