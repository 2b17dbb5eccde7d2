"""The blocked explicit backend against the plain-autograd reference, on every mask kind and GQA."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import headspace.attention.functional as fn
import headspace.kernels.blocked as kernel
from headspace.nn.masks import CanonicalMask, canonical_mask

MASK_KINDS = ("none", "padding", "causal", "causal+padding", "bool3", "bool4", "float4", "float2-dead")


def _mask(
    kind: str, B: int, H: int, Sq: int, Sk: int, dtype: torch.dtype, gen: torch.Generator
) -> CanonicalMask:
    kw: dict = {}
    if "padding" in kind:
        pad = torch.rand(B, Sk, generator=gen) > 0.4
        pad[0] = False  # a whole sample padded: every row of it is dead
        kw["key_padding"] = pad
    if "causal" in kind:
        kw["is_causal"] = True
    if kind == "bool3":
        kw["attn_mask"] = torch.rand(B, Sq, Sk, generator=gen) > 0.5
    if kind == "bool4":
        kw["attn_mask"] = torch.rand(B, H, Sq, Sk, generator=gen) > 0.5
    if kind == "float4":
        kw["attn_mask"] = torch.randn(B, H, Sq, Sk, generator=gen, dtype=dtype)
    if kind == "float2-dead":
        m = torch.randn(Sq, Sk, generator=gen, dtype=dtype)
        m[0] = float("-inf")  # query 0 sees nothing
        kw["attn_mask"] = m
    return canonical_mask(batch=B, n_heads=H, seq_q=Sq, seq_k=Sk, dtype=dtype, **kw)


def _qkv(B: int, H: int, Hkv: int, Sq: int, Sk: int, dh: int, dtype: torch.dtype, gen: torch.Generator):
    q = torch.randn(B, H, Sq, dh, generator=gen, dtype=dtype).requires_grad_()
    k = torch.randn(B, Hkv, Sk, dh, generator=gen, dtype=dtype).requires_grad_()
    v = torch.randn(B, Hkv, Sk, dh, generator=gen, dtype=dtype).requires_grad_()
    return q, k, v


def _compare(
    q, k, v, mask: CanonicalMask, scale: float, with_grad_pattern: bool, gen: torch.Generator
) -> None:
    out, pattern = fn.explicit_attention(q, k, v, mask, scale=scale)
    ref_out, ref_pattern = fn.reference_attention(q, k, v, mask, scale=scale)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(pattern, ref_pattern)
    g_out = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    outputs, ref_outputs, grads = (out,), (ref_out,), (g_out,)
    if with_grad_pattern:  # a loss on the pattern too (e.g. an attention-entropy penalty)
        g_pat = torch.randn(pattern.shape, generator=gen, dtype=out.dtype)
        outputs, ref_outputs, grads = (out, pattern), (ref_out, ref_pattern), (g_out, g_pat)
    got = torch.autograd.grad(outputs, (q, k, v), grads)
    want = torch.autograd.grad(ref_outputs, (q, k, v), grads)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("which", ["out", "pattern"])
def test_blocked_backward_with_one_output_unused(which: str) -> None:
    """Only one of (out, pattern) reaches the loss: the unused one's gradient is never materialised
    (None reaches the kernel), and the gradients still equal the reference's."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = _qkv(2, 6, 2, 5, 7, 3, torch.float64, gen)
    mask = _mask("padding", 2, 6, 5, 7, torch.float64, gen)
    used = {"out": 0, "pattern": 1}[which]
    got_out = fn.explicit_attention(q, k, v, mask, scale=0.37)[used]
    want_out = fn.reference_attention(q, k, v, mask, scale=0.37)[used]
    g = torch.randn(got_out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(got_out, (q, k, v), g, allow_unused=True, materialize_grads=True)
    want = torch.autograd.grad(want_out, (q, k, v), g, allow_unused=True, materialize_grads=True)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"d{name}: {m}")
    seen = []
    real = kernel._blocked_backward
    try:

        def spy(go, gp, *rest):
            seen.append((go is None, gp is None))
            return real(go, gp, *rest)

        kernel._blocked_backward = spy
        out, pattern = fn.explicit_attention(q, k, v, mask, scale=0.37)
        (out if which == "out" else pattern).backward(g)
    finally:
        kernel._blocked_backward = real
    assert seen == [(False, True)] if which == "out" else seen == [(False, False)]


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("block_bytes", [96, 600, 1 << 20], ids=["bands", "groups", "samples"])
@pytest.mark.parametrize("n_kv_heads", [6, 2, 1], ids=["mha", "gqa", "mqa"])
def test_blocked_matches_reference(
    kind: str, block_bytes: int, n_kv_heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kernel, "BLOCK_BYTES", block_bytes)
    monkeypatch.setattr(kernel, "FORWARD_BLOCK_BYTES", block_bytes)
    monkeypatch.setattr(kernel, "MERGE_SAMPLES_MAX_BYTES", 1 << 20 if block_bytes > 1000 else 0)
    gen = torch.Generator().manual_seed(7)
    B, H, Sq, Sk, dh = 2, 6, 5, 7, 3
    if "causal" in kind:
        Sq = Sk  # the square causal kernel case as well as bottom-right alignment with padding
    q, k, v = _qkv(B, H, n_kv_heads, Sq, Sk, dh, torch.float32, gen)
    mask = _mask(kind, B, H, Sq, Sk, torch.float32, gen)
    _compare(q, k, v, mask, 0.37, with_grad_pattern=kind in ("none", "padding", "float2-dead"), gen=gen)


def test_dead_rows_are_zero_with_finite_grads() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = _qkv(2, 3, 3, 5, 7, 2, torch.float32, gen)
    mask = _mask("padding", 2, 3, 5, 7, torch.float32, gen)  # sample 0 fully padded
    out, pattern = fn.explicit_attention(q, k, v, mask, scale=0.5)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(pattern[0], torch.zeros_like(pattern[0]))
    torch.testing.assert_close(pattern[1].sum(-1), torch.ones(3, 5))
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[0], torch.zeros_like(q.grad[0]))  # nothing flows into dead rows


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 3),
    n_kv=st.integers(1, 3),
    group=st.integers(1, 3),
    Sq=st.integers(1, 9),
    Sk=st.integers(1, 9),
    dh=st.integers(1, 6),
    block_bytes=st.sampled_from([4, 64, 300, 1 << 20]),
    kind=st.sampled_from(["none", "padding", "bool4", "float4"]),
)
def test_blocked_matches_reference_any_shape(
    B: int, n_kv: int, group: int, Sq: int, Sk: int, dh: int, block_bytes: int, kind: str
) -> None:
    old = kernel.BLOCK_BYTES, kernel.FORWARD_BLOCK_BYTES
    kernel.BLOCK_BYTES = kernel.FORWARD_BLOCK_BYTES = block_bytes
    try:
        gen = torch.Generator().manual_seed(B * 1000 + Sq * 10 + Sk)
        H = n_kv * group
        q, k, v = _qkv(B, H, n_kv, Sq, Sk, dh, torch.float32, gen)
        _compare(q, k, v, _mask(kind, B, H, Sq, Sk, torch.float32, gen), 0.41, True, gen)
    finally:
        kernel.BLOCK_BYTES, kernel.FORWARD_BLOCK_BYTES = old


@pytest.mark.parametrize("kind", ["causal+padding", "float2-dead", "bool4"])
def test_blocked_gradcheck_float64(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "BLOCK_BYTES", 200)  # several blocks per head
    monkeypatch.setattr(kernel, "FORWARD_BLOCK_BYTES", 200)
    gen = torch.Generator().manual_seed(3)
    B, H, Hkv, Sq, Sk, dh = 2, 4, 2, 5, 5, 3
    q, k, v = _qkv(B, H, Hkv, Sq, Sk, dh, torch.float64, gen)
    mask = _mask(kind, B, H, Sq, Sk, torch.float64, gen)
    assert torch.autograd.gradcheck(
        lambda q, k, v: fn.explicit_attention(q, k, v, mask, scale=0.6), (q, k, v)
    )


def test_no_grad_path_equals_grad_path_and_keeps_inputs() -> None:
    gen = torch.Generator().manual_seed(5)
    q, k, v = _qkv(2, 4, 2, 6, 6, 5, torch.float32, gen)
    mask = _mask("causal", 2, 4, 6, 6, torch.float32, gen)
    before = [t.detach().clone() for t in (q, k, v)]
    out, pattern = fn.explicit_attention(q, k, v, mask, scale=0.2)
    with torch.no_grad():
        out0, pattern0 = fn.explicit_attention(q, k, v, mask, scale=0.2)
    assert torch.equal(out.detach(), out0) and torch.equal(pattern.detach(), pattern0)
    for t, b in zip((q, k, v), before):
        assert torch.equal(t.detach(), b)


@pytest.mark.parametrize("n_kv_heads", [3, 1])
def test_views_of_a_fused_projection_match_the_reference(n_kv_heads: int) -> None:
    # q, k, v as the layer makes them: strided views of one [B, S, (H + 2 Hkv) dh] projection
    gen = torch.Generator().manual_seed(9)
    B, H, S, dh = 2, 3, 5, 4
    qkv = torch.randn(B, S, H + 2 * n_kv_heads, dh, generator=gen).requires_grad_()
    q, k, v = qkv.transpose(1, 2).split([H, n_kv_heads, n_kv_heads], dim=1)  # (B, heads, S, dh) views
    mask = _mask("causal+padding", B, H, S, S, torch.float32, gen)
    out, pattern = fn.explicit_attention(q, k, v, mask, scale=0.5)
    ref_out, ref_pattern = fn.reference_attention(q, k, v, mask, scale=0.5)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(pattern, ref_pattern)
    g = torch.randn(out.shape, generator=gen)
    (got,) = torch.autograd.grad(out, qkv, g)
    (want,) = torch.autograd.grad(ref_out, qkv, g)
    torch.testing.assert_close(got, want)


def test_dropout_and_higher_order_use_the_reference() -> None:
    gen = torch.Generator().manual_seed(2)
    q, k, v = _qkv(1, 2, 2, 3, 4, 2, torch.float64, gen)
    mask = _mask("none", 1, 2, 3, 4, torch.float64, gen)
    torch.manual_seed(0)
    out, _ = fn.explicit_attention(q, k, v, mask, scale=0.5, dropout_p=0.5)
    torch.manual_seed(0)
    ref, _ = fn.reference_attention(q, k, v, mask, scale=0.5, dropout_p=0.5)
    torch.testing.assert_close(out, ref)
    assert torch.autograd.gradgradcheck(
        lambda q, k, v: fn.reference_attention(q, k, v, mask, scale=0.5)[0], (q, k, v)
    )


@pytest.mark.parametrize("kind", ["causal+padding", "float2-dead", "bool4"])
def test_blocked_kernel_is_differentiable_to_higher_orders(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # create_graph=True takes the plain-op backward on the saved pattern; gradients of the pattern
    # output and of the output both reach second order, with grouped-query heads and dead rows
    monkeypatch.setattr(kernel, "BLOCK_BYTES", 200)
    monkeypatch.setattr(kernel, "FORWARD_BLOCK_BYTES", 200)
    gen = torch.Generator().manual_seed(4)
    B, H, Hkv, Sq, Sk, dh = 2, 4, 2, 3, 5, 2  # distinct sizes: a swapped axis fails
    q, k, v = _qkv(B, H, Hkv, Sq, Sk, dh, torch.float64, gen)
    mask = _mask(kind, B, H, Sq, Sk, torch.float64, gen)
    assert torch.autograd.gradgradcheck(
        lambda q, k, v: fn.explicit_attention(q, k, v, mask, scale=0.6), (q, k, v)
    )
    # and equal to the reference's second derivatives (a Hessian-vector product through both outputs)
    w = torch.randn(B, H, Sq, Sk, dtype=torch.float64, generator=gen)
    vecs = [torch.randn(t.shape, dtype=torch.float64, generator=gen) for t in (q, k, v)]

    def hvp(backend) -> tuple[torch.Tensor, ...]:
        out, pattern = backend(q, k, v, mask, scale=0.6)
        loss = (out**2).sum() + (pattern * w).sum()
        grads = torch.autograd.grad(loss, (q, k, v), create_graph=True)
        return torch.autograd.grad(sum((g * u).sum() for g, u in zip(grads, vecs)), (q, k, v))

    for got, want in zip(hvp(fn.explicit_attention), hvp(fn.reference_attention)):
        torch.testing.assert_close(got, want)


def test_backends_registry() -> None:
    assert set(fn.BACKENDS) == {"sdpa", "explicit", "reference"}
    with pytest.raises(ValueError, match="known backends"):
        fn.get_backend("flash")
