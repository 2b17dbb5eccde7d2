"""Encoder-decoder checkpoints on :class:`headspace.model.encdec.EncoderDecoder`: T5, BART, Marian, Whisper.

``load(folder)`` reaches them by ``config.json``'s ``model_type`` (:data:`ENCDEC_LOADERS`).
"""

from .bart import bart_config, load_bart, load_marian, marian_config
from .common import encdec_from_state_dict, load_encdec
from .t5 import load_t5, t5_config
from .whisper import load_whisper, whisper_config, whisper_from_state_dict, whisper_plan

#: ``model_type`` -> loader.
ENCDEC_LOADERS = {"t5": load_t5, "bart": load_bart, "marian": load_marian, "whisper": load_whisper}

__all__ = [
    "ENCDEC_LOADERS",
    "bart_config",
    "encdec_from_state_dict",
    "load_bart",
    "load_encdec",
    "load_marian",
    "load_t5",
    "load_whisper",
    "marian_config",
    "t5_config",
    "whisper_config",
    "whisper_from_state_dict",
    "whisper_plan",
]
