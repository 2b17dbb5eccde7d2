"""The one model loader of every command: ``--model NAME | FOLDER`` -> a loaded model, or one line.

Every command that runs a model calls :func:`load_model`; it is :func:`headspace.pretrained.load` with
its errors turned into one :class:`~headspace.errors.UsageError` line (exit code 2, by
:func:`.errors.reported`) that says what was
wrong and what is valid. ``--precision`` (``--model-precision``) is applied by :func:`at_precision` on
the loaded model (float32 loads as it always did).
"""

from __future__ import annotations

from typing import Any

from ..core.errors import UsageError
from .errors import one_line, reported

__all__ = ["UsageError", "at_precision", "load_model", "one_line"]


def load_model(spec: str) -> Any:
    """A registered model (``minilm``, ``smollm2``, ``gemma3``), a Hugging Face checkpoint folder or a
    ``.gguf`` file."""
    from .. import pretrained

    with reported():
        return pretrained.load(spec)


def at_precision(pretrained: Any, precision: str) -> Any:
    """The loaded model converted in place to ``precision`` (float32: as loaded), or one line."""
    if precision == "float32":
        return pretrained
    with reported():
        return pretrained.to_precision(precision)
