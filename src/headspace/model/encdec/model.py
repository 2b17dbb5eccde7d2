"""An encoder-decoder Transformer on headspace's own layers: :class:`EncoderDecoder`.

``m(inputs, decoder_input_ids)`` -> logits [batch, seq_dec, vocab], ``inputs`` token ids [batch, seq]
(T5, BART, Marian) or audio features [batch, n_mels, frames] (Whisper)::

    e = Encoder(inputs)                      (stacks.py: embedding / convolutions, blocks, final norm)
    h = Decoder(decoder_input_ids, e)        (each block: causal self-attention, cross-attention on e, MLP)
    logits = output_scale * h @ W_U + b_U    (W_U = E^T, the token embedding tied; b_U BART's logits bias)

Hook points by module path: ``encoder.blocks.L.attn.hook_*``, ``decoder.blocks.L.attn.hook_*``,
``decoder.blocks.L.cross_attn.hook_*`` (q, k, v, scores, pattern, z, result) and the blocks' own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ...nn.hooks import HookPoint, name_hook_points
from .config import EncDecConfig, check_ids
from .generate import greedy
from .speculative import SpeculationStats
from .stacks import DecoderStack, EncoderStack


class EncoderDecoder(nn.Module):
    """An encoder-decoder (module docstring): ``tok_embed`` (shared by both stacks and the unembedding),
    ``encoder`` (:class:`~headspace.model.encdec.stacks.EncoderStack`), ``decoder`` (:class:`DecoderStack`),
    ``logits_bias`` [vocab] where the config has one."""

    def __init__(self, config: EncDecConfig) -> None:
        super().__init__()
        if not isinstance(config, EncDecConfig):
            raise TypeError(f"config must be an EncDecConfig; got {type(config).__name__}")
        self.config = config
        self.tok_embed = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = EncoderStack(config, self.tok_embed)
        self.decoder = DecoderStack(config, self.tok_embed)
        #: the folder's tokenizer (:class:`~headspace.tokenization.TextTokenizer`) where the loader found one
        self.tokenizer: Any = None
        if config.logits_bias:
            self.logits_bias = nn.Parameter(torch.zeros(config.vocab_size))
        else:
            self.logits_bias = None

    @property
    def W_U(self) -> Tensor:
        """The unembedding [d_model, vocab]: the token embedding's transpose (tied)."""
        return self.tok_embed.weight.T

    def hook_points(self) -> dict[str, HookPoint]:
        """Every hook point by its module path (``decoder.blocks.0.cross_attn.hook_pattern``, ...)."""
        return name_hook_points(self)

    def _check_inputs(self, inputs: Any) -> None:
        c = self.config
        if not c.audio:
            check_ids("input_ids", inputs, c.vocab_size)
            return
        frames = 2 * c.max_source_positions
        if not isinstance(inputs, Tensor) or inputs.dim() != 3 or not inputs.is_floating_point():
            got = (
                f"{inputs.dtype} {list(inputs.shape)}"
                if isinstance(inputs, Tensor)
                else type(inputs).__name__
            )
            raise ValueError(
                f"input_features must be a float tensor [batch, n_mels={c.n_mels}, frames]; got {got}"
            )
        if inputs.shape[1] != c.n_mels or not 0 < inputs.shape[2] <= frames:
            raise ValueError(
                f"input_features must be [batch, n_mels={c.n_mels}, frames <= {frames}]; "
                f"got {list(inputs.shape)}"
            )

    def _check_mask(self, mask: Any, inputs: Tensor) -> None:
        if self.config.audio:
            raise ValueError(
                "attention_mask is for token inputs; an audio encoder (Whisper) reads every frame"
            )
        if not isinstance(mask, Tensor) or tuple(mask.shape) != tuple(inputs.shape):
            got = list(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(
                f"attention_mask must be [batch, seq] = {list(inputs.shape)} (1: real token); got {got}"
            )

    def encode(self, inputs: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """The encoder's output [batch, seq_k, d_model] of token ids [batch, seq] or audio features
        [batch, n_mels, frames] (seq_k = frames / 2); ``attention_mask`` [batch, seq] (1: real token)."""
        self._check_inputs(inputs)
        if attention_mask is not None:
            self._check_mask(attention_mask, inputs)
        return self.encoder(inputs, None if attention_mask is None else attention_mask.bool())

    def unembed(self, h: Tensor) -> Tensor:
        """``output_scale * h @ W_U + b_U``: [batch, seq, d_model] -> logits [batch, seq, vocab]."""
        scale = self.config.output_scale
        h = h if scale == 1.0 else h * scale
        return nn.functional.linear(h, self.tok_embed.weight, self.logits_bias)  # (B, T, V)

    def decode(
        self, decoder_input_ids: Tensor, memory: Tensor, attention_mask: Tensor | None = None
    ) -> Tensor:
        """Logits [batch, seq_dec, vocab] of ``decoder_input_ids`` [batch, seq_dec] on the encoder output."""
        check_ids("decoder_input_ids", decoder_input_ids, self.config.vocab_size)
        padding = None if attention_mask is None else attention_mask.bool()
        return self.unembed(self.decoder(decoder_input_ids, memory, padding))

    def forward(
        self, inputs: Tensor, decoder_input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> Tensor:
        """Logits [batch, seq_dec, vocab] (module docstring)."""
        return self.decode(decoder_input_ids, self.encode(inputs, attention_mask), attention_mask)

    def run_with_cache(
        self, inputs: Tensor, decoder_input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """(logits, every hook point's value by its name) of one forward pass."""
        cache: dict[str, Tensor] = {}
        removers = []
        for name, point in self.hook_points().items():

            def keep(value: Tensor, _point: HookPoint, name: str = name) -> None:
                cache[name] = value.detach()

            removers.append(point.add(keep))
        try:
            with torch.no_grad():
                logits = self(inputs, decoder_input_ids, attention_mask)
        finally:
            for remove in removers:
                remove()
        return logits, cache

    @torch.no_grad()
    def generate(
        self,
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
        """Greedy decoding: the decoder's tokens [batch, prompt + new] (:func:`greedy`; ``screen``: the
        int8 screen of the argmax, :mod:`headspace.model.encdec.screen`; ``fast``: the steps without hook
        dispatch while no decoder hook is registered, :mod:`headspace.model.encdec.fast_step`; ``draft``:
        n-gram drafts per verifying forward at batch 1, 0: off, and ``stats`` its counts,
        :mod:`headspace.model.encdec.speculative`; ``draft_model``: drafts from the decoder's int8 copy where
        the n-grams find none, :mod:`headspace.model.encdec.draft_model`)."""
        return greedy(self, inputs, max_new_tokens, attention_mask=attention_mask,
                      decoder_input_ids=decoder_input_ids, eos_token_id=eos_token_id,
                      screen=screen, fast=fast, draft=draft, stats=stats,
                      draft_model=draft_model)  # fmt: skip


__all__ = ["EncoderDecoder"]
