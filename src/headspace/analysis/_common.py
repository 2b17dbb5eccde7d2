"""Shared plumbing of :mod:`headspace.analysis`: running a model on inputs, ragged head axes, JSON, HTML.

Every result dataclass derives from :class:`JsonResult`: ``to_dict()``, ``to_json()`` and, for notebooks,
``_repr_html_()`` (small, escaped HTML tables; a result adds its own layer x head tables through
:meth:`JsonResult._html_parts`). :func:`factored_html` is the same for a
:class:`~headspace.circuits.FactoredMatrix`.
"""

from __future__ import annotations

import dataclasses
import html
import itertools
import json
import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, overload

import torch
from torch import Tensor, nn

from ..checks import is_int
from ..fileio import write_atomic

if TYPE_CHECKING:
    from ..circuits import FactoredMatrix


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
MAX_HTML_ROWS = 64
"""Rows (layers) and columns (heads) an HTML table shows at most; the rest is counted in a note."""
MAX_HTML_COLS = 64


def format_number(value: Any, digits: int = 3) -> str:
    """A short text for one table cell: ints as they are, floats to ``digits`` significant digits.

    NaN (a head a pruned layer lacks) is an em dash; bools, strings and None are their ``str``.
    """
    if isinstance(value, Tensor):
        value = value.item() if value.numel() == 1 else list(value.shape)
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "\u2014"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if value == 0.0:
            return "0"
        text = f"{value:.{digits}g}"
        return text.replace("e-0", "e-").replace("e+0", "e")
    return str(value)


def _shade(value: float, low: float, high: float) -> str:
    """The cell attribute colouring ``value`` on [low, high]: none at ``low``, blue at ``high``."""
    if not math.isfinite(value) or high <= low:
        return ""
    alpha = min(1.0, max(0.0, (value - low) / (high - low)))
    return f' style="background:#4285f4{round(153 * alpha):02x}"'


def html_table(
    cells: Sequence[Sequence[Any]],
    *,
    caption: str = "",
    row_labels: Sequence[str] | None = None,
    col_labels: Sequence[str] | None = None,
    corner: str = "",
    shade: Sequence[Sequence[float]] | None = None,
    shade_range: tuple[float, float] | None = None,
) -> str:
    """One escaped HTML table: ``cells[i][j]`` (numbers are formatted by :func:`format_number`).

    ``shade`` (same shape as ``cells``, floats) colours each cell's background on ``shade_range``
    (default: the finite values' min and max). At most :data:`MAX_HTML_ROWS` rows and
    :data:`MAX_HTML_COLS` columns are shown; a last line says how many were left out.
    """
    n_rows = len(cells)
    n_cols = max((len(r) for r in cells), default=0)
    rows_shown, cols_shown = min(n_rows, MAX_HTML_ROWS), min(n_cols, MAX_HTML_COLS)
    lo, hi = 0.0, 0.0
    if shade is not None:
        finite = [float(v) for r in shade for v in r if v is not None and math.isfinite(float(v))]
        lo, hi = (
            shade_range if shade_range is not None else (min(finite, default=0.0), max(finite, default=0.0))
        )
    e = html.escape
    out = ['<table class="headspace" style="border-collapse:collapse;font-size:12px;text-align:right">']
    if caption:
        out.append(f'<caption style="text-align:left">{e(caption)}</caption>')
    if col_labels is not None:
        corner_cell = [f"<th>{e(corner)}</th>"] if row_labels is not None else []
        heads = [f'<th scope="col">{e(str(c))}</th>' for c in list(col_labels)[:cols_shown]]
        out.append("<thead><tr>" + "".join(corner_cell + heads) + "</tr></thead>")
    out.append("<tbody>")
    for i in range(rows_shown):
        row = [] if row_labels is None else [f'<th scope="row">{e(str(row_labels[i]))}</th>']
        for j in range(cols_shown):
            value = cells[i][j] if j < len(cells[i]) else ""
            style = ""
            if shade is not None and j < len(shade[i]) and shade[i][j] is not None:
                style = _shade(float(shade[i][j]), lo, hi)
            row.append(f"<td{style}>{e(format_number(value))}</td>")
        out.append("<tr>" + "".join(row) + "</tr>")
    out.append("</tbody></table>")
    if rows_shown < n_rows or cols_shown < n_cols:
        out.append(
            f"<p><small>showing {rows_shown} of {n_rows} rows and {cols_shown} of {n_cols} columns"
            "</small></p>"
        )
    return "".join(out)


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


def factored_html(fm: FactoredMatrix, *, max_values: int = 8, max_rows: int = 16) -> str:
    """HTML for a :class:`~headspace.circuits.FactoredMatrix`: its shapes, rank bound and spectrum.

    The shape of ``A @ B`` and of the factors; for each matrix (one per leading index, e.g. per head, at
    most ``max_rows``) its Frobenius norm and top ``max_values`` singular values, computed through the
    factors. Non-finite factors are reported, not raised.
    """
    shape, a, b = list(fm.shape), list(fm.A.shape), list(fm.B.shape)
    title = f"FactoredMatrix {shape} = A {a} @ B {b} (rank <= {fm.inner_dim})"
    e = html.escape
    try:
        s = fm.singular_values.detach().to(torch.float64).cpu()  # (..., k)
    except ValueError as err:  # NaN/Inf in a factor
        return f"<div><b>{e(title)}</b><p>{e(str(err))}</p></div>"
    s = s.reshape(-1, s.shape[-1])  # (n, k): one row per matrix
    k = min(max_values, s.shape[-1])
    norms = s.pow(2).sum(-1).sqrt()  # (n,)
    batch = shape[:-2]
    if batch:  # one row per matrix: [0], [1], ... (or [0, 0], [0, 1], ... for several batch axes)
        row_labels = ["[" + ", ".join(map(str, i)) + "]" for i in itertools.product(*map(range, batch))]
    else:
        row_labels = ["M"]
    n = min(max_rows, s.shape[0])
    cells = [[float(norms[i]), *[float(x) for x in s[i, :k]]] for i in range(n)]
    table = html_table(
        cells,
        caption=f"Frobenius norm and the top {k} singular values"
        + (f" (first {n} of {s.shape[0]})" if n < s.shape[0] else ""),
        row_labels=row_labels[:n],
        col_labels=["|M|_F", *[f"s{j + 1}" for j in range(k)]],
        corner="matrix",
    )
    return f"<div><b>{e(title)}</b>{table}</div>"


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
