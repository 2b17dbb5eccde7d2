"""Tiny random encoder-decoder checkpoints written by transformers itself (test-only), loaded back both by
transformers (eager attention, the reference) and by ``headspace.load``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 37
#: decoder sizes differ from the encoder's (3 decoder layers, 2 encoder layers); odd widths where the family
#: allows them (T5's d_kv * num_heads need not be d_model).
SIZES: dict[str, dict[str, Any]] = {
    "t5": dict(
        vocab_size=VOCAB,
        d_model=26,
        d_kv=7,
        d_ff=41,
        num_layers=2,
        num_decoder_layers=3,
        num_heads=3,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=12,
        feed_forward_proj="gated-gelu",
        decoder_start_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
    ),
    "t5-relu": dict(
        vocab_size=VOCAB,
        d_model=26,
        d_kv=5,
        d_ff=33,
        num_layers=3,
        num_decoder_layers=2,
        num_heads=5,
        relative_attention_num_buckets=10,
        relative_attention_max_distance=9,
        feed_forward_proj="relu",
        decoder_start_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=False,
    ),
    "bart": dict(
        vocab_size=VOCAB,
        d_model=30,
        encoder_layers=2,
        decoder_layers=3,
        encoder_attention_heads=3,
        decoder_attention_heads=3,
        encoder_ffn_dim=41,
        decoder_ffn_dim=41,
        max_position_embeddings=40,
        scale_embedding=True,
    ),
    "marian": dict(
        vocab_size=VOCAB,
        d_model=30,
        encoder_layers=2,
        decoder_layers=3,
        encoder_attention_heads=5,
        decoder_attention_heads=5,
        encoder_ffn_dim=41,
        decoder_ffn_dim=41,
        max_position_embeddings=40,
        pad_token_id=36,
        decoder_start_token_id=36,
        eos_token_id=0,
        scale_embedding=True,
        activation_function="swish",
    ),
    "whisper": dict(
        vocab_size=VOCAB,
        d_model=30,
        encoder_layers=2,
        decoder_layers=3,
        encoder_attention_heads=3,
        decoder_attention_heads=3,
        encoder_ffn_dim=41,
        decoder_ffn_dim=41,
        num_mel_bins=7,
        max_source_positions=11,
        max_target_positions=24,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        begin_suppress_tokens=None,
        suppress_tokens=None,
    ),
}
FAMILIES = list(SIZES)


def _classes(kind: str) -> tuple[Any, Any]:
    t = transformers
    return {
        "t5": (t.T5Config, t.T5ForConditionalGeneration),
        "bart": (t.BartConfig, t.BartForConditionalGeneration),
        "marian": (t.MarianConfig, t.MarianMTModel),
        "whisper": (t.WhisperConfig, t.WhisperForConditionalGeneration),
    }[kind.split("-")[0]]


def make_tiny(kind: str, folder: Path, seed: int = 0) -> Any:
    """Write a tiny random ``kind`` checkpoint into ``folder`` (every parameter, zero-initialised ones
    too, moved by noise) and return transformers' model read back from it (eager attention)."""
    config_cls, model_cls = _classes(kind)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**SIZES[kind]))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("final_logits_bias"):  # a saved buffer, zero from transformers (BART, Marian)
                b.add_(torch.randn_like(b))
    model.save_pretrained(folder)
    return model_cls.from_pretrained(folder, attn_implementation="eager").eval()


def inputs_of(kind: str, batch: int = 2, seed: int = 1) -> torch.Tensor:
    """Token ids [batch, 9] (avoiding the special ids 0..2 and the pad 36), or Whisper features
    [batch, n_mels, 2 max_source_positions]."""
    g = torch.Generator().manual_seed(seed)
    if kind == "whisper":
        s = SIZES["whisper"]
        return torch.randn(batch, s["num_mel_bins"], 2 * s["max_source_positions"], generator=g)
    return torch.randint(3, VOCAB - 1, (batch, 9), generator=g)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    """``tiny(kind)`` -> (the folder, transformers' model), built once per module and kind."""
    made: dict[str, tuple[Path, Any]] = {}

    def get(kind: str) -> tuple[Path, Any]:
        if kind not in made:
            folder = tmp_path_factory.mktemp(kind)
            made[kind] = (folder, make_tiny(kind, folder))
        return made[kind]

    return get
