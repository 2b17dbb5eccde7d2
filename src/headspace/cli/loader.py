"""The one model loader of every command: ``--model NAME | FOLDER`` -> a loaded model, or one line.

Every command that runs a model calls :func:`load_model`; it is :func:`headspace.pretrained.load` with
its errors turned into one :class:`~headspace.errors.UsageError` line (exit code 2, by
:func:`.errors.reported`) that says what was
wrong and what is valid. ``--precision`` (``--model-precision``) is applied by :func:`at_precision` on
the loaded model (float32 loads as it always did).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from ..core.errors import UsageError
from .errors import one_line, reported

__all__ = ["UsageError", "at_precision", "encoder_decoders_allowed", "load_model", "one_line"]

#: True inside :func:`encoder_decoders_allowed` (``headspace explain``): any encoder-decoder loads
_ALLOW_ENCDEC: ContextVar[bool] = ContextVar("allow_encoder_decoders", default=False)


@contextmanager
def encoder_decoders_allowed() -> Iterator[None]:
    """Inside it, :func:`load_model` lets any encoder-decoder through (the commands that run one)."""
    token = _ALLOW_ENCDEC.set(True)
    try:
        yield
    finally:
        _ALLOW_ENCDEC.reset(token)


def load_model(spec: str, *, whisper: bool = False) -> Any:
    """A registered model (``minilm``, ``smollm2``, ``gemma3``), a Hugging Face checkpoint folder or a
    ``.gguf`` file; with ``whisper=True`` (``headspace align``) a Whisper encoder-decoder is let through,
    inside :func:`encoder_decoders_allowed` (``headspace explain``) any encoder-decoder."""
    from .. import pretrained

    with reported():
        model = pretrained.load(spec)
    refuse_encoder_decoder(model, spec, whisper=whisper, encdec=_ALLOW_ENCDEC.get())
    return model


def refuse_encoder_decoder(model: Any, spec: str, *, whisper: bool = False, encdec: bool = False) -> None:
    """An encoder-decoder (T5, BART, Marian, Whisper) is refused by name in one line where a command does
    not run one (the Python API does: :class:`headspace.EncoderDecoder`, docs/encoder_decoder.md); a
    Whisper model (audio encoder) passes when ``whisper`` (``headspace align``), any one when ``encdec``."""
    from ..model.encdec import EncoderDecoder

    if isinstance(model, EncoderDecoder) and (encdec or (whisper and model.config.audio)):
        return
    if isinstance(model, EncoderDecoder):
        raise UsageError(
            f"--model {spec}: an encoder-decoder ({model.config.name or 'T5/BART/Marian/Whisper'}); this "
            "command does not handle encoder-decoders yet (explain, align, patch, attribute, why and atlas "
            "do): use headspace.load() in Python (docs/encoder_decoder.md)"
        )


def at_precision(pretrained: Any, precision: str) -> Any:
    """The loaded model converted in place to ``precision`` (float32: as loaded), or one line."""
    if precision == "float32":
        return pretrained
    with reported():
        return pretrained.to_precision(precision)
