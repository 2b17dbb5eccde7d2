"""headspace.viz.training: reading a run's metrics.jsonl and the heads-over-training picture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headspace.viz.training import METRICS_FILE, _head_series, _panels, plot_run, read_metrics


def _write_run(folder: Path, *, relations: bool, cut_last_line: bool = False) -> list[dict]:
    """A hand-written run folder: 2 layers x 3 heads, three evaluations and training rows between."""
    rows: list[dict] = []
    for step in (0, 5, 10):
        ev: dict = {"kind": "eval", "step": step, "loss": 2.0 / (step + 1), "accuracy": step / 10}
        table = [[step + 10 * layer + h for h in range(3)] for layer in range(2)]  # [layer][head]
        ev["entropy"], ev["wo_norm"] = table, table
        if relations:
            ev["relation_mass"] = {"copy": table, "prev": table}
            ev["ablation_acc"] = {"copy": table, "prev": table}
        else:
            ev["ablation_loss"] = table
        rows.append(ev)
        if step < 10:
            rows.append({"kind": "train", "step": step + 5, "loss": 1.0 / (step + 2), "lr": 1e-3})
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if cut_last_line:
        text += '{"kind": "train", "step": 11, "lo'  # a kill in the middle of a write
    folder.mkdir(parents=True, exist_ok=True)
    (folder / METRICS_FILE).write_text(text, encoding="utf-8")
    return rows


def test_read_metrics_splits_rows_and_skips_a_cut_line(tmp_path: Path) -> None:
    rows = _write_run(tmp_path / "run", relations=True, cut_last_line=True)
    train_rows, eval_rows = read_metrics(tmp_path / "run")
    assert eval_rows == [r for r in rows if r["kind"] == "eval"]
    assert train_rows == [r for r in rows if r["kind"] == "train"]  # the cut line is not among them


def test_read_metrics_refuses_a_folder_without_metrics(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"holds no metrics\.jsonl"):
        read_metrics(tmp_path)
    (tmp_path / METRICS_FILE).write_text("{not json\n", encoding="utf-8")
    with pytest.raises(ValueError, match="holds no metrics yet"):
        read_metrics(tmp_path)


def test_head_series_follows_each_head_over_evaluations(tmp_path: Path) -> None:
    _write_run(tmp_path / "run", relations=True)
    _, eval_rows = read_metrics(tmp_path / "run")
    series = _head_series(eval_rows, "relation_mass", "copy")
    assert sorted(series) == [f"L{layer}H{h}" for layer in range(2) for h in range(3)]
    assert series["L1H2"] == [0 + 12, 5 + 12, 10 + 12]  # step + 10 layer + head, by construction
    assert _head_series(eval_rows, "no_such_metric") == {}


def test_panels_per_relation_or_the_ablation_loss(tmp_path: Path) -> None:
    _write_run(tmp_path / "task", relations=True)
    _write_run(tmp_path / "text", relations=False)
    task = [spec for _, spec in _panels(read_metrics(tmp_path / "task")[1])]
    text = [spec for _, spec in _panels(read_metrics(tmp_path / "text")[1])]
    assert task == [None, ("relation_mass", "copy"), ("ablation_acc", "copy"), ("relation_mass", "prev"),
                    ("ablation_acc", "prev"), ("entropy", None), ("wo_norm", None)]  # fmt: skip
    assert text == [None, ("ablation_loss", None), ("entropy", None), ("wo_norm", None)]


def test_plot_run_writes_one_picture(tmp_path: Path) -> None:
    _write_run(tmp_path / "run", relations=False)
    default = plot_run(tmp_path / "run")
    assert default == tmp_path / "run" / "heads_over_training.png"
    assert default.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert written == sorted([METRICS_FILE, "heads_over_training.png"])
