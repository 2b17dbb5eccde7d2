"""Named hook points, as in TransformerLens.

A :class:`HookPoint` is an identity sub-module placed at an intermediate value of a layer
(``hook_q``, ``hook_pattern`` ...). Its full name is its module path (``blocks.2.attn.hook_pattern``).
Functions added to it see the value and may return a replacement (patching, ablation).

Layers check :attr:`HookPoint.active` (or the truth of :attr:`HookPoint.fns`) and take their fast path
while no hook point of theirs has a function: an untraced module pays nothing.

Deferred values: a function that only records (:func:`headspace.trace`'s) may be handed a
:class:`Deferred` instead of the value (:attr:`HookPoint.defers`, :meth:`HookPoint.fire_deferred`), which
computes the value again, bit for bit, when read: :class:`Recomputed` is the general one (an op and the
tensors, copies of weights and other deferred values it ran on). While a fully recorded block runs, the
tensors it computed are noted with what they are recomputed from (:func:`noting_sources`,
:func:`note_source`, :func:`source_of`), so that the MLP inside, and the trace's executor
(:mod:`headspace.model.recorded`, which runs the attention), defer to them.

Threads: a function is added either for every thread (``add(fn)``, the default, as before) or for the
calling thread only (``add(fn, this_thread=True)``, what :func:`headspace.trace`,
:func:`~headspace.trace.hooked` and :func:`headspace.ablate` do). A thread-only function fires only in
calls made by the thread that added it; in every other thread the hook point looks untouched
(``active`` is False, ``fns`` holds the all-thread functions only), so their calls of the same module
behave as untraced and keep the fast path. Work that torch runs in threads of its own
(``nn.DataParallel`` replicas, autograd's device threads) does not see thread-only functions; add such
functions with ``this_thread=False``.
"""

from __future__ import annotations

import dataclasses
import operator
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol

from torch import Tensor, nn

HookFn = Callable[[Tensor, "HookPoint"], Tensor | None]


class Deferred(Protocol):
    """A value a layer hands to recorders instead of computing it: computed on access, always the same.

    ``materialize()`` returns the whole value, ``materialize(head)`` the slice of one head (the head
    axis kept, of size 1); both equal, bit for bit, what the layer's traced path would have computed.
    """

    shape: tuple[int, ...]

    def materialize(self, head: int | None = None) -> Tensor:
        """The value (or one head's slice of it, head axis kept)."""
        ...


Memo = dict[int, Any]
"""What one access of a deferred value has computed so far, by ``id`` of the deferred input: a value
needed twice by the same access (the q/k/v projection of ``hook_rot_q`` and ``hook_rot_k`` in a
pattern) is computed once."""


def resolve(value: Any, memo: Memo) -> Any:
    """``value`` itself, or, for a :class:`Deferred` input, its value (computed once per ``memo``)."""
    if isinstance(value, Tensor) or not callable(getattr(value, "materialize", None)):
        return value
    key = id(value)
    if key not in memo:
        evaluate = getattr(value, "evaluate", None)
        memo[key] = evaluate(memo) if callable(evaluate) else value.materialize()
    return memo[key]


class Recomputed:
    """A :class:`Deferred` kept as the function that computed it and that function's arguments.

    ``materialize()`` is ``fn(*args)`` with every deferred argument computed first (recursively); the
    arguments are tensors the value was computed from (kept, not copied), copies of weights, other
    deferred values and constants. As long as ``fn`` is the op the layer ran and the tensors hold what
    they held then, the value is bit for bit the layer's. ``head_axis``: the axis ``materialize(head)``
    narrows to one head (after computing the whole value); None for values without a head axis.
    """

    def __init__(
        self, fn: Callable[..., Any], *args: Any, shape: Sequence[int] = (), head_axis: int | None = None
    ) -> None:
        self.fn, self.args = fn, args
        self.shape = tuple(shape)
        self.head_axis = head_axis

    def evaluate(self, memo: Memo, head: int | None = None) -> Any:
        """The value, its deferred arguments resolved through ``memo`` (see :func:`resolve`)."""
        value = self.fn(*(resolve(a, memo) for a in self.args))
        if head is None:
            return value
        if self.head_axis is None:
            raise ValueError("this value has no head axis")
        return value.narrow(self.head_axis, head, 1)

    def materialize(self, head: int | None = None) -> Any:
        """The value (``head``: that head's slice, the head axis kept)."""
        return self.evaluate({}, head)


def deferred_tensors(value: Any) -> Iterator[Tensor]:
    """Every tensor a stored or deferred value holds: the value itself, or (recursively) the tensors of a
    deferred value's attributes, argument tuples and dataclasses (masks); modules and functions are not
    entered (what they hold belongs to the model)."""
    seen: set[int] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, Tensor):
            yield item
            continue
        if id(item) in seen or isinstance(item, nn.Module):
            continue
        seen.add(id(item))
        if isinstance(item, (tuple, list)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            stack.extend(getattr(item, f.name) for f in dataclasses.fields(item))
        elif callable(getattr(item, "materialize", None)):
            stack.extend(vars(item).values())


# --------------------------------------------------------------------------------------------- sources
# While a fully recorded block runs (TransformerBlock.forward), the tensors it computed from what the trace
# holds anyway are noted here with what they are recomputed from (a tensor the trace holds, or a
# Recomputed), so that the trace's executor (the attention) and the MLP can defer their hook points to them.
# (each entry holds its tensor by a weak reference: noting a tensor does not keep it alive)
_SOURCES: ContextVar[dict[int, tuple[weakref.ref, Any]] | None] = ContextVar("hs_sources", default=None)


@contextmanager
def noting_sources() -> Iterator[None]:
    """Open a fresh table of sources for the calls inside the block (this thread / context only);
    every entry is dropped on exit."""
    token = _SOURCES.set({})
    try:
        yield
    finally:
        _SOURCES.reset(token)


def noting() -> bool:
    """Whether a table of sources is open (inside a fully recorded block)."""
    return _SOURCES.get() is not None


def note_source(t: Tensor, source: Any) -> None:
    """Note that ``t`` is recomputed from ``source`` (a tensor the trace holds, or a :class:`Deferred`);
    nothing happens outside :func:`noting_sources`."""
    table = _SOURCES.get()
    if table is not None:
        table[id(t)] = (weakref.ref(t), source)


def source_of(t: Any) -> Any:
    """What ``t`` itself (this very tensor object) was noted to be recomputed from, or None."""
    table = _SOURCES.get()
    if not table:
        return None
    entry = table.get(id(t))
    return entry[1] if entry is not None and entry[0]() is t else None


# adding and removing functions is rare; one lock for every hook point keeps the per-thread tuples whole
# (a lock per module could not be deep-copied or pickled with the model)
_EDIT_LOCK = threading.Lock()


class HookPoint(nn.Module):
    """An identity point that named functions can read or replace.

    ``fn(value, hook_point) -> None | Tensor``: return None to leave the value, a tensor to replace it
    (it must have the same shape). In a call, the functions added for every thread run first (in the
    order added), then those the calling thread added for itself (see the module docstring).
    """

    def __init__(self) -> None:
        super().__init__()
        self._all_threads: list[HookFn] = []
        # thread id -> the functions that thread added for itself; a thread with none has no entry, so an
        # empty dict means "nothing thread-only anywhere" and costs one truth test
        self._by_thread: dict[int, tuple[HookFn, ...]] = {}
        self.name: str = ""

    # ------------------------------------------------------------------ what fires in this thread
    @property
    def fns(self) -> list[HookFn]:
        """The functions that fire in the calling thread: every-thread ones, then this thread's own.

        Without thread-only functions in this thread this is the every-thread list itself (appending to
        it adds a function for every thread, as before); otherwise a new list.
        """
        by_thread = self._by_thread
        if by_thread:
            mine = by_thread.get(threading.get_ident())
            if mine:
                return [*self._all_threads, *mine]
        return self._all_threads

    @fns.setter
    def fns(self, value: list[HookFn]) -> None:
        self._all_threads = list(value)

    @property
    def active(self) -> bool:
        """Whether a function fires in the calling thread (cheap: one or two truth tests)."""
        if self._all_threads:
            return True
        by_thread = self._by_thread
        return bool(by_thread) and threading.get_ident() in by_thread

    # ------------------------------------------------------------------ adding and removing
    def add(self, fn: HookFn, *, this_thread: bool = False) -> Callable[[], None]:
        """Add ``fn``; returns a function that removes it again (from any thread).

        Args:
            fn: ``fn(value, hook_point) -> None | Tensor``.
            this_thread: False (default): ``fn`` fires in every thread's calls. True: only in calls made
                by the thread calling ``add`` (other threads see this hook point as inactive).
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable fn(value, hook_point); got {type(fn).__name__} {fn!r}")
        if not isinstance(this_thread, bool):
            raise TypeError(f"this_thread must be a bool; got {type(this_thread).__name__} {this_thread!r}")
        if not this_thread:
            with _EDIT_LOCK:
                self._all_threads.append(fn)

            def remove() -> None:
                with _EDIT_LOCK:
                    if fn in self._all_threads:
                        self._all_threads.remove(fn)

            return remove

        ident = threading.get_ident()
        with _EDIT_LOCK:
            self._by_thread[ident] = (*self._by_thread.get(ident, ()), fn)

        def remove_own() -> None:
            with _EDIT_LOCK:
                own = list(self._by_thread.get(ident, ()))
                if fn in own:
                    own.remove(fn)
                if own:
                    self._by_thread[ident] = tuple(own)
                else:
                    self._by_thread.pop(ident, None)

        return remove_own

    def clear(self) -> None:
        """Remove every function: the every-thread ones and those of every thread."""
        with _EDIT_LOCK:
            self._all_threads.clear()
            self._by_thread.clear()

    @property
    def defers(self) -> bool:
        """Whether every function firing here (in the calling thread) only records and accepts a
        :class:`Deferred` instead of the value (``fn.record_deferred(deferred, point)``): then nothing can
        replace the value and the layer may skip computing it. True when no function fires."""
        return all(callable(getattr(fn, "record_deferred", None)) for fn in self.fns)

    def fire_deferred(self, deferred: Deferred) -> None:
        """Hand ``deferred`` to every function firing here (only valid when :attr:`defers` is True)."""
        for fn in list(self.fns):
            fn.record_deferred(deferred, self)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ running
    def fire(self, value: Tensor) -> Tensor:
        """Run the calling thread's functions on ``value`` in order; return the (possibly replaced) value."""
        for fn in list(self.fns):
            out = fn(value, self)
            if out is not None:
                if not isinstance(out, Tensor) or out.shape != value.shape:
                    got = list(out.shape) if isinstance(out, Tensor) else type(out).__name__
                    raise ValueError(
                        f"hook on {self.name or 'hook point'} must return None or a tensor of shape "
                        f"{list(value.shape)}; got {got}"
                    )
                if out.dtype != value.dtype or out.device != value.device:
                    raise ValueError(
                        f"hook on {self.name or 'hook point'} must return a tensor of the value's dtype "
                        f"{value.dtype} on {value.device}; got {out.dtype} on {out.device}"
                    )
                value = out
        return value

    def forward(self, value: Tensor) -> Tensor:
        return self.fire(value)

    def extra_repr(self) -> str:
        own = sum(len(fns) for fns in list(self._by_thread.values()))
        return f"n_fns={len(self._all_threads)}" + (f", thread_only={own}" if own else "")

    def __setstate__(self, state: dict[str, Any]) -> None:
        # hook points pickled before thread-only functions existed kept their list under "fns"
        if "fns" in state and "_all_threads" not in state:
            state["_all_threads"] = list(state.pop("fns"))
        state.setdefault("_by_thread", {})
        super().__setstate__(state)


def name_hook_points(model: nn.Module) -> dict[str, HookPoint]:
    """Give every hook point in ``model`` its full module path as name; return them by name."""
    points = {}
    for name, module in model.named_modules():
        if isinstance(module, HookPoint):
            if module.name != name:  # set once: nn.Module.__setattr__'s checks cost on every trace
                module.name = name
            points[name] = module
    return points


# ---------------------------------------------------------------------------------- torch's fast path
def keep_off_torch_fast_path(module: nn.Module, args: tuple[Any, ...]) -> None:
    """A forward pre-hook that does nothing (:func:`keep_torch_fast_path_off` registers it)."""
    return None


def keep_torch_fast_path_off(module: nn.Module) -> None:
    """Keep torch's fused transformer kernels from standing in for ``module`` (and skipping its hook
    points): register the do-nothing forward pre-hook :func:`keep_off_torch_fast_path` on it, once.

    torch's ``nn.TransformerEncoderLayer`` skips its fused inference kernel when any of its modules has
    forward hooks or pre-hooks (``why_not_sparsity_fast_path = "forward pre-/hooks are attached to the
    module"``), because that kernel would skip them; its other conditions (``batch_first``,
    ``in_proj_bias``, ``_qkv_same_embed_dim`` ...) describe the weights and cannot be met otherwise
    without lying about them. So the drop-in :class:`headspace.compat.MultiheadAttention` carries this
    one torch hook, here in the hook machinery: a layer holding it always calls the drop-in's
    ``forward``, where headspace's hook points fire.
    """
    if keep_off_torch_fast_path not in module._forward_pre_hooks.values():
        module.register_forward_pre_hook(keep_off_torch_fast_path)


def on_call(module: nn.Module, fn: Callable[..., None]) -> Callable[[], None]:
    """Run ``fn(module, args, kwargs)`` before every call of ``module``, with the call's positional and
    keyword arguments; returns the function that removes it.

    The hook machinery's one way to read a call's arguments: what no tensor hook point carries (an
    attention call's ``key_padding``, ``attn_mask``, ``is_causal``, ``positions``; a norm's input where
    no hook point sits before it). ``fn`` may raise to stop the run (the exception propagates to the
    caller). Analyses use this, or hook points, never torch's module hooks directly
    (``tests/test_no_raw_hooks.py``).
    """

    def call(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        fn(m, args, kwargs)

    return module.register_forward_pre_hook(call, with_kwargs=True).remove


# read in C by map(): a point's every-thread functions, and its thread id -> thread-only functions
_EVERY_THREAD = operator.attrgetter("_all_threads")
_SOME_THREAD = operator.attrgetter("_by_thread")


def all_idle(points: Sequence[HookPoint]) -> bool:
    """Whether no point of ``points`` has a function in the calling thread: what :attr:`HookPoint.active`
    says of each, read in C (``map`` over attribute getters: a few tens of microseconds for SmolLM2's
    511 points, against ~135 for a Python loop over ``active``); only where some point holds
    thread-only functions does each point's ``active`` decide for the calling thread."""
    if any(map(_EVERY_THREAD, points)):
        return False
    if any(map(_SOME_THREAD, points)):
        return not any(point.active for point in points)
    return True
