"""A picture of one cross-attention head: its pattern over the source (tokens or audio time), one row per
output token, with the source's word boundaries drawn (matplotlib, headless; one PNG or SVG by suffix)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .plots import ArrayLike, _np, _save, _token_ticks, plt


def plot_cross_pattern(
    pattern: ArrayLike,
    path: str | Path,
    *,
    targets: Sequence[str],
    sources: Sequence[str] | None = None,
    seconds_per_key: float | None = None,
    boundaries: Sequence[float] = (),
    title: str = "",
) -> Path:
    """Heatmap of a cross-attention head's pattern [seq_dec, seq_enc]: rows are the output tokens
    ``targets``, columns the source positions, labelled by ``sources`` (tokens) or, for audio, in seconds
    (``seconds_per_key``: Whisper's encoder positions are 0.02 s apart). ``boundaries``: source positions
    (in key units, or seconds with ``seconds_per_key``) where words start or end, drawn as white lines."""
    p = _np(pattern)
    if p.ndim != 2 or p.shape[0] != len(targets):
        raise ValueError(
            f"pattern must be [seq_dec={len(targets)}, seq_enc] (a row per target); got {list(p.shape)}"
        )
    n_q, n_k = p.shape
    fig, ax = plt.subplots(figsize=(min(4 + 0.12 * n_k, 18), min(2.5 + 0.3 * n_q, 14)))
    extent = None
    if seconds_per_key is not None:
        extent = (0.0, n_k * seconds_per_key, n_q - 0.5, -0.5)
    im = ax.imshow(p, cmap="viridis", vmin=0.0, vmax=max(float(p.max()), 1e-9), aspect="auto", extent=extent)
    _token_ticks(ax, targets, "y")
    if seconds_per_key is not None:
        ax.set_xlabel("source time (s)")
    else:
        if sources is not None:
            _token_ticks(ax, sources, "x")
        ax.set_xlabel("source position (key)")
    for b in boundaries:
        ax.axvline(b if seconds_per_key is not None else b - 0.5, color="white", lw=0.8, alpha=0.8)
    ax.set_ylabel("output token (query)")
    ax.set_title(title or "cross-attention pattern")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="attention weight")
    return _save(fig, path)


def plot_cross_explanation(e: Any, path: str | Path) -> Path:
    """The picture of ``headspace explain`` on an encoder-decoder: the head's pattern of a
    :class:`~headspace.analysis.lesson.cross_explain.CrossExplanation` ``e``, one row per output token and
    the end (labelled ``input token → predicted token``), the source in tokens or seconds, with the word
    boundaries drawn (:func:`plot_cross_pattern`)."""
    les = e.lesson
    targets = [f"{q.strip()} → {t.strip()}" for q, t in zip(e.queries, [*e.outputs, "<end>"])]
    where = "audio" if e.seconds_per_key is not None else "source"
    return plot_cross_pattern(
        e.pattern, path, targets=targets, sources=None if e.seconds_per_key is not None else e.sources,
        seconds_per_key=e.seconds_per_key, boundaries=e.boundaries,
        title=f"decoder layer {les.layer} cross-attention head {les.head} over the {where} "
        "(lines: word boundaries)",
    )  # fmt: skip
