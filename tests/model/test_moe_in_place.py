"""The mixture of experts' in-place steps where no gradient is taken (the activation over the gate's
product, the routing weight over the expert's output, the shared expert added to the routed sum) give
the values of the out-of-place formula, keep gradients where one is taken, and leave a patched expert in
charge; DeepSeek's routing with every group kept skips the group mask and chooses as transformers does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from headspace.model.moe import MixtureOfExperts
from headspace.model.moe_kernels import routed_sum
from headspace.model.moe_routing import group_topk

E, DM, D = 6, 14, 10
_FORMS = {
    "deepseek_v3": {"routing": "sigmoid_group_topk", "groups": (3, 3), "score_bias": True, "norm_topk": True,
                    "routed_scale": 2.5, "d_shared": 12, "shared_gate": False},
    "qwen2_moe": {"d_shared": 12},
    "gelu_tanh": {"act": "gelu_tanh", "norm_topk": True},
    "llama4": {"routing": "topk_sigmoid", "d_shared": 10, "shared_gate": False},
}  # fmt: skip


def _moe(form: str) -> MixtureOfExperts:
    torch.manual_seed(0)
    moe = MixtureOfExperts(D, DM, E, 2, **_FORMS[form]).eval()  # type: ignore[arg-type]
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(std=0.5)
    return moe


def _reference(moe: MixtureOfExperts, x: torch.Tensor) -> torch.Tensor:
    """The module docstring's sum, out of place: [batch, seq, d_model] -> [batch, seq, d_model]."""
    b, s, d = x.shape
    flat = x.reshape(b * s, d)  # (N, d)
    weights = moe.route(x).reshape(b * s, E)  # (N, E)
    out = torch.zeros_like(flat)
    for e in range(E):
        rows = torch.nonzero(weights[:, e]).flatten()
        if rows.numel() == 0:
            continue
        w = weights[rows, e, None]  # (n, 1)
        xe = flat[rows] * w if moe.routing == "topk_sigmoid" else flat[rows]
        hidden = moe.act(F.linear(xe, moe.experts_gate[e])) * F.linear(xe, moe.experts_in[e])  # (n, d_mlp)
        y = F.linear(hidden, moe.experts_out[e])  # (n, d)
        out.index_add_(0, rows, y if moe.routing == "topk_sigmoid" else y * w)
    if moe.shared is not None:
        shared = moe.shared(flat)  # (N, d)
        if moe.shared_gate is not None:
            shared = torch.sigmoid(moe.shared_gate(flat)) * shared
        out = out + shared
    return out.reshape(b, s, d)


@pytest.mark.parametrize("form", sorted(_FORMS))
def test_in_place_steps_give_the_out_of_place_values(form: str) -> None:
    moe = _moe(form)
    x = torch.randn(3, 7, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = _reference(moe, x)
        got = moe(x)
        for e in range(E):  # each expert alone, in place, against its formula
            rows = x[0]
            plain = moe.act(F.linear(rows, moe.experts_gate[e])) * F.linear(rows, moe.experts_in[e])
            assert torch.equal(moe.expert(e, rows), F.linear(plain, moe.experts_out[e]))
    with torch.inference_mode():
        assert torch.equal(moe(x), got)
    assert torch.equal(got, want)


def test_gradients_are_those_of_the_out_of_place_formula() -> None:
    moe = _moe("deepseek_v3")
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(2), requires_grad=True)
    moe(x).square().sum().backward()
    got = [p.grad.clone() for p in (moe.experts_gate, moe.experts_in, moe.experts_out)]  # type: ignore[union-attr]
    got_x = x.grad.clone()  # type: ignore[union-attr]
    moe.zero_grad()
    x.grad = None
    _reference(moe, x).square().sum().backward()
    for p, g in zip((moe.experts_gate, moe.experts_in, moe.experts_out), got, strict=True):
        torch.testing.assert_close(g, p.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_x, x.grad, atol=1e-5, rtol=1e-5)


def test_a_patched_expert_runs_and_its_output_is_not_written_over() -> None:
    moe = _moe("qwen2_moe")
    x = torch.randn(1, 6, D, generator=torch.Generator().manual_seed(3))
    kept: list[torch.Tensor] = []

    def patched(e: int, rows: torch.Tensor) -> torch.Tensor:
        y = torch.full_like(rows, float(e + 1))  # (n, d)
        kept.append(y)
        return y

    moe.expert = patched  # type: ignore[method-assign]
    with torch.no_grad():
        moe(x)
    assert kept and all(bool((y == y.flatten()[0]).all()) for y in kept)  # not scaled in place


def test_routed_sum_in_place_only_for_fresh_outputs() -> None:
    flat = torch.randn(5, 3, generator=torch.Generator().manual_seed(4))
    weights = torch.tensor([[0.5, 0.0], [0.0, 2.0], [0.25, 0.75], [0.0, 0.0], [1.5, 0.0]])
    both = routed_sum(flat, weights, lambda e, r: r * (e + 1.0), fresh=True)
    assert torch.equal(both, routed_sum(flat, weights, lambda e, r: r * (e + 1.0)))
    chosen_before = flat.clone()
    routed_sum(flat, weights, lambda e, r: r)  # the expert hands back its input: not scaled in place
    assert torch.equal(flat, chosen_before)


@pytest.mark.parametrize("routing", ["sigmoid_group_topk", "softmax_group_topk"])
def test_every_group_kept_routes_as_the_group_mask_does(routing: str) -> None:
    """topk_group == n_group: the mask is all True; skipped, the same choices and weights as
    transformers' routers compute with it."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(40, 8, generator=g)  # (N, E)
    bias = torch.randn(8, generator=g) if routing == "sigmoid_group_topk" else None
    got_i, got_w = group_topk(logits, routing, 3, 2, 2, score_bias=bias, norm_topk=True)
    if routing == "sigmoid_group_topk":  # DeepseekV3TopkRouter's ops
        scores = logits.sigmoid()
        choice = scores + bias  # type: ignore[operator]
        groups = choice.view(40, 2, 4).topk(2, dim=-1)[0].sum(dim=-1)  # (N, 2)
        keep = torch.zeros_like(groups).scatter_(1, torch.topk(groups, 2, dim=-1, sorted=False)[1], 1.0)
        choice = choice.masked_fill(~keep.unsqueeze(-1).expand(40, 2, 4).reshape(40, 8).bool(), float("-inf"))
        want_i = torch.topk(choice, 3, dim=-1, sorted=False)[1]
        want_w = scores.gather(1, want_i)
        want_w = want_w / (want_w.sum(dim=-1, keepdim=True) + 1e-20)
    else:  # DeepseekV2TopkRouter's group_limited_greedy
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        groups = scores.view(40, 2, 4).max(dim=-1).values  # (N, 2)
        keep = torch.zeros_like(groups).scatter_(1, torch.topk(groups, 2, dim=-1, sorted=False)[1], 1.0)
        scores = scores.masked_fill(~keep.unsqueeze(-1).expand(40, 2, 4).reshape(40, 8).bool(), 0.0)
        want_w, want_i = torch.topk(scores, 3, dim=-1, sorted=False)
    assert torch.equal(got_i, want_i)
    assert torch.equal(got_w, want_w)
