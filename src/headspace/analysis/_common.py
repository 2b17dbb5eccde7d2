"""Shared plumbing of :mod:`headspace.analysis`: running a model on inputs, ragged head axes, JSON, HTML.

Every result dataclass derives from :class:`JsonResult`: ``to_dict()``, ``to_json()`` and, for notebooks,
``_repr_html_()`` (small, escaped HTML tables built with :mod:`headspace.html`; a result adds its own
layer x head tables through :meth:`JsonResult._html_parts`). :func:`~headspace.html.factored_html` (the
view of a :class:`~headspace.circuits.FactoredMatrix`) and the table helpers are re-exported here.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, overload

import torch
from torch import Tensor, nn

from ..core.checks import is_int
from ..core.fileio import write_atomic
from ..core.html import MAX_HTML_COLS, MAX_HTML_ROWS, _shade, factored_html, format_number, html_table

__all__ = [  # the HTML helpers are headspace.html's, re-exported for the results and the tests
    "MAX_HTML_COLS",
    "MAX_HTML_ROWS",
    "Batch",
    "JsonResult",
    "_shade",
    "eval_mode",
    "factored_html",
    "fields_table",
    "format_number",
    "html_table",
    "layer_head_table",
    "make_batches",
    "pad_heads",
    "to_plain",
]


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


# ------------------------------------------------------------------------------------------------ HTML
# format_number, html_table, factored_html live in headspace.html (a foundation module, so that
# FactoredMatrix can show itself too); they are re-exported here, where the results use them.


def layer_head_table(values: Tensor, caption: str, *, labels: Sequence[Sequence[str]] | None = None) -> str:
    """A layer x head table of ``values`` [n_layers, n_heads] (rows ``L0``.., columns ``H0``..), shaded.

    With ``labels`` (``labels[layer][head]``) a cell reads ``"label value"``.
    """
    v = values.detach().to(torch.float64).cpu()
    if v.dim() == 1:
        v = v[None]  # one layer
    rows = v.tolist()
    cells: list[list[Any]] = []
    for i, row in enumerate(rows):
        if labels is None:
            cells.append(row)
        else:
            names = labels[i] if i < len(labels) else []
            cells.append(
                [
                    f"{names[h]} {format_number(x)}" if h < len(names) else format_number(x)
                    for h, x in enumerate(row)
                ]
            )
    return html_table(
        cells,
        caption=caption,
        row_labels=[f"L{i}" for i in range(v.shape[0])],
        col_labels=[f"H{h}" for h in range(v.shape[1])],
        corner="layer \\ head",
        shade=rows,
    )


def _describe(value: Any) -> str:
    """A field's type and shape for the summary table: ``"tensor float32 [6, 12]"``, ``"list [6]"``."""
    if isinstance(value, Tensor):
        return f"tensor {str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} [{len(value)}]"
    if isinstance(value, dict):
        return f"dict [{len(value)}]"
    return type(value).__name__


def fields_table(result: Any) -> str:
    """Every field of a result dataclass: its name, type and shape, and the value of scalars."""
    rows = []
    for f in dataclasses.fields(result):
        value = getattr(result, f.name)
        scalar = isinstance(value, (int, float, str, bool)) or value is None
        if isinstance(value, Tensor) and value.numel() == 1:
            scalar = True
        rows.append([f.name, _describe(value), format_number(value) if scalar else ""])
    return html_table(rows, caption="fields", col_labels=["field", "type [shape]", "value"])


class JsonResult:
    """Mixin for result dataclasses: ``to_dict()``, ``to_json()`` and a notebook view (``_repr_html_``).

    ``to_dict()`` gives tensors as lists and NaN as None; ``to_json()`` the JSON text, and
    ``to_json(path)`` writes it and returns the path. In a notebook a result shows as small HTML tables:
    :meth:`_html_parts` (a result's own layer x head tables) and the table of its fields.
    """

    kind: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        """Every field in plain Python (nested lists for tensors, None for NaN), plus ``"kind"``."""
        return {"kind": self.kind, **to_plain(self)}

    @overload
    def to_json(self, path: None = None, *, indent: int | None = None) -> str: ...

    @overload
    def to_json(self, path: str | os.PathLike[str], *, indent: int | None = None) -> Path: ...

    def to_json(self, path: str | os.PathLike[str] | None = None, *, indent: int | None = None) -> str | Path:
        """The JSON text of :meth:`to_dict`; with ``path``, written there atomically: the ``Path`` returned.

        (Returning the path, not the text, keeps a notebook cell that saves a result from printing
        kilobytes of JSON; ``json.loads(path.read_text())`` reads it back.)
        """
        text = json.dumps(self.to_dict(), indent=indent)
        if path is None:
            return text
        return write_atomic(path, text, make_parents=True)

    def _html_parts(self) -> list[str]:
        """The result's own HTML tables (a layer x head view); the fields table follows them."""
        return []

    def _repr_html_(self) -> str:
        """Small, escaped HTML for Jupyter: a title, the result's own tables, then its fields."""
        title = html.escape(f"{type(self).__name__} ({self.kind})" if self.kind else type(self).__name__)
        parts = "".join(self._html_parts())
        return f'<div class="headspace-result"><b>{title}</b>{parts}{fields_table(self)}</div>'
