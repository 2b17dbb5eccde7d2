"""The numbers of an encoder-decoder (:class:`EncDecConfig`), checked on construction.

One dataclass describes T5, BART, Marian and Whisper: what differs between them is a field each (the norm
and its place, the positions of each stack, the embedding's scale, the audio front end).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...core.checks import is_int, is_number

#: Where each sublayer's norm sits: ``"post"`` (BART, Marian: ``h = N(x + A(x))``) or ``"pre"`` (T5,
#: Whisper: ``h = x + A(N(x))``).
ENCDEC_LAYOUTS = ("post", "pre")
#: The positions of a stack: ``"learned"`` (a table added to the embedding, BART with its offset, Whisper),
#: ``"sinusoidal"`` (Marian's fixed table: sines in the first half, cosines in the second), ``"buckets"``
#: (T5's learned per-head score bias by relative-position bucket) or ``"none"``.
POSITION_KINDS = ("learned", "sinusoidal", "buckets", "none")
ENCDEC_NORMS = ("layernorm", "rmsnorm")
ENCDEC_MLPS = ("plain", "gated")
ENCDEC_ACTS = ("gelu", "gelu_tanh", "relu", "silu")


def check_ids(name: str, ids: Any, vocab: int) -> None:
    """``ids`` must be an integer tensor [batch, seq] of ids in [0, vocab) (one-line ValueError)."""
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        got = f"{ids.dtype} {list(ids.shape)}" if isinstance(ids, Tensor) else type(ids).__name__
        raise ValueError(f"{name} must be an int64 tensor [batch, seq]; got {got}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(
            f"{name} must hold token ids in [0, {vocab}); got ids {int(ids.min())}..{int(ids.max())}"
        )


def _fail(name: str, expected: str, value: object) -> ValueError:
    return ValueError(f"EncDecConfig.{name} must be {expected}; got {value!r}")


@dataclass(frozen=True)
class EncDecConfig:
    """An encoder-decoder's numbers.

    Sizes: ``vocab_size``, ``d_model``, ``n_heads`` heads of width ``d_head`` (every attention layer: encoder
    self, decoder self and cross), MLP width ``d_mlp``, ``n_encoder_layers`` / ``n_decoder_layers`` blocks.
    ``norm`` (``"layernorm"`` or ``"rmsnorm"``) with ``norm_eps``, placed by ``layout``; ``mlp``
    (``"plain"`` or ``"gated"``) with ``act``; ``bias``: every linear has a bias (T5: none). ``scale``: the
    scores' factor (None: ``1 / sqrt(d_head)``; T5: 1). ``encoder_positions`` / ``decoder_positions``: one
    of :data:`POSITION_KINDS`, tables of ``max_source_positions`` / ``max_target_positions`` rows read at
    ``position + position_offset`` (BART: 2). ``embed_scale`` multiplies the token embedding
    (``sqrt(d_model)`` where scaled); ``embed_norm``: a norm right after the embedding (BART's
    ``layernorm_embedding``); ``final_norm``: a norm after each stack's last block (pre-LN models);
    ``logits_bias``: a bias on the logits (BART's ``final_logits_bias``); ``output_scale``: the decoder's
    output is multiplied by it before the unembedding (T5 with tied embeddings: ``d_model ** -0.5``).
    ``num_buckets`` / ``max_distance``: T5's relative-position buckets. ``n_mels``: an audio encoder
    (Whisper) reading [batch, n_mels, frames] through two convolutions, else None (token ids).
    """

    vocab_size: int
    d_model: int
    n_heads: int
    d_head: int
    d_mlp: int
    n_encoder_layers: int
    n_decoder_layers: int
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    layout: str = "post"
    mlp: str = "plain"
    act: str = "gelu"
    bias: bool = True
    scale: float | None = None
    encoder_positions: str = "learned"
    decoder_positions: str = "learned"
    max_source_positions: int = 1024
    max_target_positions: int = 1024
    position_offset: int = 0
    embed_scale: float = 1.0
    embed_norm: bool = False
    final_norm: bool = False
    logits_bias: bool = False
    output_scale: float = 1.0
    num_buckets: int = 32
    max_distance: int = 128
    n_mels: int | None = None
    decoder_start_token_id: int = 0
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    name: str = ""

    def __post_init__(self) -> None:
        for key in ("vocab_size", "d_model", "n_heads", "d_head", "d_mlp", "n_encoder_layers",
                    "n_decoder_layers", "max_source_positions", "max_target_positions", "num_buckets",
                    "max_distance"):  # fmt: skip
            value = getattr(self, key)
            if not is_int(value) or value <= 0:
                raise _fail(key, "a positive int", value)
        for key, choices in (("norm", ENCDEC_NORMS), ("layout", ENCDEC_LAYOUTS), ("mlp", ENCDEC_MLPS),
                             ("act", ENCDEC_ACTS), ("encoder_positions", POSITION_KINDS),
                             ("decoder_positions", POSITION_KINDS)):  # fmt: skip
            if getattr(self, key) not in choices:
                raise _fail(key, f"one of {list(choices)}", getattr(self, key))
        for key in ("bias", "embed_norm", "final_norm", "logits_bias"):
            if not isinstance(getattr(self, key), bool):
                raise _fail(key, "a bool", getattr(self, key))
        for key in ("norm_eps", "embed_scale", "output_scale"):
            value = getattr(self, key)
            if not is_number(value) or not 0 < value < math.inf:
                raise _fail(key, "a finite positive float", value)
        if self.scale is not None and (not is_number(self.scale) or not math.isfinite(self.scale)):
            raise _fail("scale", "None (1 / sqrt(d_head)) or a finite float", self.scale)
        if not is_int(self.position_offset) or self.position_offset < 0:
            raise _fail("position_offset", "an int >= 0", self.position_offset)
        if self.n_mels is not None and (not is_int(self.n_mels) or self.n_mels <= 0):
            raise _fail("n_mels", "None (token ids) or a positive int", self.n_mels)
        for key in ("decoder_start_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, key)
            if value is None and key != "decoder_start_token_id":
                continue
            if not is_int(value) or not 0 <= value < self.vocab_size:
                raise _fail(key, f"a token id in [0, {self.vocab_size})", value)
        if self.encoder_positions == "sinusoidal" and self.d_model % 2:
            raise _fail("d_model", "even for sinusoidal positions", self.d_model)
        if self.n_mels is not None and self.encoder_positions == "buckets":
            raise _fail(
                "encoder_positions", "'learned', 'sinusoidal' or 'none' for an audio encoder", "buckets"
            )

    @property
    def audio(self) -> bool:
        """Whether the encoder reads audio features [batch, n_mels, frames] (Whisper), not token ids."""
        return self.n_mels is not None
