"""Rotary attention layers: fast path == traced path == a reference written here, KV cache, positions,
gradcheck; grouped-query head views; RoPE-aware QK circuits (``Head.qk(delta)``) against the traced scores;
the per-plane decomposition of the scores (``analysis.rotary_planes``)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import headspace as hs
from headspace import MultiHeadAttention
from headspace.analysis import RotaryPlanes, plane_scores, rotary_planes
from headspace.nn.positions import Rotary

pytestmark = pytest.mark.usefixtures("single_thread")

B, S, H, HKV, DH = 2, 7, 6, 2, 10  # batch, seq, query heads, key/value heads (groups of 3), d_head
D = 11  # d_model: prime, unrelated to H * DH = 60


def rotary_layer(
    *, interleaved: bool = False, fraction: float = 1.0, bias: bool = True, dtype: torch.dtype = torch.float32
) -> MultiHeadAttention:
    rot = Rotary(DH, base=100.0, fraction=fraction, interleaved=interleaved)
    attn = MultiHeadAttention(D, H, d_head=DH, n_kv_heads=HKV, bias=bias, rotary=rot, dtype=dtype)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0.0, 0.5)
    return attn.eval()


def reference(attn: MultiHeadAttention, x: Tensor, positions: Tensor, causal: bool = True) -> Tensor:
    """The layer's maths written out here: projections, Rotary.rotate, GQA by repetition, causal softmax."""
    Sx = x.shape[1]
    q = torch.einsum("bsm,hmd->bhsd", x, attn.W_Q)  # (B, H, S, dh)
    k = torch.einsum("bsm,gmd->bgsd", x, attn.W_K)  # (B, Hkv, S, dh)
    v = torch.einsum("bsm,gmd->bgsd", x, attn.W_V)  # (B, Hkv, S, dh)
    if attn.b_Q is not None:
        q = q + attn.b_Q[None, :, None]
        k = k + attn.b_K[None, :, None]
        v = v + attn.b_V[None, :, None]
    q = attn.rotary.rotate(q, positions)
    k = attn.rotary.rotate(k, positions)
    g = attn.n_heads // attn.n_kv_heads
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # (B, H, S, dh)
    scores = q @ k.transpose(-2, -1) / math.sqrt(attn.d_head)  # (B, H, S, S)
    if causal:
        scores = scores.masked_fill(~torch.ones(Sx, Sx, dtype=torch.bool).tril(), float("-inf"))
    z = scores.softmax(-1) @ v  # (B, H, S, dh)
    out = torch.einsum("bhsd,hdm->bsm", z, attn.W_O)
    return out if attn.b_O is None else out + attn.b_O


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("fraction", [1.0, 0.6])
def test_fast_path_equals_traced_path_and_the_reference(interleaved: bool, fraction: float) -> None:
    attn = rotary_layer(interleaved=interleaved, fraction=fraction)
    x = torch.randn(B, S, D)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [3, 4, 5, 9, 10, 11, 12]])  # per row, with a gap
    fast = attn(x, is_causal=True, positions=positions)
    with hs.trace(attn) as t:
        traced = attn(x, is_causal=True, positions=positions)
    ref = reference(attn, x, positions)
    torch.testing.assert_close(fast, ref)
    torch.testing.assert_close(traced, ref)
    # the hook points: hook_q before the rotation, hook_rot_q after; [batch, seq, heads, d_head]
    assert t["hook_rot_q"].shape == (B, S, H, DH) and t["hook_rot_k"].shape == (B, S, HKV, DH)
    rot_q = attn.rotary.rotate(t["hook_q"].transpose(1, 2), positions).transpose(1, 2)
    torch.testing.assert_close(t["hook_rot_q"], rot_q, rtol=0, atol=0)  # the same operations, bitwise
    rd = attn.rotary.rotary_dim
    assert torch.equal(t["hook_rot_k"][..., rd:], t["hook_k"][..., rd:])  # pass-through features
    # need_weights (explicit kernel) agrees too
    out, pattern = attn(x, is_causal=True, positions=positions, need_weights=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(pattern, t["hook_pattern"])


def test_default_positions_count_from_the_cache_and_the_cache_holds_rotated_keys() -> None:
    attn = rotary_layer()
    x = torch.randn(B, S, D)
    full = attn(x, is_causal=True)  # positions 0 .. S - 1
    torch.testing.assert_close(full, attn(x, is_causal=True, positions=torch.arange(S)))
    with hs.trace(attn) as t:
        attn(x, is_causal=True)
    cache = attn.make_kv_cache(B, S)
    steps = [attn(x[:, :3], is_causal=True, kv_cache=cache)]
    steps += [attn(x[:, i : i + 1], is_causal=True, kv_cache=cache) for i in range(3, S)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full)
    torch.testing.assert_close(cache.k, t["hook_rot_k"].transpose(1, 2))  # rotated keys are cached


def test_only_position_differences_reach_the_scores() -> None:
    """A left-padded row counting its positions from its first real token equals the row alone."""
    attn = rotary_layer()
    x = torch.randn(1, 5, D)
    alone = attn(x, is_causal=True)
    padded = torch.cat([torch.randn(1, 2, D), x], dim=1)  # two padding tokens in front
    real = torch.tensor([[False, False, True, True, True, True, True]])
    positions = (real.cumsum(1) - 1).clamp(min=0)  # [0, 0, 0, 1, 2, 3, 4]
    out = attn(padded, is_causal=True, key_padding=real, positions=positions)
    torch.testing.assert_close(out[:, 2:], alone)
    shifted = attn(x, is_causal=True, positions=torch.arange(5) + 17)  # any common offset
    torch.testing.assert_close(shifted, alone, rtol=1e-5, atol=2e-5)  # angles rounded at other positions


def test_rotary_arguments_are_checked() -> None:
    attn = rotary_layer()
    x = torch.randn(B, S, D)
    with pytest.raises(
        ValueError, match=r"positions must be \[seq_q=7\] or \[batch=2, seq_q=7\].*got shape \[6\]"
    ):
        attn(x, positions=torch.arange(6))
    with pytest.raises(TypeError, match=r"positions must have an integer dtype.*float32"):
        attn(x, positions=torch.arange(S).float())
    with pytest.raises(ValueError, match="rotary positions, which are defined for self-attention only"):
        attn(x, x, x)
    plain = MultiHeadAttention(D, H, d_head=DH)
    with pytest.raises(ValueError, match=r"positions were given but this layer has no rotary positions"):
        plain(x, positions=torch.arange(S))
    assert plain.rotary is None and plain.hook_rot_q is None and len(plain._hook_points) == 7
    with pytest.raises(ValueError, match="rotary was made for d_head=8 but this layer has d_head=10"):
        MultiHeadAttention(D, H, d_head=DH, rotary=Rotary(8))
    with pytest.raises(TypeError, match=r"rotary must be a headspace\.positions\.Rotary"):
        MultiHeadAttention(D, H, d_head=DH, rotary="rope")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="qkv_bias must be a bool or None"):
        MultiHeadAttention(D, H, d_head=DH, qkv_bias=1)  # type: ignore[arg-type]


def test_separate_bias_switches() -> None:
    attn = MultiHeadAttention(D, H, d_head=DH, bias=False, qkv_bias=True)
    assert attn.b_Q is not None and attn.b_O is None
    assert "qkv_bias=True, out_bias=False" in repr(attn)
    attn = MultiHeadAttention(D, H, d_head=DH, out_bias=False)
    assert attn.b_Q is not None and attn.b_O is None


@pytest.mark.parametrize("interleaved", [False, True])
def test_gradcheck_float64(interleaved: bool) -> None:
    attn = MultiHeadAttention(
        5, 2, d_head=4, n_kv_heads=1, rotary=Rotary(4, base=10.0, fraction=0.5, interleaved=interleaved),
        dtype=torch.float64,
    )  # fmt: skip
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_()
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    positions = torch.tensor([[0, 1, 2], [4, 6, 7]])
    assert torch.autograd.gradcheck(lambda t: attn(t, is_causal=True, positions=positions), (x,))
    with hs.trace(attn, names="hook_rot_q"):
        assert torch.autograd.gradcheck(lambda t: attn(t, is_causal=True, positions=positions), (x,))


# ------------------------------------------------------------------------------------------ GQA head views
def test_grouped_query_heads_share_their_key_value_storage() -> None:
    attn = rotary_layer()
    h1, h2, h4 = attn.heads[1], attn.heads[2], attn.heads[4]
    assert h1.kv_index == h2.kv_index == 0 and h4.kv_index == 1
    assert h1.kv_group == [0, 1, 2] and h4.kv_group == [3, 4, 5]
    assert h1.shares_kv_with == [0, 2] and h4.shares_kv_with == [3, 5]
    assert h1.W_K.data_ptr() == h2.W_K.data_ptr() == attn.W_K[0].data_ptr()
    assert h1.W_K._base is not None  # a view of the fused storage, not a copy
    with torch.no_grad():
        h1.W_V[0, 0] = 123.0
    assert float(h2.W_V[0, 0].detach()) == 123.0
    assert float(attn.qkv_weight[H * DH + HKV * DH, 0].detach()) == 123.0
    assert (
        repr(h4) == "Head(4 of 6, d_model=11, d_head=10, kv_head=1 shared with heads [3, 5], rotary_dim=10)"
    )
    plain = MultiHeadAttention(D, H, d_head=DH)
    assert plain.heads[2].shares_kv_with == [] and repr(plain.heads[2]).endswith("kv_head=2)")


# ----------------------------------------------------------------------------------------------- circuits
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("fraction", [1.0, 0.6])
def test_qk_delta_equals_the_traced_scores(interleaved: bool, fraction: float) -> None:
    """[x_i, 1] qk(p_i - p_j, augmented) [x_j, 1]^T == hook_scores * sqrt(d_head), with GQA and biases."""
    attn = rotary_layer(interleaved=interleaved, fraction=fraction, dtype=torch.float64)
    x = torch.randn(B, S, D, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [2, 3, 5, 8, 9, 13, 14]])
    with hs.trace(attn, names="hook_scores") as t:
        attn(x, is_causal=True, positions=positions)
    scores = t["hook_scores"] * math.sqrt(DH)  # (B, H, S, S), -inf above the diagonal
    ones = torch.ones(B, S, 1, dtype=torch.float64)
    xa = torch.cat([x, ones], dim=-1)  # (B, S, d_model + 1)
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    for b in range(B):
        delta = positions[b][:, None] - positions[b][None, :]  # (S, S): query position - key position
        for h in range(H):
            circuit = attn.heads[h].qk(delta, augmented=True)  # batched over the (i, j) offsets
            assert circuit.shape == (S, S, D + 1, D + 1)
            M = circuit.AB  # (S, S, D + 1, D + 1)
            got = torch.einsum("im,ijmn,jn->ij", xa[b], M, xa[b])  # (S, S)
            torch.testing.assert_close(got[causal], scores[b, h][causal], rtol=1e-10, atol=1e-10)
    # one offset at a time, as an int, gives the same matrix
    torch.testing.assert_close(
        attn.heads[3].qk(4, augmented=True).AB, attn.heads[3].qk(torch.tensor(4), augmented=True).AB
    )


def test_qk_without_bias_rows_and_without_rotary() -> None:
    attn = rotary_layer(bias=False, dtype=torch.float64)
    x = torch.randn(1, S, D, dtype=torch.float64)
    with hs.trace(attn, names="hook_scores") as t:
        attn(x, is_causal=True)
    head = attn.heads[5]
    i, j = 6, 2
    got = x[0, i] @ head.qk(i - j).AB @ x[0, j]
    torch.testing.assert_close(got, t["hook_scores"][0, 5, i, j] * math.sqrt(DH))
    torch.testing.assert_close(head.qk().AB, head.qk(0).AB)  # qk() is the offset-0 circuit
    assert head.qk(3, augmented=True).shape == (D + 1, D + 1)  # zero bias rows without biases
    plain = MultiHeadAttention(D, H, d_head=DH)
    torch.testing.assert_close(plain.heads[1].qk(5).AB, plain.heads[1].qk().AB)  # no offset dependence
    with pytest.raises(TypeError, match="delta must be None, an int or an integer tensor"):
        head.qk(1.5)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ planes
def rotary_decoder(**overrides: object) -> hs.Decoder:
    cfg = dict(
        arch="decoder", vocab_size=29, d_model=D, n_layers=2, n_heads=H, n_kv_heads=HKV, d_head=DH,
        d_mlp=13, max_seq_len=32, positions="rotary", rope_theta=100.0, norm_kind="rmsnorm",
        mlp_kind="gated", act="silu", bias=False, qkv_bias=True,
    )  # fmt: skip
    cfg.update(overrides)
    return hs.Decoder(hs.ModelConfig(**cfg)).eval()


def test_plane_parts_sum_exactly_to_the_scores() -> None:
    model = rotary_decoder(rotary_fraction=0.6).double()
    tokens = torch.randint(0, 29, (B, 9))
    with hs.trace(model, names="blocks.1.attn.hook_*") as t:
        model(tokens)
    attn = model.blocks[1].attn
    parts = plane_scores(t["blocks.1.attn.hook_rot_q"], t["blocks.1.attn.hook_rot_k"], attn.rotary)
    assert parts.shape == (B, H, 9, 9, 3 + 1)  # 3 planes (rotary_dim 6) + the pass-through part
    scores = t["blocks.1.attn.hook_scores"] / attn.scale
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    torch.testing.assert_close(parts.sum(-1)[..., causal], scores[..., causal], rtol=1e-12, atol=1e-12)


def test_rotary_planes_shares_wavelengths_and_labels() -> None:
    model = rotary_decoder(n_layers=1, n_heads=2, n_kv_heads=2, rope_theta=10000.0)
    attn = model.blocks[0].attn
    rot = attn.rotary  # planes (i, i + 5), wavelengths 2 pi * 10000^(2i / 10): 6.3 ... 10^3.2 tokens
    with torch.no_grad():  # head 0 reads only the slowest plane (4, 9), head 1 only the fastest (0, 5)
        attn.W_Q.zero_()
        attn.W_K.zero_()
        attn.qkv_bias.zero_()
        for head, (a, b) in ((0, rot.planes()[-1]), (1, rot.planes()[0])):
            attn.W_Q[head][:, [a, b]] = torch.randn(D, 2)
            attn.W_K[head][:, [a, b]] = torch.randn(D, 2)
    tokens = torch.randint(0, 29, (3, 20))
    result = rotary_planes(model, tokens)
    assert isinstance(result, RotaryPlanes)
    assert result.share.shape == (1, 2, 5) and result.wavelengths.shape == (1, 5)
    torch.testing.assert_close(result.wavelengths[0], rot.wavelengths.double())
    torch.testing.assert_close(
        result.share.sum(-1) + result.passthrough, torch.ones(1, 2, dtype=torch.float64)
    )
    assert float(result.share[0, 0, -1]) == pytest.approx(1.0) and float(
        result.share[0, 1, 0]
    ) == pytest.approx(1.0)
    assert result.split == 20.0 and result.n_pairs == 3 * 20 * 21 // 2  # causal pairs of real tokens
    assert result.labels == [["content", "position"]]
    assert result.heads_with("position") == [(0, 1)]
    d = result.to_dict()
    assert d["kind"] == "rotary_planes" and len(d["share"][0][0]) == 5
    # padding: padded queries and keys do not count
    kp = torch.ones(3, 20, dtype=torch.bool)
    kp[0, 15:] = False
    assert rotary_planes(model, tokens, key_padding=kp).n_pairs == 2 * 210 + 15 * 16 // 2


def test_rotary_planes_refuses_models_without_rotary() -> None:
    model = hs.Decoder(
        hs.ModelConfig(arch="decoder", vocab_size=29, d_model=D, n_layers=1, n_heads=1, max_seq_len=8)
    )
    with pytest.raises(ValueError, match="rotary_planes needs rotary positions in every attention layer"):
        rotary_planes(model, torch.randint(0, 29, (1, 4)))
    with pytest.raises(ValueError, match=r"threshold must be a number in \(0.5, 1\]"):
        rotary_planes(rotary_decoder(), torch.randint(0, 29, (1, 4)), threshold=0.3)
