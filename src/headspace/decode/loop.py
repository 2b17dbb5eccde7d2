"""generate: sampling continuation tokens from a decoder, a short loop over a chosen decoding step.

The prompt runs through the model's ``forward`` into KV caches (:func:`generation_caches`), then each
new token through a :class:`~headspace.decode.backends.Stepper` of the model's
:class:`~headspace.decode.step.DecodeStep`, or through ``forward`` where there is none (a block without
the step, a left-padded batch, ``use_cache=False``) or while a hook point has a function (``forward``
fires it). Every argument is described in ``docs/decoding.md``.

Left-padded prompts: each row's positions count from 0 at its first real token (``cumsum(key_padding)
- 1``, as transformers derives ``position_ids`` from the attention mask) and its padded keys are never
attended, so greedy decoding of a padded batch equals decoding each prompt alone.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..kernels import native as library
from ..kernels import policy
from ..kernels.cpu import forced
from ..kernels.q8_0 import Q8Blocks, q8_0_blocks
from ..nn.inputs import check_left_padding, check_tokens
from ..nn.kv_cache import KVCache
from .backends import Stepper, get_backend
from .native import native_form
from .step import DecoderModel, blocks_of, describe, products_of, unembedding


@torch.no_grad()
def generate(
    model: DecoderModel,
    tokens: Tensor,
    max_new_tokens: int,
    *,
    key_padding: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
    use_cache: bool = True,
    prepack: bool | None = None,
    compile: bool = False,
    native: bool | None = None,
    backend: str | None = None,
    stop_tokens: Sequence[int] | Tensor | None = None,
    on_token: Callable[[Tensor], object] | None = None,
) -> Tensor:
    """Sample ``max_new_tokens`` tokens after each prompt of ``tokens`` int64 [batch, prompt_len]
    (left-padded, real tokens marked by ``key_padding`` bool [batch, prompt_len]); returns [batch,
    prompt_len + max_new_tokens]: the prompts as given, then the new tokens. ``temperature`` 0 is greedy;
    ``top_k`` and ``seed`` (a private generator) shape sampling. ``backend`` ``"python"`` or ``"native"``
    (None: native once built; ``native`` True/False says the same); ``prepack`` packs float32 weights
    for MKL at batch >= 2, and at batch 1 a large unembedding alone (None: where it pays). The model is
    in eval mode for the call.

    ``stop_tokens`` (token ids; None or empty: none): a row that samples one of them has stopped; its
    later columns repeat that token, and once every row has stopped the loop ends: the result is then
    [batch, prompt_len + n], n <= ``max_new_tokens`` the steps taken. The tokens up to a stop are those
    of the same call without ``stop_tokens`` (the same logits, the same draws). ``on_token(new)`` is
    called after each step with its tokens int64 [batch] (a fresh tensor; a stopped row's entry is its
    stop token again), before the next step is computed."""
    backend = _check_options(max_new_tokens, temperature, top_k, seed, compile, native, backend)
    stops = _check_stops(stop_tokens, on_token, model.config.vocab_size)
    prompt = _Prompt.of(model, tokens, key_padding, max_new_tokens)
    kernels = policy.choose_kernels(products_of(model), prompt.batch, prepack, q8=use_cache)
    pack_rows = kernels.pack_rows
    unembed_q8 = q8_0_blocks(unembedding(model)[0]) if kernels.unembed_q8 else None
    unembed_rows = kernels.unembed_rows if unembed_q8 is None else None
    if max_new_tokens == 0:
        return tokens.clone()
    generator = None if seed is None else torch.Generator(device=tokens.device).manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        out = torch.empty(
            prompt.batch, prompt.total, dtype=torch.long, device=tokens.device
        )  # (batch, total)
        out[:, : prompt.length] = tokens
        caches = generation_caches(model, prompt.batch, prompt.total) if use_cache else None
        real, positions = prompt.cols(0, prompt.length)
        logits = _last(model)(tokens.long(), real, caches, positions=positions)  # (batch, vocab_size)
        step = None
        if caches is not None and prompt.real is None:
            step = _stepper(model, pack_rows, backend, unembed_rows, unembed_q8)
        stopping = None if stops is None else _Stopping(stops)
        for pos in range(prompt.length, prompt.total):
            new = sample(logits, temperature, top_k, generator)  # (batch,)
            if stopping is not None:
                new = stopping.update(new)  # (batch,): stopped rows repeat their stop token
            out[:, pos] = new
            if on_token is not None:
                on_token(new)
            if stopping is not None and stopping.all_stopped():
                return out[:, : pos + 1].clone()  # (batch, prompt_len + steps taken)
            if pos + 1 < prompt.total and caches is not None and pos == _recompute_at(model):
                logits = _recompute(model, out, pos, caches, prompt)  # (batch, vocab_size)
            elif pos + 1 < prompt.total:
                logits = _next_logits(model, out, pos, caches, prompt, step)  # (batch, vocab_size)
    finally:
        model.train(was_training)
    return out


def _check_stops(stop_tokens: object, on_token: object, vocab_size: int) -> Tensor | None:
    """``stop_tokens`` as int64 [n] on the CPU (None where none), each an id < ``vocab_size``; a
    one-line error for anything else (and for an ``on_token`` that is not callable)."""
    if on_token is not None and not callable(on_token):
        raise TypeError(f"on_token must be None or callable (new tokens [batch]); got {on_token!r:.60}")
    if stop_tokens is None:
        return None
    if isinstance(stop_tokens, Tensor):
        ok = stop_tokens.dim() <= 1 and not stop_tokens.is_floating_point() and not stop_tokens.is_complex()
        ids = stop_tokens.reshape(-1).tolist() if ok else None  # (n,)
    elif isinstance(stop_tokens, (list, tuple, set, frozenset)):
        ids = list(stop_tokens)
    else:
        ids = None
    bad = ids is None or any(isinstance(i, bool) or not isinstance(i, int) for i in ids)
    if bad or any(not 0 <= i < vocab_size for i in ids):  # type: ignore[union-attr]
        raise ValueError(
            f"stop_tokens must be None or token ids (ints in [0, {vocab_size})), a sequence or a 1-D "
            f"integer tensor; got {stop_tokens!r:.80}"
        )
    return torch.tensor(sorted(set(ids)), dtype=torch.long) if ids else None  # (n,)


class _Stopping:
    """Which rows have sampled a stop token, and the token each repeats from then on."""

    def __init__(self, stops: Tensor) -> None:
        self.stops = stops  # (n,)
        self.done: Tensor | None = None  # bool (batch,), on the tokens' device once seen
        self.fill: Tensor | None = None  # int64 (batch,): each stopped row's stop token

    def update(self, new: Tensor) -> Tensor:
        """The step's tokens [batch] with stopped rows' replaced by their stop token; marks the rows
        whose token is a stop token as stopped."""
        if self.done is None or self.fill is None:
            self.stops = self.stops.to(new.device)
            self.done = torch.zeros_like(new, dtype=torch.bool)  # (batch,)
            self.fill = torch.zeros_like(new)  # (batch,)
        new = torch.where(self.done, self.fill, new)  # (batch,)
        newly = ~self.done & torch.isin(new, self.stops)  # (batch,)
        self.fill = torch.where(newly, new, self.fill)
        self.done = self.done | newly
        return new

    def all_stopped(self) -> bool:
        return self.done is not None and bool(self.done.all())


def _last(model: Any) -> Callable[..., Tensor]:
    """The model's ``last_logits`` (only the last position unembedded), else ``forward(...)[:, -1]``."""
    last = getattr(model, "last_logits", None)
    if last is not None:
        return last
    return lambda *args, **kwargs: model(*args, **kwargs)[:, -1]


def _check_options(
    max_new_tokens: object,
    temperature: object,
    top_k: object,
    seed: object,
    compile: object,
    native: object,
    backend: object,
) -> str | None:
    """Refuse bad arguments with a one-line error; the backend chosen by name (None: automatic)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0; got {max_new_tokens!r}")
    number = isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
    if not number or not math.isfinite(temperature) or temperature < 0:  # type: ignore[arg-type,operator]
        raise ValueError(f"temperature must be a float >= 0, finite (0 = greedy); got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1; got {top_k!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be None or an int; got {seed!r}")
    if not isinstance(compile, bool):
        raise TypeError(f"compile must be a bool; got {type(compile).__name__} {compile!r}")
    if native is not None and not isinstance(native, bool):
        raise TypeError(
            f"native must be None (once built), True or False; got {type(native).__name__} {native!r}"
        )
    if backend is not None:
        get_backend(backend)  # type: ignore[arg-type]  # names the registered ones
        if native is not None and (backend == "native") != native:
            raise ValueError(f"backend={backend!r} contradicts native={native!r}; give one of them")
    if compile:
        warnings.warn(
            "generate(compile=True) is ignored: the compiled decoding step was removed (the native "
            "step is faster); decoding runs the default step",
            FutureWarning,
            stacklevel=3,
        )
    if backend is None and native is not None:
        backend = "native" if native else "python"
    if backend == "native" and not library.build():
        raise RuntimeError(
            f"native=True: headspace's native decoding step is unavailable ({library.status()})"
        )
    return backend  # type: ignore[return-value]


@dataclass(frozen=True)
class _Prompt:
    """The checked prompts: ``length`` columns (padding included), ``total`` with the new tokens, and for
    a left-padded batch ``real`` bool [batch, total] and per-row ``positions`` int64 [batch, total]."""

    batch: int
    length: int
    total: int
    real: Tensor | None
    positions: Tensor | None

    @classmethod
    def of(cls, model: DecoderModel, tokens: Tensor, key_padding: Tensor | None, new: int) -> _Prompt:
        config = model.config
        check_tokens(tokens, config, check_length=key_padding is None, device=model.tok_embed.weight.device)
        batch, length = tokens.shape
        if length == 0:
            raise ValueError("tokens must hold a prompt of at least 1 token; got prompt_len=0")
        longest = length
        if key_padding is not None:
            check_left_padding(key_padding, tokens)
            longest = int(key_padding.sum(dim=1).max())
            if bool(key_padding.all()):
                key_padding = None  # nothing padded: the unmasked path, as without key_padding
        if longest + new > config.max_seq_len:
            what = (
                f"prompt_len {length}" if longest == length else f"the longest prompt's {longest} real tokens"
            )
            raise ValueError(
                f"{what} + max_new_tokens {new} = {longest + new} exceeds the position table "
                f"(max_seq_len={config.max_seq_len}); refused, not truncated"
            )
        real = positions = None
        if key_padding is not None:
            real = torch.ones(batch, length + new, dtype=torch.bool, device=tokens.device)  # (batch, total)
            real[:, :length] = key_padding
            # each row counts from 0 at its first real token; padding (never attended) takes position 0
            positions = (real.cumsum(dim=1) - 1).clamp(min=0)  # (batch, total)
        return cls(batch, length, length + new, real, positions)

    def cols(self, lo: int, hi: int) -> tuple[Tensor | None, Tensor | None]:
        """``real`` and ``positions`` of columns lo..hi-1 (None without padding)."""
        if self.real is None or self.positions is None:
            return None, None
        return self.real[:, :hi], self.positions[:, lo:hi]  # (batch, hi), (batch, hi - lo)


def _stepper(
    model: DecoderModel,
    pack_rows: int | None,
    backend: str | None,
    unembed_rows: int | None = None,
    unembed_q8: Q8Blocks | None = None,
) -> Stepper | None:
    """The call's step (None: the model has none), on ``backend`` (None: native once built, unless its
    fallback is forced: :mod:`headspace.kernels.cpu`); starts the native build in the background."""
    step = describe(model, pack_rows, unembed_rows, unembed_q8)
    if step is None:
        return None
    if backend is None and forced("native"):
        backend = "python"
    if backend is None and native_form(step) is not None:
        library.start_build()  # in the background; steps run in Python until it is loaded
    return Stepper(step, backend)


def _recompute_at(model: DecoderModel) -> int | None:
    """The column at which generation re-runs the whole prefix into fresh caches, or None:
    ``config.extra["recompute_cache_at"]`` (Phi-3 with LongRoPE: transformers' Phi-3 ``generate`` drops
    its cache the first time the sequence passes ``original_max_position_embeddings``, so every cached
    key is rotated again with the long factors)."""
    extra = getattr(getattr(model, "config", None), "extra", None)
    at = extra.get("recompute_cache_at") if isinstance(extra, dict) else None
    return at if isinstance(at, int) and not isinstance(at, bool) else None


def _recompute(model: DecoderModel, out: Tensor, pos: int, caches: list[KVCache], prompt: _Prompt) -> Tensor:
    """The logits [batch, vocab_size] after ``out[:, pos]``, every cache emptied and refilled from the
    columns 0..pos by ``forward`` (see :func:`_recompute_at`)."""
    for cache in caches:
        cache.reset()
    real, positions = prompt.cols(0, pos + 1)
    return _last(model)(out[:, : pos + 1], real, caches, positions=positions)  # (batch, vocab_size)


def _next_logits(
    model: DecoderModel,
    out: Tensor,
    pos: int,
    caches: list[KVCache] | None,
    prompt: _Prompt,
    step: Stepper | None,
) -> Tensor:
    """The logits [batch, vocab_size] after ``out[:, pos]``: by the step while it is idle, else by
    ``forward`` (with the caches, or on the whole sequence without them)."""
    if step is not None and caches is not None and step.idle():
        # inference mode: no hook runs here to see its tensors, and each op dispatches faster
        with torch.inference_mode():
            return step.logits(out[:, pos : pos + 1], caches)  # (batch, vocab_size)
    if caches is not None:
        real, positions = prompt.cols(pos, pos + 1)  # key_padding covers every cached position + the new
        return model(out[:, pos : pos + 1], real, caches, positions=positions)[:, -1]
    real, positions = prompt.cols(0, pos + 1)
    return _last(model)(out[:, : pos + 1], real, positions=positions)


def generation_caches(model: DecoderModel, batch: int, capacity: int) -> list[KVCache]:
    """The KV caches generate decodes into: one per block, stacked in two buffers
    (:meth:`~headspace.nn.kv_cache.KVCache.stacked`) where every block's attention makes plain
    KVCaches of the same key/value heads, d_head, dtype and device and no window, else each block's own
    ``attn.make_kv_cache(batch, capacity)``. ``capacity`` may exceed ``max_seq_len`` (left padding takes
    slots, not positions)."""
    blocks = blocks_of(model)
    caches = [b.attn.make_kv_cache(batch, 1) for b in blocks]
    kinds = {(type(c), c.k.shape[1], c.k.shape[3], c.k.dtype, c.k.device, c.window) for c in caches}
    if len(kinds) != 1 or type(caches[0]) is not KVCache or caches[0].window is not None:
        # (a sliding layer's cache keeps only its window: never one of the stacked full-length buffers)
        return [b.attn.make_kv_cache(batch, capacity) for b in blocks]
    first = caches[0].k
    return KVCache.stacked(
        len(caches), batch, first.shape[1], first.shape[3], capacity, dtype=first.dtype, device=first.device
    )


def choose_pack_rows(model: DecoderModel, batch: int, prepack: bool | None) -> int | None:
    """The rows to pack the weights for (None: no packing): :func:`headspace.kernels.policy.pack_rows`
    of ``model``'s description. ``prepack`` None chooses (batch >= 2, MKL's packed linear present, at
    least 32 MiB of float32 weights, their copy within half the available memory); True packs (a
    ValueError where this torch has no MKL packed linear); False never packs."""
    return policy.pack_rows(products_of(model), batch, prepack)


def choose_unembed_rows(model: DecoderModel, batch: int, prepack: bool | None) -> int | None:
    """At batch 1 with ``prepack`` None, the rows to pack the unembedding alone for (1), or None:
    :func:`headspace.kernels.policy.unembed_rows` of ``model``'s description."""
    return policy.unembed_rows(products_of(model), batch, prepack)


def choose_unembed_q8(model: DecoderModel, batch: int) -> Q8Blocks | None:
    """The unembedding's Q8_0 blocks for the step to multiply from (:mod:`headspace.kernels.q8_0`),
    where the policy takes them (:func:`headspace.kernels.policy.unembed_q8`) and the unembedding is
    exactly Q8_0 blocks, as a GGUF's Q8_0 embedding dequantises; else None."""
    if not policy.unembed_q8(products_of(model), batch):
        return None
    return q8_0_blocks(unembedding(model)[0])


def sample(
    logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> Tensor:
    """One token id per row of ``logits`` [batch, vocab_size] -> [batch]: the first largest for
    ``temperature`` 0 (as argmax picks it, ties and NaN alike), else a draw from softmax(logits /
    temperature) over the ``top_k`` most likely (None: all)."""
    if temperature == 0:
        return logits.max(dim=-1).indices
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (batch, 1)
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)  # (batch, vocab_size)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)  # (batch,)
