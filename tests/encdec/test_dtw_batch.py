"""The batched, anti-diagonal DTW (``analysis/lesson/dtw.py``) gives transformers' Whisper DTW path for
every matrix of a batch, ties included (integer costs make many)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headspace.analysis.lesson.dtw import dtw_paths


def _reference(cost: torch.Tensor) -> tuple[list[int], list[int]]:
    from transformers.models.whisper import generation_whisper as ref

    rows, frames = ref._dynamic_time_warping(cost.double().numpy())
    return rows.tolist(), frames.tolist()


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 3),
    rows=st.integers(1, 13),
    frames=st.integers(1, 17),
    ties=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_each_path_equals_transformers(batch: int, rows: int, frames: int, ties: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    costs = (
        torch.randint(0, 3, (batch, rows, frames), generator=g).double()
        if ties
        else torch.randn(batch, rows, frames, generator=g, dtype=torch.float64)
    )
    for cost, (r, f) in zip(costs, dtw_paths(costs), strict=True):
        assert (r.tolist(), f.tolist()) == _reference(cost)


def test_a_long_float32_batch_equals_transformers() -> None:
    costs = -torch.rand(2, 29, 211, generator=torch.Generator().manual_seed(3)).softmax(dim=-1)
    for cost, (r, f) in zip(costs, dtw_paths(costs), strict=True):
        assert (r.tolist(), f.tolist()) == _reference(cost)


@pytest.mark.parametrize("shape", [(3, 4), (0, 3, 4), (2, 0, 4), (2, 3, 0)])
def test_bad_shapes_are_refused_in_one_line(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"costs \[batch, rows, frames\]; got"):
        dtw_paths(torch.zeros(shape))
