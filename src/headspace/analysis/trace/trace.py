"""Named hook points, the ``trace()`` context manager and :class:`Trace`, the activation cache.

Every intermediate value of a headspace model has a name that follows its module path, as in
TransformerLens::

    blocks.3.attn.hook_q        [batch, seq_q, n_heads, d_head]
    blocks.3.attn.hook_k        [batch, seq_k, n_kv_heads, d_head]       (hook_v alike)
    blocks.3.attn.hook_scores   [batch, n_heads, seq_q, seq_k]           scaled, masked (-inf) scores
    blocks.3.attn.hook_pattern  [batch, n_heads, seq_q, seq_k]           softmax of the scores
    blocks.3.attn.hook_z        [batch, seq_q, n_heads, d_head]          pattern @ v, per head
    blocks.3.attn.hook_result   [batch, seq_q, n_heads, d_model]         z_h @ W_O[h]; sum_h + b_O = output
    blocks.3.hook_resid_pre     [batch, seq, d_model]                    (and hook_attn_out, hook_resid_mid,
                                                                          hook_mlp_out, hook_resid_post)

``with trace(model) as t: model(tokens)`` collects them into ``t``; ``trace(model, names=[...])``
collects only some (exact names or ``fnmatch`` globs such as ``"*.hook_pattern"``), and only the
attention layers owning a collected hook point leave their fused fast path. ``hooks=`` adds functions
that may *replace* a value (patching, ablation); the trace records the value after replacement.

Memory: a block whose every hook point is recorded keeps, on inputs long enough, only its input
(``hook_resid_pre``), the attention's ``hook_z`` and one copy of each weight: every other value of the
block is computed again from those when read. Elsewhere ``hook_scores``/``hook_pattern`` are kept as the
layer's q and k, ``hook_result`` as z and a copy of W_O, the MLP's ``hook_pre``/``hook_pre_linear``/
``hook_post`` (on inputs long enough) as its input and copies of its input linears, and
``hook_resid_mid`` (where the block adds ``x + a``) as the recorded ``hook_resid_pre`` and
``hook_attn_out``. Every recomputed value is bit for bit the recorded one; see :class:`Trace`.

A bare :class:`~headspace.MultiHeadAttention` is a one-layer model: its names are ``hook_pattern`` ...
and its layer index is 0.

Threads: the functions :func:`trace`, :func:`hooked` (and :func:`headspace.ablate`) add fire only in
calls made by the thread that opened the block; another thread running the same model meanwhile sees
it untraced (nothing recorded, nothing replaced, its fast path kept). ``all_threads=True`` adds them
for every thread instead (as :meth:`HookPoint.add` does by default).

``headspace.trace`` is the function :func:`trace` (the package exports it under the module's name);
import the rest with ``from headspace.trace import Trace, hooked, attention_layers``.
"""

from __future__ import annotations

import difflib
import fnmatch
import sys
import types
from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from ...attention.delta_net import GatedDeltaNet
from ...attention.layer import MultiHeadAttention
from ...core.checks import is_int
from ...nn.hooks import Deferred, HookFn, HookPoint, deferred_tensors, name_hook_points

ATTN_HOOKS = ("q", "k", "v", "scores", "pattern", "z", "result")
"""Short names of the hook points of an attention layer (full name: ``<attn path>.hook_<short>``)."""

ROTARY_HOOKS = ("rot_q", "rot_k")

QK_NORM_HOOKS = ("q_normed", "k_normed")
"""Short names of the hook points only QK-norm attention layers have: q and k after the norm (before RoPE)."""
"""Short names of the hook points only rotary attention layers have: q and k after the rotation."""

BLOCK_HOOKS = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")
"""Short names of the hook points of a transformer block (full name: ``<block path>.hook_<short>``)."""

# axis that indexes heads in each attention hook's value
_HEAD_AXIS = {
    "q": 2, "k": 2, "v": 2, "rot_q": 2, "rot_k": 2, "q_normed": 2, "k_normed": 2, "z": 2, "result": 2,
    "scores": 1, "pattern": 1,
}  # fmt: skip

NameFilter = str | Sequence[str] | Callable[[str], bool] | None


def as_module(model: Any) -> nn.Module:
    """The ``nn.Module`` behind ``model``: the model itself, or the ``.model`` of a pretrained wrapper."""
    if isinstance(model, nn.Module):
        return model
    inner = getattr(model, "model", None)
    if isinstance(inner, nn.Module):
        return inner
    raise TypeError(
        f"model must be an nn.Module (MultiHeadAttention, Encoder, Decoder ...) or a pretrained wrapper "
        f"with a .model module; got {type(model).__name__}"
    )


def attention_layers(model: Any) -> list[tuple[str, MultiHeadAttention]]:
    """Every :class:`MultiHeadAttention` in ``model`` as (module path, layer), in module order.

    The position in this list is the *layer index* used by :class:`Trace`, :func:`ablate`,
    :func:`~headspace.prune_heads` and :mod:`headspace.analysis` (``blocks.i.attn`` is layer ``i``).
    """
    module = as_module(model)
    return [(name, m) for name, m in module.named_modules() if isinstance(m, MultiHeadAttention)]


def _refuse_linear_pattern(key: str, linear_paths: Sequence[str]) -> None:
    """One-line ``ValueError`` where ``key`` asks a Gated DeltaNet layer for a softmax value."""
    path, _, name = key.rpartition(".")
    if path in linear_paths and name in ("hook_scores", "hook_pattern", "hook_rot_q", "hook_rot_k"):
        raise ValueError(
            f"{key!r}: {path} is a Gated DeltaNet layer (the block field 'mixer' is 'gated_deltanet'): "
            "linear attention has no softmax scores or pattern"
        )


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def select_hook_points(model: Any, names: NameFilter = None) -> dict[str, HookPoint]:
    """The hook points of ``model`` whose full names pass ``names``.

    ``names``: None (all), a full name or ``fnmatch`` glob, a sequence of them, or a predicate on the
    full name. A name that matches no full name is tried as a suffix, so ``"hook_pattern"`` means every
    layer's ``hook_pattern``. A name or glob that still matches nothing raises ``ValueError`` listing
    close valid names.
    """
    points = name_hook_points(as_module(model))
    if names is None:
        return points
    if callable(names) and not isinstance(names, str):
        return {n: p for n, p in points.items() if names(n)}
    if not isinstance(names, (str, Sequence, Set)):
        raise TypeError(
            "names must be None, a hook name or glob, a list of them, or a predicate on the full name; "
            f"got {type(names).__name__} {names!r}"
        )
    patterns = [names] if isinstance(names, str) else list(names)
    chosen: dict[str, HookPoint] = {}
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"names must hold strings (full hook names or globs); got {pattern!r}")
        hits = [n for n in points if n == pattern or fnmatch.fnmatchcase(n, pattern)]
        if not hits:  # a bare hook name ("hook_pattern") means that hook point in every layer
            hits = [n for n in points if fnmatch.fnmatchcase(n, f"*.{pattern}")]
        if not hits:
            close = difflib.get_close_matches(pattern, list(points), n=3, cutoff=0.5)
            some = close or list(points)[:5]
            raise ValueError(
                f"names: {pattern!r} matches no hook point of this {type(as_module(model)).__name__}; "
                f"{'close names' if close else 'valid names include'}: {some} "
                f"({len(points)} hook points in all; globs such as '*.hook_pattern' work)"
            )
        for n in hits:
            chosen[n] = points[n]
    return chosen


@contextmanager
def hooked(
    model: Any, hooks: Mapping[str, HookFn], *, all_threads: bool = False
) -> Iterator[dict[str, HookPoint]]:
    """Add functions to hook points for the duration of the block; they are removed on exit, even on error.

    ``hooks`` maps a full name or glob to ``fn(value, hook_point) -> None | Tensor`` (return a tensor of
    the same shape to replace the value). Yields the hook points that got a function, by name.

    The functions fire only in calls made by the thread that entered the block (other threads' calls of
    the same model behave as unhooked); ``all_threads=True`` makes them fire in every thread.
    """
    if not isinstance(all_threads, bool):
        raise TypeError(f"all_threads must be a bool; got {type(all_threads).__name__} {all_threads!r}")
    if not isinstance(hooks, Mapping):
        raise TypeError(f"hooks must be a dict {{name or glob: fn}}; got {type(hooks).__name__}")
    removers: list[Callable[[], None]] = []
    touched: dict[str, HookPoint] = {}
    try:
        for pattern, fn in hooks.items():
            if not callable(fn):
                raise TypeError(f"hooks[{pattern!r}] must be callable fn(value, hook_point); got {fn!r}")
            for name, point in select_hook_points(model, pattern).items():
                removers.append(point.add(fn, this_thread=not all_threads))
                touched[name] = point
        yield touched
    finally:
        for remove in reversed(removers):
            remove()


class Trace(Mapping[str, Tensor]):
    """The values recorded by :func:`trace`: a read-only mapping from full hook name to tensor.

    Besides ``t["blocks.3.attn.hook_pattern"]`` it speaks layers and heads:

    * ``t["pattern", 3]`` / ``t.act("pattern", 3)``: the hook ``pattern`` of layer 3 (attention hooks
      ``q k v scores pattern z result`` or block hooks ``resid_pre attn_out resid_mid mlp_out resid_post``);
    * ``t["pattern", 3, 5]`` / ``t.head("pattern", 3, 5)``: head 5 only (the head axis removed; for
      ``k``/``v`` the key/value head that query head 5 reads);
    * ``t.pattern(3)``, ``t.result(3, 5)``, ``t.z(3)``: shortcuts;
    * ``t.stack("pattern")``: every layer stacked on a new leading axis [n_layers, ...];
    * ``t.layer(3)``: the recorded values of layer 3 by short name.

    A value recorded by several forward passes inside the same ``trace`` holds the *last* one;
    ``t.calls[name]`` counts the passes.

    Memory: what can be recomputed exactly is not stored.

    * A block whose every hook point (its own, its attention's and its MLP's) is recorded, with
      nothing replacing a value, keeps its input ``hook_resid_pre``, the attention's ``hook_z``, its
      output ``hook_resid_post`` (the next block's input) and one copy of each weight it computes with,
      where that is smaller than what the parts below keep (inputs long enough: from about 430 tokens
      on for SmolLM2, whose copies are 14 MB a block); q, k, v and their normed and rotated forms, the
      scores and the pattern, the head results, ``hook_attn_out``, ``hook_resid_mid``, the MLP's hook
      points and ``hook_mlp_out`` are all computed again from those
      (:class:`~headspace.hooks.Recomputed`). Standard parts only: :class:`~headspace.MultiHeadAttention`
      (fused self-attention, no soft-capping), this package's MLPs, RMSNorm or LayerNorm; eval mode,
      no KV cache.
    * Otherwise ``hook_scores`` and ``hook_pattern`` are kept as the layer's q and k (rotated on rotary
      layers) and ``hook_result`` as z and a copy of W_O
      (:class:`~headspace.functional.DeferredAttention`, :class:`~headspace.functional.DeferredResult`);
      a standard MLP's ``hook_pre``, ``hook_pre_linear`` and ``hook_post`` [batch, seq, d_mlp] as the
      MLP's input [batch, seq, d_model] and copies of its input linears, where those values outweigh
      the input and the copies (:class:`~headspace.block.DeferredMLP`; shorter inputs store them); a
      pre-norm, sandwich or post-sublayer block's ``hook_resid_mid`` as the ``hook_resid_pre`` and
      ``hook_attn_out`` it is the sum of, when both are recorded (:class:`~headspace.block.DeferredSum`).

    Each access computes the value again with the layer's own ops, bit for bit what the layer
    computed, whatever the weights became since (``t.pattern(3, 5)`` computes head 5 only; scores and
    patterns are computed a block of query rows at a time into the result). The most recent value is
    kept until the next access of another. With ``detach=False``, or when a function that may replace
    them runs on those hook points, values are stored as computed.
    """

    def __init__(self, layer_paths: Sequence[str], layers: Sequence[MultiHeadAttention]) -> None:
        self._values: dict[str, Tensor | Deferred] = {}
        self._last: tuple[str, int | None, Tensor] | None = None  # the latest computed deferred value
        self.calls: dict[str, int] = {}
        self.layer_paths: list[str] = list(layer_paths)
        self._layers = list(layers)
        #: the module paths of the model's Gated DeltaNet layers (no pattern; not counted as layers)
        self.linear_paths: list[str] = []

    # -- Mapping
    def __getitem__(self, key: str | tuple) -> Tensor:
        if isinstance(key, tuple):
            if len(key) == 2:
                return self.act(*key)
            if len(key) == 3:
                return self.head(*key)
            raise KeyError(f"Trace keys are a full name, (name, layer) or (name, layer, head); got {key!r}")
        try:
            return self._value(key)
        except KeyError:
            _refuse_linear_pattern(str(key), self.linear_paths)
            close = difflib.get_close_matches(str(key), list(self._values), n=3, cutoff=0.5)
            raise KeyError(
                f"{key!r} was not recorded; recorded: {close or list(self._values)[:5]} "
                f"({len(self._values)} in all)"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Trace({len(self)} values, {self.n_layers} attention layers)"

    def _record(self, name: str, value: Tensor | Deferred) -> None:
        self._values[name] = value
        self.calls[name] = self.calls.get(name, 0) + 1
        if self._last is not None and self._last[0] == name:
            self._last = None

    def _value(self, name: str, head: int | None = None) -> Tensor:
        """The value of ``name`` (``head``: that head only, head axis kept), computed if it was deferred.

        Raises KeyError when ``name`` was not recorded.
        """
        value = self._values[name]
        if isinstance(value, Tensor):
            return value
        last = self._last
        if last is not None and last[0] == name and last[1] == head:
            return last[2]
        del last
        self._last = None  # (released before the next value is computed: one at a time in memory)
        out = value.materialize(head)
        self._last = (name, head, out)
        return out

    def is_deferred(self, name: str) -> bool:
        """Whether ``name`` is kept as the inputs it is recomputed from (see the class docstring)."""
        return not isinstance(self._values[name], Tensor)

    def stored_bytes(self) -> int:
        """Bytes of the distinct tensor storages this trace holds (shared storages counted once)."""
        seen: dict[int, int] = {}
        for value in self._values.values():
            for t in deferred_tensors(value):
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())

    # -- layers and heads
    @property
    def n_layers(self) -> int:
        return len(self.layer_paths)

    def _check_layer(self, layer: int) -> int:
        n = self.n_layers
        if not is_int(layer) or not -n <= layer < n:
            raise ValueError(f"layer must be an int in [0, {n}) for this model; got {layer!r}")
        return layer % n

    def full_name(self, name: str, layer: int) -> str:
        """Full hook name of the short ``name`` (``"pattern"``, ``"hook_pattern"``, ``"resid_post"`` ...)."""
        short = name.removeprefix("hook_")
        path = self.layer_paths[self._check_layer(layer)]
        if short in ATTN_HOOKS + ROTARY_HOOKS + QK_NORM_HOOKS:
            return _join(path, f"hook_{short}")
        if short in BLOCK_HOOKS:
            return _join(_parent(path), f"hook_{short}")
        raise ValueError(
            f"name must be one of {ATTN_HOOKS + ROTARY_HOOKS + QK_NORM_HOOKS + BLOCK_HOOKS} (with or "
            "without 'hook_'); "
            f"got {name!r}"
        )

    def act(self, name: str, layer: int) -> Tensor:
        """The recorded value of hook ``name`` in ``layer`` (shapes in the module docstring)."""
        return self[self.full_name(name, layer)]

    def head(self, name: str, layer: int, head: int) -> Tensor:
        """The recorded value of attention hook ``name`` in ``layer`` for one head (head axis removed)."""
        short = name.removeprefix("hook_")
        if short not in _HEAD_AXIS:
            raise ValueError(f"name must be a per-head attention hook {tuple(_HEAD_AXIS)}; got {name!r}")
        layer = self._check_layer(layer)
        attn = self._layers[layer]
        n = attn.n_heads
        if not is_int(head) or not -n <= head < n:
            raise ValueError(f"head must be an int in [0, {n}) for layer {layer}; got {head!r}")
        index = head % n
        if short in ("k", "v", "rot_k", "k_normed"):
            index //= attn.group_size
        full = self.full_name(short, layer)
        if full in self._values and not isinstance(self._values[full], Tensor):
            return self._value(full, index).select(_HEAD_AXIS[short], 0)  # only this head computed
        return self.act(short, layer).select(_HEAD_AXIS[short], index)

    def pattern(self, layer: int, head: int | None = None) -> Tensor:
        """[batch, n_heads, seq_q, seq_k], or [batch, seq_q, seq_k] for one head."""
        return self.act("pattern", layer) if head is None else self.head("pattern", layer, head)

    def scores(self, layer: int, head: int | None = None) -> Tensor:
        """[batch, n_heads, seq_q, seq_k], or [batch, seq_q, seq_k] for one head."""
        return self.act("scores", layer) if head is None else self.head("scores", layer, head)

    def z(self, layer: int, head: int | None = None) -> Tensor:
        """[batch, seq_q, n_heads, d_head], or [batch, seq_q, d_head] for one head."""
        return self.act("z", layer) if head is None else self.head("z", layer, head)

    def result(self, layer: int, head: int | None = None) -> Tensor:
        """[batch, seq_q, n_heads, d_model], or [batch, seq_q, d_model] for one head."""
        return self.act("result", layer) if head is None else self.head("result", layer, head)

    def layer(self, layer: int) -> dict[str, Tensor]:
        """The recorded values of ``layer`` by short name (``"pattern"``, ``"resid_post"`` ...)."""
        out = {}
        for short in ATTN_HOOKS + ROTARY_HOOKS + QK_NORM_HOOKS + BLOCK_HOOKS:
            full = self.full_name(short, layer)
            if full in self._values:
                out[short] = self._value(full)
        return out

    def stack(self, name: str) -> Tensor:
        """Hook ``name`` of every layer stacked: [n_layers, ...] (layers must have equal shapes)."""
        values = [self.act(name, i) for i in range(self.n_layers)]
        shapes = {tuple(v.shape) for v in values}
        if len(shapes) > 1:
            raise ValueError(
                f"cannot stack {name!r}: the layers' shapes differ ({sorted(shapes)}); pruned layers have "
                "other head counts, use act(name, layer) per layer"
            )
        return torch.stack(values)  # (n_layers, ...)


@contextmanager
def trace(
    model: Any,
    names: NameFilter = None,
    *,
    hooks: Mapping[str, HookFn] | None = None,
    detach: bool = True,
    all_threads: bool = False,
) -> Iterator[Trace]:
    """Record hook point values while the block runs: ``with trace(model) as t: model(x)``.

    Args:
        model: any module holding hook points (a :class:`MultiHeadAttention`, a block, an Encoder or a
            Decoder), or a pretrained wrapper with a ``.model``.
        names: which values to record: None (all), a full name or ``fnmatch`` glob
            (``"*.hook_pattern"``, ``"blocks.3.*"``), a bare hook name (``"hook_pattern"``: every layer's),
            a sequence of them, or a predicate on the full name.
            Layers none of whose hook points are chosen stay on their fused fast path.
        hooks: extra functions by full name or glob, ``fn(value, hook_point) -> None | Tensor``, that run
            *before* recording and may return a replacement value (patching); they are removed on exit.
        detach: record ``value.detach()`` (default) or the value itself, keeping its autograd graph.
        all_threads: False (default): record (and run ``hooks``) only in calls made by the thread that
            opened the ``with`` block; another thread running the same model meanwhile is untraced and
            keeps the fast path. True: every thread's calls are recorded into this trace.

    Yields:
        A :class:`Trace`, filled as the model runs. All functions are removed on exit, even on error.
    """
    if not isinstance(detach, bool):
        raise TypeError(f"detach must be a bool; got {detach!r}")
    if not isinstance(all_threads, bool):
        raise TypeError(f"all_threads must be a bool; got {type(all_threads).__name__} {all_threads!r}")
    layers = attention_layers(model)
    t = Trace([p for p, _ in layers], [m for _, m in layers])
    t.linear_paths = [p for p, m in as_module(model).named_modules() if isinstance(m, GatedDeltaNet)]
    chosen = select_hook_points(model, names)

    recorders = {name: _Recorder(t, name, detach) for name in chosen}
    with hooked(model, hooks or {}, all_threads=all_threads):
        removers = [chosen[name].add(fn, this_thread=not all_threads) for name, fn in recorders.items()]
        try:
            yield t
        finally:
            for remove in reversed(removers):
                remove()


class _Recorder:
    """The function :func:`trace` adds to one hook point: records the value (detached unless told).

    With ``detach=True`` it also accepts a :class:`~headspace.hooks.Deferred` (``record_deferred``), which
    lets the layer skip computing values nothing replaces; with ``detach=False`` it does not (a value
    recomputed later would not be part of the forward's autograd graph).
    """

    def __init__(self, t: Trace, name: str, detach: bool) -> None:
        self.t, self.name, self.detach = t, name, detach
        if detach:
            self.record_deferred = self._record_deferred

    def __call__(self, value: Tensor, point: HookPoint) -> None:
        self.t._record(self.name, value.detach() if self.detach else value)

    def _record_deferred(self, deferred: Deferred, point: HookPoint) -> None:
        self.t._record(self.name, deferred)


class _CallableModule(types.ModuleType):
    """``headspace.trace`` names both this module and :func:`trace`.

    ``import headspace`` loads its names lazily, and importing this submodule (as the analysis tools do)
    binds ``headspace.trace`` to the module; calling the module calls :func:`trace`, so
    ``headspace.trace(model, ...)`` works whichever of the two the name holds.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return trace(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
