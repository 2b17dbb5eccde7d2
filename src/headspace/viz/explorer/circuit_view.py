"""A circuit on the explorer page: each head's and MLP's share of the circuit's edge scores.

Reads the ``"circuit_summary"`` JSON that ``headspace circuit`` writes (``circuit.json``;
:func:`headspace.cli.circuits.circuit_summary`): ``n_layers``, ``n_heads``, ``node_scores``
[n_layers][n_heads + 1] (per head, then the layer's MLP: the sum of ``|score|`` over the circuit's edges
that the node sends or receives), ``edges`` ([sender, receiver, score] in order of ``|score|``),
``faithfulness``, ``cpr``, ``cmd``, ``method``, ``task``. One view: a layer x (heads, MLP) heatmap whose
cells link to the page's layer and head, the circuit's numbers as facts and its largest edges as the top
list.
"""

from __future__ import annotations

from typing import Any

__all__ = ["circuit_views"]


def circuit_views(
    d: dict[str, Any], array: Any, scalar: Any, text: Any, bad: type[ValueError]
) -> list[dict[str, Any]]:
    """The view of a ``"circuit_summary"`` dict; ``array``/``scalar``/``text`` are :mod:`.results`'s
    checked readers and ``bad`` its error type (so a malformed file is refused as every result is)."""
    values, (n_layers, width) = array(d["node_scores"], 2, "'node_scores'")
    n_heads = width - 1
    if n_heads < 1:
        raise bad(f"'node_scores' must have n_heads + 1 columns (heads, then the MLP); got {width}")
    edges = d.get("edges", [])
    if not isinstance(edges, list) or any(
        not (isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and isinstance(e[1], str))
        for e in edges
    ):
        raise bad("'edges' must be a list of [sender, receiver, score]")
    what = "a circuit summary"
    top = [[f"{e[0][:40]} -> {e[1][:40]}", scalar({"s": e[2]}, "s", "an edge score")] for e in edges[:10]]
    facts = [
        ["task", text(d, "task")],
        ["method", text(d, "method")],
        ["edges in the circuit", str(len(edges))],
        ["faithfulness", f"{scalar(d, 'faithfulness', what):.4f} (1 = full model, 0 = corrupt)"],
        ["CPR (area under the curve)", f"{scalar(d, 'cpr', what):.4f}"],
        ["CMD (area between the curve and 1)", f"{scalar(d, 'cmd', what):.4f}"],
    ]
    cols = [f"H{h}" for h in range(n_heads)] + ["MLP"]
    return [
        {
            "kind": "circuit_summary", "name": f"circuit: {len(edges)} edges ({text(d, 'method')})",
            "title": "each head's and MLP's part in the circuit: the sum of |edge score| over the circuit's "
            "edges it sends or receives (q, k, v inputs together)",
            "rows": [f"L{i}" for i in range(n_layers)], "cols": cols, "row_axis": "layer", "col_axis": "part",
            "values": values, "scale": "sequential", "unit": "sum of |edge score| in the circuit",
            "link": "layer_head", "n_layers": n_layers, "n_heads": n_heads, "facts": facts, "top": top,
            "notes": None, "prompt": text(d, "prompt") or None,
        }
    ]  # fmt: skip
