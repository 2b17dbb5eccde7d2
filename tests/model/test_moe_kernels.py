"""The routed sum with tokens sorted by expert (headspace.model.moe_kernels) against the per-expert loop:
the module's unhooked path (routed_sum) and its hooked path (hook_expert_out, the per-expert loop) give
the same bits, for every routing, with biases, the clamped SwiGLU, ablation and experts no token chose."""

from __future__ import annotations

import pytest
import torch

from headspace.model.moe import MixtureOfExperts
from headspace.model.moe_kernels import expert_pairs, routed_sum

_FORMS = {
    "mixtral": {"norm_topk": True},
    "qwen2_moe_shared": {"d_shared": 12},
    "gpt_oss": {"routing": "topk_softmax", "router_bias": True, "bias": True, "swiglu": (7.0, 1.702)},
    "llama4": {"routing": "topk_sigmoid", "d_shared": 10, "shared_gate": False},
    "deepseek_v3": {"routing": "sigmoid_group_topk", "groups": (2, 1), "score_bias": True, "norm_topk": True,
                    "routed_scale": 2.5},
    "deepseek_v2": {"routing": "softmax_group_topk", "groups": (3, 2), "routed_scale": 1.5},
}  # fmt: skip


def _moe(form: str) -> MixtureOfExperts:
    torch.manual_seed(0)
    moe = MixtureOfExperts(10, 14, 6, 2, **_FORMS[form]).eval()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(std=0.5)  # biases and score_bias too (they start at 0)
    return moe


def _loop(moe: MixtureOfExperts, x: torch.Tensor) -> torch.Tensor:
    """The per-expert loop the module ran before the sort (84c97fc): each expert on its rows, index_add_."""
    b, s, d = x.shape
    weights = moe.route(x).reshape(b * s, moe.n_experts)  # (N, E)
    flat = x.reshape(b * s, d)  # (N, d)
    out = torch.zeros_like(flat)
    for e in torch.nonzero(weights.ne(0).any(dim=0)).flatten().tolist():
        rows = torch.nonzero(weights[:, e]).flatten()
        if moe.routing == "topk_sigmoid":
            y = moe.expert(e, flat[rows] * weights[rows, e, None])
        else:
            y = moe.expert(e, flat[rows]) * weights[rows, e, None]
        out.index_add_(0, rows, y)
    return out


@pytest.mark.parametrize("form", sorted(_FORMS))
@pytest.mark.parametrize("ablated", [(), (1, 4)])
def test_sorted_sum_is_the_loop_and_the_hooked_path(form: str, ablated: tuple[int, ...]) -> None:
    moe = _moe(form)
    moe.ablate_experts(list(ablated))
    x = torch.randn(3, 7, 10, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        weights = moe.route(x).reshape(21, 6)
        fast = routed_sum(x.reshape(21, 10), weights, moe.expert, scale_input=moe.routing == "topk_sigmoid")
        assert torch.equal(fast, _loop(moe, x))
        unhooked = moe(x)
        seen: list[torch.Tensor] = []
        moe.hook_expert_out.add(lambda t, hook: seen.append(t))
        hooked = moe(x)
    assert len(seen) == 1 and seen[0].shape == (3, 7, 6, 10)
    torch.testing.assert_close(unhooked, hooked, rtol=0, atol=1e-6)  # a sum over E against index_add_
    for e in ablated:  # an ablated expert contributes nothing on either path
        assert not seen[0][:, :, e].any()


def test_pairs_are_expert_major_and_skip_unchosen_experts() -> None:
    weights = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.2, 0.0, 0.0, 0.8], [0.0, 0.3, 0.0, 0.0]])
    tokens, experts, counts = expert_pairs(weights)
    assert experts.tolist() == [0, 1, 1, 3, 3] and tokens.tolist() == [1, 0, 2, 0, 1]
    assert counts == [1, 2, 0, 2]


def test_no_chosen_expert_gives_zeros() -> None:
    calls: list[int] = []
    out = routed_sum(torch.ones(2, 3), torch.zeros(2, 4), lambda e, r: calls.append(e) or r)
    assert torch.equal(out, torch.zeros(2, 3)) and calls == []


def test_one_token_decode_visits_only_its_experts() -> None:
    moe = _moe("mixtral")
    x = torch.randn(1, 1, 10, generator=torch.Generator().manual_seed(2))
    visited: list[int] = []
    real = moe.expert

    def spy(e: int, rows: torch.Tensor) -> torch.Tensor:
        visited.append(e)
        return real(e, rows)

    with torch.no_grad():
        weights = moe.route(x).reshape(1, 6)
        out = routed_sum(x.reshape(1, 10), weights, spy)
        assert torch.equal(out, _loop(moe, x))
    assert visited == sorted(torch.nonzero(weights[0]).flatten().tolist()) and len(visited) == 2
