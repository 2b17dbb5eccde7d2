"""generate's stop tokens and its per-step callback (headspace.decode.generate): each row stops
independently, the tokens before a stop are those of the same call without stops, the loop ends once
every row has stopped, and on_token sees each step's tokens as they come."""

from __future__ import annotations

import pytest
import torch

import headspace.decode.loop as loop
from headspace import Decoder, ModelConfig

V = 13


def decoder() -> Decoder:
    torch.manual_seed(0)
    cfg = ModelConfig(
        arch="decoder", vocab_size=V, d_model=36, n_layers=2, n_heads=6, n_kv_heads=2, d_mlp=11,
        max_seq_len=40, positions="rotary", norm_kind="rmsnorm", mlp_kind="gated", act="silu", bias=False,
    )  # fmt: skip
    return Decoder(cfg).eval()


def expected_with_stops(full: torch.Tensor, prompt_len: int, stops: set[int]) -> torch.Tensor:
    """From a run without stops [batch, total]: each row's new tokens up to its first stop token, then
    that token repeated; cut after the column where the last row stopped (when every row did)."""
    rows, last = [], 0
    for row in full.tolist():
        new = row[prompt_len:]
        at = next((i for i, t in enumerate(new) if t in stops), None)
        if at is None:
            last = len(new) - 1
            rows.append(row)
            continue
        last = max(last, at)
        rows.append(row[: prompt_len + at + 1] + [new[at]] * (len(new) - at - 1))
    return torch.tensor(rows)[:, : prompt_len + last + 1]


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": 0},
        {"temperature": 0, "use_cache": False},
        {"temperature": 0.9, "seed": 3},
        {"temperature": 0, "backend": "python"},
    ],
)
@pytest.mark.parametrize("padded", [False, True])
def test_each_row_stops_on_its_own_and_the_tokens_before_are_unchanged(options: dict, padded: bool) -> None:
    model = decoder()
    torch.manual_seed(1)
    tokens = torch.randint(0, V, (3, 4))  # (batch, prompt_len)
    key_padding = None
    if padded:
        key_padding = torch.tensor([[False, True, True, True], [True] * 4, [False, False, True, True]])
    full = model.generate(tokens, 12, key_padding=key_padding, **options)  # (3, 16)
    for stops in ({int(full[0, 6])}, {int(full[1, 4]), int(full[2, 9])}, {int(full[2, 15])}):
        got = model.generate(tokens, 12, key_padding=key_padding, stop_tokens=sorted(stops), **options)
        want = expected_with_stops(full, 4, stops)
        assert torch.equal(got, want), (stops, got, want)


def test_the_loop_ends_when_every_row_has_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    model = decoder()
    tokens = torch.randint(0, V, (2, 3))
    full = model.generate(tokens, 10, temperature=0)
    steps: list[int] = []
    real = loop._next_logits
    monkeypatch.setattr(loop, "_next_logits", lambda *a: steps.append(a[2]) or real(*a))
    stops = {int(full[0, 5]), int(full[1, 3])}
    calls: list[torch.Tensor] = []
    out = model.generate(tokens, 10, temperature=0, stop_tokens=torch.tensor(sorted(stops)),
                         on_token=calls.append)  # fmt: skip
    want = expected_with_stops(full, 3, stops)
    assert torch.equal(out, want) and want.shape[1] <= 6  # both stopped by the third new token
    assert steps == list(range(3, want.shape[1] - 1))  # no step computed after the last row stopped
    assert len(calls) == want.shape[1] - 3 and torch.equal(calls[0], full[:, 3])


def test_on_token_sees_every_step_in_order() -> None:
    model = decoder()
    tokens = torch.randint(0, V, (2, 3))
    seen: list[torch.Tensor] = []
    out = model.generate(tokens, 7, temperature=0, on_token=seen.append)
    assert len(seen) == 7 and all(t.shape == (2,) and t.dtype == torch.long for t in seen)
    assert torch.equal(torch.stack(seen, dim=1), out[:, 3:])
    assert torch.equal(out, model.generate(tokens, 7, temperature=0))  # as without the callback


def test_no_stop_tokens_is_todays_generate() -> None:
    model = decoder()
    tokens = torch.randint(0, V, (2, 3))
    full = model.generate(tokens, 6, temperature=0)
    assert full.shape == (2, 9)
    for none in (None, [], ()):
        assert torch.equal(model.generate(tokens, 6, temperature=0, stop_tokens=none), full)


@pytest.mark.parametrize(
    ("stop_tokens", "error"),
    [
        ([V], ValueError),
        ([-1], ValueError),
        ([1.5], ValueError),
        ([True], ValueError),
        ("2", ValueError),
        (torch.tensor([[1, 2], [3, 4]]), ValueError),
        (torch.tensor([1.0]), ValueError),
    ],
)
def test_bad_stop_tokens_are_named(stop_tokens: object, error: type) -> None:
    model = decoder()
    with pytest.raises(error, match=r"^stop_tokens must be None or token ids \(ints in \[0, 13\)\)"):
        model.generate(torch.tensor([[1, 2]]), 3, stop_tokens=stop_tokens)


def test_a_bad_on_token_is_named() -> None:
    with pytest.raises(TypeError, match=r"^on_token must be None or callable"):
        decoder().generate(torch.tensor([[1, 2]]), 3, on_token="print")
