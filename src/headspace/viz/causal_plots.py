"""Pictures of causal results: the patching heatmap and the direct-attribution bars (matplotlib)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless, before pyplot

import matplotlib.pyplot as plt
import numpy as np
from torch import Tensor

from .plots import _save


def plot_patch_effect(
    effect: Tensor,
    axes: Sequence[str],
    path: str | Path,
    *,
    title: str = "",
    tokens: Sequence[str] | None = None,
) -> Path:
    """Heatmap of a patching effect [layer, head] or [layer, position] (a bar chart for [layer]).

    A diverging colour scale centred on 0 (blue: patching moves the metric away from clean, red: towards
    it; 1 = fully restored), with a colour bar, labelled axes and the layer/head (or token) ticks.
    """
    e = effect.detach().float().cpu().numpy()
    if e.ndim == 1:
        fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * len(e) + 2), 3.2))
        colours = ["tab:red" if v >= 0 else "tab:blue" for v in e]
        ax.bar(np.arange(len(e)), e, color=colours)
        ax.axhline(0, color="black", lw=0.6)
        ax.set_xlabel(axes[0])
        ax.set_ylabel("normalised effect (1 = clean restored)")
        ax.set_xticks(np.arange(len(e)))
        ax.set_title(title or "patching effect per layer")
        return _save(fig, path)
    if e.ndim == 3:  # [layer, head, position]: the sum over positions
        e = np.nansum(e, axis=2)
        axes = axes[:2]
    n_rows, n_cols = e.shape
    lim = float(np.nanmax(np.abs(e))) if np.isfinite(e).any() else 1.0
    lim = lim or 1.0
    fig, ax = plt.subplots(figsize=(max(4.0, 0.42 * n_cols + 2.5), max(3.0, 0.22 * n_rows + 1.5)))
    im = ax.imshow(e, cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto", interpolation="nearest")
    cbar = fig.colorbar(im, ax=ax)
    cbar.set_label("normalised effect (1 = clean restored, 0 = none)")
    ax.set_ylabel(axes[0])
    ax.set_xlabel(axes[1])
    ax.set_yticks(np.arange(0, n_rows, max(1, n_rows // 15)))
    if axes[1] == "position" and tokens is not None and len(tokens) == n_cols:
        ax.set_xticks(np.arange(n_cols))
        ax.set_xticklabels([repr(t)[1:-1] for t in tokens], rotation=90, fontsize=8)
    else:
        ax.set_xticks(np.arange(n_cols))
    ax.set_title(title or f"patching effect per {axes[0]} x {axes[1]}")
    return _save(fig, path)


def plot_attribution(heads: Tensor, mlps: Tensor, path: str | Path, *, title: str = "") -> Path:
    """The largest direct contributions: a heatmap of heads [layer, head] beside the MLPs [layer]."""
    h = heads.detach().float().cpu().numpy()
    m = mlps.detach().float().cpu().numpy()
    lim = float(max(np.nanmax(np.abs(h)), np.nanmax(np.abs(m)), 1e-9))
    fig, (ax_h, ax_m) = plt.subplots(
        1, 2, figsize=(max(5.0, 0.42 * h.shape[1] + 3.5), max(3.0, 0.22 * h.shape[0] + 1.5)),
        gridspec_kw={"width_ratios": [h.shape[1], 1.5]},
    )  # fmt: skip
    im = ax_h.imshow(h, cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto", interpolation="nearest")
    ax_h.set_xlabel("head")
    ax_h.set_ylabel("layer")
    ax_h.set_title("heads (hook_result)")
    ax_m.imshow(m[:, None], cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto", interpolation="nearest")
    ax_m.set_xticks([])
    ax_m.set_yticks([])
    ax_m.set_title("MLPs")
    cbar = fig.colorbar(im, ax=[ax_h, ax_m])
    cbar.set_label("direct contribution to the logit (difference)")
    fig.suptitle(title or "direct logit attribution")
    return _save(fig, path)
