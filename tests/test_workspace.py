"""Scratch memory: the caller's Workspace and the attention layer's per-thread workspace.

The layer writes its fused QKV projection into the thread's workspace only when nothing can keep a
reference to it past the call; these tests hold it to that: same numbers as fresh memory, results
never aliased, not used with autograd, hooks, a KV cache or cross-attention, one workspace per thread.
"""

from __future__ import annotations

import threading

import pytest
import torch

import headspace.attention as attention_module
from headspace import MultiHeadAttention
from headspace.workspace import Workspace, release_thread_workspace, thread_workspace

B, S, H, DH = 2, 5, 7, 3  # batch, seq, n_heads, d_head: distinct primes
D = H * DH  # d_model = 21


@pytest.fixture
def always(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make every projection large enough for the thread workspace; record each use of it."""
    monkeypatch.setattr(attention_module, "THREAD_SCRATCH_MIN_BYTES", 0)
    calls: list[int] = []

    def spy() -> Workspace:
        calls.append(1)
        return thread_workspace()

    monkeypatch.setattr(attention_module, "thread_workspace", spy)
    release_thread_workspace()
    yield calls
    release_thread_workspace()


def layer(**kw) -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(D, H, **kw).eval()


def fresh_outputs(attn: MultiHeadAttention, x: torch.Tensor, **kw):
    """The layer's result with the workspace switched off (fresh memory, as before it existed)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention_module, "THREAD_SCRATCH_MIN_BYTES", 1 << 62)
        with torch.no_grad():
            return attn(x, **kw)


@pytest.mark.parametrize("kw", [{}, {"n_kv_heads": 1}, {"bias": False}])
def test_same_numbers_as_fresh_memory(always: list[int], kw: dict) -> None:
    attn = layer(**kw)
    x = torch.randn(B, S, D)
    pad = torch.tensor([[True] * S, [True, True, False, False, False]])
    with torch.no_grad():
        out = attn(x, key_padding=pad, is_causal=True)
        assert len(always) == 1
        attn(x, key_padding=pad, need_weights=True)  # the explicit path frees its projection instead
        assert len(always) == 1
    assert torch.equal(out, fresh_outputs(attn, x, key_padding=pad, is_causal=True))


def test_results_never_lie_in_the_workspace(always: list[int]) -> None:
    attn = layer()
    x1, x2 = torch.randn(B, S, D), torch.randn(B, S, D)
    with torch.no_grad():
        out1 = attn(x1)
        kept = out1.clone()
        attn(x2)
    assert torch.equal(out1, kept)
    assert len(always) == 2


def test_not_used_when_a_reference_could_outlive_the_call(always: list[int]) -> None:
    attn = layer()
    x = torch.randn(B, S, D)
    # autograd records a graph: the projection is saved for backward
    out = attn(x)
    out.sum().backward()
    assert attn.qkv_weight.grad is not None and always == []
    # a hook may keep q, k or v
    seen = []
    remove = attn.hook_q.add(lambda v, hp: seen.append(v))
    with torch.no_grad():
        attn(x)
    remove()
    assert len(seen) == 1 and always == []
    # a KV cache may keep the new keys and values
    cache = attn.make_kv_cache(B, S)
    with torch.no_grad():
        attn(x, kv_cache=cache, is_causal=True)
    assert always == []
    # cross-attention: separate projections
    with torch.no_grad():
        attn(x, torch.randn(B, 3, D))
    assert always == []
    # and, to show the spy works: a plain no-grad call uses it
    with torch.no_grad():
        attn(x)
    assert always == [1]


def test_small_projections_keep_fresh_memory() -> None:
    """Below THREAD_SCRATCH_MIN_BYTES (glibc reuses such blocks anyway) nothing is kept."""
    release_thread_workspace()
    attn = layer()
    with torch.no_grad():
        attn(torch.randn(B, S, D))
    assert thread_workspace()._buffers == {}


def test_each_thread_has_its_own(always: list[int]) -> None:
    attn = layer()
    inputs = [torch.randn(B, S, D) for _ in range(2)]
    want = [fresh_outputs(attn, x) for x in inputs]
    errors: list[str] = []
    start = threading.Barrier(2)

    def work(i: int) -> None:
        start.wait()
        with torch.no_grad():
            for _ in range(50):
                if not torch.equal(attn(inputs[i]), want[i]):
                    errors.append(f"thread {i}")
                    return

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(always) == 100


def test_release_frees_the_thread_workspace(always: list[int]) -> None:
    attn = layer()
    with torch.no_grad():
        attn(torch.randn(B, S, D))
    ws = thread_workspace()
    assert ws._buffers["qkv"].numel() == B * S * 3 * D
    release_thread_workspace()
    assert thread_workspace() is not ws and thread_workspace()._buffers == {}


def test_workspace_matrix_grows_and_reuses() -> None:
    ws = Workspace()
    like = torch.empty(0, dtype=torch.float64)
    a = ws.matrix("m", 3, 5, like)
    assert a.shape == (3, 5) and a.dtype == torch.float64
    b = ws.matrix("m", 2, 7, like)  # smaller: the same memory
    assert b.data_ptr() == a.data_ptr()
    c = ws.matrix("m", 11, 13, like)  # larger: grows
    assert c.shape == (11, 13) and ws._buffers["m"].numel() == 143
    assert ws.matrix("m", 2, 2, torch.empty(0)).dtype == torch.float32  # another dtype: replaced
    x, w, bias = torch.randn(5, 3), torch.randn(7, 3), torch.randn(7)
    torch.testing.assert_close(ws.linear("y", x, w, bias), torch.nn.functional.linear(x, w, bias))
    torch.testing.assert_close(ws.linear("y", x, w, None), x @ w.t())
