"""Per-head views: W_Q, W_K, W_V, W_O, the biases and ``heads[h]`` are zero-copy views of the fused storage.

A view is checked three ways: its memory lies inside the parameter's storage, its values are the right
slice of it, and writing into it (under no_grad) changes the layer exactly as writing the corresponding
entries of the fused storage does.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

from headspace import MultiHeadAttention

pytestmark = pytest.mark.usefixtures("single_thread")

B, S, D_MODEL, N_HEADS, N_KV, D_HEAD, KDIM, VDIM = 2, 3, 7, 6, 2, 5, 11, 13


def make(
    n_kv_heads: int = N_KV, *, kdim: int | None = None, vdim: int | None = None, bias: bool = True
) -> MultiHeadAttention:
    layer = MultiHeadAttention(
        D_MODEL, N_HEADS, d_head=D_HEAD, n_kv_heads=n_kv_heads, kdim=kdim, vdim=vdim, bias=bias
    )
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * 0.4)
    return layer


def inside(view: Tensor, param: nn.Parameter) -> bool:
    """True when every element of ``view`` lives in ``param``'s memory (no copy was made)."""
    size = param.element_size()
    lo, hi = param.data_ptr(), param.data_ptr() + param.numel() * size
    if view.untyped_storage().data_ptr() != param.untyped_storage().data_ptr():
        return False
    last = view.data_ptr() + sum((n - 1) * st for n, st in zip(view.shape, view.stride())) * size
    return lo <= view.data_ptr() and last < hi


# --- storage
def test_fused_layer_has_only_fused_parameters() -> None:
    layer = make()
    names = {n for n, _ in layer.named_parameters()}
    assert names == {"qkv_weight", "qkv_bias", "o_weight", "o_bias"}
    assert layer.qkv_weight.shape == ((N_HEADS + 2 * N_KV) * D_HEAD, D_MODEL)
    assert layer.o_weight.shape == (D_MODEL, N_HEADS * D_HEAD)
    assert set(layer.state_dict()) == names  # the views add nothing to a checkpoint


def test_cross_layer_has_separate_projections() -> None:
    layer = make(kdim=KDIM, vdim=VDIM)
    names = {n for n, _ in layer.named_parameters()}
    assert names == {"q_weight", "k_weight", "v_weight", "qkv_bias", "o_weight", "o_bias"}
    assert layer.k_weight.shape == (N_KV * D_HEAD, KDIM) and layer.v_weight.shape == (N_KV * D_HEAD, VDIM)


def test_views_live_inside_the_fused_storage() -> None:
    layer = make()
    for view in (layer.W_Q, layer.W_K, layer.W_V):
        assert inside(view, layer.qkv_weight)
    assert inside(layer.W_O, layer.o_weight)
    for view in (layer.b_Q, layer.b_K, layer.b_V):
        assert inside(view, layer.qkv_bias)
    assert layer.b_O is layer.o_bias
    for h in range(N_HEADS):
        head = layer.heads[h]
        for view in (head.W_Q, head.W_K, head.W_V, head.b_Q, head.b_K, head.b_V):
            assert inside(view, layer.qkv_weight) or inside(view, layer.qkv_bias)
        assert inside(head.W_O, layer.o_weight)


def test_cross_views_live_inside_their_storage() -> None:
    layer = make(kdim=KDIM, vdim=VDIM)
    assert inside(layer.W_Q, layer.q_weight)
    assert inside(layer.W_K, layer.k_weight)
    assert inside(layer.W_V, layer.v_weight)
    assert layer.W_K.shape == (N_KV, KDIM, D_HEAD) and layer.W_V.shape == (N_KV, VDIM, D_HEAD)


def test_view_values_are_the_right_slices() -> None:
    layer = make()
    hq, hkv = N_HEADS * D_HEAD, N_KV * D_HEAD
    w, b = layer.qkv_weight, layer.qkv_bias
    for h in range(N_HEADS):
        rows = slice(h * D_HEAD, (h + 1) * D_HEAD)
        assert torch.equal(layer.W_Q[h], w[rows].T)
        assert torch.equal(layer.b_Q[h], b[rows])
        assert torch.equal(layer.W_O[h], layer.o_weight[:, rows].T)
    for g in range(N_KV):
        k_rows = slice(hq + g * D_HEAD, hq + (g + 1) * D_HEAD)
        v_rows = slice(hq + hkv + g * D_HEAD, hq + hkv + (g + 1) * D_HEAD)
        assert torch.equal(layer.W_K[g], w[k_rows].T)
        assert torch.equal(layer.W_V[g], w[v_rows].T)
        assert torch.equal(layer.b_K[g], b[k_rows])
        assert torch.equal(layer.b_V[g], b[v_rows])


def test_views_follow_dtype_changes_and_loaded_weights() -> None:
    layer = make()
    layer.double()
    assert layer.W_Q.dtype == torch.float64 and inside(layer.W_Q, layer.qkv_weight)
    other = make().double()
    layer.load_state_dict(other.state_dict())
    assert torch.equal(layer.W_V, other.W_V) and inside(layer.W_V, layer.qkv_weight)


def test_views_carry_gradients_to_the_storage() -> None:
    layer = make()
    layer.W_K[1].sum().backward()
    grad = layer.qkv_weight.grad
    hq = N_HEADS * D_HEAD
    rows = slice(hq + D_HEAD, hq + 2 * D_HEAD)  # key head 1
    assert (grad[rows] == 1).all()
    assert grad.sum() == D_HEAD * D_MODEL  # nothing else


# --- the views are the layer's maths
def test_per_head_formula_through_the_views() -> None:
    """q_h = x W_Q[h] + b_Q[h], k_g = c W_K[g] + b_K[g], out = sum_h z_h W_O[h] + b_O, seen at the hooks."""
    layer = make(kdim=KDIM, vdim=VDIM)
    x, c, cv = torch.randn(B, S, D_MODEL), torch.randn(B, 4, KDIM), torch.randn(B, 4, VDIM)
    seen: dict[str, Tensor] = {}
    for name in ("hook_q", "hook_k", "hook_v", "hook_z"):
        getattr(layer, name).add(lambda t, hp, name=name: seen.__setitem__(name, t))
    out = layer(x, c, cv)
    for h in range(N_HEADS):
        head = layer.heads[h]
        assert_close(seen["hook_q"][:, :, h], x @ head.W_Q + head.b_Q)
    for g in range(N_KV):
        assert_close(seen["hook_k"][:, :, g], c @ layer.W_K[g] + layer.b_K[g])
        assert_close(seen["hook_v"][:, :, g], cv @ layer.W_V[g] + layer.b_V[g])
    summed = sum(seen["hook_z"][:, :, h] @ layer.W_O[h] for h in range(N_HEADS)) + layer.b_O
    assert_close(out, summed)


def test_qk_and_ov_circuits() -> None:
    """The QK circuit gives the scores; the OV circuit gives what a head writes per attended token."""
    layer = make(bias=False)
    x = torch.randn(B, S, D_MODEL)
    seen: dict[str, Tensor] = {}
    for name in ("hook_scores", "hook_pattern", "hook_result"):
        getattr(layer, name).add(lambda t, hp, name=name: seen.__setitem__(name, t))
    layer(x)
    for h in range(N_HEADS):
        head = layer.heads[h]
        qk = head.qk().AB  # (d_model, d_model)
        ov = head.ov().AB  # (d_model, d_model)
        assert_close(qk, head.W_Q @ head.W_K.T)
        assert_close(ov, head.W_V @ head.W_O)
        assert_close(seen["hook_scores"][:, h], x @ qk @ x.transpose(1, 2) * layer.scale)
        assert_close(seen["hook_result"][:, :, h], seen["hook_pattern"][:, h] @ (x @ ov))


# --- writing through views
def write_cases(layer: MultiHeadAttention) -> dict[str, tuple[Callable[[], None], Callable[[], None]]]:
    """For each view: (write through the view, the same write on the fused storage by hand)."""
    hq, hkv = N_HEADS * D_HEAD, N_KV * D_HEAD
    w, b, o = layer.qkv_weight, layer.qkv_bias, layer.o_weight
    # W_Q[h][i, j] is w[h * d_head + j, i]; W_O[h][j, m] is o[m, h * d_head + j]
    return {
        "W_Q": (lambda: layer.W_Q[4, 2, 3].add_(1.5), lambda: w[4 * D_HEAD + 3, 2].add_(1.5)),
        "W_K": (lambda: layer.W_K[1, 6, 0].add_(1.5), lambda: w[hq + D_HEAD + 0, 6].add_(1.5)),
        "W_V": (lambda: layer.W_V[0, 1, 4].add_(1.5), lambda: w[hq + hkv + 4, 1].add_(1.5)),
        "W_O": (lambda: layer.W_O[5, 2, 6].add_(1.5), lambda: o[6, 5 * D_HEAD + 2].add_(1.5)),
        "b_Q": (lambda: layer.b_Q[3, 1].add_(1.5), lambda: b[3 * D_HEAD + 1].add_(1.5)),
        "b_K": (lambda: layer.b_K[0, 2].add_(1.5), lambda: b[hq + 2].add_(1.5)),
        "b_V": (lambda: layer.b_V[1, 3].add_(1.5), lambda: b[hq + hkv + D_HEAD + 3].add_(1.5)),
        "b_O": (lambda: layer.b_O[4].add_(1.5), lambda: layer.o_bias[4].add_(1.5)),
        "heads[2].W_Q": (
            lambda: layer.heads[2].W_Q[0].mul_(-2),
            lambda: w[2 * D_HEAD : 3 * D_HEAD, 0].mul_(-2),
        ),
        "heads[4].W_V": (
            lambda: layer.heads[4].W_V.zero_(),
            lambda: w[hq + hkv + D_HEAD : hq + 2 * hkv].zero_(),
        ),
        "heads[1].W_O": (lambda: layer.heads[1].W_O.zero_(), lambda: o[:, D_HEAD : 2 * D_HEAD].zero_()),
    }


@pytest.mark.parametrize("case", list(write_cases(make())))
def test_writing_into_a_view_changes_the_output(case: str) -> None:
    layer = make()
    twin = make()
    twin.load_state_dict(layer.state_dict())
    x = torch.randn(B, S, D_MODEL)
    scores: list[Tensor] = []
    remove = layer.hook_scores.add(lambda t, hp: scores.append(t))
    before = layer(x, is_causal=True)
    with torch.no_grad():
        write_cases(layer)[case][0]()
        write_cases(twin)[case][1]()
    after = layer(x, is_causal=True)
    if case == "b_K":
        # b_K adds q_i . b_K to every score of row i: the scores move, the softmax does not
        assert not torch.allclose(scores[1], scores[0])
        assert_close(after, before)
    else:
        assert not torch.allclose(after, before)
    remove()
    assert_close(layer(x, is_causal=True), after)  # the fast path sees the write too
    for (n, p), (_, q) in zip(layer.named_parameters(), twin.named_parameters()):
        assert torch.equal(p, q), n
    assert_close(after, twin(x, is_causal=True))
    assert_close(layer(x, is_causal=True, need_weights=True)[0], after)


# --- heads[h]
def test_head_list_indexing_and_iteration() -> None:
    layer = make()
    assert len(layer.heads) == N_HEADS
    assert [h.index for h in layer.heads] == list(range(N_HEADS))
    assert layer.heads[-1].index == N_HEADS - 1
    assert layer.heads[3].W_Q.shape == (D_MODEL, D_HEAD)
    assert layer.heads[3].W_O.shape == (D_HEAD, D_MODEL)
    assert layer.heads[3].b_Q.shape == (D_HEAD,)
    assert layer.heads[3].W_Q.data_ptr() == layer.W_Q[3].data_ptr()
    with pytest.raises(IndexError, match=r"head index must be in \[0, 6\).*n_heads=6.*got 6"):
        layer.heads[6]
    with pytest.raises(IndexError, match=r"got -7"):
        layer.heads[-7]


def test_gqa_heads_share_their_key_value_head() -> None:
    layer = make(n_kv_heads=2)  # group size 3
    assert [h.kv_index for h in layer.heads] == [0, 0, 0, 1, 1, 1]
    assert layer.heads[4].W_K.data_ptr() == layer.heads[5].W_K.data_ptr() == layer.W_K[1].data_ptr()
    assert layer.heads[0].W_V.data_ptr() != layer.heads[3].W_V.data_ptr()
    with torch.no_grad():
        layer.heads[4].W_K.zero_()
    assert (layer.heads[3].W_K == 0).all() and (layer.W_K[1] == 0).all() and (layer.W_K[0] != 0).any()
    mqa = make(n_kv_heads=1)
    assert {h.kv_index for h in mqa.heads} == {0}


def test_no_bias_views_are_none() -> None:
    layer = make(bias=False)
    assert layer.b_Q is None and layer.b_K is None and layer.b_V is None and layer.b_O is None
    head = layer.heads[0]
    assert head.b_Q is None and head.b_K is None and head.b_V is None


def test_head_index_types() -> None:
    layer = make()
    assert layer.heads[np.int64(2)].index == 2  # any integer type with __index__
    assert layer.heads[torch.tensor(5)].index == 5
    with pytest.raises(TypeError, match=r"head index must be an int in \[0, 6\).*got bool True"):
        layer.heads[True]
    with pytest.raises(TypeError, match=r"got float 1.0"):
        layer.heads[1.0]
    with pytest.raises(TypeError, match=r"got slice.*list\(attn.heads\)\[a:b\]"):
        layer.heads[1:3]


def test_device_and_dtype_arguments() -> None:
    """device= and dtype= place every parameter (and so every view); meta -> to_empty -> reset works."""
    layer = MultiHeadAttention(
        D_MODEL, N_HEADS, d_head=D_HEAD, n_kv_heads=N_KV, device="meta", dtype=torch.float64
    )
    assert all(p.device.type == "meta" and p.dtype == torch.float64 for p in layer.parameters())
    assert layer.W_Q.device.type == "meta" and layer.W_Q.shape == (N_HEADS, D_MODEL, D_HEAD)
    layer = layer.to_empty(device="cpu")
    layer.reset_parameters()
    assert inside(layer.W_K, layer.qkv_weight) and layer.W_K.dtype == torch.float64
    assert (layer.qkv_bias == 0).all() and (layer.o_bias == 0).all()
    # Xavier-uniform per projection: W_Q's [out, in] = [30, 7] block is bounded by sqrt(6 / (30 + 7))
    bound = (6 / (N_HEADS * D_HEAD + D_MODEL)) ** 0.5
    assert layer.qkv_weight[: N_HEADS * D_HEAD].abs().max() <= bound
    assert layer(torch.randn(B, S, D_MODEL, dtype=torch.float64)).shape == (B, S, D_MODEL)
