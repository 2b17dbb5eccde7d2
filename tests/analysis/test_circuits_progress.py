"""The circuit command's passes show progress in their real units, one tick per pair and step as each
backward pass (or batch of patched runs) ends: issue 41's EAP-IG bar ticked 3 times in 192 s."""

from __future__ import annotations

import re

import pytest
import torch

import headspace as hs
from headspace.analysis import circuits as C
from headspace.analysis import tasks as T
from headspace.analysis.graph import graph_of
from headspace.core import progress

V, S = 53, 9  # vocabulary, sequence length


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = hs.ModelConfig(
        arch="decoder", n_heads=4, d_model=24, n_layers=2, d_mlp=32, vocab_size=V, max_seq_len=32,
        dropout=0.0, attn_dropout=0.0, emb_dropout=0.0,
    )  # fmt: skip
    return hs.Decoder(cfg).eval()


def _task(n: int = 5) -> T.Task:
    g = torch.Generator().manual_seed(4)
    clean, corrupt = torch.randint(0, V, (n, S), generator=g), torch.randint(0, V, (n, S), generator=g)
    answer = torch.randint(0, V, (n,), generator=g)
    lengths = torch.full((n,), S)
    return T.Task("random", clean, corrupt, lengths, answer, (answer + 1) % V, [("", "")] * n)


def _lines(err: str, desc: str) -> list[tuple[int, int, str]]:
    found = re.findall(rf"^{re.escape(desc)}: (\d+)/(\d+) ([\w-]+)", err, flags=re.M)
    return [(int(n), int(total), unit) for n, total, unit in found]


@pytest.mark.parametrize(("method", "steps", "unit"), [("eap", 1, "pairs"), ("eap-ig", 3, "pair-steps")])
def test_edge_scores_tick_per_pair_and_step(
    method: str, steps: int, unit: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(progress, "PLAIN_EVERY", 0.0)  # a line at every tick (stderr is not a terminal)
    C.edge_scores(_model(), _task(), method, steps, batch_size=2)  # 3 parts of 2, 2 and 1 pairs
    lines = _lines(capsys.readouterr().err, f"{method} edge scores")
    assert {total for _, total, _ in lines} == {5 * steps} and {u for *_, u in lines} == {unit}
    counts = [n for n, _, _ in lines]
    assert counts == sorted(counts) and counts[-1] == 5 * steps
    assert len(set(counts)) == 1 + 3 * steps  # 0, then a tick after each backward pass of each part


def test_circuit_runs_tick_per_pair_and_circuit(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(progress, "PLAIN_EVERY", 0.0)
    model, task = _model(), _task()
    C.faithfulness(model, task, graph_of(model).valid, batch_size=2)  # 3 circuits: it, the full, the empty
    lines = _lines(capsys.readouterr().err, "circuit runs")
    counts = [n for n, _, _ in lines]
    assert {total for _, total, _ in lines} == {5 * 3} and counts[-1] == 15
    assert len(set(counts)) == 1 + 3 * 3 and {u for *_, u in lines} == {"runs"}
