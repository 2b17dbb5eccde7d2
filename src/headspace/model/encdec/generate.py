"""Greedy generation of an encoder-decoder with its caches.

The encoder runs once; each decoder layer's cross keys and values ``e W_K + b_K``, ``e W_V + b_V`` are
computed once from its output (:meth:`EncDecAttention.cross_kv`) and read by every step; each layer's
self-attention keeps a :class:`~headspace.decode.kv_cache.KVCache`. A step feeds only the newest token.
While no hook point of the decoder has a function, a step runs
:func:`~headspace.model.encdec.fast_step.fast_step` (the same maths without hook dispatch or masks).
Each step's token is the argmax of the last position's logits, found by the int8 screen of
:mod:`headspace.model.encdec.screen` where it runs (float32 on the CPU; ``screen=False``: the full product).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn

from ...core.checks import is_int
from ...kernels.cpu import int8_products_exact
from ...nn.kv_cache import KVCache
from .config import EncDecConfig, check_ids
from .draft_model import DraftModel, draft_model_usable
from .fast_step import fast_step, fast_step_usable
from .screen import ScreenedArgmax, screen_usable
from .speculative import SpeculationStats, speculation_on, speculative_loop
from .stacks import DecoderStack


class Seq2Seq(Protocol):
    """What :func:`greedy` reads of a model (:class:`~headspace.model.encdec.EncoderDecoder` has it): its
    config, ``encode``, the decoder stack and ``unembed``. (A protocol, so that this module and the model's
    import each other in one direction only.)"""

    config: EncDecConfig
    decoder: DecoderStack
    tok_embed: nn.Embedding
    logits_bias: Tensor | None

    def encode(self, inputs: Tensor, attention_mask: Tensor | None = None) -> Tensor: ...

    def unembed(self, h: Tensor) -> Tensor: ...


def _cross_mask(attention_mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """An additive mask [batch, 1, 1, seq_k] (0 on real positions, -inf on padding), or None."""
    if attention_mask is None:
        return None
    keep = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, Sk)
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, float("-inf"))


#: the smallest vocabulary that takes the screen by default (below it the full product costs little)
AUTO_MIN_VOCAB = 4096


def _screen(model: Seq2Seq, screen: bool | None) -> ScreenedArgmax | None:
    """The model's screen of its unembedding (made once, kept while the weights are unchanged), or None
    where ``screen`` is False (or None, below :data:`AUTO_MIN_VOCAB` tokens) or it cannot run
    (:func:`screen_usable`)."""
    w, b = model.tok_embed.weight, model.logits_bias
    if screen is False or (screen is None and w.shape[0] < AUTO_MIN_VOCAB) or not screen_usable(w):
        return None
    kept = model.__dict__.get("_screened_argmax")
    if isinstance(kept, ScreenedArgmax) and kept.fits(w, b):
        return kept
    made = ScreenedArgmax(w, b)
    if made.packed is None and not int8_products_exact()[1]:  # fbgemm's probe failed, _int_mm inexact
        return None
    model.__dict__["_screened_argmax"] = made  # (not a submodule, no state-dict key)
    return made


def _next_tokens(model: Seq2Seq, h: Tensor, screened: ScreenedArgmax | None) -> Tensor:
    """The greedy tokens [batch] of the decoder's last position ``h`` [batch, d_model]."""
    if screened is None:
        return model.unembed(h[:, None])[:, 0].argmax(-1)  # (B,)
    scale = model.config.output_scale
    return screened(h if scale == 1.0 else h * scale)  # (B,)


def greedy(
    model: Seq2Seq,
    inputs: Tensor,
    max_new_tokens: int,
    *,
    attention_mask: Tensor | None = None,
    decoder_input_ids: Tensor | None = None,
    eos_token_id: int | None = None,
    screen: bool | None = None,
    fast: bool = True,
    draft: int | None = None,
    stats: SpeculationStats | None = None,
    draft_model: bool | None = None,
) -> Tensor:
    """The decoder's tokens [batch, prompt + generated] by greedy search (argmax at each step).

    The prompt is ``decoder_input_ids`` [batch, prompt] (default: the config's decoder start token); a row
    that produced ``eos_token_id`` (default: the config's) is continued with the pad token (the config's,
    else eos), and decoding stops when every row has or after ``max_new_tokens`` steps. The same tokens as
    transformers' ``generate(do_sample=False, num_beams=1)`` without logits processors.

    ``screen`` (default: where it runs): each argmax through the int8 screen, certified by the float32
    logits of the rows that may win (:mod:`headspace.model.encdec.screen`): the same tokens as the full
    product unless two logits tie within float32 rounding; ``False``: the full float32 product.
    ``fast`` (default True): each step through :func:`fast_step` while no hook point of the decoder has a
    function (checked once, before the first step; with a hook, the ordinary path, which fires it);
    ``False``: always the ordinary path. Both give the same stream to float32 rounding.
    ``draft`` (default :data:`~headspace.model.encdec.speculative.DRAFT_TOKENS`; 0: off, as with
    ``HEADSPACE_FORCE_FALLBACK=speculative``): at batch 1 on the fast path, exact speculative decoding
    with up to ``draft`` n-gram drafts verified per decoder forward (:mod:`headspace.model.encdec.
    speculative`: the same greedy tokens); ``stats`` (a :class:`SpeculationStats`) counts what it did.
    ``draft_model`` (default: where it runs; False: off, as with ``HEADSPACE_FORCE_FALLBACK=draft_model``):
    where the n-gram lookup finds no draft, the drafts come from the decoder's int8 copy
    (:mod:`headspace.model.encdec.draft_model`), verified the same way (the same greedy tokens).
    """
    k = speculation_on(draft)
    with_model = draft_model_usable(model.decoder, draft_model)
    if not is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0; got {max_new_tokens!r}")
    c = model.config
    memory = model.encode(inputs, attention_mask)  # (B, Sk, d_model)
    B = memory.shape[0]
    if decoder_input_ids is None:
        decoder_input_ids = torch.full(
            (B, 1), c.decoder_start_token_id, dtype=torch.long, device=memory.device
        )
    if decoder_input_ids.shape[0] != B:
        raise ValueError(
            f"decoder_input_ids must have batch {B} (the inputs'); got {list(decoder_input_ids.shape)}"
        )
    check_ids("decoder_input_ids", decoder_input_ids, c.vocab_size)
    embed = model.decoder.embed
    total = decoder_input_ids.shape[1] + max_new_tokens
    if embed.kind in ("learned", "sinusoidal") and total > embed.n_positions:
        raise ValueError(
            f"a prompt of {decoder_input_ids.shape[1]} tokens and max_new_tokens={max_new_tokens} need "
            f"{total} positions; the decoder has {embed.n_positions}"
        )
    eos = c.eos_token_id if eos_token_id is None else eos_token_id
    pad = c.pad_token_id if c.pad_token_id is not None else eos
    blocks = list(model.decoder.blocks)
    caches = [b.attn.make_kv_cache(B, decoder_input_ids.shape[1] + max_new_tokens) for b in blocks]
    cross = [b.cross_attn.cross_kv(memory) for b in blocks]  # once per input: (B, H, Sk, dh) x 2 each
    cross_mask = _cross_mask(attention_mask, memory.dtype)
    screened = _screen(model, screen)
    lean = fast and fast_step_usable(model.decoder)
    if lean and k > 0 and B == 1 and cross_mask is None and max_new_tokens > 0:
        drafter = _drafter(model, cross, total) if with_model else None
        return _speculate(
            model, decoder_input_ids, max_new_tokens, caches, cross, screened, eos, k, stats, drafter
        )
    return _plain(
        model, decoder_input_ids, max_new_tokens, caches, cross, cross_mask, screened, lean, eos, pad
    )


def _plain(
    model: Seq2Seq,
    prompt: Tensor,
    max_new_tokens: int,
    caches: list[KVCache],
    cross: list[tuple[Tensor, Tensor]],
    cross_mask: Tensor | None,
    screened: ScreenedArgmax | None,
    lean: bool,
    eos: int | None,
    pad: int | None,
) -> Tensor:
    """:func:`greedy`'s loop of one token per step: the tokens [batch, prompt + generated]."""
    B = prompt.shape[0]
    tokens, step = prompt, prompt
    done = torch.zeros(B, dtype=torch.bool, device=prompt.device)
    for _ in range(max_new_tokens):
        if lean and step.shape[1] == 1:
            h = fast_step(model.decoder, step, caches, cross, cross_mask)  # (B, 1, d_model)
        else:
            h = model.decoder(
                step, None, caches=caches, cross=cross, cross_mask=cross_mask
            )  # (B, T, d_model)
        nxt = _next_tokens(model, h[:, -1], screened)  # (B,)
        if eos is not None:
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            done |= nxt == eos
        tokens = torch.cat((tokens, nxt[:, None]), dim=1)  # (B, T + 1)
        if bool(done.all()):
            break
        step = nxt[:, None]  # (B, 1)
    return tokens


def _drafter(model: Seq2Seq, cross: list[tuple[Tensor, Tensor]], capacity: int) -> DraftModel:
    """The model's :class:`DraftModel` (made once, kept while the weights are unchanged), started on
    ``cross`` with caches of ``capacity`` positions."""
    w, kept = model.tok_embed.weight, model.__dict__.get("_draft_model")
    if not (isinstance(kept, DraftModel) and kept.fits(model.decoder, w)):
        kept = DraftModel(model.decoder, w, model.logits_bias, model.config.output_scale)
        model.__dict__["_draft_model"] = kept  # (not a submodule, no state-dict key)
    kept.start(model.decoder, cross, capacity)
    return kept


def _speculate(
    model: Seq2Seq,
    prompt: Tensor,
    max_new_tokens: int,
    caches: list[KVCache],
    cross: list[tuple[Tensor, Tensor]],
    screened: ScreenedArgmax | None,
    eos: int | None,
    k: int,
    stats: SpeculationStats | None,
    drafter: DraftModel | None = None,
) -> Tensor:
    """:func:`greedy`'s loop at batch 1 with speculation (:func:`speculative_loop`): the prompt through the
    ordinary path, as :func:`_plain` feeds it, then drafts verified. Returns [1, prompt + generated]."""
    h = model.decoder(prompt, None, caches=caches, cross=cross, cross_mask=None)  # (1, P, d_model)
    first = int(_next_tokens(model, h[:, -1], screened)[0])
    new = [first]
    if first != eos and max_new_tokens > 1:

        def pick(rows: Tensor) -> Tensor:
            return _next_tokens(model, rows, screened)  # (T,)

        tokens = prompt[0].tolist() + new
        propose = None if drafter is None else drafter.propose
        new += speculative_loop(
            model.decoder, tokens, max_new_tokens - 1, caches, cross, pick, eos, k, stats, propose
        )
    if drafter is not None:
        drafter.stop()
    added = torch.tensor([new], dtype=prompt.dtype, device=prompt.device)  # (1, generated)
    return torch.cat((prompt, added), dim=1)  # (1, prompt + generated)
