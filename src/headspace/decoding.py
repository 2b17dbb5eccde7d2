"""DecodePlan: a Decoder's cached decoding step, flattened once and run at every new token.

A decoding step of SmolLM2 runs 151 matrix products on one row each (or eight, batched), and little
else: the products alone take ~21 ms of a ~28 ms token on a 2-core CPU. What is left is Python, mostly
``nn.Module`` attribute lookups (~900 a step: every block's norms, weights, hook points and head
counts) and the checks that decide whether the fast step may run at all. A plan does that work once:
each block's :class:`~headspace.block.DecodingLayer` (callables and numbers), the norm after the last
block, the unembedding and the model's hook points, gathered when it is built. A step then runs the
same operations in the same order as :meth:`headspace.Decoder.forward` on one new token with the KV
caches, so its logits are bit for bit those of ``forward`` (tested). On the stacked caches ``generate``
makes, and once :mod:`headspace.kernels.native` is built, the blocks run in one C++ call making the
same roundings (the native step, bit for bit the same; :attr:`DecodePlan.use_native` switches it).

:meth:`headspace.Decoder.generate` builds one plan per call, after the prompt, and asks
:meth:`DecodePlan.idle` before each step: a hook point that has gained a function (from another thread)
sends that step back to ``forward``, which fires it. ``forward`` itself builds a plan for each
one-token cached call. A plan holds the parameters as they were when it was built: in-place edits of
their values show, parameters replaced since (``to_precision``, pruning, assignment) do not.
"""

from __future__ import annotations

import operator
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from .attention import KVCache, MultiHeadAttention, rotary_tables
from .block import _BLOCK_HOOKS, DecodingLayer, decode_layer_rows, linear_fn, native_norm, norm_fn
from .hooks import HookPoint
from .kernels import native
from .kernels.prepack import prepack_available, should_prepack

if TYPE_CHECKING:
    from .models import Decoder


_EVERY_THREAD = operator.attrgetter("_all_threads")  # a hook point's functions for every thread
_SOME_THREAD = operator.attrgetter("_by_thread")  # thread id -> that thread's own functions


class DecodePlan:
    """One cached decoding step of ``model`` (a :class:`~headspace.Decoder` whose every block has
    :attr:`~headspace.block.TransformerBlock.decode_supported`, in eval mode, hooks idle: what
    :meth:`headspace.Decoder.decode_plan` checks before building one).

    Notation used for tensor shapes:
        batch, d_model, vocab_size.
    """

    def __init__(self, model: Decoder, *, watch_hooks: bool = True, pack_rows: int | None = None) -> None:
        self._model = weakref.ref(model)  # a plan must not keep its model alive
        #: the batch the products' weights were packed for (:mod:`headspace.kernels.prepack`), or None
        self.pack_rows = pack_rows
        self.layers: list[DecodingLayer] = [b.decoding_layer(pack_rows) for b in model.blocks]
        self.rotary = model.rotary
        self.ln_final = None if model.ln_final is None else norm_fn(model.ln_final)
        #: whether :meth:`rows` may run the native step (:mod:`headspace.kernels.native`) once it is
        #: loaded; :meth:`headspace.Decoder.generate` sets it from its ``native`` argument
        self.use_native = True
        #: every block and the final norm as the native step takes them, or None where some part has
        #: no native form (int8 weights, another norm or activation)
        self.native: tuple[list[Tensor | None], list[int], list[float]] | None = None
        final = native_norm(model.ln_final)
        if final is not None and all(layer.native is not None for layer in self.layers):
            params: list[Tensor | None] = []
            ints: list[int] = []
            floats: list[float] = []
            for layer in self.layers:
                p, i, f = layer.native  # type: ignore[misc]
                params += p
                ints += i
                floats += f
            self.native = ([*params, final[1], final[2]], [*ints, final[0]], [*floats, final[3]])
        head, bias = _unembedding(model)
        self.unembed = linear_fn(head, bias, pack_rows)
        # every hook point a decoding step passes (the model's, each block's, its attention's and MLP's)
        self.hook_points: tuple[HookPoint, ...] = ()
        if watch_hooks:
            points: list[HookPoint] = [model.hook_embed]
            for b in model.blocks:
                modules = b._modules
                points += [modules[name] for name in _BLOCK_HOOKS]  # type: ignore[misc]
                points += list(b.attn._hook_points)
                points += [m for m in b.mlp._modules.values() if isinstance(m, HookPoint)]
            self.hook_points = tuple(points)

    @property
    def model(self) -> Decoder:
        """The Decoder this plan was built from."""
        model = self._model()
        if model is None:
            raise RuntimeError("the Decoder this DecodePlan was built from no longer exists")
        return model

    def idle(self) -> bool:
        """Whether no hook point the step passes has a function in the calling thread, and the model is
        still in eval mode: the plan may run this step.

        What :attr:`HookPoint.active` says of each point, read in C (``map`` over attribute getters: ~35
        us for SmolLM2's 511 points against ~135 us for a Python loop over ``active``); only where some
        point holds thread-only functions does each point's ``active`` decide for the calling thread."""
        if self.model.training:
            return False
        points = self.hook_points
        if any(map(_EVERY_THREAD, points)):
            return False
        if any(map(_SOME_THREAD, points)):
            return not any(point.active for point in points)
        return True

    def rows(self, x: Tensor, kv_caches: list[KVCache], start: int) -> Tensor:
        """The blocks and LN_f on the new position ``start``'s rows ``x`` [batch, d_model] -> [batch,
        d_model], for a caller that ran ``cache.check(batch, 1, ...)`` on every cache."""
        cos = sin = None
        if self.rotary is not None:
            positions = torch.arange(start, start + 1, device=x.device)  # (1,)
            cos, sin = rotary_tables(self.rotary, positions, x.dtype, x.device)  # (1, 1, 1, rotary_dim) x 2
            cos, sin = cos.squeeze(2), sin.squeeze(2)  # (1, 1, rotary_dim): over (batch, heads, d_head)
        stack = _stack_of(kv_caches, start)
        native_ok = self.native is not None and self.use_native and x.dtype == torch.float32 and x.is_cpu
        if stack is not None and native_ok and native.ready():
            params, ints, floats = self.native  # type: ignore[misc]
            # every block and LN_f in one C++ call: the same roundings as below, bit for bit
            h = native.decode_rows(x, params, ints, floats, *stack, start, cos, sin)  # (batch, d_model)
            for cache in kv_caches:
                cache.length = start + 1
            return h
        views = None if stack is None else _views_of(*stack, start)  # _stack_of checked once
        if views is None:
            for layer, cache in zip(self.layers, kv_caches):
                x = decode_layer_rows(layer, x, cache, cos, sin)  # (batch, d_model)
        else:
            # every layer's slot and filled positions, taken in four calls (not four per layer)
            for layer, *kv in zip(self.layers, *views):
                x = decode_layer_rows(layer, x, tuple(kv), cos, sin)  # type: ignore[arg-type]
            for cache in kv_caches:
                cache.length = start + 1
        return x if self.ln_final is None else self.ln_final(x)

    def logits(self, tokens: Tensor, kv_caches: list[KVCache]) -> Tensor:
        """Next-token logits [batch, vocab_size] (float32) after the new tokens [batch, 1], appended to
        ``kv_caches`` (which the caller made for them: :meth:`headspace.Decoder.generate`'s own)."""
        start = kv_caches[0].length
        x = self.model.embed(tokens, start=start)  # (batch, 1, d_model)
        h = self.rows(x.view(x.shape[0], x.shape[2]), kv_caches, start)  # (batch, d_model)
        logits = self.unembed(h)  # (batch, vocab_size)
        return logits if logits.dtype == torch.float32 else logits.float()


def _stack_of(kv_caches: list[KVCache], start: int) -> tuple[Tensor, Tensor] | None:
    """The two [layers, batch, n_kv_heads, capacity, d_head] buffers of caches that are, in order,
    every slice of one :meth:`~headspace.KVCache.stacked` pair, each holding ``start`` positions, with
    no autograd history to keep; None otherwise (each cache appends on its own)."""
    stack = kv_caches[0].stack
    if stack is None or torch.is_grad_enabled():
        return None
    k_all, v_all, _ = stack
    if len(kv_caches) != k_all.shape[0] or start >= k_all.shape[3]:
        return None
    for i, cache in enumerate(kv_caches):
        s = cache.stack
        if s is None or s[0] is not k_all or s[2] != i or cache._k_parts or cache.length != start:
            return None
    return k_all, v_all


def _stacked_views(kv_caches: list[KVCache], start: int) -> tuple[tuple[Tensor, ...], ...] | None:
    """For caches that are, in order, every slice of one :meth:`~headspace.KVCache.stacked` pair
    (:func:`_stack_of`): :func:`_views_of` their buffers. None otherwise: each cache appends on its own."""
    stack = _stack_of(kv_caches, start)
    return None if stack is None else _views_of(*stack, start)


def _views_of(k_all: Tensor, v_all: Tensor, start: int) -> tuple[tuple[Tensor, ...], ...]:
    """Per layer of the stacked buffers [layers, batch, n_kv_heads, capacity, d_head]: the new position
    ``start``'s slots [batch, n_kv_heads, 1, d_head] and the filled positions [batch, n_kv_heads, start +
    1, d_head] of k and v (four tuples of views, one per layer each)."""
    return (
        k_all.narrow(3, start, 1).unbind(0),  # (batch, n_kv_heads, 1, d_head) per layer
        v_all.narrow(3, start, 1).unbind(0),
        k_all.narrow(3, 0, start + 1).unbind(0),  # (batch, n_kv_heads, start + 1, d_head) per layer
        v_all.narrow(3, 0, start + 1).unbind(0),
    )


def generation_caches(model: Decoder, batch: int, capacity: int) -> list[KVCache]:
    """The KV caches :meth:`headspace.Decoder.generate` decodes into: one per block, stacked in two
    buffers (:meth:`~headspace.KVCache.stacked`) where every block's attention has the same key/value
    heads, d_head, dtype and device, else each block's own :meth:`make_kv_cache`."""
    kinds: set[tuple[Any, ...] | None] = set()
    for b in model.blocks:
        a = b.attn
        if (
            not isinstance(a, MultiHeadAttention)
            or type(a).make_kv_cache is not MultiHeadAttention.make_kv_cache
        ):
            kinds.add(None)  # another kind of cache: each block makes its own
            break
        kinds.add((a.n_kv_heads, a.d_head, a.o_weight.dtype, a.o_weight.device))
    if len(kinds) != 1 or None in kinds:
        return [b.attn.make_kv_cache(batch, capacity) for b in model.blocks]
    ((n_kv_heads, d_head, dtype, device),) = kinds  # type: ignore[misc]
    return KVCache.stacked(len(model.blocks), batch, n_kv_heads, d_head, capacity, dtype=dtype, device=device)


def _unembedding(model: Decoder) -> tuple[Tensor, Tensor | None]:
    """The unembedding's weight [vocab_size, d_model] (the token table where tied) and bias."""
    if model.lm_head is None:
        return model.tok_embed.weight, None
    return model.lm_head.weight, model.lm_head.bias


def product_weights(model: Decoder) -> list[Tensor]:
    """Every weight a decoding step multiplies by, in order: per block the fused QKV, W_O and the
    MLP's (gate, in, out), then the unembedding."""
    weights: list[Tensor] = []
    for b in model.blocks:
        weights += [b.attn.qkv_weight, b.attn.o_weight]
        weights += [lin.weight for lin in b.mlp.modules() if isinstance(lin, nn.Linear)]
    weights.append(_unembedding(model)[0])
    return weights


def choose_pack_rows(model: Decoder, batch: int, prepack: bool | None) -> int | None:
    """The rows to pack the weights for in :meth:`~headspace.Decoder.generate` (None: no packing).

    ``prepack`` None chooses (:func:`~headspace.kernels.prepack.should_prepack`: batch >= 2, MKL's
    packed linear present, at least 32 MiB of float32 weights, their copy within half the available
    memory); True packs (a ValueError where this torch has no MKL packed linear); False never packs.
    """
    if prepack is None:
        # no plan without every block's decoding step (e.g. head-parallel layers): nothing to pack for
        if batch < 2 or not all(getattr(b, "decode_supported", False) for b in model.blocks):
            return None
        return batch if should_prepack(product_weights(model), batch) else None
    if not isinstance(prepack, bool):
        raise TypeError(
            f"prepack must be None (choose), True or False; got {type(prepack).__name__} {prepack!r}"
        )
    if not prepack:
        return None
    if not prepack_available():
        mkl = torch.backends.mkl.is_available()
        raise ValueError(
            "prepack=True needs torch's MKL packed linear (torch.ops.mkl._mkl_linear, x86 builds with "
            f"MKL); this torch has none (torch.backends.mkl.is_available()={mkl})"
        )
    return batch
