"""The fused sink softmax (``headspace.attention.sinks.sink_attention``): an untraced gpt-oss layer runs
torch's fused CPU kernel and scales each row by ``sigmoid(logsumexp - s_h)``; it equals the hooked
(reference) path and transformers' gpt-oss eager attention, windowed, grouped and cached, and falls back
to the reference maths where it does not apply (no kernel, a graph to record, dead rows)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

import headspace as hs
from headspace.attention import sinks as sinks_module

pytestmark = pytest.mark.usefixtures("single_thread")

D, H, HKV, DH, S, W = 24, 4, 2, 6, 11, 4


def _layer(dtype: torch.dtype = torch.float32) -> hs.MultiHeadAttention:
    torch.manual_seed(7)
    attn = hs.MultiHeadAttention(D, H, d_head=DH, n_kv_heads=HKV, window=W, sink="learned", bias=True)
    attn = attn.to(dtype).eval()
    with torch.no_grad():
        attn.sinks.copy_(torch.randn(H) * 2)
    return attn


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the fused kernel's calls (the real kernel still runs)."""
    calls: list[int] = []
    real = sinks_module._FUSED_WITH_LSE
    assert real is not None, "this torch has the fused CPU kernel with logsumexp"

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(sinks_module, "_FUSED_WITH_LSE", counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_path_equals_the_hooked_path_and_transformers(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    attn = _layer(dtype)
    x = torch.randn(2, S, D, dtype=dtype)
    calls = _spy(monkeypatch)
    with torch.no_grad():
        fast = attn(x, is_causal=True)  # untraced: the fused kernel
        assert len(calls) == 1
        with hs.trace(attn, names=["hook_q", "hook_k", "hook_v", "hook_z"]) as t:
            hooked = attn(x, is_causal=True)  # traced: the reference maths, pattern and all
        assert len(calls) == 1
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(fast, hooked, atol=tol, rtol=0)
    q, k, v = (t[n].transpose(1, 2) for n in ("hook_q", "hook_k", "hook_v"))  # (B, heads, S, dh)
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    allowed = (j <= i) & (j > i - W)  # causal, window W
    mask = torch.zeros(S, S, dtype=dtype).masked_fill(~allowed, float("-inf"))[None, None]
    module = SimpleNamespace(sinks=attn.sinks.detach(), num_key_value_groups=H // HKV, training=False)
    want_z, _ = eager_attention_forward(module, q, k, v, mask, scaling=DH**-0.5)  # (B, S, H, dh)
    with torch.no_grad():
        want = attn.output_from_heads(want_z)  # (B, S, D)
    torch.testing.assert_close(fast, want, atol=tol, rtol=0)


def test_cached_decoding_takes_the_fused_path_and_equals_the_whole_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    attn = _layer()
    x = torch.randn(1, S, D)
    with torch.no_grad():
        whole = attn(x, is_causal=True)  # (1, S, D)
        calls = _spy(monkeypatch)
        cache = attn.make_kv_cache(1, S)  # a windowed cache: it keeps the last W positions
        steps = [attn(x[:, i : i + 1], kv_cache=cache, positions=None) for i in range(S)]
    assert len(calls) == S
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-6, rtol=0)


def test_the_reference_runs_where_the_fused_kernel_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    attn = _layer()
    x = torch.randn(2, S, D)
    with torch.no_grad():
        want = attn(x, is_causal=True)
        monkeypatch.setattr(sinks_module, "_FUSED_WITH_LSE", None)  # a torch without the kernel
        torch.testing.assert_close(attn(x, is_causal=True), want, atol=1e-6, rtol=0)
    monkeypatch.undo()
    calls = _spy(monkeypatch)
    y = attn(x, is_causal=True)  # a graph to record (the sinks are a parameter): the reference
    y.sum().backward()
    assert not calls and attn.sinks.grad is not None and bool(attn.sinks.grad.abs().sum() > 0)
    torch.testing.assert_close(y.detach(), want, atol=1e-6, rtol=0)
    padding = torch.ones(2, S, dtype=torch.bool)
    padding[1] = False  # row 1 has no key at all: dead rows, the reference's
    with torch.no_grad():
        dead = attn(x, key_padding=padding, is_causal=True)
        with hs.trace(attn, names=["hook_z"]):
            dead_hooked = attn(x, key_padding=padding, is_causal=True)
    assert not calls
    torch.testing.assert_close(dead, dead_hooked, atol=0, rtol=0)
