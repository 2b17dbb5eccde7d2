"""torch.compile(fullgraph=True) on the attention layer: no graph break on any mask, the eager numbers,
and the "no NaN on fully masked rows" promise kept inside the compiled graph."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from headspace import MultiHeadAttention, compat

B, S, D, H = 2, 5, 21, 3  # distinct sizes: a swapped axis fails


def _masks() -> dict[str, dict]:
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[1, 3:] = False
    dead = torch.ones(S, S, dtype=torch.bool)
    dead[2] = False  # query 2 may attend to nothing: a dead row
    additive = torch.zeros(B, H, S, S)
    additive[0, 1, 4] = float("-inf")  # a dead row in the additive mask
    additive[1] = -0.5
    return {
        "none": {},
        "causal": {"is_causal": True},
        "key_padding": {"key_padding": pad},
        "causal_and_padding": {"is_causal": True, "key_padding": pad},
        "bool_dead_row": {"attn_mask": dead},
        "additive_dead_row": {"attn_mask": additive},
    }


@pytest.mark.parametrize("name", list(_masks()))
def test_attention_compiles_without_graph_breaks(name: str) -> None:
    torch.manual_seed(0)
    attn = MultiHeadAttention(D, H).eval()
    x = torch.randn(B, S, D)
    kwargs = _masks()[name]

    def f(x: torch.Tensor) -> torch.Tensor:
        return attn(x, **kwargs)

    explained = torch._dynamo.explain(f)(x)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    out = compiled(x)
    assert torch.isfinite(out).all()
    assert_close(out, f(x))


def test_compiled_dead_rows_are_zero_with_finite_gradients() -> None:
    torch.manual_seed(1)
    attn = MultiHeadAttention(D, H, bias=False)
    x = torch.randn(B, S, D, requires_grad=True)
    mask = torch.ones(S, S, dtype=torch.bool)
    mask[2] = False

    compiled = torch.compile(lambda x: attn(x, attn_mask=mask), fullgraph=True, backend="eager")
    out = compiled(x)
    assert_close(out[:, 2], torch.zeros(B, D))  # no bias: z = 0 gives exactly 0
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_compat_drop_in_compiles_with_key_padding() -> None:
    torch.manual_seed(2)
    mha = compat.MultiheadAttention(D, H, batch_first=True).eval()
    x = torch.randn(B, S, D)
    padding = torch.zeros(B, S, dtype=torch.bool)
    padding[1, 3:] = True  # torch's convention: True = padding

    def f(x: torch.Tensor) -> torch.Tensor:
        return mha(x, x, x, key_padding_mask=padding, need_weights=False)[0]

    explained = torch._dynamo.explain(f)(x)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    assert_close(torch.compile(f, fullgraph=True, backend="eager")(x), f(x))
