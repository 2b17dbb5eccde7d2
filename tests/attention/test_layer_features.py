"""Sliding windows, QK-norm and soft-capping in MultiHeadAttention, against the maths written by hand."""

from __future__ import annotations

import math

import pytest
import torch

from headspace import MultiHeadAttention
from headspace.nn.masks import canonical_mask, window_mask
from headspace.nn.positions import Rotary


def _by_hand(a: MultiHeadAttention, x: torch.Tensor, window: int | None, pad: torch.Tensor | None = None):
    """Reference: per-head loops over the maths of the docstrings (no headspace attention code)."""
    B, S, _ = x.shape
    H, Hkv = a.n_heads, a.n_kv_heads
    q = torch.einsum("bsd,hde->bhse", x, a.W_Q)  # (B, H, S, dh)
    k = torch.einsum("bsd,hde->bhse", x, a.W_K)  # (B, Hkv, S, dh)
    v = torch.einsum("bsd,hde->bhse", x, a.W_V)  # (B, Hkv, S, dh)
    if a.qk_norm == "head":
        wq, wk, eps = a.q_norm.weight, a.k_norm.weight, a.q_norm.eps
        q = q / torch.sqrt(q.pow(2).mean(-1, keepdim=True) + eps) * (a.q_norm.offset + wq)
        k = k / torch.sqrt(k.pow(2).mean(-1, keepdim=True) + eps) * (a.k_norm.offset + wk)
    out = torch.zeros(B, S, a.d_model, dtype=x.dtype)
    pattern = torch.zeros(B, H, S, S, dtype=x.dtype)
    for b in range(B):
        for h in range(H):
            g = h // (H // Hkv)
            s = q[b, h] @ k[b, g].T * a.scale  # (S, S)
            if a.softcap is not None:
                s = a.softcap * torch.tanh(s / a.softcap)
            i = torch.arange(S)[:, None]
            j = torch.arange(S)[None, :]
            ok = j <= i
            if window is not None:
                ok = ok & (i - window < j)
            if pad is not None:
                ok = ok & pad[b][None, :]
            p = torch.softmax(s.masked_fill(~ok, -math.inf), -1)
            pattern[b, h] = p
            out[b] += p @ v[b, g] @ a.W_O[h]
    return out, pattern


@pytest.mark.parametrize("qk_norm", [None, "head"])
@pytest.mark.parametrize("softcap", [None, 2.5])
def test_window_qknorm_softcap_match_hand_maths(qk_norm: str | None, softcap: float | None) -> None:
    torch.manual_seed(0)
    a = MultiHeadAttention(
        26, 2, d_head=13, n_kv_heads=1, bias=False, window=3, qk_norm=qk_norm, softcap=softcap,
        qk_norm_offset=1.0 if qk_norm else 0.0, dtype=torch.float64,
    )  # fmt: skip
    if qk_norm:
        with torch.no_grad():
            a.q_norm.weight.normal_()
            a.k_norm.weight.normal_()
    x = torch.randn(2, 11, 26, dtype=torch.float64)
    want, want_p = _by_hand(a, x, 3)
    out, pattern = a(x, need_weights=True)  # the window is causal by itself
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(pattern, want_p)
    torch.testing.assert_close(a(x, is_causal=True), want)  # the fused path (sdpa or reference)
    hit = []
    a.hook_pattern.add(lambda t, _hook: hit.append(t) or t)
    torch.testing.assert_close(a(x, is_causal=True), want)  # the traced path
    torch.testing.assert_close(hit[0], want_p)


def test_window_with_padding_and_kv_cache_uses_absolute_positions() -> None:
    torch.manual_seed(1)
    a = MultiHeadAttention(22, 2, d_head=11, bias=False, window=4, dtype=torch.float64)
    x = torch.randn(2, 13, 22, dtype=torch.float64)
    pad = torch.ones(2, 13, dtype=torch.bool)
    pad[1, :3] = False  # left padding
    want, _ = _by_hand(a, x, 4, pad)
    cache = a.make_kv_cache(2, 13)
    outs = [a(x[:, :5], is_causal=True, kv_cache=cache, key_padding=pad[:, :5])]
    for t in range(5, 13):  # one query at a time: the window is what masks the older keys
        outs.append(a(x[:, t : t + 1], kv_cache=cache, key_padding=pad[:, : t + 1]))
    got = torch.cat(outs, 1)
    real = pad[:, :, None]
    torch.testing.assert_close(got[real.expand_as(got)], want[real.expand_as(want)])


def test_window_mask_rows_and_and() -> None:
    m = window_mask(3, 6, 2)  # queries at key positions 3, 4, 5
    assert m.tolist() == [
        [False, False, True, True, False, False],
        [False, False, False, True, True, False],
        [False, False, False, False, True, True],
    ]
    add = torch.zeros(3, 6)
    add[:, 4] = -math.inf
    cm = canonical_mask(batch=1, n_heads=1, seq_q=3, seq_k=6, attn_mask=add, window=2)
    assert torch.isneginf(cm.mask[0, 0, 1, 4]) and cm.mask[0, 0, 1, 3] == 0
    assert cm.dead_rows is None or not bool(cm.dead_rows[0, 0, 1])


def test_qk_norm_before_rotation_and_hooks() -> None:
    torch.manual_seed(2)
    rot = Rotary(6, base=100.0)
    a = MultiHeadAttention(18, 3, d_head=6, bias=False, qk_norm="all", rotary=rot, dtype=torch.float64)
    x = torch.randn(1, 7, 18, dtype=torch.float64)
    seen: dict[str, torch.Tensor] = {}
    a.hook_q_normed.add(lambda t, _hook: seen.setdefault("q", t))
    out_traced = a(x, is_causal=True)
    a.hook_q_normed.fns.clear()
    out = a(x, is_causal=True)
    torch.testing.assert_close(out, out_traced)
    q = torch.einsum("bsd,hde->bshe", x, a.W_Q).reshape(1, 7, 18)  # (1, 7, H dh)
    q = q / torch.sqrt(q.pow(2).mean(-1, keepdim=True) + a.q_norm.eps) * a.q_norm.weight
    torch.testing.assert_close(seen["q"], q.view(1, 7, 3, 6))


@pytest.mark.parametrize("qk_norm", ["head", "all"])
def test_qk_circuit_gives_the_scores_at_the_frozen_norm_scales(qk_norm: str) -> None:
    """With QK-norm, ``head.qk(i - j)`` (the norms' gains folded in) times the run's norm scales
    (``qk_norm_scales`` of hook_q / hook_k) and ``scale`` is the traced score; without the scales it is
    not (a fixed matrix cannot give a normalised score). GQA, rotary, biases and Gemma's 1 + w."""
    from headspace import trace

    torch.manual_seed(3)
    a = MultiHeadAttention(
        20, 4, d_head=6, n_kv_heads=2, qk_norm=qk_norm, qk_norm_offset=1.0, rotary=Rotary(6, base=50.0),
        dtype=torch.float64,
    )  # fmt: skip
    with torch.no_grad():
        for p in (a.q_norm.weight, a.k_norm.weight, a.qkv_bias):
            p.normal_()
    x = torch.randn(1, 7, 20, dtype=torch.float64)
    names = ["hook_q", "hook_k", "hook_q_normed", "hook_scores"]
    with trace(a, names=names) as t:
        a(x, is_causal=True)
    s_q, s_k = a.qk_norm_scales(t["hook_q"], t["hook_k"])  # (1, 7, 4), (1, 7, 2)
    g_q, _ = a.qk_norm_gains()  # (4, 6), (2, 6)
    torch.testing.assert_close(t["hook_q_normed"], t["hook_q"] * s_q[..., None] * g_q)
    xa = torch.cat([x[0], torch.ones(7, 1, dtype=x.dtype)], dim=1)  # (7, 21): [x, 1]
    for h, (i, j) in ((0, (6, 2)), (3, (5, 5)), (2, (4, 0))):
        g = a.heads[h].kv_index
        raw = xa[i] @ a.heads[h].qk(i - j, augmented=True).AB @ xa[j]
        want = t["hook_scores"][0, h, i, j]
        torch.testing.assert_close(raw * s_q[0, i, h] * s_k[0, j, g] * a.scale, want)
        assert not torch.isclose(raw * a.scale, want, rtol=1e-3)  # the scales are needed
    with pytest.raises(ValueError, match="no QK-norm"):
        MultiHeadAttention(8, 2).qk_norm_scales(t["hook_q"], t["hook_k"])
    assert MultiHeadAttention(8, 2).qk_norm_gains() is None


def test_bad_values_are_refused() -> None:
    with pytest.raises(ValueError, match="window must be None"):
        MultiHeadAttention(8, 2, window=0)
    with pytest.raises(ValueError, match="qk_norm must be None"):
        MultiHeadAttention(8, 2, qk_norm="rms")
    with pytest.raises(ValueError, match="softcap must be None"):
        MultiHeadAttention(8, 2, softcap=-1.0)


def test_gradcheck_window_softcap_qknorm() -> None:
    torch.manual_seed(3)
    a = MultiHeadAttention(
        10, 2, d_head=5, bias=False, window=2, qk_norm="head", softcap=1.5, dtype=torch.float64
    )
    x = torch.randn(1, 5, 10, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: a(t, is_causal=True), (x,))


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_a_windowed_cache_holds_only_the_window_and_decodes_exactly(chunk: int) -> None:
    """A sliding layer's KV cache keeps the last `window` positions (in order): decoding 2x the window past
    the prompt, in chunks shorter or longer than the window, equals the full forward; its buffers stay at
    the window's size; gradients through the decoding equal the full forward's (float64)."""
    torch.manual_seed(2)
    window = 5
    a = MultiHeadAttention(
        22, 2, d_head=14, n_kv_heads=1, bias=False, window=window, qk_norm="head", dtype=torch.float64,
        rotary=Rotary(14, base=10000.0),
    )  # fmt: skip
    x = torch.randn(2, 17, 22, dtype=torch.float64, requires_grad=True)
    pad = torch.ones(2, 17, dtype=torch.bool)
    pad[1, :2] = False  # left padding
    want = a(x, is_causal=True, key_padding=pad)
    cache = a.make_kv_cache(2, 17)
    assert cache.window == window and cache.k.shape[2] == window and cache.capacity == 17
    outs = [a(x[:, :6], is_causal=True, kv_cache=cache, key_padding=pad[:, :6])]
    for t in range(6, 17, chunk):
        end = min(17, t + chunk)
        outs.append(a(x[:, t:end], is_causal=True, kv_cache=cache, key_padding=pad[:, :end]))
        assert cache.k.shape[2] == window and cache.held == min(end, window) and cache.length == end
    got = torch.cat(outs, 1)
    real = pad[:, :, None].expand_as(got)
    torch.testing.assert_close(got[real], want[real])
    g_want = torch.autograd.grad(want[real].sum(), x)[0]
    g_got = torch.autograd.grad(got[real].sum(), x)[0]
    torch.testing.assert_close(g_got, g_want)
