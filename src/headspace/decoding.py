"""DecodePlan: a Decoder's cached decoding step, flattened once and run at every new token.

A decoding step of SmolLM2 runs 151 matrix products on one row each (or eight, batched), and little
else: the products alone take ~21 ms of a ~28 ms token on a 2-core CPU. What is left is Python, mostly
``nn.Module`` attribute lookups (~900 a step: every block's norms, weights, hook points and head
counts) and the checks that decide whether the fast step may run at all. A plan does that work once:
each block's :class:`~headspace.block.DecodingLayer` (callables and numbers), the norm after the last
block, the unembedding and the model's hook points, gathered when it is built. A step then runs the
same operations in the same order as :meth:`headspace.Decoder.forward` on one new token with the KV
caches, so its logits are bit for bit those of ``forward`` (tested).

:meth:`headspace.Decoder.generate` builds one plan per call, after the prompt, and asks
:meth:`DecodePlan.idle` before each step: a hook point that has gained a function (from another thread)
sends that step back to ``forward``, which fires it. ``forward`` itself builds a plan for each
one-token cached call. A plan holds the parameters as they were when it was built: in-place edits of
their values show, parameters replaced since (``to_precision``, pruning, assignment) do not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from .attention import KVCache, rotary_tables
from .block import _BLOCK_HOOKS, DecodingLayer, decode_layer_rows, linear_fn, norm_fn
from .hooks import HookPoint
from .kernels.prepack import prepack_available, should_prepack

if TYPE_CHECKING:
    from .models import Decoder


class DecodePlan:
    """One cached decoding step of ``model`` (a :class:`~headspace.Decoder` whose every block has
    :attr:`~headspace.block.TransformerBlock.decode_supported`, in eval mode, hooks idle: what
    :meth:`headspace.Decoder.decode_plan` checks before building one).

    Notation used for tensor shapes:
        batch, d_model, vocab_size.
    """

    def __init__(self, model: Decoder, *, watch_hooks: bool = True, pack_rows: int | None = None) -> None:
        self.model = model
        #: the batch the products' weights were packed for (:mod:`headspace.kernels.prepack`), or None
        self.pack_rows = pack_rows
        self.layers: list[DecodingLayer] = [b.decoding_layer(pack_rows) for b in model.blocks]
        self.rotary = model.rotary
        self.ln_final = None if model.ln_final is None else norm_fn(model.ln_final)
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

    def idle(self) -> bool:
        """Whether no hook point the step passes has a function in the calling thread (one truth test
        each), and the model is still in eval mode: the plan may run this step."""
        if self.model.training:
            return False
        for point in self.hook_points:
            if point.active:
                return False
        return True

    def rows(self, x: Tensor, kv_caches: list[KVCache], start: int) -> Tensor:
        """The blocks and LN_f on the new position ``start``'s rows ``x`` [batch, d_model] -> [batch,
        d_model], for a caller that ran ``cache.check(batch, 1, ...)`` on every cache."""
        cos = sin = None
        if self.rotary is not None:
            positions = torch.arange(start, start + 1, device=x.device)  # (1,)
            cos, sin = rotary_tables(self.rotary, positions, x.dtype, x.device)  # (1, 1, 1, rotary_dim) x 2
            cos, sin = cos.squeeze(2), sin.squeeze(2)  # (1, 1, rotary_dim): over (batch, heads, d_head)
        for layer, cache in zip(self.layers, kv_caches):
            x = decode_layer_rows(layer, x, cache, cos, sin)  # (batch, d_model)
        return x if self.ln_final is None else self.ln_final(x)

    def logits(self, tokens: Tensor, kv_caches: list[KVCache]) -> Tensor:
        """Next-token logits [batch, vocab_size] (float32) after the new tokens [batch, 1], appended to
        ``kv_caches`` (which the caller made for them: :meth:`headspace.Decoder.generate`'s own)."""
        start = kv_caches[0].length
        x = self.model.embed(tokens, start=start)  # (batch, 1, d_model)
        h = self.rows(x.view(x.shape[0], x.shape[2]), kv_caches, start)  # (batch, d_model)
        logits = self.unembed(h)  # (batch, vocab_size)
        return logits if logits.dtype == torch.float32 else logits.float()


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
