"""canonical_mask keeps the last causal sliding-window mask (issue 38, speed): every sliding layer of a
forward asks for the same one, and gets it without building it again; the same values as the general
path (padding or a user mask beside the window), dead rows included."""

from __future__ import annotations

import pytest
import torch

import headspace.nn.masks as masks
from headspace.nn.masks import canonical_mask


def _band(seq_q: int, seq_k: int, window: int, sides: str | None = None) -> masks.CanonicalMask:
    return canonical_mask(
        batch=2, n_heads=3, seq_q=seq_q, seq_k=seq_k, is_causal=True, window=window, window_sides=sides
    )


def test_the_same_band_is_built_once() -> None:
    first = _band(9, 9, 4)
    again = _band(9, 9, 4)
    assert again is first
    assert _band(9, 9, 5) is not first  # another window: built again


@pytest.mark.parametrize(
    "seq_q, seq_k, window, sides", [(9, 9, 4, None), (3, 9, 4, None), (9, 5, 2, None), (7, 7, 3, "both")]
)
def test_the_kept_band_is_the_general_paths_mask(
    seq_q: int, seq_k: int, window: int, sides: str | None
) -> None:
    got = _band(seq_q, seq_k, window, sides)
    padded = canonical_mask(
        batch=2,
        n_heads=3,
        seq_q=seq_q,
        seq_k=seq_k,
        key_padding=torch.ones(2, seq_k, dtype=torch.bool),
        is_causal=True,
        window=window,
        window_sides=sides,
    )  # fmt: skip  (every key real: the general path, the same constraint)
    assert torch.equal(got.mask.expand_as(padded.mask), padded.mask)
    assert (got.dead_rows is None) == (padded.dead_rows is None)
    if got.dead_rows is not None:
        assert torch.equal(got.dead_rows.expand_as(padded.dead_rows), padded.dead_rows)
    i = torch.arange(seq_q)[:, None] + (seq_k - seq_q)  # each query's key position
    j = torch.arange(seq_k)[None, :]
    allowed = (j <= i) & ((i - j).abs() < window)
    dead = ~allowed.any(-1, keepdim=True)
    assert torch.equal(got.mask[0, 0], allowed | dead)


def test_inference_mode_masks_stay_there() -> None:
    with torch.inference_mode():
        inside = _band(6, 6, 2)
    outside = _band(6, 6, 2)
    assert inside.mask.is_inference() and not outside.mask.is_inference()
    assert torch.equal(inside.mask, outside.mask)


def test_large_bands_are_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(masks, "BAND_MEMO_MAX", 80)
    assert _band(9, 9, 4) is not _band(9, 9, 4)  # 81 entries: built on every call
    assert _band(8, 8, 4) is _band(8, 8, 4)
