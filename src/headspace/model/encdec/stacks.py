"""The encoder and decoder stacks: embedding and positions, the blocks, the final norm.

Encoder input (tokens, T5 / BART / Marian): ``x = embed_scale * E[ids] + P[offset + arange(seq)]``
(no ``P`` with T5's buckets), then BART's ``embed_ln``. Audio (Whisper)::

    x = gelu(conv2(gelu(conv1(features))))^T + P[arange(frames / 2)]
    conv1: n_mels -> d_model, kernel 3, padding 1;  conv2: d_model -> d_model, kernel 3, stride 2, padding 1

The decoder's input is the same as the token encoder's, its positions starting after the cached ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...nn.hooks import HookPoint
from ...nn.kv_cache import KVCache
from ..block import make_norm
from .blocks import DecoderBlock, EncoderBlock
from .config import EncDecConfig
from .positions import RelativeBias, sinusoidal_table


class Embedding(nn.Module):
    """Token embedding (``tokens``, shared with the other stack and the unembedding where tied), the
    positions of one stack (``pos_embed``: a learned ``nn.Embedding``; or ``sinusoid``, a fixed buffer) and
    the embedding norm; ``forward(ids, start)`` -> [batch, seq, d_model] (module docstring)."""

    def __init__(self, c: EncDecConfig, kind: str, n_positions: int, tokens: nn.Embedding | None) -> None:
        super().__init__()
        self.__dict__["tokens"] = tokens  # owned by the model: not a submodule of each stack
        self.kind = kind
        self.offset = c.position_offset if kind == "learned" else 0
        self.n_positions = n_positions
        self.embed_scale = c.embed_scale
        if kind == "learned":
            self.pos_embed = nn.Embedding(n_positions + self.offset, c.d_model)
        if kind == "sinusoidal":
            self.register_buffer("sinusoid", sinusoidal_table(n_positions, c.d_model), persistent=False)
        self.embed_ln = make_norm(c.norm, c.d_model, c.norm_eps) if c.embed_norm else None

    def positions(self, seq: int, start: int, device: torch.device) -> Tensor | None:
        """The position rows [seq, d_model] of positions ``start .. start + seq - 1``, or None."""
        if start + seq > self.n_positions and self.kind in ("learned", "sinusoidal"):
            raise ValueError(
                f"positions {start}..{start + seq - 1} do not fit this model's {self.n_positions} positions"
            )
        if self.kind == "learned":
            idx = torch.arange(start + self.offset, start + self.offset + seq, device=device)  # (seq,)
            return self.pos_embed(idx)  # (seq, d_model)
        if self.kind == "sinusoidal":
            return self.sinusoid[start : start + seq]  # (seq, d_model)
        return None

    def add_positions(self, x: Tensor, start: int = 0) -> Tensor:
        """x [batch, seq, d_model] plus its positions, through ``embed_ln`` where there is one."""
        pos = self.positions(x.shape[1], start, x.device)
        x = x if pos is None else x + pos
        return x if self.embed_ln is None else self.embed_ln(x)

    def forward(self, ids: Tensor, start: int = 0) -> Tensor:
        x = self.tokens(ids) * self.embed_scale  # (batch, seq, d_model)
        return self.add_positions(x, start)


class EncoderStack(nn.Module):
    """The encoder: ``embed`` (or the audio front end ``conv1``, ``conv2``), ``blocks``, ``final_ln``;
    T5's bucket table ``rel_bias`` (bidirectional)."""

    def __init__(self, c: EncDecConfig, tokens: nn.Embedding) -> None:
        super().__init__()
        self.audio = c.audio
        if c.n_mels is not None:
            self.conv1 = nn.Conv1d(c.n_mels, c.d_model, kernel_size=3, padding=1)
            self.conv2 = nn.Conv1d(c.d_model, c.d_model, kernel_size=3, stride=2, padding=1)
        self.embed = Embedding(c, c.encoder_positions, c.max_source_positions, None if c.audio else tokens)
        buckets = c.encoder_positions == "buckets"
        self.rel_bias = (
            RelativeBias(c.num_buckets, c.n_heads, c.max_distance, bidirectional=True) if buckets else None
        )
        self.blocks = nn.ModuleList(EncoderBlock(c, self.rel_bias) for _ in range(c.n_encoder_layers))
        self.final_ln = make_norm(c.norm, c.d_model, c.norm_eps) if c.final_norm else None
        self.hook_out = (
            HookPoint()
        )  # [batch, seq_enc, d_model]: the output, every cross-attention's k/v input

    def forward(self, inputs: Tensor, key_padding: Tensor | None = None) -> Tensor:
        """Token ids [batch, seq] (or features [batch, n_mels, frames]) -> output [batch, seq, d_model]."""
        if self.audio:
            h = F.gelu(self.conv1(inputs))  # (B, d_model, frames)
            h = F.gelu(self.conv2(h))  # (B, d_model, frames / 2)
            x = self.embed.add_positions(h.transpose(1, 2))  # (B, frames / 2, d_model)
        else:
            x = self.embed(inputs)  # (B, S, d_model)
        S = x.shape[1]
        bias = None
        if self.rel_bias is not None:  # the padding folded into the additive bias (masks do not mix kinds)
            bias = self.rel_bias(S, S).expand(x.shape[0], -1, -1, -1)  # (B, H, S, S)
            if key_padding is not None:
                bias = bias.masked_fill(~key_padding[:, None, None, :], float("-inf"))  # (B, H, S, S)
                key_padding = None
        for block in self.blocks:
            x = block(x, key_padding=key_padding, bias=bias)
        return self.hook_out(x if self.final_ln is None else self.final_ln(x))


class DecoderStack(nn.Module):
    """The decoder: ``embed``, ``blocks``, ``final_ln``; T5's bucket table ``rel_bias`` (causal)."""

    def __init__(self, c: EncDecConfig, tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed = Embedding(c, c.decoder_positions, c.max_target_positions, tokens)
        buckets = c.decoder_positions == "buckets"
        self.rel_bias = (
            RelativeBias(c.num_buckets, c.n_heads, c.max_distance, bidirectional=False) if buckets else None
        )
        self.blocks = nn.ModuleList(DecoderBlock(c, self.rel_bias) for _ in range(c.n_decoder_layers))
        self.final_ln = make_norm(c.norm, c.d_model, c.norm_eps) if c.final_norm else None

    def forward(
        self,
        ids: Tensor,
        memory: Tensor | None,
        memory_padding: Tensor | None = None,
        *,
        caches: list[KVCache] | None = None,
        cross: list[tuple[Tensor, Tensor]] | None = None,
        cross_mask: Tensor | None = None,
    ) -> Tensor:
        """Decoder ids [batch, seq] on the encoder's output -> the final stream [batch, seq, d_model].

        While decoding, ``caches`` hold each layer's self-attention keys and values (the new positions
        start after them) and ``cross`` each layer's cross keys and values, computed once per input."""
        start = 0 if caches is None else caches[0].length
        x = self.embed(ids, start)  # (B, T, d_model)
        T = x.shape[1]
        bias = None
        if self.rel_bias is not None:
            bias = self.rel_bias(T, start + T, start).expand(x.shape[0], -1, -1, -1)  # (B, H, T, start+T)
        for i, block in enumerate(self.blocks):
            x = block(
                x, memory, memory_padding=memory_padding, bias=bias,
                kv_cache=None if caches is None else caches[i],
                cross_kv=None if cross is None else cross[i], cross_mask=cross_mask,
            )  # fmt: skip
        return x if self.final_ln is None else self.final_ln(x)
