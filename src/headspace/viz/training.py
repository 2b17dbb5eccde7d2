"""``plot-run``: loss curves and per-head measurements over training, from ``RUN_DIR/metrics.jsonl``.

The pictures of a training run live here with the other pictures (:mod:`headspace.viz.plots`); the old
path ``headspace.train.plots`` is this module (``headspace._MOVED``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def read_metrics(run_dir: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training rows, evaluation rows) of a run; a line cut short by a kill is skipped."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        raise ValueError(
            f"{run_dir} holds no {METRICS_FILE}; is it a run folder written by `headspace train`?"
        )
    train_rows, eval_rows = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        (eval_rows if row.get("kind") == "eval" else train_rows).append(row)
    if not train_rows and not eval_rows:
        raise ValueError(f"{path} holds no metrics yet")
    return train_rows, eval_rows


def _head_series(eval_rows: list[dict[str, Any]], key: str, sub: str | None = None) -> dict[str, list[float]]:
    """{"L0H1": [value at each evaluation]} for a [layer][head] metric (``sub`` picks a relation)."""
    series: dict[str, list[float]] = {}
    for row in eval_rows:
        table = row.get(key)
        if sub is not None and isinstance(table, dict):
            table = table.get(sub)
        if table is None:
            continue
        for layer, heads in enumerate(table):
            for h, value in enumerate(heads):
                series.setdefault(f"L{layer}H{h}", []).append(value)
    return series


def plot_run(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """Draw the run's loss curves and per-head metrics over training into a PNG; returns its path.

    ``out`` defaults to ``RUN_DIR/heads_over_training.png``; the suffix picks the format (PNG, SVG).

    Panels: training and evaluation loss (and accuracy for synthetic tasks); for each relation, every
    head's attention mass on the relation's ground-truth positions and the accuracy lost when the head
    is ablated; every head's pattern entropy and ``W_O`` block norm.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .plots import _save

    train_rows, eval_rows = read_metrics(run_dir)
    steps = [r["step"] for r in eval_rows]
    panels = _panels(eval_rows)
    ncols = 2
    nrows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(nrows, ncols, figsize=(11, 3.2 * nrows), squeeze=False)
    for ax, (title, spec) in zip(axes.flat, panels):
        if spec is None:
            _draw_losses(ax, train_rows, eval_rows)
        else:
            for name, values in _head_series(eval_rows, *spec).items():
                ax.plot(steps[: len(values)], values, "o-", label=name, markersize=3)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.legend(fontsize=8, loc="best")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"heads over training: {Path(run_dir).name}", fontsize=11)
    fig.tight_layout()
    return _save(fig, Path(out) if out is not None else Path(run_dir) / "heads_over_training.png")


def _panels(eval_rows: list[dict[str, Any]]) -> list[tuple[str, tuple[str, str | None] | None]]:
    """The panels of :func:`plot_run` as (title, spec): spec None is the loss panel, else the
    ``(metric, relation)`` of :func:`_head_series`. Relations are those of the last evaluation; a text
    run (none) gets the loss increase when each head is ablated instead."""
    relations = list((eval_rows[-1].get("relation_mass") or {}).keys()) if eval_rows else []
    panels: list[tuple[str, tuple[str, str | None] | None]] = [("loss", None)]
    for rel in relations:
        panels.append((f"attention on {rel} positions", ("relation_mass", rel)))
        panels.append((f"accuracy lost when ablated ({rel})", ("ablation_acc", rel)))
    if not relations:
        panels.append(("loss increase when ablated", ("ablation_loss", None)))
    panels.append(("pattern entropy (nats)", ("entropy", None)))
    panels.append(("W_O block norm", ("wo_norm", None)))
    return panels


def _draw_losses(ax: Any, train_rows: list[dict[str, Any]], eval_rows: list[dict[str, Any]]) -> None:
    """Training and evaluation loss on a log scale; the accuracy on a second axis when evaluated."""
    steps = [r["step"] for r in eval_rows]
    ax.plot([r["step"] for r in train_rows], [r["loss"] for r in train_rows], label="train loss")
    ax.plot(steps, [r["loss"] for r in eval_rows], "o-", label="eval loss")
    ax.set_yscale("log")
    if eval_rows and "accuracy" in eval_rows[-1]:
        ax2 = ax.twinx()
        ax2.plot(steps, [r["accuracy"] for r in eval_rows], "s--", color="tab:green", label="accuracy")
        ax2.set_ylim(0, 1.05)
        ax2.set_ylabel("accuracy")
        ax2.legend(loc="center right", fontsize=8)
