"""The experts' gate and up projections as the halves of one buffer (headspace.model.moe_fused): one
product per expert where the layout allows it, the two products otherwise, the same outputs; the layout
survives assign-loading, deepcopy and in-place edits; DeepSeek's routing with every group kept."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from headspace.model.moe import MixtureOfExperts
from headspace.model.moe_fused import gate_in_rows, lay_out_gate_in
from headspace.model.moe_routing import group_topk

E, DM, D = 6, 14, 10


def _moe(**kwargs: object) -> MixtureOfExperts:
    torch.manual_seed(0)
    moe = MixtureOfExperts(D, DM, E, 2, **kwargs).eval()  # type: ignore[arg-type]
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(std=0.5)
    return moe


def _reference(moe: MixtureOfExperts, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e as the module docstring writes it, each product apart: [n, d_model] -> [n, d_model]."""
    gate = F.linear(x, moe.experts_gate[e].detach().clone())  # (n, d_mlp)
    up = F.linear(x, moe.experts_in[e].detach().clone())  # (n, d_mlp)
    return F.linear(F.silu(gate) * up, moe.experts_out[e].detach().clone())  # (n, d_model)


def _stacked(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "router.weight": torch.randn(E, D, generator=g),
        "experts_gate": torch.randn(E, DM, D, generator=g),  # contiguous, as the loaders stack them
        "experts_in": torch.randn(E, DM, D, generator=g),
        "experts_out": torch.randn(E, D, DM, generator=g),
    }


def test_a_new_module_holds_gate_and_up_as_halves_of_one_buffer() -> None:
    moe = _moe()
    rows = gate_in_rows(moe.experts_gate, moe.experts_in)
    assert rows is not None and rows.shape == (E, 2 * DM, D)
    assert torch.equal(rows[:, :DM], moe.experts_gate) and torch.equal(rows[:, DM:], moe.experts_in)
    assert type(moe.experts_gate) is nn.Parameter and moe.experts_gate.shape == (E, DM, D)


def test_assign_loading_lays_the_halves_out_again_with_the_loaded_values() -> None:
    moe = MixtureOfExperts(D, DM, E, 2)
    sd = _stacked(1)
    moe.load_state_dict(sd, strict=True, assign=True)
    assert gate_in_rows(moe.experts_gate, moe.experts_in) is not None
    for name in ("experts_gate", "experts_in", "experts_out"):
        assert torch.equal(getattr(moe, name), sd[name])
    assert moe.experts_gate.data_ptr() != sd["experts_gate"].data_ptr()  # a copy, not the caller's tensor
    copied = MixtureOfExperts(D, DM, E, 2)
    before = copied.experts_gate
    copied.load_state_dict(sd, strict=True)  # (copied into the parameters: the same objects, same layout)
    assert copied.experts_gate is before and gate_in_rows(copied.experts_gate, copied.experts_in) is not None
    assert torch.equal(copied.experts_in, sd["experts_in"])


def test_one_product_per_expert_equals_the_two_products() -> None:
    moe = _moe()
    x = torch.randn(9, D, generator=torch.Generator().manual_seed(2))
    assert moe._expert_fn() == moe._expert_apart  # a gradient may be taken: the two products
    with torch.no_grad():
        fused = moe._expert_fn()
        assert fused != moe._expert_apart  # the layout allows the one product
        for e in range(E):
            want = _reference(moe, e, x)
            torch.testing.assert_close(fused(e, x), want, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(moe._expert_apart(e, x), want, atol=1e-6, rtol=1e-6)
            assert torch.equal(moe.expert(e, x), fused(e, x))


@pytest.mark.parametrize("grad", [False, True])
def test_any_other_layout_runs_the_two_products_with_the_same_outputs(grad: bool) -> None:
    moe = _moe(d_shared=12, shared_gate=False)
    x = torch.randn(2, 7, D, generator=torch.Generator().manual_seed(3), requires_grad=grad)
    with torch.set_grad_enabled(grad):
        want = moe(x)
        moe.experts_in = nn.Parameter(moe.experts_in.detach().clone())  # its own storage now
        assert gate_in_rows(moe.experts_gate, moe.experts_in) is None
        with torch.no_grad():
            assert moe._expert_fn() == moe._expert_apart
        got = moe(x)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    if grad:  # with a gradient to take, both halves get theirs (as from two separate parameters)
        fresh = _moe(d_shared=12, shared_gate=False)
        fresh(x).sum().backward()
        g_fused = fresh.experts_gate.grad, fresh.experts_in.grad
        assert g_fused[0] is not None and g_fused[1] is not None
        fresh.experts_in = nn.Parameter(fresh.experts_in.detach().clone())
        fresh.experts_gate.grad = None
        fresh(x).sum().backward()
        torch.testing.assert_close(fresh.experts_gate.grad, g_fused[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fresh.experts_in.grad, g_fused[1], atol=1e-5, rtol=1e-5)


def test_in_place_edits_reach_the_fused_product_and_a_deepcopy_computes_the_same() -> None:
    moe = _moe()
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        moe.experts_in[3].zero_()  # expert 3's up branch off: its output is 0
        assert not moe.expert(3, x).any() and moe.expert(2, x).any()
        twin = copy.deepcopy(moe)  # (Parameter's deepcopy clones each half: the two products there)
        assert twin.experts_gate.data_ptr() != moe.experts_gate.data_ptr()
        for e in range(E):
            torch.testing.assert_close(twin.expert(e, x), moe.expert(e, x), atol=1e-6, rtol=1e-6)


def test_biases_and_the_clamped_swiglu_keep_the_two_products() -> None:
    moe = _moe(routing="topk_softmax", router_bias=True, bias=True, swiglu=(7.0, 1.702))
    assert gate_in_rows(moe.experts_gate, moe.experts_in) is not None
    with torch.no_grad():
        assert moe._expert_fn() == moe._expert_apart


def test_lay_out_keeps_values_dtype_and_requires_grad() -> None:
    gate = torch.randn(3, 4, 5, dtype=torch.float64)
    up = torch.randn(3, 4, 5, dtype=torch.float64).requires_grad_()
    g, u = lay_out_gate_in(gate, up)
    assert torch.equal(g, gate) and torch.equal(u, up) and g.dtype == torch.float64
    assert not g.requires_grad and u.requires_grad
    assert gate_in_rows(g, u) is not None and gate_in_rows(gate, up) is None
    assert gate_in_rows(u, g) is None  # the halves in the other order are not [gate; up]


@pytest.mark.parametrize("routing", ["sigmoid_group_topk", "softmax_group_topk"])
def test_every_group_kept_routes_as_the_group_mask_does(routing: str) -> None:
    """topk_group == n_group: the group mask is all True; the routing skips it, same choices and weights."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(40, 8, generator=g)  # (N, E)
    bias = torch.randn(8, generator=g) if routing == "sigmoid_group_topk" else None
    got_i, got_w = group_topk(logits, routing, 3, 2, 2, score_bias=bias, norm_topk=True)
    if routing == "sigmoid_group_topk":  # transformers' DeepseekV3TopkRouter with the mask applied
        scores = logits.sigmoid()
        choice = scores + bias  # type: ignore[operator]
        groups = choice.view(40, 2, 4).topk(2, dim=-1)[0].sum(dim=-1)  # (N, 2)
        keep = torch.zeros_like(groups).scatter_(1, torch.topk(groups, 2, dim=-1, sorted=False)[1], 1.0)
        choice = choice.masked_fill(~keep.unsqueeze(-1).expand(40, 2, 4).reshape(40, 8).bool(), -1e9)
        want_i = torch.topk(choice, 3, dim=-1, sorted=False)[1]
        want_w = scores.gather(1, want_i)
        want_w = want_w / (want_w.sum(dim=-1, keepdim=True) + 1e-20)
    else:  # DeepseekV2TopkRouter, group_limited_greedy
        scores = logits.softmax(dim=-1)
        want_w, want_i = torch.topk(scores, 3, dim=-1, sorted=False)
    assert torch.equal(got_i, want_i)
    assert torch.equal(got_w, want_w)
