"""Exact speculative greedy decoding of an encoder-decoder (batch 1), with n-gram drafts.

Greedy decoding at batch 1 is memory-bound: each step reads every decoder weight and every layer's cross
keys and values for one new token. Speculation reads them once for several tokens:

1. **draft** (:func:`ngram_draft`, free): the last ``n`` tokens so far (``n`` from :data:`MAX_NGRAM` down to
   :data:`MIN_NGRAM`) are looked up in the earlier tokens (prompt included); the ``k`` tokens that
   followed their latest earlier occurrence (copied on into the draft itself) are the draft ``d_1 .. d_m``.
   No match: no draft, and the step is the plain one-token step
   (:func:`~headspace.model.encdec.fast_step.fast_step`).
2. **verify** (:func:`fast_verify`): ONE decoder forward over the ``m + 1`` positions ``t, d_1 .. d_m``
   (``t`` = the newest token, not yet in the cache) with the self-attention cache, causal inside the new
   positions (query ``i`` sees the cached keys and new keys ``0 .. i``). Row ``i`` of the final stream
   holds what a one-token step would hold after feeding ``t, d_1 .. d_i``: the greedy token ``g_i`` of
   each row comes from the same argmax (the int8 screen, certified per row, or the full product).
3. **accept**: ``a`` = the length of the longest prefix with ``d_{i+1} = g_i``; the new tokens are
   ``d_1 .. d_a`` then ``g_a`` (the model's own token at the first mismatch, or after the last draft).
   The caches are rolled back (:func:`rollback`) to the cached length plus ``a + 1`` (``t`` and the
   accepted drafts); the keys of the rejected drafts are overwritten by later steps.

What is exact: every token appended is the argmax of the float32 model's logits at its position, given
exactly the tokens before it (the accepted drafts equal the model's own choices), so the sequence is the
greedy sequence. The logits themselves come from a forward over ``m + 1`` rows instead of one, so they
differ from the one-token step's by float32 rounding (matrix products may sum in another order): the tokens
differ only where two logits tie within that rounding (the screen's certificate holds per row, as in a
plain step). The end token stops decoding where it is accepted or produced; ``max_new_tokens`` caps the
drafts so that no more tokens are made than the plain loop makes.

Taken only at batch 1, while :func:`~headspace.model.encdec.fast_step.fast_step_usable` (no hook point of
the decoder has a function: a hook never sees a rejected draft) and not switched off (``draft=0``, or
``HEADSPACE_FORCE_FALLBACK=speculative``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ...kernels.cpu import forced
from ...nn.kv_cache import KVCache
from .blocks import DecoderBlock
from .fast_step import _residual, fast_step
from .stacks import DecoderStack

#: drafted tokens per verifying forward by default
DRAFT_TOKENS = 6
#: the longest and shortest suffix looked up for a draft
MAX_NGRAM, MIN_NGRAM = 4, 2
#: a draft model whose drafts were accepted less than this share, over at least ``MODEL_TRIAL`` drafted
#: tokens of one call, is asked no more in that call (its drafts cost more than they save)
MODEL_ACCEPTANCE, MODEL_TRIAL = 0.5, 12


@dataclass
class SpeculationStats:
    """What speculation did in one or more :func:`greedy` calls (filled in place, counts add up).

    ``verifies``: forwards over a draft; ``steps``: plain one-token steps; ``drafted``: draft tokens fed;
    ``accepted``: draft tokens that were the model's greedy tokens (and were kept)."""

    verifies: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    #: of ``drafted`` and ``accepted``: the draft model's (:mod:`headspace.model.encdec.draft_model`)
    model_drafted: int = 0
    model_accepted: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counts as a JSON-ready dict."""
        return {
            "verifies": self.verifies,
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "model_drafted": self.model_drafted,
            "model_accepted": self.model_accepted,
        }


def speculation_on(draft: int | None) -> int:
    """Draft tokens per verify: ``draft`` (None: :data:`DRAFT_TOKENS`), 0 where the ``speculative``
    fallback is forced (``HEADSPACE_FORCE_FALLBACK``). Raises ``ValueError`` unless ``draft`` is None or an
    int >= 0."""
    if draft is not None and (isinstance(draft, bool) or not isinstance(draft, int) or draft < 0):
        raise ValueError(f"draft must be None or an int >= 0 (0: no speculation); got {draft!r}")
    if forced("speculative"):
        return 0
    return DRAFT_TOKENS if draft is None else draft


def ngram_draft(tokens: list[int], k: int, max_n: int = MAX_NGRAM, min_n: int = MIN_NGRAM) -> list[int]:
    """``k`` tokens that followed the latest earlier occurrence of the last ``n`` of ``tokens`` (the
    longest ``n`` in ``max_n .. min_n`` that occurs earlier), the copy running on into the tokens it drafts
    where the occurrence is recent (a repeated run or period drafts its continuation); [] when no suffix
    occurs earlier or ``k`` < 1."""
    if k < 1:
        return []
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        tail = tokens[size - n :]
        for start in range(size - n - 1, -1, -1):  # the latest earlier occurrence first
            if tokens[start : start + n] == tail:
                seq = list(tokens)
                for j in range(start + n, start + n + k):  # j < len(seq): seq grows by one each time
                    seq.append(seq[j])
                return seq[size:]
    return []


def rollback(caches: list[KVCache], length: int) -> None:
    """Keep the first ``length`` positions of every cache (the later keys and values are overwritten by the
    next appends). Raises ``ValueError`` for a windowed cache, one tracking gradients, or a ``length``
    beyond what a cache holds."""
    for cache in caches:
        if cache.window is not None or cache._k_parts or not 0 <= length <= cache.length:
            raise ValueError(
                f"rollback needs a full cache without gradient pieces holding >= {length} positions; got "
                f"window={cache.window}, length={cache.length}"
            )
        cache.length = length


def _self_attention(block: DecoderBlock, h: Tensor, cache: KVCache) -> Tensor:
    """Causal self-attention of ``T`` new positions ``h`` [batch, T, d_model] on the cache -> [batch, T,
    d_model]; query ``i`` sees the cached keys and new keys ``0 .. i``; the new keys are appended."""
    a = block.attn
    B, T, _ = h.shape
    H, dh = a.n_heads, a.d_head
    qkv = F.linear(h, a.qkv_weight, a.qkv_bias)  # (B, T, 3 H dh)
    q, k, v = qkv.view(B, T, 3, H, dh).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, T, dh) x 3
    before = cache.length
    keys, values = cache.append(k, v)  # (B, H, before + T, dh) x 2
    i = torch.arange(T, device=h.device)[:, None]  # (T, 1)
    j = torch.arange(before + T, device=h.device)[None, :]  # (1, before + T)
    mask = j <= before + i  # (T, before + T): causal, every cached key visible
    z = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=a.scale)  # (B, H, T, dh)
    z = z.transpose(1, 2).reshape(B, T, H * dh)  # (B, T, H dh)
    return F.linear(z, a.o_weight, a.o_bias)  # (B, T, d_model)


def fast_verify(
    decoder: DecoderStack,
    ids: Tensor,
    caches: list[KVCache],
    cross: list[tuple[Tensor, Tensor]],
    cross_mask: Tensor | None,
) -> Tensor:
    """The decoder's final stream [batch, T, d_model] of ``T`` new tokens ``ids`` [batch, T] after the
    cached positions, without hook dispatch (as :func:`fast_step`, for several positions, causal among
    them); the caches grow by ``T``. Use only where :func:`fast_step_usable` holds."""
    x = decoder.embed(ids, caches[0].length)  # (B, T, d_model)
    for block, cache, (k, v) in zip(decoder.blocks, caches, cross, strict=True):
        pre = block.pre
        h = block.ln1(x) if pre else x
        x = _residual(pre, block.ln1, x, _self_attention(block, h, cache))  # (B, T, d_model)
        h = block.ln_cross(x) if pre else x
        out = block.cross_attn.attend_cached(h, k, v, cross_mask)  # (B, T, d_model)
        x = _residual(pre, block.ln_cross, x, out)
        h = block.ln2(x) if pre else x
        x = _residual(pre, block.ln2, x, block.mlp(h))
    return x if decoder.final_ln is None else decoder.final_ln(x)


def _accept(drafts: list[int], greedy: list[int]) -> list[int]:
    """The new tokens of one verify: the drafts up to the first that differs from the model's greedy token
    at its position, then the model's token there (``greedy`` has one more entry than ``drafts``)."""
    a = 0
    while a < len(drafts) and drafts[a] == greedy[a]:
        a += 1
    return [*drafts[:a], greedy[a]]


def speculative_loop(
    decoder: DecoderStack,
    tokens: list[int],
    max_new: int,
    caches: list[KVCache],
    cross: list[tuple[Tensor, Tensor]],
    next_tokens: Callable[[Tensor], Tensor],
    eos: int | None,
    k: int,
    stats: SpeculationStats | None = None,
    drafter: Callable[[list[int], int], list[int]] | None = None,
) -> list[int]:
    """The new greedy tokens (at most ``max_new``; the end token kept, and last) after ``tokens``, whose last
    entry is the newest token (not yet in the caches; every earlier one is). ``next_tokens``: stream rows
    [T, d_model] -> greedy tokens [T]. ``drafter`` (tokens, k) -> up to k drafts: asked where the n-gram
    lookup finds none (a draft model), until its drafts of this call were accepted less than
    :data:`MODEL_ACCEPTANCE` of the time over at least :data:`MODEL_TRIAL` drafted tokens. Batch 1, no
    cross mask (module docstring)."""
    new: list[int] = []
    tried = kept = 0  # the draft model's drafted and accepted tokens in this call
    stats = SpeculationStats() if stats is None else stats
    while len(new) < max_new:
        m = min(k, max_new - len(new) - 1)
        drafts = ngram_draft(tokens, m)
        modelled = not drafts and drafter is not None and m > 0
        if modelled:
            drafts = drafter(tokens, m)[:m]
        ids = torch.tensor([tokens[-1:] + drafts])  # (1, 1 + m)
        if drafts:
            cached = caches[0].length
            h = fast_verify(decoder, ids, caches, cross, None)  # (1, 1 + m, d_model)
            made = _accept(drafts, next_tokens(h[0]).tolist())
            rollback(caches, cached + len(made))  # the newest token and the accepted drafts
            stats.verifies, stats.drafted, stats.accepted = (
                stats.verifies + 1, stats.drafted + len(drafts), stats.accepted + len(made) - 1
            )  # fmt: skip
            if modelled:
                tried, kept = tried + len(drafts), kept + len(made) - 1
                stats.model_drafted += len(drafts)
                stats.model_accepted += len(made) - 1
                if tried >= MODEL_TRIAL and kept < MODEL_ACCEPTANCE * tried:
                    drafter = None
        else:
            h = fast_step(decoder, ids, caches, cross, None)  # (1, 1, d_model)
            made = next_tokens(h[0]).tolist()
            stats.steps += 1
        if eos is not None and eos in made:
            made = made[: made.index(eos) + 1]
        new += made
        tokens = tokens + made
        if eos is not None and new[-1] == eos:
            break
    return new


__all__ = [
    "DRAFT_TOKENS",
    "SpeculationStats",
    "fast_verify",
    "ngram_draft",
    "rollback",
    "speculation_on",
    "speculative_loop",
]
