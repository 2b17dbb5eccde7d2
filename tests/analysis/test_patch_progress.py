"""A patching sweep of several batches shows its patched runs as each batch ends (issue 41: progress
during every pass longer than 2 s, in real units); a sweep of one batch prints nothing."""

from __future__ import annotations

import re

import pytest
import torch

import headspace as hs
from headspace.analysis import patching
from headspace.core import progress


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = hs.ModelConfig(
        arch="decoder", n_heads=4, d_model=24, n_layers=2, d_mlp=32, vocab_size=41, max_seq_len=16
    )
    return hs.Decoder(cfg).eval()


def test_a_sweep_of_several_batches_ticks_per_batch_of_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(progress, "PLAIN_EVERY", 0.0)  # a line at every tick (stderr is not a terminal)
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 41, (1, 6), generator=g)
    corrupt = torch.cat([clean[:, :2], torch.randint(0, 41, (1, 4), generator=g)], dim=1)  # differ from 2
    model = _model()
    whole = patching.patch(model, clean, corrupt, site="heads_pos", answer=3, other=5)
    assert capsys.readouterr().err == ""  # one batch: no bar
    parts = patching.patch(model, clean, corrupt, site="heads_pos", answer=3, other=5, max_runs=10)
    torch.testing.assert_close(parts.effect, whole.effect)
    runs = 2 * 4 * 4  # layers x heads x the positions from the first difference
    found = re.findall(r"^patching heads_pos: (\d+)/(\d+) runs", capsys.readouterr().err, flags=re.M)
    assert [int(n) for n, _ in found] == [0, 10, 20, 30, 32, 32] and {int(t) for _, t in found} == {runs}


@pytest.mark.parametrize("engine", [True, False])
def test_head_importance_ticks_on_every_batch_not_only_the_last(
    engine: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With several batches (``heads --sentences FILE``) the bar sat at 0 until the last batch began."""
    from headspace.analysis import ablation

    if not engine:  # the whole-model path (one copy of the batch per head)
        monkeypatch.setattr(ablation, "_engine_applies", lambda *a: False)
    monkeypatch.setattr(progress, "PLAIN_EVERY", 0.0)
    inputs = torch.randint(0, 41, (3, 7), generator=torch.Generator().manual_seed(2))
    ablation.head_importance(
        _model(), list(inputs.split(1)), max_rows=4
    )  # 3 batches (one pass each), 8 heads
    err = capsys.readouterr().err
    found = re.findall(r"^ablating heads \(loss, zero\): (\d+)/(\d+) head-batches", err, flags=re.M)
    counts = [int(n) for n, _ in found]
    assert {int(t) for _, t in found} == {24} and counts[-1] == 24
    assert 0 < min(n for n in counts if n > 0) <= 8  # a tick during the first batch
