"""Decoding: sampling continuation tokens from a Decoder, with or without its KV caches.

:func:`generate` is what :meth:`headspace.Decoder.generate` runs; it is written against the decoder's
public methods (``forward`` with ``kv_caches`` and ``positions``, ``blocks``, ``config``).
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .decoding import choose_pack_rows, generation_caches
from .inputs import check_left_padding, check_tokens
from .kernels import native as native_step
from .kernels.cpu import forced

if TYPE_CHECKING:
    from .models import Decoder


@torch.no_grad()
def generate(
    self: Decoder,
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
) -> Tensor:
    """Sample ``max_new_tokens`` continuation tokens after each prompt.

    Prompts of different lengths are left-padded into one batch, with ``key_padding`` marking the
    real tokens. Each row then behaves as if generated alone: its positions count from 0 at its first
    real token (``cumsum(key_padding) - 1``, as transformers' GPT-2 ``generate`` derives
    ``position_ids`` from the attention mask) and its padded keys are never attended, neither by the
    prompt nor by any generated token, with or without the KV cache. Greedy decoding
    (``temperature=0``) of a padded batch equals decoding each prompt alone; sampling draws for the
    whole batch at once, so with a seed it is reproducible but not equal to per-prompt sampling.
    With rotary positions (Llama-family decoders) the same per-row positions are those the queries
    and keys are rotated to, and the KV cache holds rotated keys, so each step rotates only the new
    token's query and key.

    Notation used for tensor shapes:
        batch, prompt_len (the longest prompt; shorter ones are left-padded to it),
        new (= max_new_tokens).

    Args:
        tokens: int64 [batch, prompt_len] prompts; left-padded when they differ in length (any
            valid id at padded positions: they never affect the real rows).
        max_new_tokens: number of tokens to add: the longest prompt's real tokens + max_new_tokens
            <= max_seq_len (left padding takes no position, so it is not counted).
        key_padding: bool [batch, prompt_len], True for real tokens; every row's real tokens must be
            right-aligned (``[F, F, T, T]``) and at least one (None: every token is real).
        temperature: logits are divided by it before sampling; 0 means greedy (argmax).
        top_k: sample only among the k most likely tokens (None: all).
        seed: seeds a private generator, so the same seed gives the same tokens (None: torch's
            global RNG).
        use_cache: decode with a KV cache (default); False recomputes the whole sequence each step
            (the reference the cache is tested against).
        prepack: pack the float32 weights for MKL's GEMM once for this call, so that the cached
            steps of a batch do not repack them in every product (:mod:`headspace.kernels.prepack`;
            SmolLM2 at batch 8: ~1.4x the tokens/s). It costs a second copy of the weights while the
            call runs (513 MiB for SmolLM2) and ~0.2 s to pack, and the logits then agree with
            ``forward``'s to float32 rounding rather than bit for bit. None (default) packs at batch
            >= 2 for at least 32 MiB of float32 weights whose copy fits in half the available
            memory; True always (ValueError without MKL); False never.
        compile: accepted for code written for earlier versions, and ignored with a FutureWarning:
            the inductor-compiled step it ran was slower than the native step
            (``docs/benchmarks.md``) and was removed.
        native: run the cached steps' blocks in one C++ call each (:mod:`headspace.kernels.native`):
            the same arithmetic as the Python step, so the same logits bit for bit, without its ~25
            Python-level calls per block (SmolLM2 at batch 1: ~3 ms of a ~26 ms token). For float32
            products, packed or not, and bfloat16 ones (RMSNorm or LayerNorm, torch's SiLU, ReLU or
            GELU; int8 weights take the Python step). None
            (default) uses it once built: the first call starts compiling it in the background
            (~10 s with the system's C++ compiler, once per machine: the library is cached) and
            decodes in Python meanwhile (a build unfinished at exit is stopped; ``headspace native
            build`` builds it up front); without a compiler it stays Python (one warning). True builds
            it first and waits (RuntimeError where it cannot be built); False never uses it.

    Returns:
        [batch, prompt_len + new]: the prompts (padding included, as given) followed by the sampled
        tokens.

    The model is put in eval mode for the call (no dropout) and restored afterwards.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0; got {max_new_tokens!r}")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not math.isfinite(temperature)
        or temperature < 0
    ):
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
    if compile:
        warnings.warn(
            "generate(compile=True) is ignored: the compiled decoding step was removed (the native "
            "step is faster); decoding runs the default step",
            FutureWarning,
            stacklevel=2,
        )
    check_tokens(tokens, self.config, check_length=key_padding is None, device=self.tok_embed.weight.device)
    batch, prompt_len = tokens.shape
    if prompt_len == 0:
        raise ValueError("tokens must hold a prompt of at least 1 token; got prompt_len=0")
    longest = prompt_len
    if key_padding is not None:
        check_left_padding(key_padding, tokens)
        longest = int(key_padding.sum(dim=1).max())
        if bool(key_padding.all()):
            key_padding = None  # nothing padded: the unmasked path, as without key_padding
    pack_rows = choose_pack_rows(self, batch, prepack)  # checks prepack
    if native:
        if not native_step.build():
            raise RuntimeError(
                f"native=True: headspace's native decoding step is unavailable ({native_step.status()})"
            )
    total = prompt_len + max_new_tokens  # columns of the result, padding included
    if longest + max_new_tokens > self.config.max_seq_len:
        what = (
            f"prompt_len {prompt_len}"
            if longest == prompt_len
            else f"the longest prompt's {longest} real tokens"
        )
        raise ValueError(
            f"{what} + max_new_tokens {max_new_tokens} = {longest + max_new_tokens} exceeds the "
            f"position table (max_seq_len={self.config.max_seq_len}); refused, not truncated"
        )
    if max_new_tokens == 0:
        return tokens.clone()
    real = positions = None
    if key_padding is not None:
        real = torch.ones(batch, total, dtype=torch.bool, device=tokens.device)  # (batch, total)
        real[:, :prompt_len] = key_padding
        # each row counts from 0 at its first real token; padding (never attended) takes position 0
        positions = (real.cumsum(dim=1) - 1).clamp(min=0)  # (batch, total)

    def cols(t: Tensor | None, lo: int, hi: int) -> Tensor | None:
        return None if t is None else t[:, lo:hi]  # (batch, hi - lo)

    generator = None
    if seed is not None:
        generator = torch.Generator(device=tokens.device)
        generator.manual_seed(seed)
    was_training = self.training
    self.eval()
    try:
        out = torch.empty(batch, total, dtype=torch.long, device=tokens.device)  # (batch, total)
        out[:, :prompt_len] = tokens
        # one slot per column, padding included (may exceed max_seq_len; positions never do)
        caches = generation_caches(self, batch, total) if use_cache else None
        logits = self(
            tokens.long(), cols(real, 0, prompt_len), caches, positions=cols(positions, 0, prompt_len)
        )[:, -1]  # (batch, vocab_size)
        # the cached one-token steps, flattened once at the first of them (None where they take
        # forward's general path)
        plan = None
        planned = not (use_cache and key_padding is None)
        for pos in range(prompt_len, total):
            out[:, pos] = _sample(logits, temperature, top_k, generator)
            if pos + 1 == total:
                break
            if not planned:
                plan = self.decode_plan(pack_rows)
                planned = True
                if plan is not None:
                    # None: the native step once built, unless its fallback is forced (kernels.cpu)
                    use_native = native is True or (native is None and not forced("native"))
                    plan.use_native = use_native  # type: ignore[union-attr]
                    if use_native and native is None and plan.native is not None:  # type: ignore[union-attr]
                        native_step.start_build()  # in the background; steps run in Python until built
            if plan is not None and plan.idle():
                # forward(out[:, pos : pos + 1], kv_caches=caches)[:, -1] (caches made above): bit for
                # bit, or to float32 rounding with packed weights. Inference mode: no hook runs here
                # to see its tensors, and each of the step's ~1,000 ops dispatches ~0.5 us faster
                # without no_grad's view and version bookkeeping (SmolLM2: ~0.6-1.3 ms of a 26 ms token)
                with torch.inference_mode():
                    logits = plan.logits(out[:, pos : pos + 1], caches)  # (batch, vocab_size)
            elif use_cache:
                # key_padding covers every cached position plus the new one
                logits = self(
                    out[:, pos : pos + 1],
                    cols(real, 0, pos + 1),
                    caches,
                    positions=cols(positions, pos, pos + 1),
                )[:, -1]  # (batch, vocab_size)
            else:
                logits = self(
                    out[:, : pos + 1], cols(real, 0, pos + 1), positions=cols(positions, 0, pos + 1)
                )[:, -1]  # (batch, vocab_size)
    finally:
        self.train(was_training)
    return out


def _sample(
    logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> Tensor:
    """One token id per row of ``logits`` [batch, vocab_size] -> [batch]."""
    if temperature == 0:
        # the first largest logit, as argmax picks it (ties and NaN alike), by the faster max kernel
        return logits.max(dim=-1).indices
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (batch, 1)
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)  # (batch, vocab_size)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)  # (batch,)
