"""``sink_pattern`` against transformers' gpt-oss eager attention (the concatenated sink column, the row
maximum subtracted, softmax, the column dropped): bit for bit in float32 and float64 (the softmax
subtracts the row maximum itself), to bfloat16 rounding in bfloat16, with gradients too."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from headspace.attention.sinks import sink_pattern


def _case(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(5)
    B, H, S, D = 2, 3, 7, 5
    q, k, v = (torch.randn(B, H, S, D, generator=g).to(dtype) * 3 for _ in range(3))
    sinks = (torch.randn(H, generator=g) * 2).to(dtype)
    mask = torch.zeros(S, S, dtype=dtype).masked_fill(~torch.ones(S, S).tril().bool(), float("-inf"))
    mask = mask.expand(B, 1, S, S).clone()  # (B, 1, S, S)
    mask[1, 0, 3] = float("-inf")  # a row with no visible key: all its mass on the sink
    return q, k, v, sinks, mask


@pytest.mark.parametrize(("dtype", "grad"), [(torch.float32, False), (torch.float32, True),
                                             (torch.float64, False), (torch.bfloat16, False)])  # fmt: skip
def test_sink_pattern_equals_transformers_gpt_oss(dtype: torch.dtype, grad: bool) -> None:
    q, k, v, sinks, mask = _case(dtype)
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=1, training=False)
    _, want = eager_attention_forward(module, q, k, v, mask, scaling=0.4)  # (B, H, S, S)
    scores = torch.matmul(q, k.transpose(2, 3)) * 0.4 + mask  # (B, H, S, S): as transformers' scores
    sinks = sinks.clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        got = sink_pattern(scores, sinks).detach()
    assert torch.equal(got, want)
    assert float(got[1, :, 3].abs().max()) == 0.0 and float(got[0, :, 3].sum()) > 0.0


def test_sink_pattern_gradients() -> None:
    q, k, _, sinks, mask = _case(torch.float64)
    scores = (torch.matmul(q, k.transpose(2, 3)) + mask).requires_grad_(True)  # (B, H, S, S)
    assert torch.autograd.gradcheck(sink_pattern, (scores, sinks.requires_grad_(True)))
