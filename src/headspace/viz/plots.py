"""Pictures of heads (matplotlib, headless): patterns, attention rows, W_O shares, overlaps, spectra.

Every function takes plain tensors or lists, writes one PNG (or SVG, by the suffix) and returns its path.
Axes are labelled with tokens, colour scales have colour bars, titles name the layer and head.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
from torch import Tensor

ArrayLike = Tensor | np.ndarray | Sequence


def _np(a: ArrayLike) -> np.ndarray:
    if isinstance(a, Tensor):
        return a.detach().float().cpu().numpy()
    return np.asarray(a, dtype=np.float64)


def _save(fig: plt.Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _token_ticks(ax: plt.Axes, tokens: Sequence[str], axis: str, max_labels: int = 80) -> None:
    n = len(tokens)
    step = max(1, int(np.ceil(n / max_labels)))
    idx = list(range(0, n, step))
    labels = [tokens[i] for i in idx]
    if axis == "x":
        ax.set_xticks(idx)
        ax.set_xticklabels(labels, rotation=90, fontsize=8)
    else:
        ax.set_yticks(idx)
        ax.set_yticklabels(labels, fontsize=8)


def plot_pattern(
    pattern: ArrayLike,
    tokens: Sequence[str],
    path: str | Path,
    *,
    title: str = "",
    highlight: int | None = None,
) -> Path:
    """Heatmap of one head's pattern [seq_q, seq_k]: rows are queries, columns the keys they attend to."""
    p = _np(pattern)
    n = max(len(tokens), 1)
    size = min(4 + 0.28 * n, 16)
    fig, ax = plt.subplots(figsize=(size + 1.2, size))
    im = ax.imshow(p, cmap="viridis", vmin=0.0, vmax=1.0, aspect="equal")
    _token_ticks(ax, tokens, "x")
    _token_ticks(ax, tokens, "y")
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    if highlight is not None:
        ax.axhline(highlight - 0.5, color="white", lw=1)
        ax.axhline(highlight + 0.5, color="white", lw=1)
    ax.set_title(title or "attention pattern")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="attention weight")
    return _save(fig, path)


def plot_attention_row(
    weights: ArrayLike, tokens: Sequence[str], path: str | Path, *, title: str = "", query: int | None = None
) -> Path:
    """Bar chart of one token's attention over the keys [seq_k]."""
    w = _np(weights)
    fig, ax = plt.subplots(figsize=(min(3 + 0.45 * len(tokens), 16), 3.6))
    colors = ["#d62728" if i == query else "#1f77b4" for i in range(len(w))]
    ax.bar(range(len(w)), w, color=colors)
    _token_ticks(ax, tokens, "x")
    ax.set_ylim(0, max(1.0, float(w.max()) if len(w) else 1.0))
    ax.set_ylabel("softmax weight")
    ax.set_title(title or "attention of one token")
    for i, v in enumerate(w):
        if v >= 0.05:
            ax.text(i, v + 0.01, f"{v:.2f}", ha="center", fontsize=7)
    return _save(fig, path)


def plot_head_shares(
    shares: ArrayLike, path: str | Path, *, title: str = "", highlight: int | None = None
) -> Path:
    """Bar chart of each head's share of the attention output [n_heads]."""
    s = _np(shares)
    fig, ax = plt.subplots(figsize=(max(4, 0.5 * len(s) + 2), 3.4))
    colors = ["#d62728" if i == highlight else "#2ca02c" for i in range(len(s))]
    ax.bar(range(len(s)), s, color=colors)
    ax.set_xticks(range(len(s)))
    ax.set_xticklabels([f"H{i}" for i in range(len(s))], fontsize=8)
    ax.set_xlabel("head")
    ax.set_ylabel("share of || z_h W_O[h] ||")
    ax.set_title(title or "how W_O weighs the heads")
    return _save(fig, path)


def plot_vectors(
    rows: dict[str, ArrayLike], path: str | Path, *, title: str = "", row_labels: Sequence[str] | None = None
) -> Path:
    """Stacked coloured cells of several vectors (e.g. q, z) or one matrix per name (e.g. k [seq, d_head])."""
    mats = {k: np.atleast_2d(_np(v)) for k, v in rows.items()}
    total = sum(m.shape[0] for m in mats.values())
    width = max(m.shape[1] for m in mats.values())
    fig, axes = plt.subplots(
        len(mats),
        1,
        figsize=(min(2 + 0.22 * width, 16), 1.0 + 0.3 * total + 0.4 * len(mats)),
        gridspec_kw={"height_ratios": [m.shape[0] for m in mats.values()]},
        squeeze=False,
    )
    vmax = max(float(np.abs(m).max()) for m in mats.values()) or 1.0
    im = None
    for ax, (name, m) in zip(axes[:, 0], mats.items()):
        im = ax.imshow(m, cmap="RdBu_r", vmin=-vmax, vmax=vmax, aspect="auto")
        ax.set_ylabel(name, rotation=0, ha="right", va="center")
        if m.shape[0] > 1 and row_labels is not None and len(row_labels) == m.shape[0]:
            _token_ticks(ax, row_labels, "y")
        else:
            ax.set_yticks([])
        ax.set_xticks([])
    axes[-1, 0].set_xlabel("d_head dimension")
    fig.suptitle(title)
    fig.colorbar(im, ax=axes[:, 0].tolist(), fraction=0.03, pad=0.02, label="value")
    return _save(fig, path)


def plot_pattern_grid(
    patterns: Sequence[ArrayLike], tokens: Sequence[str], path: str | Path, *, title: str = ""
) -> Path:
    """Grid of every head's pattern: a row per layer, a column per head (``patterns[l]`` [n_heads, s, s])."""
    pats = [_np(p) for p in patterns]
    n_layers, n_heads = len(pats), max(p.shape[0] for p in pats)
    cell = 1.6
    fig, axes = plt.subplots(
        n_layers, n_heads, figsize=(cell * n_heads + 1.5, cell * n_layers + 0.8), squeeze=False
    )
    im = None
    for l, p in enumerate(pats):
        for h in range(n_heads):
            ax = axes[l, h]
            ax.set_xticks([])
            ax.set_yticks([])
            if h < p.shape[0]:
                im = ax.imshow(p[h], cmap="viridis", vmin=0.0, vmax=1.0)
            else:
                ax.axis("off")
            if l == 0:
                ax.set_title(f"H{h}", fontsize=9)
            if h == 0:
                ax.set_ylabel(f"L{l}", fontsize=9)
    fig.suptitle(title or f"every head's pattern ({len(tokens)} tokens; rows: queries, columns: keys)")
    fig.colorbar(im, ax=axes.ravel().tolist(), fraction=0.02, pad=0.01, label="attention weight")
    return _save(fig, path)


def plot_overlap(
    matrix: ArrayLike,
    path: str | Path,
    *,
    baseline: float | None = None,
    title: str = "",
    label: str = "overlap",
) -> Path:
    """Head x head overlap heatmap [n_heads, n_heads], with the random-subspace baseline in the colour bar."""
    m = _np(matrix)
    n = m.shape[0]
    fig, ax = plt.subplots(figsize=(max(4.5, 0.45 * n + 2.5), max(4, 0.45 * n + 1.5)))
    im = ax.imshow(m, cmap="magma", vmin=0.0, vmax=1.0)
    ax.set_xticks(range(n))
    ax.set_yticks(range(n))
    ax.set_xticklabels([f"H{i}" for i in range(n)], fontsize=7, rotation=90)
    ax.set_yticklabels([f"H{i}" for i in range(n)], fontsize=7)
    cb = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label=label)
    if baseline is not None:
        cb.ax.axhline(baseline, color="cyan", lw=2)
        cb.ax.text(
            1.6,
            baseline,
            f" random {baseline:.2f}",
            color="black",
            fontsize=7,
            va="center",
            transform=cb.ax.get_yaxis_transform(),
        )
    ax.set_title(title or "head x head subspace overlap")
    return _save(fig, path)


def plot_circuit_spectra(
    qk: Sequence[ArrayLike] | ArrayLike,
    ov: Sequence[ArrayLike] | ArrayLike,
    path: str | Path,
    *,
    title: str = "",
    head_labels: Sequence[str] | None = None,
    ncols: int = 4,
) -> Path:
    """Small multiples of the QK and OV circuits' singular values: one panel per head, two lines each.

    ``qk[h]`` and ``ov[h]`` are head h's singular values (largest first; NaN rows, a pruned head's, are
    left out). Every panel shares the log-scaled y axis, so heads compare at a glance; one legend tells
    QK from OV.
    """
    qks, ovs = [_np(s) for s in qk], [_np(s) for s in ov]
    if len(qks) != len(ovs):
        raise ValueError(f"qk has {len(qks)} heads but ov has {len(ovs)}; give both circuits of every head")
    heads = [h for h in range(len(qks)) if np.isfinite(qks[h]).any() or np.isfinite(ovs[h]).any()]
    labels = list(head_labels) if head_labels is not None else [f"head {h}" for h in range(len(qks))]
    ncols = max(1, min(ncols, len(heads) or 1))
    nrows = max(1, -(-len(heads) // ncols))
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(2.6 * ncols + 0.8, 2.0 * nrows + 1.0), sharex=True, sharey=True, squeeze=False
    )
    for ax in axes.flat[len(heads) :]:
        ax.axis("off")
    for ax, h in zip(axes.flat, heads):
        lines = ((qks[h], "QK = W_Q W_K^T", "#1f77b4"), (ovs[h], "OV = W_V W_O", "#d62728"))
        for values, name, color in lines:
            v = values[np.isfinite(values)]
            ax.semilogy(range(1, len(v) + 1), np.clip(v, 1e-12, None), lw=1.6, color=color, label=name)
        ax.set_title(labels[h], fontsize=9)
        ax.grid(True, which="major", alpha=0.3)
        ax.tick_params(labelsize=7)
    fig.supxlabel("singular value index (largest first)", fontsize=9)
    fig.supylabel("singular value (log scale)", fontsize=9)
    handles, names = axes.flat[0].get_legend_handles_labels()
    fig.suptitle(title or "QK and OV circuit singular values per head", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.legend(
        handles, names, loc="upper center", ncol=2, fontsize=9, frameon=False, bbox_to_anchor=(0.5, 0.96)
    )
    return _save(fig, path)


def plot_rotary_planes(
    share: ArrayLike,
    wavelengths: ArrayLike,
    path: str | Path,
    *,
    split: float | None = None,
    title: str = "",
) -> Path:
    """Heads x rotary planes heatmap: each head's share of |score| on each RoPE plane.

    ``share`` [n_heads, n_planes] (a row sums to 1 minus the pass-through share; NaN rows, pruned heads,
    stay blank), ``wavelengths`` [n_planes] in tokens per turn (the x axis, fast planes on the left).
    ``split``: the wavelength between position (fast) and content (slow) planes, drawn as a line.
    """
    m, wl = _np(share), _np(wavelengths)
    n_heads, n_planes = m.shape
    fig, ax = plt.subplots(figsize=(max(6.0, 0.22 * n_planes + 2.5), max(3.0, 0.38 * n_heads + 1.5)))
    im = ax.imshow(m, cmap="viridis", vmin=0.0, aspect="auto")
    step = max(1, n_planes // 16)
    ticks = list(range(0, n_planes, step))
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{wl[i]:.3g}" for i in ticks], fontsize=7, rotation=90)
    ax.set_yticks(range(n_heads))
    ax.set_yticklabels([f"H{h}" for h in range(n_heads)], fontsize=7)
    ax.set_xlabel("rotary plane, by its wavelength (tokens per turn; fast = position, slow = content)")
    ax.set_ylabel("query head")
    if split is not None:
        faster = int(np.sum(wl <= split))  # planes are ordered fast to slow
        if 0 < faster < n_planes:
            ax.axvline(faster - 0.5, color="white", lw=1.5, ls="--")
            ax.text(faster - 0.4, -0.7, f" split {split:g} tokens", fontsize=7, va="bottom")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="share of the head's |score|")
    ax.set_title(title or "score share by rotary plane")
    return _save(fig, path)
