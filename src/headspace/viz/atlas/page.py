"""The atlas page: a layer x head grid coloured by a chosen statistic; click a head for its numbers.

``render_atlas_page(d)`` fills the packaged ``assets/template.html`` with ``atlas.css``, ``atlas.js`` and
the page data of :func:`atlas_page_data` (from ``Atlas.to_dict()`` / ``atlas.json``), following the
explorer's rules (:mod:`headspace.viz.explorer.page`): everything inline, a Content-Security-Policy that
forbids every request, the data as JSON in a ``<script type="application/json">`` element with ``<``
escaped (no token can end the element), and the script puts every text in with ``textContent``.
"""

from __future__ import annotations

import html
import math
import os
import re
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from ...core.fileio import write_atomic
from ..explorer.page import _json_for_script

STAT_NAMES = (
    "previous", "first", "sink", "self", "entropy", "duplicate", "induction", "induction_repeated", "copying",
    "direct_effect", "ablation",
)  # fmt: skip
"""The statistics the grid can be coloured by (those present in the atlas)."""

SIGNED = ("copying", "direct_effect", "ablation")
"""Statistics drawn on a diverging scale (red positive, blue negative)."""

RELATION_THRESHOLDS = {
    "previous": 0.4,
    "induction": 0.3,
    "duplicate": 0.3,
    "first": 0.6,
    "self": 0.4,
    "copying": 1.0,
}
"""Where the numbers say a relation: mean mass (or, for ``copying``, mean logit change) at least this."""

_PLACEHOLDERS = re.compile(r"/\*__CSS__\*/|/\*__JS__\*/|__DATA__|__TITLE__")


@cache
def _asset(name: str) -> str:
    return resources.files(__package__).joinpath("assets", name).read_text(encoding="utf-8")


def _value(d: dict[str, Any], name: str, layer: int, head: int) -> float | None:
    v = d.get(name, [[None]])[layer][head] if name in d else None
    return None if v is None or not math.isfinite(v) else float(v)


def relations(d: dict[str, Any], layer: int, head: int) -> list[str]:
    """The head's relations in words, where its numbers pass :data:`RELATION_THRESHOLDS`.

    "previous-token" (mass on the previous token), "induction" (on the token after an earlier
    occurrence of the current one, on the corpus), "duplicate-token" (on earlier occurrences), "attention
    sink" (on the first token), "current token" (on itself), "copies the attended token" / "suppresses
    it" (its direct effect on the logit of the token it attends to, in logits, above +1 / below -1).
    """
    t = RELATION_THRESHOLDS
    words = []
    named = (
        ("previous", "previous-token"), ("induction", "induction"), ("duplicate", "duplicate-token"),
        ("first", "attention sink"), ("self", "current token"),
    )  # fmt: skip
    for name, word in named:
        v = _value(d, name, layer, head)
        if v is not None and v >= t[name]:
            words.append(f"{word} ({name} {v:.2f})")
    c = _value(d, "copying", layer, head)
    if c is not None and c >= t["copying"]:
        words.append(f"copies the attended token (copying {c:+.2f} logits)")
    elif c is not None and c <= -t["copying"]:
        words.append(f"suppresses it: lowers the attended token's logit (copying {c:+.2f} logits)")
    return words


def atlas_page_data(d: dict[str, Any]) -> dict[str, Any]:
    """The page's data from an ``atlas.json`` dict: statistics, relations, examples, labels."""
    if not isinstance(d, dict) or d.get("kind") != "head_atlas" or "n_heads" not in d:
        raise TypeError("expected the dict of Atlas.to_dict() (atlas.json, kind 'head_atlas')")
    n_heads = [int(n) for n in d["n_heads"]]
    names = [n for n in STAT_NAMES if n in d and any(v is not None for row in d[n] for v in row)]
    return {
        "stat_names": names, "default_stat": "previous" if "previous" in names else names[0],
        "signed": [n for n in SIGNED if n in names], "n_heads": n_heads, "max_heads": max(n_heads),
        "stats": {n: d[n] for n in names}, "examples": d["examples"],
        "relations": [[relations(d, layer, h) for h in range(n)] for layer, n in enumerate(n_heads)],
        "subtitle": (
            f"{d['model']}: {d['n_tokens']} tokens in {d['n_sequences']} windows of up to {d['window']}; "
            f"corpus SHA-256 {str(d['corpus_sha256'])[:16]}..."
        ),
    }  # fmt: skip


def render_atlas_page(d: dict[str, Any], *, title: str | None = None) -> str:
    """The whole HTML page of an ``atlas.json`` dict, as a string."""
    data = atlas_page_data(d)
    parts = {
        "/*__CSS__*/": _asset("atlas.css"), "/*__JS__*/": _asset("atlas.js"),
        "__DATA__": _json_for_script(data),
        "__TITLE__": html.escape(title or f"head atlas: {d['model']}"),
    }  # fmt: skip
    return _PLACEHOLDERS.sub(lambda m: parts[m.group(0)], _asset("template.html"))


def write_atlas_page(path: str | os.PathLike[str], d: dict[str, Any]) -> Path:
    """Write the page of ``d`` to ``path`` atomically; return the path."""
    return write_atomic(path, render_atlas_page(d), make_parents=True)
