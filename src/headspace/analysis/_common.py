"""Shared plumbing of :mod:`headspace.analysis`: running a model on inputs, ragged head axes, JSON."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ..checks import is_int
from ..fileio import write_atomic


@dataclass
class Batch:
    """One forward pass: positional ``args`` for the module and the ``key_padding`` used (or None).

    ``key_padding`` is bool [batch, seq], True for real tokens; ``tokens`` the int64 ids when known.
    """

    args: tuple[Tensor, ...]
    key_padding: Tensor | None
    tokens: Tensor | None

    def run(self, module: nn.Module) -> Tensor:
        if self.key_padding is None:
            return module(*self.args)
        return module(*self.args, key_padding=self.key_padding)

    @property
    def real(self) -> Tensor:
        """bool [batch, seq]: True for real tokens (all True without padding)."""
        if self.key_padding is not None:
            return self.key_padding
        x = self.args[0]
        return torch.ones(x.shape[0], x.shape[1], dtype=torch.bool, device=x.device)


def make_batches(
    model: Any, inputs: Any, key_padding: Tensor | None = None, batch_size: int = 32
) -> list[Batch]:
    """Turn ``inputs`` into forward passes of ``as_module(model)``.

    ``inputs`` may be: a sentence or a list of sentences (needs a pretrained wrapper with
    ``.tokenize(sentences) -> (tokens, key_padding)``; split into batches of ``batch_size``), an int64
    token tensor [batch, seq] (an Encoder/Decoder), a float tensor [batch, seq, d_model] (a bare
    attention layer or block), or a list of such tensors (one pass each). ``key_padding`` (bool
    [batch, seq], True = real) goes with a single tensor.
    """
    if not is_int(batch_size) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int; got {batch_size!r}")
    if isinstance(inputs, str):
        inputs = [inputs]
    if isinstance(inputs, Sequence) and inputs and all(isinstance(s, str) for s in inputs):
        tokenize = getattr(model, "tokenize", None)
        if tokenize is None:
            raise TypeError(
                f"inputs are sentences but the model ({type(model).__name__}) has no .tokenize(); pass token "
                "ids [batch, seq] or a pretrained model such as headspace.load('minilm')"
            )
        if key_padding is not None:
            raise ValueError("key_padding is derived from the sentences; pass it only with a tensor input")
        max_length = getattr(model, "max_length", None)  # truncate as the wrapper's encode() does
        out = []
        for start in range(0, len(inputs), batch_size):
            chunk = list(inputs[start : start + batch_size])
            got = tokenize(chunk, max_length=max_length) if max_length else tokenize(chunk)
            tokens, kp = got if isinstance(got, tuple) else (got, None)  # GPT-2 wrappers return ids only
            out.append(Batch((tokens,), kp, tokens))
        return out
    if isinstance(inputs, Tensor):
        inputs_list = [inputs]
    elif isinstance(inputs, Sequence) and inputs and all(isinstance(t, Tensor) for t in inputs):
        if key_padding is not None:
            raise ValueError("key_padding goes with a single input tensor; got a list of tensors")
        inputs_list = list(inputs)
    else:
        raise TypeError(
            "inputs must be a sentence, a non-empty list of sentences, a tensor (token ids [batch, seq] or "
            f"activations [batch, seq, d_model]) or a list of tensors; got {type(inputs).__name__}"
        )
    out = []
    for x in inputs_list:
        if x.dim() not in (2, 3) or x.numel() == 0:
            raise ValueError(
                "inputs must be token ids [batch, seq] or activations [batch, seq, d_model], non-empty; got "
                f"shape {list(x.shape)}"
            )
        if key_padding is not None:
            if not isinstance(key_padding, Tensor) or key_padding.dtype != torch.bool:
                raise TypeError(f"key_padding must be a bool tensor [batch, seq]; got {key_padding!r}")
            if tuple(key_padding.shape) != tuple(x.shape[:2]):
                raise ValueError(
                    f"key_padding must have shape [batch, seq] = {list(x.shape[:2])}; "
                    f"got {list(key_padding.shape)}"
                )
        tokens = x if not x.is_floating_point() else None
        out.append(Batch((x,), key_padding, tokens))
    return out


@contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """Eval mode and no autograd for the block; each submodule's training flag is restored after."""
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, flag in flags:
            m.training = flag


def pad_heads(rows: Sequence[Tensor]) -> Tensor:
    """Stack per-layer tensors [n_heads_l, ...] into [n_layers, max n_heads, ...], NaN-padded.

    Layers differ in head count only after :func:`headspace.prune_heads`.
    """
    if not rows:
        return torch.empty(0)
    width = max(r.shape[0] for r in rows)
    out = torch.full((len(rows), width, *rows[0].shape[1:]), float("nan"), dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r.detach().cpu()
    return out


def to_plain(value: Any) -> Any:
    """JSON-ready form: tensors -> nested lists (NaN/Inf -> None), dataclasses -> dicts, tuples -> lists."""
    if isinstance(value, Tensor):
        return to_plain(value.detach().cpu().tolist())
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    return value


class JsonResult:
    """Mixin for result dataclasses: ``to_dict()`` (tensors as lists, NaN as None) and ``to_json()``."""

    kind: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        """Every field in plain Python (nested lists for tensors, None for NaN), plus ``"kind"``."""
        return {"kind": self.kind, **to_plain(self)}

    def to_json(self, path: str | os.PathLike[str] | None = None, *, indent: int | None = None) -> str:
        """The JSON text of :meth:`to_dict`; also written atomically to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            write_atomic(path, text, make_parents=True)
        return text
