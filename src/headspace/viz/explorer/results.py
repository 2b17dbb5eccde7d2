"""Saved causal results on the explorer page: patching effects and logit attributions as heatmaps.

The page's fifth view draws results of :mod:`headspace.analysis.patching` and
:mod:`headspace.analysis.attribution`, given as the objects, as their ``to_dict()``, or as the JSON
files ``to_json(path)``, ``headspace patch --json`` and ``headspace attribute --json`` write::

    Explorer(model, sentence, results=[patch_result, "dla.json"])
    headspace view --model smollm2 --result saved.json -o page.html

Each result becomes one or more *views*, one heatmap each, with everything the page needs as plain
JSON (no tensors, numbers exactly as saved, ``null`` for a cell with no value)::

    name, title, kind          the selector's label, a sentence on what is shown, the result's kind
    rows, cols                 labels: "L0".., "H0".., "L3 H5" (one row per head), tokens (positions)
    row_axis, col_axis         "layer", "head", "layer, head", "position", "part", "read"
    values                     [len(rows)][len(cols)] numbers or null
    scale, unit                "diverging" (centred on 0) or "sequential" (0..1); the colour bar's label
    link                       what a click on a cell selects in the other views: "layer_head" (rows are
                               layers, columns heads), "layer_head_rows" (row = layer * n_heads + head),
                               "layer", "lens" (row 0 = embeddings, row l = after layer l - 1) or null
    n_layers, n_heads          the model's shape the result was computed on (checked against the page's)
    facts, top                 [label, text] pairs (metrics, the parts that add up) and the largest cells
    notes                      [rows][cols] hover text or null; prompt: the clean prompt when known

Kinds read: ``"patching"`` (:class:`~headspace.analysis.patching.PatchResult`, any site: heads
[layer, head], heads_pos [layer, head, position], resid [layer, position], mlp [layer]; activation or
attribution patching), ``"direct_logit_attribution"`` (:class:`~headspace.analysis.attribution.
LogitAttribution`: heads, then the MLP (and b_O) of each layer, the same units) and ``"logit_lens"``
(:class:`~headspace.analysis.attribution.LogitLens`: p(answer) and the top token's p per layer).
A file is untrusted input: a regular file of at most :data:`MAX_RESULT_BYTES`, JSON, of a known kind,
with arrays of the documented ranks and finite numbers; anything else is a ``ValueError`` naming the
file and the problem.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...analysis.causal.patching import EFFECT_KEYS, SITES
from ...core.fileio import UnsafeFileError, parse_json, read_regular_file
from .circuit_view import circuit_views

#: The largest result file read (a heads_pos sweep of a 30-layer model on 512 tokens is ~3 MB of JSON).
MAX_RESULT_BYTES = 64 * 1024 * 1024
#: Cells one view may hold, and views one page may hold.
MAX_CELLS = 1_000_000
MAX_VIEWS = 64
#: Entries of a view's "top" list.
TOP = 10

__all__ = [
    "MAX_RESULT_BYTES",
    "ResultView",
    "check_views_fit",
    "load_results",
    "prompt_of",
    "result_views",
    "views_of",
]


class ResultView(dict):
    """One heatmap of a saved result, ready for the page (the keys of the module docstring).

    :func:`load_results` and :func:`result_views` return these; passing them on (``Explorer(...,
    results=views)``) uses them as they are, so a file read early (to fail fast) is not read again.
    """


class _Bad(ValueError):
    """A malformed result; the message says which field and what is wrong (the file is added later)."""


# ---------------------------------------------------------------------------------------------- arrays
def _number(x: Any, what: str) -> float | None:
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise _Bad(f"{what} must hold numbers (or null); found {type(x).__name__} {x!r:.40}")
    x = float(x)
    if not math.isfinite(x):
        raise _Bad(f"{what} must hold finite numbers (or null); found {x}")
    return x


def _array(value: Any, rank: int, what: str) -> tuple[list[Any], tuple[int, ...]]:
    """A rectangular nested list of ``rank`` levels of numbers/null, as floats/None, and its shape."""
    if rank == 0:
        return _number(value, what), ()  # type: ignore[return-value]

    def nested(v: Any, depth: int) -> tuple[Any, tuple[int, ...]]:
        if depth == rank:
            if isinstance(v, list):
                raise _Bad(f"{what} must be a {rank}-d array; it nests deeper")
            return _number(v, what), ()
        if not isinstance(v, list) or not v:
            got = "an empty list" if isinstance(v, list) else f"{type(v).__name__} {v!r:.20}"
            where = "" if depth == 0 else f" (at depth {depth})"
            raise _Bad(
                f"{what} must be a {rank}-d array (non-empty nested lists of numbers); got {got}{where}"
            )
        items = [nested(x, depth + 1) for x in v]
        shapes = {s for _, s in items}
        if len(shapes) != 1:
            raise _Bad(f"{what} is ragged: its rows have shapes {sorted(shapes)[:4]}")
        return [x for x, _ in items], (len(items), *shapes.pop())

    values, shape = nested(value, 0)
    if math.prod(shape) > MAX_CELLS:
        raise _Bad(f"{what} has {math.prod(shape)} values, more than the {MAX_CELLS} a page draws")
    return values, shape


def _scalar(d: dict[str, Any], key: str, what: str, default: Any = ...) -> float | None:
    if key not in d:
        if default is ...:
            raise _Bad(f"{what} has no {key!r}")
        return default
    value = d[key]
    if isinstance(value, list) and len(value) == 1:  # a 0-d tensor saved by an older to_dict
        value = value[0]
    return _number(value, f"{what} {key!r}")


def _text(d: dict[str, Any], key: str, default: str = "") -> str:
    value = d.get(key, default)
    if value is None:
        return default
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise _Bad(f"{key!r} must be text; got {type(value).__name__}")
    return str(value)[:500]


def _tokens(d: dict[str, Any], n: int | None) -> list[str] | None:
    tokens = d.get("tokens")
    if tokens is None:
        return None
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise _Bad("'tokens' must be a list of strings")
    if n is not None and len(tokens) != n:
        raise _Bad(f"'tokens' has {len(tokens)} entries but the effect has {n} positions")
    return [t[:200] for t in tokens]


def _fmt(x: float | None) -> str:
    return "none" if x is None else f"{x:+.4g}"


def _top(values: list[list[float | None]], label: Any, k: int = TOP) -> list[list[Any]]:
    cells = [(abs(v), r, c, v) for r, row in enumerate(values) for c, v in enumerate(row) if v is not None]
    cells.sort(key=lambda t: (-t[0], t[1], t[2]))
    return [[label(r, c), v] for _, r, c, v in cells[:k]]


# ---------------------------------------------------------------------------------------------- patching
def _patching_views(d: dict[str, Any]) -> list[dict[str, Any]]:
    site = d.get("site")
    if site not in SITES:
        raise _Bad(f"'site' must be one of {list(SITES)}; got {site!r:.40}")
    axes = tuple(d.get("axes", SITES[site]) or ())
    if axes != SITES[site]:
        raise _Bad(f"'axes' of site {site!r} must be {list(SITES[site])}; got {list(axes)[:4]}")
    key = "effect" if "effect" in d else EFFECT_KEYS[site]
    if key not in d:
        raise _Bad(f"a patching result needs 'effect' (or {EFFECT_KEYS[site]!r})")
    effect, shape = _array(d[key], len(axes), f"{key!r}")
    method = _text(d, "method", "activation")
    if method not in ("activation", "attribution"):
        raise _Bad(f"'method' must be 'activation' or 'attribution'; got {method!r}")
    clean = _scalar(d, "clean_metric", "a patching result")
    corrupt = _scalar(d, "corrupt_metric", "a patching result")
    metric = _text(d, "metric_name") or _text(d, "metric") or "the metric"
    first = d.get("first_difference")
    positions = shape[-1] if "position" in axes else None
    tokens = _tokens(d, positions)
    n_layers = shape[0]
    layers = [f"L{i}" for i in range(n_layers)]
    pos_cols = list(tokens) if tokens is not None else [str(i) for i in range(positions or 0)]
    n_heads: int | None = None
    if site == "heads":
        n_heads = shape[1]
        rows, cols, values = layers, [f"H{h}" for h in range(n_heads)], effect
        row_axis, col_axis, link = "layer", "head", "layer_head"
    elif site == "heads_pos":
        n_heads = shape[1]
        rows = [f"L{layer} H{h}" for layer in range(n_layers) for h in range(n_heads)]
        values = [effect[layer][h] for layer in range(n_layers) for h in range(n_heads)]
        cols, row_axis, col_axis, link = pos_cols, "layer, head", "position", "layer_head_rows"
    elif site == "resid":
        rows, cols, values = layers, pos_cols, effect
        row_axis, col_axis, link = "layer", "position", "layer"
    else:  # mlp
        rows, cols, values = layers, ["MLP"], [[v] for v in effect]
        row_axis, col_axis, link = "layer", "part", "layer"
    what = "activation patching" if method == "activation" else "attribution patching (first-order estimate)"
    site_words = {
        "heads": "each head's z (all positions)",
        "heads_pos": "each head's z at each position",
        "resid": "the residual stream entering each layer, at each position",
        "mlp": "each MLP's output (all positions)",
    }[site]
    prompt = "".join(tokens) if tokens else None
    facts = [
        ["method", what],
        ["patched", site_words],
        ["metric", metric],
        ["clean metric", _fmt(clean)],
        ["corrupt metric", _fmt(corrupt)],
        ["effect", "(patched - corrupt) / (clean - corrupt): 1 = the clean behaviour restored, 0 = none"],
    ]
    if isinstance(first, int) and not isinstance(first, bool) and tokens and 0 <= first < len(tokens):
        facts.append(["first difference", f"position {first} {tokens[first]!r}"])
    if prompt:
        facts.append(["clean prompt", prompt])

    def label(r: int, c: int) -> str:
        if col_axis == "position":
            return f"{rows[r]}, position {c}" + ("" if tokens is None else f" {cols[c]!r}")
        return f"{rows[r]} {cols[c]}" if col_axis == "head" else rows[r]

    return [
        {
            "kind": "patching",
            "name": f"{'patching' if method == 'activation' else 'attribution patching'}: {site}",
            "title": f"{what} of {site_words}; metric {metric}, clean {_fmt(clean)}, corrupt {_fmt(corrupt)}",
            "rows": rows, "cols": cols, "row_axis": row_axis, "col_axis": col_axis, "values": values,
            "scale": "diverging",
            "unit": "normalised effect" + (" (estimated)" if method == "attribution" else ""),
            "link": link, "n_layers": n_layers, "n_heads": n_heads, "facts": facts,
            "top": _top(values, label), "notes": None, "prompt": prompt,
        }
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------- attribution
def _dla_views(d: dict[str, Any]) -> list[dict[str, Any]]:
    cli = "head_attribution" in d  # `headspace attribute --json`
    heads, (n_layers, n_heads) = _array(d["head_attribution" if cli else "heads"], 2, "'heads'")
    mlps, (n_mlp,) = _array(d["mlp_attribution" if cli else "mlps"], 1, "'mlps'")
    bias_key = "attention_bias_attribution" if cli else "attn_biases"
    biases: list[Any] = [0.0] * n_layers
    if d.get(bias_key) is not None:
        biases, _ = _array(d[bias_key], 1, "'attn_biases'")
    if n_mlp != n_layers or len(biases) != n_layers:
        raise _Bad(f"'heads' has {n_layers} layers but 'mlps' {n_mlp} and 'attn_biases' {len(biases)}")
    what = "a direct logit attribution"
    embed = _scalar(d, "embed", what)
    norm_bias = _scalar(d, "norm_bias_attribution" if cli else "norm_bias", what, 0.0)
    total = _scalar(d, "total", what)
    logit = _scalar(d, "logit", what)
    answer = _text(d, "answer" if cli else "answer_token") or _text(d, "answer")
    other = _text(d, "other" if cli else "other_token")
    quantity = f"logit({answer!r})" + (f" - logit({other!r})" if other else "")
    has_bias = any(b not in (None, 0.0) for b in biases)
    cols = [f"H{h}" for h in range(n_heads)] + ["MLP"] + (["b_O"] if has_bias else [])
    values = [
        [*heads[i], mlps[i], *([biases[i]] if has_bias else [])] for i in range(n_layers)
    ]  # (layers, heads + 1 (+ 1))
    head_sum = sum(v for row in heads for v in row if v is not None)
    mlp_sum = sum(v for v in mlps if v is not None)
    bias_sum = sum(v for v in biases if v is not None)
    facts = [
        ["quantity", quantity],
        ["the model's value", _fmt(logit)],
        ["sum of the parts", f"{_fmt(total)} = embeddings + heads + MLPs + biases (the parts add up)"],
        ["embeddings", _fmt(embed)],
        ["all heads", _fmt(head_sum)],
        ["all MLPs", _fmt(mlp_sum)],
        ["biases (b_O, final norm)", _fmt(bias_sum + (norm_bias or 0.0))],
    ]
    prompt = _text(d, "prompt") or None
    if prompt:
        facts.insert(0, ["prompt", prompt])
    views = [
        {
            "kind": "direct_logit_attribution",
            "name": f"direct attribution: {quantity}",
            "title": f"each head's and MLP's direct contribution to {quantity} at the last position "
            "(the final norm's scale frozen: the parts add up to the logit)",
            "rows": [f"L{i}" for i in range(n_layers)], "cols": cols, "row_axis": "layer", "col_axis": "part",
            "values": values, "scale": "diverging", "unit": "direct contribution to " + quantity,
            "link": "layer_head", "n_layers": n_layers, "n_heads": n_heads, "facts": facts,
            "top": _top(values, lambda r, c: f"L{r} {cols[c]}"), "notes": None, "prompt": prompt,
        }
    ]  # fmt: skip
    if cli and isinstance(d.get("logit_lens"), list) and d["logit_lens"]:
        views += _lens_view(
            {
                "answer_token": d.get("answer"),
                "answer_prob": [[row.get("answer_prob") for row in d["logit_lens"]]],
                # the command counts ranks from 1, LogitLens (and the page) from 0
                "answer_rank": [[_from_one(row.get("answer_rank")) for row in d["logit_lens"]]],
                "top_probs": [[row.get("top_probs") for row in d["logit_lens"]]],
                "top_tokens": [[row.get("top_tokens") for row in d["logit_lens"]]],
                "prompt": prompt,
            }
        )
    return views


def _from_one(rank: Any) -> Any:
    """A rank of ``headspace attribute --json`` (1 = the top token) in LogitLens's count (0 = the top)."""
    return rank - 1 if isinstance(rank, int) and not isinstance(rank, bool) else rank


def _lens_view(d: dict[str, Any]) -> list[dict[str, Any]]:
    top_probs, (_, n_rows, _k) = _array(d.get("top_probs"), 3, "'top_probs'")
    top_tokens = d.get("top_tokens")
    ok = (
        isinstance(top_tokens, list) and top_tokens and isinstance(top_tokens[0], list)
        and len(top_tokens[0]) == n_rows
        and all(isinstance(r, list) and all(isinstance(t, str) for t in r) for r in top_tokens[0])
    )  # fmt: skip
    if not ok:
        raise _Bad("'top_tokens' must be [prompts][rows][k] strings, as many rows as 'top_probs'")
    tokens = top_tokens[0]
    prob = rank = None
    if d.get("answer_prob") is not None:
        prob, shape = _array(d["answer_prob"], 2, "'answer_prob'")
        rank, _ = _array(d.get("answer_rank"), 2, "'answer_rank'")
        if shape[1] != n_rows:
            raise _Bad(f"'answer_prob' has {shape[1]} rows but 'top_probs' {n_rows}")
        prob, rank = prob[0], rank[0]
    answer = _text(d, "answer_token")
    rows = ["embed"] + [f"after L{i}" for i in range(n_rows - 1)]
    cols = (["p(answer)"] if prob is not None else []) + ["p(top token)"]
    values, notes = [], []
    for r in range(n_rows):
        pairs = zip(tokens[r][:3], top_probs[0][r][:3])
        shown = ", ".join(f"{t!r} {p:.3f}" for t, p in pairs if p is not None)
        row = ([prob[r]] if prob is not None else []) + [top_probs[0][r][0]]
        values.append(row)
        note = f"top: {shown}"
        if rank is not None and rank[r] is not None:
            note = f"{answer!r} rank {int(rank[r])}; " + note
        notes.append([note] * len(row))
    facts = [
        ["what", "each layer's residual stream at the last position read through the final norm and W_U"],
        ["answer", repr(answer) if answer else "none given"],
        ["rows", f"{n_rows}: the embeddings, then after each of {n_rows - 1} layers (the last = the model)"],
    ]
    prompt = _text(d, "prompt") or None
    return [
        {
            "kind": "logit_lens", "name": "logit lens",
            "title": "the logit lens: the probability of the answer (and of the top token) layer by layer",
            "rows": rows, "cols": cols, "row_axis": "read", "col_axis": "probability", "values": values,
            "scale": "sequential", "unit": "probability", "link": "lens", "n_layers": n_rows - 1,
            "n_heads": None, "facts": facts,
            "top": _top(values, lambda r, c: f"{rows[r]} {cols[c]}"),
            "notes": notes, "prompt": prompt,
        }
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------- entry points
def views_of(d: Any) -> list[dict[str, Any]]:
    """The views of one result given as a dict (``to_dict()`` or a command's ``--json``)."""
    if not isinstance(d, dict):
        raise _Bad(f"a result must be a JSON object; got {type(d).__name__}")
    kind = d.get("kind")
    try:
        if kind == "patching" or (kind is None and "site" in d):
            return [ResultView(v) for v in _patching_views(d)]
        if kind == "direct_logit_attribution" or (kind is None and "head_attribution" in d):
            return [ResultView(v) for v in _dla_views(d)]
        if kind == "logit_lens":
            return [ResultView(v) for v in _lens_view(d)]
        if kind == "circuit_summary":
            return [ResultView(v) for v in circuit_views(d, _array, _scalar, _text, _Bad)]
    except KeyError as e:
        raise _Bad(f"a {kind or 'result'} needs the field {e.args[0]!r}") from None
    known = "'patching', 'direct_logit_attribution', 'logit_lens', 'circuit_summary'"
    raise _Bad(
        f"unknown result kind {kind!r:.60}: the explorer shows {known} (PatchResult, LogitAttribution, "
        "LogitLens: their to_json(), or headspace patch/attribute --json)"
    )


def load_results(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The views of a saved result file (one result object, or a list of them).

    Raises ``ValueError`` naming the file: not a regular file or larger than :data:`MAX_RESULT_BYTES`,
    not UTF-8 JSON, or not a result the page can show; ``FileNotFoundError`` when it does not exist.
    """
    path = Path(path)
    try:
        data = parse_json(read_regular_file(path, max_bytes=MAX_RESULT_BYTES))
    except UnsafeFileError as e:
        mb = MAX_RESULT_BYTES // (1024 * 1024)
        raise ValueError(f"{e} (a result file is a regular file of at most {mb} MB)") from None
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such result file") from None
    except IsADirectoryError:  # pragma: no cover - read_regular_file refuses folders first
        raise ValueError(f"{path}: a folder, not a result file") from None
    except ValueError as e:
        raise ValueError(f"{path}: not a JSON result file ({e})") from None
    items = data if isinstance(data, list) else [data]
    if not items:
        raise ValueError(f"{path}: an empty list, no result in it")
    views = []
    for i, item in enumerate(items):
        try:
            views += views_of(item)
        except _Bad as e:
            where = f" (result {i})" if isinstance(data, list) else ""
            raise ValueError(f"{path}{where}: {e}") from None
    _check_count(views)
    return views


def result_views(results: Any) -> list[dict[str, Any]]:
    """The views of ``results``: one result or a list of results, each a result object (with
    ``to_dict()``), its dict, the path of its JSON file, or a :class:`ResultView` already made."""
    if results is None:
        return []
    if isinstance(results, (str, os.PathLike, dict)) or hasattr(results, "to_dict"):
        results = [results]  # one result (a ResultView is a dict too)
    if not isinstance(results, Sequence):
        raise TypeError(
            "results must be a result (PatchResult, LogitAttribution, LogitLens), its to_dict(), the path of "
            f"its JSON, or a list of those; got {type(results).__name__}"
        )
    views: list[dict[str, Any]] = []
    for i, r in enumerate(results):
        if isinstance(r, ResultView):  # already read (load_results)
            views.append(r)
            continue
        if isinstance(r, (str, os.PathLike)):
            views += load_results(r)
            continue
        name = type(r).__name__
        d = r.to_dict() if hasattr(r, "to_dict") and not isinstance(r, dict) else r
        if not isinstance(d, dict):
            raise TypeError(f"results[{i}] must be a result object, a dict or a path; got {type(r).__name__}")
        try:
            views += views_of(d)
        except _Bad as e:
            raise ValueError(f"results[{i}] ({name}): {e}") from None
    _check_count(views)
    return views


def _check_count(views: list[dict[str, Any]]) -> None:
    if len(views) > MAX_VIEWS:
        raise ValueError(f"{len(views)} result views; a page shows at most {MAX_VIEWS}")


def check_views_fit(views: Sequence[dict[str, Any]], n_layers: int, n_heads: int) -> None:
    """Refuse a result computed on another model shape than the page's (``ValueError`` naming both)."""
    for v in views:
        layers, heads = v["n_layers"], v["n_heads"]
        if layers != n_layers or (heads is not None and heads != n_heads):
            theirs = f"{layers} layers" + ("" if heads is None else f" x {heads} heads")
            raise ValueError(
                f"the result {v['name']!r} is of a model with {theirs}, but the page shows {n_layers} "
                f"layers x {n_heads} heads: show it with the model it was computed on (--model)"
            )


def prompt_of(views: Sequence[dict[str, Any]]) -> str | None:
    """The clean prompt of the first view that knows it (the page can open on it), else None."""
    for v in views:
        if v.get("prompt"):
            return str(v["prompt"])
    return None
