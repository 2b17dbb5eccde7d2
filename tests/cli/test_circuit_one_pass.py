"""``headspace circuit`` runs the circuit's faithfulness in the faithfulness curve's pass (issue 41: work
beyond the engine): :func:`curve_and_faithfulness` equals the two separate calls, and the command makes
one batched pass of circuit runs, not two (the second ran the corrupt and clean forwards again)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import headspace as hs
from headspace.analysis.circuits import edges as C
from headspace.analysis.circuits.tasks import ioi_task
from headspace.cli import cli


def test_curve_and_faithfulness_equal_the_two_calls(tiny_gpt2: Callable[..., Path]) -> None:
    model = hs.load(str(tiny_gpt2(n_layer=3, n_head=4, n_embd=32)))
    task = ioi_task(model, 6)
    scores = C.edge_scores(model, task, "eap")
    circuit = C.find_circuit(scores, edges=25)
    curve, faith = C.curve_and_faithfulness(model, task, scores, circuit, batch_size=4)
    want_curve = C.faithfulness_curve(model, task, scores, batch_size=4)
    want = C.faithfulness(model, task, circuit, batch_size=4)
    assert curve.to_dict() == want_curve.to_dict()
    assert faith.to_dict() == pytest.approx(want.to_dict(), rel=1e-12, abs=1e-12)
    assert faith.n_edges == 25 and 0 < abs(faith.faithfulness) < 10


def test_the_circuit_command_makes_one_pass_of_circuit_runs(
    tiny_gpt2: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    passes: list[int] = []
    real = C._circuit_metrics

    def counted(module: Any, graph: Any, task: Any, masks: Any, batch_size: int) -> list[float]:
        passes.append(len(masks))
        return real(module, graph, task, masks, batch_size)

    monkeypatch.setattr(C, "_circuit_metrics", counted)
    folder, out = tiny_gpt2(), tmp_path / "circ"
    args = ["circuit", "--model", str(folder), "--pairs", "4", "--method", "eap", "--edges", "9"]
    res = CliRunner().invoke(cli, [*args, "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert passes == [12]  # the curve's 11 circuits (MIB's fractions, 0 added) and the circuit's own
    summary = json.loads((out / "circuit.json").read_text())
    model = hs.load(str(folder))  # the same numbers as the separate faithfulness call gives
    task = ioi_task(model, 4)
    want = C.faithfulness(model, task, C.find_circuit(C.edge_scores(model, task, "eap"), edges=9))
    assert summary["faithfulness"] == pytest.approx(want.faithfulness, rel=1e-9, abs=1e-12)
    assert summary["clean_metric"] == pytest.approx(want.clean_metric, rel=1e-9, abs=1e-12)
