"""Where a Decoder finds its decoding: a registry that :mod:`headspace.decode`, the package above the
model, fills when it is imported.

The model layer never imports the decoding package (it sits above the model: a decoding step reads a
model's description, the model never reads a step's). :meth:`headspace.Decoder.generate` and
:meth:`headspace.Decoder.decode_plan` ask :func:`decoding` for the functions that
:func:`provide_decoding` registered: importing ``headspace.decode`` registers
:func:`headspace.decode.generate` and :func:`headspace.decode.decode_plan`. Where nothing is registered
yet, :func:`decoding` runs the loader the package's face gave (:func:`load_with`: ``headspace/__init__``
gives one that imports ``headspace.decode``), so the first ``generate`` loads it whichever path the
model class was imported by.

This module imports no torch at run time (``import headspace`` imports it, and stays free of torch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import Tensor


class StepPlan(Protocol):
    """A model's cached decoding step ready to run (:class:`headspace.decode.Stepper`)."""

    def logits(self, tokens: Tensor, caches: Sequence[Any]) -> Tensor:
        """Next-token logits [batch, vocab_size] after the new tokens [batch, 1], appended to ``caches``."""
        ...

    def idle(self) -> bool:
        """Whether the step may run now (eval mode, no hook point active)."""
        ...


class Plan(Protocol):
    """:func:`headspace.decode.decode_plan`'s signature: ``(model, pack_rows) -> StepPlan | None``."""

    def __call__(self, model: Any, pack_rows: int | None = None) -> StepPlan | None: ...


@dataclass(frozen=True)
class Decoding:
    """The decoding a Decoder runs: ``generate`` (the sampling loop) and ``plan`` (the cached step)."""

    #: :func:`headspace.decode.generate`: ``(model, tokens, max_new_tokens, **options) -> tokens``
    generate: Callable[..., Tensor]
    plan: Plan


_provided: list[Decoding] = []
_loaders: list[Callable[[], None]] = []


def provide_decoding(provider: Decoding) -> None:
    """Register ``provider`` as the decoding every Decoder runs (the last one registered wins)."""
    if not isinstance(provider, Decoding):
        raise TypeError(f"provide_decoding expects a headspace.model.decoding.Decoding; got {provider!r:.60}")
    _provided[:] = [provider]


def load_with(loader: Callable[[], None]) -> None:
    """Set the function :func:`decoding` calls while nothing is registered (it should register one)."""
    if not callable(loader):
        raise TypeError(f"load_with expects a callable; got {loader!r:.60}")
    _loaders[:] = [loader]


def decoding() -> Decoding:
    """The registered decoding, loaded first where none is (:func:`load_with`); a one-line RuntimeError
    where there is still none."""
    if not _provided and _loaders:
        _loaders[0]()
    if not _provided:
        raise RuntimeError(
            "Decoder.generate and decode_plan need the package headspace.decode, which registers them "
            "when imported; none is registered: import headspace.decode"
        )
    return _provided[0]
