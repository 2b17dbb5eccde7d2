"""trace / hooked / ablate act on the calls of the thread that opened them, never on another thread's.

Two real threads share one model; a barrier makes them run their iterations at the same time, so each
iteration of the traced (ablated) thread overlaps an iteration of the other. Sizes differ per thread
(batch 2 against batch 3) so that a value recorded from the wrong thread shows in its shape.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

import headspace as hs
from headspace.analysis.trace import hooked
from headspace.nn.hooks import HookPoint

ITERATIONS = 20
D, H, V, SEQ = 35, 7, 37, 5


def encoder() -> hs.Encoder:
    torch.manual_seed(0)
    cfg = hs.ModelConfig(
        arch="encoder", vocab_size=V, d_model=D, n_layers=2, n_heads=H, d_mlp=23, max_seq_len=16
    )
    model = hs.Encoder(cfg).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.o_bias.normal_()
            block.attn.qkv_bias.normal_()
    return model


def run_pair(first: Callable[[int], None], second: Callable[[int], None]) -> None:
    """Run ``first(i)`` and ``second(i)`` in two threads, iteration i of both at the same time."""
    barrier = threading.Barrier(2, timeout=60)
    errors: list[BaseException] = []

    def loop(fn: Callable[[int], None]) -> None:
        try:
            for i in range(ITERATIONS):
                barrier.wait()
                fn(i)
                barrier.wait()
        except BaseException as e:  # re-raised in the main thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=loop, args=(fn,)) for fn in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]


def test_a_trace_records_only_the_calls_of_its_own_thread() -> None:
    model = encoder()
    a_tokens = torch.randint(0, V, (2, SEQ))
    b_tokens = torch.randint(0, V, (3, SEQ))
    with torch.no_grad():
        b_expected = model(b_tokens)
    a_calls, b_outputs, b_saw_hooks = [], [], []
    inside = threading.Barrier(2, timeout=60)

    def tracing(i: int) -> None:
        with hs.trace(model, "*.hook_pattern") as t:
            inside.wait()  # the other thread runs while this trace is open
            with torch.no_grad():
                model(a_tokens)
            inside.wait()
        a_calls.append((dict(t.calls), {n: tuple(v.shape) for n, v in t.items()}))

    def plain(i: int) -> None:
        inside.wait()
        attn = model.blocks[0].attn
        b_saw_hooks.append((attn.hook_pattern.active, attn.hooks_active, bool(attn.hook_pattern.fns)))
        with torch.no_grad():
            b_outputs.append(model(b_tokens))
        inside.wait()

    run_pair(tracing, plain)
    assert len(a_calls) == len(b_outputs) == ITERATIONS
    for calls, shapes in a_calls:
        assert calls == {"blocks.0.attn.hook_pattern": 1, "blocks.1.attn.hook_pattern": 1}
        assert set(shapes.values()) == {(2, H, SEQ, SEQ)}  # batch 2: never the other thread's batch 3
    assert b_saw_hooks == [(False, False, False)] * ITERATIONS  # the other thread stays untraced
    for out in b_outputs:
        assert torch.equal(out, b_expected)
    assert not any(p.active or p.fns for p in model.modules() if isinstance(p, HookPoint))


def test_an_ablation_changes_only_the_encodes_of_its_own_thread() -> None:
    model = encoder()
    a_tokens = torch.randint(0, V, (2, SEQ))
    b_tokens = torch.randint(0, V, (3, SEQ))
    with torch.no_grad():
        b_expected = model(b_tokens)
        with hs.ablate(model, {(0, 1): "zero", (1, 4): "mean"}):
            a_expected = model(a_tokens)
        assert not torch.equal(a_expected, model(a_tokens))  # the ablation has teeth
    a_outputs, b_outputs = [], []
    inside = threading.Barrier(2, timeout=60)

    def ablating(i: int) -> None:
        with hs.ablate(model, {(0, 1): "zero", (1, 4): "mean"}):
            inside.wait()
            with torch.no_grad():
                a_outputs.append(model(a_tokens))
            inside.wait()

    def plain(i: int) -> None:
        inside.wait()
        with torch.no_grad():
            b_outputs.append(model(b_tokens))
        inside.wait()

    run_pair(ablating, plain)
    assert len(a_outputs) == len(b_outputs) == ITERATIONS
    for a, b in zip(a_outputs, b_outputs):
        assert torch.equal(a, a_expected)
        assert torch.equal(b, b_expected)


def test_two_threads_tracing_at_once_each_get_their_own_values() -> None:
    model = encoder()
    tokens = {0: torch.randint(0, V, (2, SEQ)), 1: torch.randint(0, V, (3, SEQ))}
    got: dict[int, list[tuple[int, ...]]] = {0: [], 1: []}
    inside = threading.Barrier(2, timeout=60)

    def tracer(which: int) -> Callable[[int], None]:
        def fn(i: int) -> None:
            with hs.trace(model, "blocks.1.attn.hook_z") as t:
                inside.wait()
                with torch.no_grad():
                    model(tokens[which])
                inside.wait()
            got[which].append((t.calls["blocks.1.attn.hook_z"], *t["blocks.1.attn.hook_z"].shape))

        return fn

    run_pair(tracer(0), tracer(1))
    assert got[0] == [(1, 2, SEQ, H, D // H)] * ITERATIONS
    assert got[1] == [(1, 3, SEQ, H, D // H)] * ITERATIONS


def test_all_threads_option_and_hook_point_add_keep_the_global_behaviour() -> None:
    model = encoder()
    tokens = torch.randint(0, V, (3, SEQ))
    seen: list[str] = []

    def other_thread() -> None:
        with torch.no_grad():
            model(tokens)

    def run_elsewhere() -> None:
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()

    point = model.blocks[0].attn.hook_z
    remove = point.add(lambda v, p: seen.append("global"))  # no option: every thread, as before
    run_elsewhere()
    assert seen == ["global"]
    remove()
    with hooked(model, {"blocks.0.attn.hook_z": lambda v, p: seen.append("all")}, all_threads=True):
        run_elsewhere()
    with hs.trace(model, "blocks.0.attn.hook_z", all_threads=True) as t:
        run_elsewhere()
    assert seen == ["global", "all"] and t.calls == {"blocks.0.attn.hook_z": 1}
    with hooked(model, {"blocks.0.attn.hook_z": lambda v, p: seen.append("mine")}):
        run_elsewhere()  # the default: not in another thread
        with torch.no_grad():
            model(tokens)  # but in this one
    assert seen == ["global", "all", "mine"]
    with pytest.raises(TypeError, match="all_threads must be a bool"):
        with hs.trace(model, all_threads="yes"):  # type: ignore[arg-type]
            pass
    with pytest.raises(TypeError, match="this_thread must be a bool"):
        point.add(lambda v, p: None, this_thread=1)  # type: ignore[arg-type]


def test_a_thread_only_function_can_be_removed_from_another_thread() -> None:
    point = HookPoint()
    remove = point.add(lambda v, p: None, this_thread=True)
    assert point.active and len(point.fns) == 1
    t = threading.Thread(target=remove)
    t.start()
    t.join()
    assert not point.active and point.fns == [] and point._by_thread == {}


def test_hook_points_copy_and_unpickle_including_the_old_layout() -> None:
    import copy
    import pickle

    model = encoder()
    clone = copy.deepcopy(model)
    with hs.trace(clone, "blocks.0.attn.hook_pattern") as t, torch.no_grad():
        clone(torch.randint(0, V, (2, SEQ)))
    assert t.calls == {"blocks.0.attn.hook_pattern": 1}
    point = pickle.loads(pickle.dumps(HookPoint()))
    assert point.fns == [] and not point.active
    old = HookPoint.__new__(HookPoint)  # a hook point pickled before thread-only functions: a list "fns"
    state = {k: v for k, v in HookPoint().__dict__.items() if k not in ("_all_threads", "_by_thread")}
    old.__setstate__({**state, "fns": []})
    assert old.fns == [] and old._by_thread == {} and not old.active
