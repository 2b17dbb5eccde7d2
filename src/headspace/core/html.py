"""Small, escaped HTML tables for notebooks: :func:`html_table`, :func:`format_number`, :func:`factored_html`.

A foundation module (the standard library and torch only), so that low layers can show themselves in
Jupyter: :class:`~headspace.circuits.FactoredMatrix` has ``_repr_html_() = factored_html(self)``, and the
analysis results (:mod:`headspace.analysis`) build their layer x head tables from :func:`html_table`.

Everything a caller passes is text to escape (``html.escape``), never markup; a table shows at most
:data:`MAX_HTML_ROWS` x :data:`MAX_HTML_COLS` cells and says how many it left out. Nothing global
(no ``<script>``, no ``<style>`` element) goes into a cell's output.
"""

from __future__ import annotations

import html
import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["MAX_HTML_COLS", "MAX_HTML_ROWS", "factored_html", "format_number", "html_table"]

MAX_HTML_ROWS = 64
"""Rows (layers) and columns (heads) an HTML table shows at most; the rest is counted in a note."""
MAX_HTML_COLS = 64


def format_number(value: Any, digits: int = 3) -> str:
    """A short text for one table cell: ints as they are, floats to ``digits`` significant digits.

    NaN (a head a pruned layer lacks) is an em dash; bools, strings and None are their ``str``; a
    tensor of one element is its value, a larger one its shape.
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


def factored_html(fm: Any, *, max_values: int = 8, max_rows: int = 16) -> str:
    """HTML for a :class:`~headspace.circuits.FactoredMatrix`: its shapes, rank bound and spectrum.

    The shape of ``A @ B`` and of the factors; for each matrix (one per leading index, e.g. per head, at
    most ``max_rows``) its Frobenius norm and top ``max_values`` singular values, computed through the
    factors. Non-finite factors are reported, not raised.

    ``fm`` is anything with FactoredMatrix's ``shape``, ``A``, ``B``, ``inner_dim`` and
    ``singular_values`` (this module sits below :mod:`headspace.circuits` and does not import it).
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
