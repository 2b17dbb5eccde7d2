"""Scratch memory: the caller's Workspace and the attention layer's per-thread workspace.

The layer writes its fused QKV projection into the thread's workspace only when nothing can keep a
reference to it past the call; these tests hold it to that: same numbers as fresh memory, results
never aliased, not used with autograd, hooks, a KV cache or cross-attention, one workspace per thread.
"""

from __future__ import annotations

import threading

import pytest
import torch

import headspace.attention.layer as attention_module
from headspace import MultiHeadAttention
from headspace.kernels.workspace import Workspace, release_thread_workspace, thread_workspace

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


# ------------------------------------------------------------------------------ recycled results
@pytest.fixture
def recycle_all(monkeypatch: pytest.MonkeyPatch):
    """Every CPU result recycled, whatever its size; a clean pool before and after."""
    import headspace.kernels.workspace as workspace_module

    monkeypatch.setattr(workspace_module, "THREAD_SCRATCH_MIN_BYTES", 0)
    release_thread_workspace()
    yield workspace_module
    release_thread_workspace()


def test_pattern_memory_is_reused_only_once_dropped(recycle_all) -> None:
    attn = layer()
    x1, x2 = torch.randn(B, S, D), torch.randn(B, S, D)
    with torch.no_grad():
        _, p1 = attn(x1, need_weights=True)
        ptr = p1.data_ptr()
        kept = p1.clone()
        _, p2 = attn(x2, need_weights=True)  # p1 is held: new memory, p1 untouched
        assert p2.data_ptr() != ptr and torch.equal(p1, kept)
        _, ref_pattern = fresh_outputs(attn, x2, need_weights=True)
        assert torch.equal(p2, ref_pattern)
        del p1
        _, p3 = attn(x1, need_weights=True)  # p1's memory is free again: reused
        assert p3.data_ptr() == ptr and torch.equal(p3, kept)


def test_a_view_keeps_the_memory_in_use(recycle_all) -> None:
    attn = layer()
    with torch.no_grad():
        _, pattern = attn(torch.randn(B, S, D), need_weights=True)
        row = pattern[1, 3]  # (seq_q, seq_k): a view, sharing the storage
        kept = row.clone()
        del pattern
        attn(torch.randn(B, S, D), need_weights=True)
        assert torch.equal(row, kept)


def test_at_most_one_idle_buffer_is_kept(recycle_all) -> None:
    f = recycle_all.recycled_empty
    cpu = torch.device("cpu")
    held = [f((7, 11), torch.float32, cpu) for _ in range(3)]  # three in use
    assert len(recycle_all._local.recycled) == 3
    del held  # all three idle now
    small = f((2, 3), torch.float32, cpu)  # far smaller than each: none fits, all idle ones dropped
    assert len(recycle_all._local.recycled) == 1 and small.shape == (2, 3)
    del small
    again = f((2, 3), torch.float64, cpu)  # 48 bytes: the idle 24-byte one is too small, replaced
    assert len(recycle_all._local.recycled) == 1 and again.dtype == torch.float64
    release_thread_workspace()
    assert recycle_all._local.recycled == []


def test_recycled_pattern_through_autograd(recycle_all) -> None:
    """Saved for backward, the pattern stays in use until the graph is freed, then its memory returns."""
    attn = layer()
    x = torch.randn(B, S, D, requires_grad=True)
    out, pattern = attn(x, need_weights=True)
    ptr = pattern.data_ptr()
    with torch.no_grad():
        _, other = attn(x, need_weights=True)
    assert other.data_ptr() != ptr  # the graph still holds the first pattern
    del other
    out.sum().backward()
    ref = layer()
    ref_x = x.detach().clone().requires_grad_(True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(recycle_all, "THREAD_SCRATCH_MIN_BYTES", 1 << 62)
        ref(ref_x, need_weights=True)[0].sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=0, atol=0)
    del out, pattern
    with torch.no_grad():
        _, again = attn(x, need_weights=True)
    assert again.data_ptr() == ptr  # backward freed the saved pattern: its memory is the first idle one


def test_small_or_non_cpu_requests_are_plain_empty() -> None:
    from headspace.kernels.workspace import recycled_empty

    release_thread_workspace()
    t = recycled_empty((3, 5), torch.float32, torch.device("cpu"))  # far below the threshold
    assert t.shape == (3, 5) and t.untyped_storage().resizable()
    import headspace.kernels.workspace as workspace_module

    assert getattr(workspace_module._local, "recycled", []) == []


def test_a_pattern_too_large_to_allocate_names_its_shape_and_size(
    recycle_all, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mmap behind a recycled pattern fails with ENOMEM: a MemoryError saying what and what to do."""
    import errno
    import mmap as mmap_module

    def no_memory(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    class FakeMmap:  # the module attribute the workspace calls, failing as the kernel does
        mmap = staticmethod(no_memory)

    monkeypatch.setattr(recycle_all, "mmap", FakeMmap)
    attn = layer()
    x = torch.randn(B, S, D)
    with torch.no_grad(), pytest.raises(MemoryError) as info:
        attn(x, need_weights=True)
    message = str(info.value)
    assert isinstance(info.value, recycle_all.PatternMemoryError)
    assert f"[batch, heads, seq_q, seq_k] = [{B}, {H}, {S}, {S}]" in message
    gib = B * H * S * S * 4 / (1 << 30)
    assert f"{gib:.2f} GiB" in message and "torch.float32" in message
    assert "need_weights=False" in message and "smaller batches" in message
    assert "Cannot allocate memory" in message
    with torch.no_grad():
        out = attn(x)  # the fused path needs no pattern: it still runs
    assert out.shape == (B, S, D)
    monkeypatch.setattr(recycle_all, "mmap", mmap_module)
    with torch.no_grad():
        _, pattern = attn(x, need_weights=True)  # and the pool is left usable
    assert pattern.shape == (B, H, S, S)
