"""Encoder-decoder Transformers (T5, BART, Marian, Whisper) on headspace's own layers (issue #40).

* :class:`EncDecConfig` (config.py): the numbers;
* :class:`EncoderDecoder` (model.py): ``m(inputs, decoder_input_ids)`` -> logits, ``generate``;
* stacks.py / blocks.py: the encoder and decoder stacks and their blocks;
* attention.py: cross-attention with keys and values computed once, T5's bucket bias in the head views;
* positions.py: Marian's sinusoids, T5's relative-position buckets;
* generate.py, fast_step.py, screen.py: greedy decoding, its one-token step without hook dispatch and the
  certified int8 screen of its argmax;
* speculative.py, draft_model.py: exact speculative greedy decoding (n-gram drafts, else an int8 draft
  model), verified by the float32 model in one forward over the drafts.

See docs/encoder_decoder.md.
"""

from .attention import BucketHead, BucketQK, EncDecAttention
from .config import ENCDEC_LAYOUTS, POSITION_KINDS, EncDecConfig
from .model import EncoderDecoder
from .positions import RelativeBias, relative_bucket, sinusoidal_table

__all__ = [
    "ENCDEC_LAYOUTS",
    "POSITION_KINDS",
    "BucketHead",
    "BucketQK",
    "EncDecAttention",
    "EncDecConfig",
    "EncoderDecoder",
    "RelativeBias",
    "relative_bucket",
    "sinusoidal_table",
]
