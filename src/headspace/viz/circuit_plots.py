"""Pictures of circuits: a score decomposition heatmap, a faithfulness curve, a circuit as a graph."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless, before pyplot

import matplotlib.pyplot as plt
import numpy as np

from .plots import _save

#: receiver kind -> (colour, line style) of the edges drawn into it
EDGE_STYLES = {"q": ("tab:blue", "-"), "k": ("tab:green", "--"), "v": ("tab:red", ":"),
               "mlp": ("tab:gray", "-"), "logits": ("black", "-")}  # fmt: skip


def plot_score_decomposition(result: Any, path: str | Path, *, top: int = 12) -> Path:
    """Heatmap of ``result.parts`` (a :class:`~headspace.analysis.decomposition.ScoreDecomposition`)
    restricted to the ``top`` components of largest row or column sum magnitude; rows are query-side
    components, columns key-side."""
    parts = result.parts.detach().double().cpu().numpy()  # (n, n)
    weight = np.abs(parts).sum(1) + np.abs(parts).sum(0)  # (n,)
    keep = np.sort(np.argsort(-weight)[:top])
    sub = parts[np.ix_(keep, keep)]  # (top, top)
    names = [result.components[i] for i in keep]
    lim = float(np.abs(sub).max()) or 1.0
    fig, ax = plt.subplots(figsize=(0.45 * len(keep) + 3.0, 0.4 * len(keep) + 2.0))
    im = ax.imshow(sub, cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest")
    ax.set_xticks(np.arange(len(keep)), names, rotation=90, fontsize=8)
    ax.set_yticks(np.arange(len(keep)), names, fontsize=8)
    ax.set_xlabel(f"key side (position {result.key} {result.tokens[result.key]!r})")
    ax.set_ylabel(f"query side (position {result.query} {result.tokens[result.query]!r})")
    fig.colorbar(im, ax=ax).set_label("part of the pre-softmax score")
    ax.set_title(f"L{result.layer}H{result.head}: score {result.score:+.3f} = sum of parts", fontsize=10)
    return _save(fig, path)


def plot_faithfulness_curve(curves: Sequence[Any], path: str | Path, *, title: str = "") -> Path:
    """Faithfulness against the fraction of edges (log scale), one line per
    :class:`~headspace.analysis.circuits.FaithfulnessCurve`, CPR and CMD in the legend."""
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    for c in curves:
        x = np.array(c.fractions[1:])  # fraction 0 has no place on a log axis
        ax.plot(
            x,
            c.faithfulness[1:],
            marker="o",
            label=f"{c.method or 'circuit'}: CPR {c.cpr:.3f}, CMD {c.cmd:.3f}",
        )
    ax.axhline(1.0, color="black", lw=0.6)
    ax.axhline(0.0, color="black", lw=0.6)
    ax.set_xscale("log")
    ax.set_xlabel("fraction of edges in the circuit")
    ax.set_ylabel("faithfulness (1 = full model, 0 = corrupt)")
    ax.legend(fontsize=8)
    ax.set_title(title or "faithfulness curve")
    return _save(fig, path)


def _node_xy(name: str, n_heads: int, n_layers: int) -> tuple[float, float]:
    """Where a node sits: layers bottom to top, heads left to right, the MLP right of its heads."""
    if name == "embed":
        return (n_heads / 2, -1.0)
    if name == "logits":
        return (n_heads / 2, float(n_layers))
    if name.startswith("mlp"):
        return (n_heads + 0.5, int(name[3:].split(".")[0]) + 0.45)
    layer, rest = name[1:].split("H") if "KV" not in name else (name[1:].split("KV")[0], "0")
    return (float(rest.split(".")[0]), float(layer))


def plot_circuit(
    circuit: Any, n_layers: int, n_heads: int, path: str | Path, *,
    n_kv_heads: int | None = None, title: str = "",
) -> Path:  # fmt: skip
    """A :class:`~headspace.analysis.circuits.Circuit` as a picture: nodes ``L.H`` by layer (bottom to top),
    edges from sender to receiver with width by ``|score|``, colour and style by the receiver's input
    (q blue solid, k green dashed, v red dotted, MLP grey, logits black). A key/value receiver under
    GQA is drawn at the first query head of its group."""
    fig, ax = plt.subplots(figsize=(max(6.0, 0.8 * n_heads + 2), max(5.0, 0.35 * n_layers + 2)))
    if not circuit.listed:
        raise ValueError("the circuit has no edge to draw")
    top = max(abs(s) for _, _, s in circuit.listed) or 1.0
    kinds = dict(zip(circuit.receivers, circuit.kinds))
    nodes: set[str] = set()
    group = n_heads // (n_kv_heads or n_heads)
    for s, r, score in circuit.listed:
        base = r.split(".")[0]
        if "KV" in r:
            layer, g = base[1:].split("KV")
            base = f"L{layer}H{int(g) * group}"
        base = "logits" if r == "logits" else base
        x0, y0 = _node_xy(s, n_heads, n_layers)
        x1, y1 = _node_xy(base, n_heads, n_layers)
        colour, style = EDGE_STYLES[kinds[r]]
        ax.plot([x0, x1], [y0, y1], color=colour, ls=style, lw=0.3 + 3.0 * abs(score) / top, alpha=0.7)
        nodes |= {s, base}
    for n in nodes:
        x, y = _node_xy(n, n_heads, n_layers)
        label = n if not n.startswith("L") else n[1:].replace("H", ".")
        ax.text(x, y, label, ha="center", va="center", fontsize=7,
                bbox={"boxstyle": "round", "fc": "white", "ec": "0.4", "lw": 0.5})  # fmt: skip
    for kind, (colour, style) in EDGE_STYLES.items():
        ax.plot([], [], color=colour, ls=style, label=f"into {kind}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_xlim(-1, n_heads + 1.5)
    ax.set_ylim(-1.6, n_layers + 0.6)
    ax.set_xlabel("head (MLP at the right)")
    ax.set_ylabel("layer")
    ax.set_title(title or f"circuit: {circuit.n_edges} edges")
    return _save(fig, path)
