"""The decoding backends: one registry, one signature (as Hugging Face's attention registry).

A backend is a function ``prepare(step) -> run | None`` of a :class:`~headspace.decode.step.DecodeStep`;
``run(x, caches, start, cos, sin) -> rows`` runs every block and the final norm on the new position
``start``'s rows x [batch, d_model], writing the new keys and values into ``caches`` (one
:class:`~headspace.nn.kv_cache.KVCache` per block) at ``start``; ``cos``/``sin`` [1, 1, rotary_dim]
are the new position's rotation tables (None without rotary). ``prepare`` returns None where it cannot
run that step (here: ``"native"`` without the built library or a native form).

* ``"python"``: :func:`headspace.decode.python.prepare`, any step;
* ``"native"``: :func:`headspace.decode.native.prepare`, the same roundings in one C++ call.

:class:`Stepper` is what :func:`headspace.decode.generate` runs at each new token: a step, a backend
chosen by name (None: ``"native"`` once its library is loaded, ``"python"`` meanwhile and wherever the
native one cannot run), the tables, the caches' lengths and the unembedding around it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..kernels import native as library
from ..nn.kv_cache import KVCache
from ..nn.positions import rotary_tables
from . import native, python
from .python import linear_fn
from .step import DecoderModel, DecodeStep, describe

StepFn = Callable[[Tensor, Sequence[KVCache], int, "Tensor | None", "Tensor | None"], Tensor]
Prepare = Callable[[DecodeStep], "StepFn | None"]

_BACKENDS: dict[str, Prepare] = {"python": python.prepare, "native": native.prepare}


def register_backend(name: str, prepare: Prepare) -> None:
    """Add (or replace) the backend ``name``: ``prepare(step) -> run | None`` (see the module docstring)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"a backend's name must be a non-empty str; got {name!r}")
    if not callable(prepare):
        raise TypeError(f"backend {name!r}: prepare must be callable; got {type(prepare).__name__}")
    _BACKENDS[name] = prepare


def backend_names() -> tuple[str, ...]:
    """The registered backends' names."""
    return tuple(_BACKENDS)


def get_backend(name: str) -> Prepare:
    """The backend ``name``'s ``prepare``; a ValueError naming the registered ones otherwise."""
    if name not in _BACKENDS:
        raise ValueError(f"backend must be one of {list(_BACKENDS)} (or None: choose); got {name!r}")
    return _BACKENDS[name]


class Stepper:
    """A :class:`~headspace.decode.step.DecodeStep` run by a backend, one new token at a time.

    ``backend`` names one (:func:`get_backend`); where it cannot run the step, or for None before the
    native library is loaded, the step runs in ``"python"``. :attr:`backend_used` says which ran last.
    """

    def __init__(self, step: DecodeStep, backend: str | None = None) -> None:
        if backend is not None:
            get_backend(backend)  # checks the name
        self.step = step
        self.backend = backend
        self._runs: dict[str, StepFn | None] = {}
        self.unembed = linear_fn(step.unembed)
        #: the backend the last step ran on
        self.backend_used: str | None = None

    def _run(self) -> StepFn:
        name = self.backend
        if name is None:
            name = "native" if self._runs.get("native", True) is not None and library.ready() else "python"
        if name not in self._runs:
            try:
                self._runs[name] = get_backend(name)(self.step)
            except ValueError:  # a field the chosen backend refuses by name (ALiBi: native)
                if self.backend is not None:
                    raise
                self._runs[name] = None  # chosen by default: the Python step runs it
        run = self._runs[name]
        if run is None:
            name, run = "python", self._runs.get("python") or python.prepare(self.step)
            self._runs["python"] = run
        self.backend_used = name
        return run

    def rows(self, x: Tensor, caches: Sequence[KVCache], start: int) -> Tensor:
        """Every block and the final norm on the new position ``start``'s rows x [batch, d_model] ->
        [batch, d_model]; the caches (each holding ``start`` positions) then hold ``start + 1``."""
        cos = sin = None
        rotary = self.step.rotary
        if rotary is not None:
            positions = torch.arange(start, start + 1, device=x.device)  # (1,)
            cos, sin = rotary_tables(rotary, positions, x.dtype, x.device)  # (1, 1, 1, rotary_dim) x 2
            cos, sin = cos.squeeze(2), sin.squeeze(2)  # (1, 1, rotary_dim): over (batch, heads, d_head)
        h = self._run()(x, caches, start, cos, sin)  # (batch, d_model)
        for cache in caches:
            cache.length = start + 1
        return h

    def idle(self) -> bool:
        """:meth:`DecodeStep.idle`: whether the step may run now (eval mode, no hook active)."""
        return self.step.idle()

    def logits(self, tokens: Tensor, caches: Sequence[KVCache]) -> Tensor:
        """Next-token logits [batch, vocab_size] (float32) after the new tokens [batch, 1], appended to
        ``caches``: ``forward(tokens, kv_caches=caches)[:, -1]``, bit for bit (to float32 rounding
        with packed weights or a ``"q8_0"`` unembedding), final-logit soft-capping included."""
        start = caches[0].length
        x = self.step.embed(tokens, start=start)  # (batch, 1, d_model)
        h = self.rows(x.view(x.shape[0], x.shape[2]), caches, start)  # (batch, d_model)
        logits = self.unembed(h)  # (batch, vocab_size)
        cap = self.step.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap  # Gemma 2's final-logit soft-capping, as forward
        return logits if logits.dtype == torch.float32 else logits.float()


def decode_plan(model: DecoderModel, pack_rows: int | None = None) -> Stepper | None:
    """``model``'s cached decoding step (:func:`~headspace.decode.step.describe`) ready to run, or None
    where one-token steps must take ``forward`` (training mode, a block without its decoding step, an
    active hook point): :meth:`headspace.Decoder.decode_plan`. ``pack_rows`` packs the float32 products
    for that batch."""
    step = describe(model, pack_rows)
    if step is None or not step.idle():
        return None
    return Stepper(step)
