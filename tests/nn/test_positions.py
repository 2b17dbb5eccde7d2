"""Rotary position embeddings (headspace.positions) and RMSNorm (headspace.norms).

References: transformers' Llama / GPT-NeoX rotary embeddings, its RoPE init functions and its RMSNorms
(test-only), and hand-written complex-number and rotation-matrix references.

Notation used for tensor shapes:
    batch=2, n_heads=3, seq=5 (distinct where possible), d_head, rotary_dim, n_planes = rotary_dim // 2.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import GPTNeoXConfig, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding
from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_apply_rotary
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from headspace.nn.norms import RMSNorm
from headspace.nn.positions import Rotary

pytestmark = pytest.mark.usefixtures("single_thread")

B, H, S = 2, 3, 5
SRC = Path(__file__).resolve().parents[2] / "src" / "headspace"

# Left padding (transformers' cumsum(mask) - 1, pads filled with 1) in row 0, a KV-cache offset in row 1.
ROW_POSITIONS = torch.tensor([[1, 1, 0, 1, 2], [7, 8, 9, 10, 11]])  # [batch, seq]


def llama_config(head_dim: int, theta: float, **rope: Any) -> LlamaConfig:
    params = {"rope_type": "default", "rope_theta": theta, **rope}
    return LlamaConfig(
        hidden_size=head_dim * H,
        num_attention_heads=H,
        head_dim=head_dim,
        max_position_embeddings=256,
        rope_parameters=params,
    )


def complex_reference(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rotary_dim: int):
    """Meta's formulation: features (2i, 2i+1) as one complex number, times exp(i p w_i)."""
    x_rot = x[..., :rotary_dim].double()  # [batch, n_heads, seq, rotary_dim]
    xc = torch.view_as_complex(x_rot.unflatten(-1, (rotary_dim // 2, 2)).contiguous())  # [b, h, s, n_planes]
    angles = positions.double()[..., None] * inv_freq.double()  # [seq, n_planes] or [batch, seq, n_planes]
    if angles.dim() == 3:
        angles = angles.unsqueeze(1)  # [batch, seq, n_planes] -> [batch, 1, seq, n_planes]
    turned = xc * torch.polar(torch.ones_like(angles), angles)  # [batch, n_heads, seq, n_planes]
    out = torch.view_as_real(turned).flatten(-2)  # [b, h, s, n_planes, 2] -> [b, h, s, rotary_dim]
    return torch.cat((out, x[..., rotary_dim:].double()), dim=-1)  # [batch, n_heads, seq, d_head]


def il_to_rh(rotary_dim: int, d_head: int) -> torch.Tensor:
    """Feature permutation: index rotate-half layout from an interleaved one ((2i, 2i+1) -> (i, i + n))."""
    return torch.cat(
        (torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2), torch.arange(rotary_dim, d_head))
    )


# ----------------------------------------------------------------------------- transformers parity


@pytest.mark.parametrize("positions", [torch.arange(S), ROW_POSITIONS], ids=["seq", "batch_seq"])
def test_rotate_half_matches_transformers_llama(positions: torch.Tensor) -> None:
    d_head, theta = 16, 500.0
    hf = LlamaRotaryEmbedding(llama_config(d_head, theta))
    ours = Rotary(d_head, base=theta)
    torch.testing.assert_close(ours.inv_freq, hf.inv_freq, rtol=0, atol=0)
    q, k = torch.randn(B, H, S, d_head), torch.randn(B, H, S, d_head)
    position_ids = positions if positions.dim() == 2 else positions[None]  # [batch or 1, seq]
    cos, sin = hf(q, position_ids)  # each [batch or 1, seq, d_head]
    hq, hk = apply_rotary_pos_emb(q, k, cos, sin)
    our_cos, our_sin = ours.cos_sin(positions, torch.float32, q.device)
    torch.testing.assert_close(our_cos, cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(our_sin, sin, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.rotate(q, positions), hq, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.rotate(k, positions), hk, rtol=0, atol=1e-6)
    # bfloat16: computed in float32 then cast, as transformers.
    qb, kb = q.bfloat16(), k.bfloat16()
    cos_b, sin_b = hf(qb, position_ids)
    hqb, _ = apply_rotary_pos_emb(qb, kb, cos_b, sin_b)
    out_b = ours.rotate(qb, positions)
    assert out_b.dtype == torch.bfloat16
    torch.testing.assert_close(out_b, hqb, rtol=0, atol=0)


def test_partial_rotary_matches_transformers_gpt_neox() -> None:
    config = GPTNeoXConfig(
        hidden_size=32 * H,
        num_attention_heads=H,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
    hf = GPTNeoXRotaryEmbedding(config)
    ours = Rotary(32, fraction=0.25)
    assert ours.rotary_dim == 8
    torch.testing.assert_close(ours.inv_freq, hf.inv_freq, rtol=0, atol=0)
    q, k = torch.randn(B, H, S, 32), torch.randn(B, H, S, 32)
    cos, sin = hf(q, ROW_POSITIONS)  # each [batch, seq, rotary_dim]
    hq, hk = neox_apply_rotary(q, k, cos, sin)
    out_q = ours.rotate(q, ROW_POSITIONS)
    torch.testing.assert_close(out_q, hq, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.rotate(k, ROW_POSITIONS), hk, rtol=0, atol=1e-6)
    assert torch.equal(out_q[..., 8:], q[..., 8:])  # pass-through untouched


def test_phi_style_partial_rotary_hand_reference() -> None:
    # Phi-2: d_head 80, partial_rotary_factor 0.4 -> 32 rotated features; rotate-half on those only.
    ours = Rotary(80, fraction=0.4)
    assert ours.rotary_dim == 32
    x = torch.randn(B, H, S, 80, dtype=torch.float64)
    angles = ROW_POSITIONS.double()[..., None] * ours.inv_freq.double()  # [batch, seq, 16]
    cos = torch.cat((angles.cos(), angles.cos()), -1).unsqueeze(1)  # [batch, 1, seq, 32]
    sin = torch.cat((angles.sin(), angles.sin()), -1).unsqueeze(1)  # [batch, 1, seq, 32]
    x1, x2 = x[..., :16], x[..., 16:32]
    expected = torch.cat((x[..., :32] * cos + torch.cat((-x2, x1), -1) * sin, x[..., 32:]), -1)
    torch.testing.assert_close(ours.rotate(x, ROW_POSITIONS), expected, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------- interleaved


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("positions", [torch.arange(S) + 3, ROW_POSITIONS], ids=["seq", "batch_seq"])
def test_interleaved_matches_complex_reference(fraction: float, positions: torch.Tensor) -> None:
    d_head = 12
    ours = Rotary(d_head, interleaved=True, fraction=fraction)
    x = torch.randn(B, H, S, d_head, dtype=torch.float64)
    expected = complex_reference(x, positions, ours.inv_freq, ours.rotary_dim)
    torch.testing.assert_close(ours.rotate(x, positions), expected, rtol=0, atol=1e-12)
    x32 = x.float()
    torch.testing.assert_close(ours.rotate(x32, positions), expected.float(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_interleaved_equals_rotate_half_after_permutation(fraction: float) -> None:
    d_head = 12
    il = Rotary(d_head, interleaved=True, fraction=fraction)
    rh = Rotary(d_head, interleaved=False, fraction=fraction)
    perm = il_to_rh(il.rotary_dim, d_head)  # [d_head]
    x = torch.randn(B, H, S, d_head)
    torch.testing.assert_close(rh.rotate(x[..., perm], ROW_POSITIONS), il.rotate(x, ROW_POSITIONS)[..., perm])
    planes_il = [tuple(int(perm.tolist().index(f)) for f in plane) for plane in il.planes()]
    assert planes_il == rh.planes()  # plane i of one is plane i of the other, after the permutation
    cos_il, _ = il.cos_sin(ROW_POSITIONS)
    cos_rh, _ = rh.cos_sin(ROW_POSITIONS)
    assert torch.equal(cos_il[..., perm[: il.rotary_dim]], cos_rh)


# ----------------------------------------------------------------------------------------- scaling


def test_linear_scaling_inv_freq_matches_transformers() -> None:
    config = llama_config(16, 10000.0, rope_type="linear", factor=4.0)
    hf_inv, _ = ROPE_INIT_FUNCTIONS["linear"](config)
    ours = Rotary(16, scaling={"rope_type": "linear", "factor": 4.0})
    torch.testing.assert_close(ours.inv_freq, hf_inv, rtol=0, atol=0)
    # positions divided by the factor: position 8 scaled is position 2 unscaled (factor 4 is exact).
    x = torch.randn(1, H, 1, 16)
    plain = Rotary(16)
    assert torch.equal(ours.rotate(x, torch.tensor([8])), plain.rotate(x, torch.tensor([2])))
    hf_cos, _ = LlamaRotaryEmbedding(config)(x, ROW_POSITIONS)
    torch.testing.assert_close(ours.cos_sin(ROW_POSITIONS)[0], hf_cos, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("d_head", "original"), [(16, 64), (128, 8192)], ids=["small", "llama3.1_8b"])
def test_llama3_scaling_inv_freq_matches_transformers(d_head: int, original: int) -> None:
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original,
    }
    config = llama_config(d_head, 500000.0, **rope)
    hf_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    ours = Rotary(d_head, base=500000.0, scaling=dict(rope))
    torch.testing.assert_close(ours.inv_freq, hf_inv, rtol=0, atol=0)
    plain = Rotary(d_head, base=500000.0)
    kept = ours.inv_freq == plain.inv_freq
    divided = torch.isclose(ours.inv_freq, plain.inv_freq / 8.0)
    smoothed = ~kept & ~divided
    assert kept.any() and divided.any() and smoothed.any()  # all three bands are exercised
    # transformers' own rope_parameters (with rope_theta) may be passed through as they are.
    again = Rotary(d_head, base=500000.0, scaling=dict(config.rope_parameters))
    assert torch.equal(again.inv_freq, ours.inv_freq)
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(torch.randn(1), ROW_POSITIONS)
    our_cos, our_sin = ours.cos_sin(ROW_POSITIONS)
    torch.testing.assert_close(our_cos, hf_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(our_sin, hf_sin, rtol=0, atol=1e-6)


@pytest.mark.parametrize("scaling", [{"rope_type": "default"}, {"type": "default"}])
def test_default_scaling_is_no_scaling(scaling: dict[str, Any]) -> None:
    assert torch.equal(Rotary(8, scaling=scaling).inv_freq, Rotary(8).inv_freq)


# ---------------------------------------------------------------------------- rotation matrices


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_rotation_gives_relative_scores(interleaved: bool, fraction: float) -> None:
    d_head = 12
    rot = Rotary(d_head, interleaved=interleaved, fraction=fraction, base=100.0)
    n = 7
    positions = torch.tensor([0, 3, 11, 2, 40, 5, 97])  # [n]
    q = torch.randn(1, 1, n, d_head, dtype=torch.float64)
    k = torch.randn(1, 1, n, d_head, dtype=torch.float64)
    scores = rot.rotate(q, positions)[0, 0] @ rot.rotate(k, positions)[0, 0].T  # [n, n]
    delta = positions[:, None] - positions[None, :]  # [n, n], query minus key
    matrices = rot.rotation(delta)  # [n, n, d_head, d_head]
    expected = torch.einsum("id,ijde,je->ij", q[0, 0], matrices, k[0, 0])  # [n, n]
    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-10)
    # rotate(x, p) == x @ R(p), row by row
    rows = torch.einsum("nd,nde->ne", q[0, 0], rot.rotation(positions))  # [n, d_head]
    torch.testing.assert_close(rot.rotate(q, positions)[0, 0], rows, rtol=0, atol=1e-12)
    # orthogonal, R(0) = I, R(s) R(t) = R(s + t), R(t)^T = R(-t)
    eye = torch.eye(d_head, dtype=torch.float64)
    for t in (1, -4, 37):
        r = rot.rotation(t)
        torch.testing.assert_close(r @ r.T, eye, rtol=0, atol=1e-12)
        torch.testing.assert_close(r.T, rot.rotation(-t), rtol=0, atol=1e-12)
        torch.testing.assert_close(r @ rot.rotation(5), rot.rotation(t + 5), rtol=0, atol=1e-12)
    assert torch.equal(rot.rotation(0), eye)
    assert torch.equal(rot.rotation(torch.tensor(3)), rot.rotation(3))
    assert rot.rotation(3, dtype=torch.float32).dtype == torch.float32
    # the sign convention: on plane (a, b) with frequency w, R[a, b] = +sin(delta w)
    a, b = rot.planes()[0]
    assert rot.rotation(1)[a, b] == pytest.approx(math.sin(rot.inv_freq[0].item()))


# ----------------------------------------------------------------------- planes and wavelengths


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_planes_and_wavelengths(interleaved: bool, fraction: float) -> None:
    d_head = 12
    rot = Rotary(d_head, interleaved=interleaved, fraction=fraction)
    r = rot.rotary_dim
    planes = rot.planes()
    assert len(planes) == r // 2 == rot.inv_freq.shape[0] == rot.wavelengths.shape[0]
    expected = (
        [(2 * i, 2 * i + 1) for i in range(r // 2)]
        if interleaved
        else [(i, i + r // 2) for i in range(r // 2)]
    )
    assert planes == expected
    assert sorted(f for plane in planes for f in plane) == list(range(r))  # pass-through features are in none
    torch.testing.assert_close(rot.wavelengths * rot.inv_freq, torch.full((r // 2,), 2 * math.pi))
    assert torch.allclose(rot.inv_freq, 10000.0 ** (-torch.arange(0, r, 2, dtype=torch.float64) / r).float())
    # plane i turns at inv_freq[i]: e_a at position p -> cos(p w) e_a + sin(p w) e_b
    p = 3
    for i, (a, b) in enumerate(planes):
        e = torch.zeros(1, 1, 1, d_head, dtype=torch.float64)
        e[..., a] = 1.0
        out = rot.rotate(e, torch.tensor([p]))[0, 0, 0]
        w = rot.inv_freq[i].double()
        torch.testing.assert_close(out[a], torch.cos(p * w), rtol=0, atol=1e-12)
        torch.testing.assert_close(out[b], torch.sin(p * w), rtol=0, atol=1e-12)
    # per-plane score parts plus the pass-through part add up to the full score
    i_pos, j_pos = 9, 4
    q = torch.randn(d_head, dtype=torch.float64)
    k = torch.randn(d_head, dtype=torch.float64)
    rq = rot.rotate(q.view(1, 1, 1, d_head), torch.tensor([i_pos])).flatten()  # [1, 1, 1, d_head] -> [d_head]
    rk = rot.rotate(k.view(1, 1, 1, d_head), torch.tensor([j_pos])).flatten()  # [1, 1, 1, d_head] -> [d_head]
    full = rq @ rk
    matrix = rot.rotation(i_pos - j_pos)
    parts = [q[[a, b]] @ matrix[[a, b]][:, [a, b]] @ k[[a, b]] for a, b in planes]
    passthrough = q[r:] @ k[r:]
    torch.testing.assert_close(sum(parts) + passthrough, full, rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------- tables and modules


def test_cached_tables_give_identical_numbers() -> None:
    cached = Rotary(16, max_seq_len=32)
    direct = Rotary(16)
    x = torch.randn(B, H, S, 16)
    for positions in (
        ROW_POSITIONS,
        torch.arange(S) + 27,
        torch.tensor([[0, 1, 2, 3, 40], [-1, 0, 1, 2, 3]]),
    ):
        assert torch.equal(cached.rotate(x, positions), direct.rotate(x, positions))
        for got, want in zip(
            cached.cos_sin(positions, torch.bfloat16), direct.cos_sin(positions, torch.bfloat16)
        ):
            assert torch.equal(got, want)


def test_module_has_no_state_and_keeps_float32_tables() -> None:
    rot = Rotary(16, max_seq_len=8)
    assert list(rot.parameters()) == [] and rot.state_dict() == {}
    before = rot.inv_freq.clone()
    rot.to(torch.bfloat16)
    assert rot.inv_freq.dtype == torch.float32 and torch.equal(rot.inv_freq, before)
    assert rot._cos_table is not None and rot._cos_table.dtype == torch.float32
    x = torch.randn(1, 1, 3, 16, dtype=torch.float64)
    out = rot.rotate(x, torch.arange(3))
    assert out.dtype == torch.float64 and out.shape == x.shape
    assert not torch.equal(out, x) and out.data_ptr() != x.data_ptr()  # out of place


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_gradcheck(interleaved: bool, fraction: float) -> None:
    rot = Rotary(8, interleaved=interleaved, fraction=fraction)
    x = torch.randn(1, 2, 3, 8, dtype=torch.float64, requires_grad=True)
    positions = torch.tensor([[0, 3, 7]])
    assert torch.autograd.gradcheck(lambda t: rot.rotate(t, positions), (x,))


@settings(max_examples=25, deadline=None)
@given(
    d_head=st.sampled_from([2, 4, 6, 8, 10, 14]),
    interleaved=st.booleans(),
    half=st.booleans(),
    shift=st.integers(-50, 50),
    seed=st.integers(0, 2**16),
)
def test_properties(d_head: int, interleaved: bool, half: bool, shift: int, seed: int) -> None:
    fraction = 0.5 if half and d_head % 4 == 0 else 1.0
    rot = Rotary(d_head, interleaved=interleaved, fraction=fraction)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, d_head, dtype=torch.float64, generator=gen)
    k = torch.randn(B, H, S, d_head, dtype=torch.float64, generator=gen)
    positions = torch.randint(0, 100, (B, S), generator=gen)  # [batch, seq]
    rq, rk = rot.rotate(q, positions), rot.rotate(k, positions)
    assert rq.shape == q.shape and rq.dtype == q.dtype
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1), rtol=0, atol=1e-12)  # orthogonal
    # scores depend on positions only through their differences
    scores = rq @ rk.transpose(-1, -2)  # [batch, n_heads, seq, seq]
    shifted = rot.rotate(q, positions + shift) @ rot.rotate(k, positions + shift).transpose(-1, -2)
    torch.testing.assert_close(shifted, scores, rtol=0, atol=1e-9)
    delta = (
        positions[:, :, None] - positions[:, None, :]
    )  # [batch, seq, 1] - [batch, 1, seq] -> [batch, seq, seq]
    expected = torch.einsum("bhid,bijde,bhje->bhij", q, rot.rotation(delta), k)  # [batch, n_heads, seq, seq]
    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-10)
    # one position row broadcast over the batch equals the [seq] form
    torch.testing.assert_close(rot.rotate(q, positions[0]), rot.rotate(q, positions[:1]), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_transformers_llama(dtype: torch.dtype) -> None:
    d_model = 24
    ours, hf = RMSNorm(d_model, eps=1e-5), LlamaRMSNorm(d_model, eps=1e-5)
    assert torch.equal(ours.weight, torch.ones(d_model))
    weight = torch.randn(d_model)
    with torch.no_grad():
        ours.weight.copy_(weight)
        hf.weight.copy_(weight)
    ours.to(dtype)
    hf.to(dtype)
    x = (torch.randn(B, S, d_model) * 3).to(dtype)
    out = ours(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out, hf(x), rtol=0, atol=0)
    if dtype == torch.float32:
        expected = weight * x / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-5).float()
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_offset_matches_transformers_gemma(dtype: torch.dtype) -> None:
    d_model = 24
    ours, hf = RMSNorm(d_model, offset=1.0), GemmaRMSNorm(d_model)
    assert torch.equal(ours.weight, torch.zeros(d_model))  # scale 1 + 0 at init, as Gemma
    weight = torch.randn(d_model)
    with torch.no_grad():
        ours.weight.copy_(weight)
        hf.weight.copy_(weight)
    ours.to(dtype)
    hf.to(dtype)
    x = torch.randn(B, S, d_model).to(dtype)
    torch.testing.assert_close(ours(x), hf(x), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------- layering


@pytest.mark.parametrize("module", ["nn/positions.py", "nn/norms.py", "nn/rope_scaling.py"])
def test_modules_import_only_torch_and_stdlib_basics(module: str) -> None:
    tree = ast.parse((SRC / module).read_text())
    allowed = {"__future__", "math", "dataclasses", "typing", "weakref", "torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and module == "nn/positions.py" and node.level == 1:
            # its one sibling, itself held to this rule: the rotary scalings (YaRN, dynamic, LongRoPE)
            assert node.module in (None, "rope_scaling"), f"{module}: relative import of {node.module}"
            assert node.module == "rope_scaling" or [a.name for a in node.names] == ["rope_scaling"]
            continue
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module is not None, f"{module}: relative import"
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            assert name in allowed or name.split(".")[0] == "torch", f"{module} imports {name}"


# -------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"d_head": 0}, ValueError, r"d_head must be a positive int; got 0"),
        ({"d_head": -4}, ValueError, r"d_head must be a positive int; got -4"),
        ({"d_head": 8.0}, TypeError, r"d_head must be a positive int; got float"),
        ({"d_head": True}, TypeError, r"d_head must be a positive int; got bool"),
        ({"d_head": 8, "base": 0.0}, ValueError, r"base must be a finite number > 0; got 0.0"),
        ({"d_head": 8, "base": -10.0}, ValueError, r"base must be a finite number > 0; got -10.0"),
        ({"d_head": 8, "base": math.inf}, ValueError, r"base must be a finite number > 0; got inf"),
        ({"d_head": 8, "base": math.nan}, ValueError, r"base must be a finite number > 0; got nan"),
        ({"d_head": 8, "base": "1e4"}, TypeError, r"base must be a finite number > 0; got str"),
        ({"d_head": 8, "fraction": 0.0}, ValueError, r"fraction must be in \(0, 1\]; got 0.0"),
        ({"d_head": 8, "fraction": 1.5}, ValueError, r"fraction must be in \(0, 1\]; got 1.5"),
        ({"d_head": 8, "fraction": "half"}, TypeError, r"fraction must be a number in \(0, 1\]; got str"),
        (
            {"d_head": 7},
            ValueError,
            r"rotary_dim = int\(d_head \* fraction\) = int\(7 \* 1.0\) = 7 must be even",
        ),
        ({"d_head": 8, "fraction": 0.1}, ValueError, r"= 0 must be even and >= 2"),
        ({"d_head": 12, "fraction": 0.25}, ValueError, r"= 3 must be even"),
        ({"d_head": 8, "interleaved": 1}, TypeError, r"interleaved must be a bool; got int"),
        ({"d_head": 8, "max_seq_len": 0}, ValueError, r"max_seq_len must be None or a positive int; got 0"),
        (
            {"d_head": 8, "max_seq_len": 8.0},
            TypeError,
            r"max_seq_len must be None or a positive int; got float",
        ),
        (
            {"d_head": 8, "scaling": "linear"},
            TypeError,
            r"scaling \(rope_scaling\) must be None or a dict.*got str",
        ),
        (
            {"d_head": 8, "scaling": {"rope_type": "proportional", "factor": 2.0}},
            ValueError,
            r"rope_scaling.*'rope_type' must be one of \['default', 'linear', 'llama3', 'yarn', 'dynamic', "
            r"'longrope'\]; got 'proportional'",
        ),
        (
            {"d_head": 8, "scaling": {"factor": 2.0}},
            ValueError,
            r"rope_scaling.*one of .*got no 'rope_type' key",
        ),
        (
            {"d_head": 8, "scaling": {"rope_type": "linear", "type": "llama3", "factor": 2.0}},
            ValueError,
            r"both 'rope_type'='linear' and 'type'='llama3'",
        ),
        (
            {"d_head": 8, "scaling": {"rope_type": "linear"}},
            ValueError,
            r"'linear' needs the keys \['factor'\]",
        ),
        (
            {"d_head": 8, "scaling": {"rope_type": "linear", "factor": 2.0, "beta": 1}},
            ValueError,
            r"'linear' takes the keys \['rope_type', 'factor'\]; got unexpected \['beta'\]",
        ),
        (
            {"d_head": 8, "scaling": {"rope_type": "linear", "factor": 0.0}},
            ValueError,
            r"'factor' must be a finite number > 0; got 0.0",
        ),
        (
            {"d_head": 8, "scaling": {"rope_type": "linear", "factor": "2"}},
            ValueError,
            r"'factor' must be a finite number > 0; got '2'",
        ),
        (
            {"d_head": 8, "scaling": {"rope_type": "default", "rope_theta": 500.0}},
            ValueError,
            r"'rope_theta'=500.0 disagrees with base=10000.0",
        ),
        (
            {"d_head": 8, "scaling": {"rope_type": "default", "partial_rotary_factor": 0.5}},
            ValueError,
            r"'partial_rotary_factor'=0.5 disagrees with fraction=1.0",
        ),
        (
            {
                "d_head": 8,
                "scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 4.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            },
            ValueError,
            r"'high_freq_factor' must be greater than 'low_freq_factor'; got high_freq_factor=4.0",
        ),
        (
            {
                "d_head": 8,
                "scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64.5,
                },
            },
            ValueError,
            r"'original_max_position_embeddings' must be a positive int; got 64.5",
        ),
        (
            {"d_head": 8, "scaling": {"rope_type": "llama3", "factor": 8.0}},
            ValueError,
            r"'llama3' needs the keys .*missing \['low_freq_factor', 'high_freq_factor', 'original_max",
        ),
    ],
)
def test_constructor_errors(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    d_head = kwargs.pop("d_head")
    with pytest.raises(error, match=match):
        Rotary(d_head, **kwargs)


@pytest.mark.parametrize(
    ("x", "positions", "error", "match"),
    [
        ([1.0], torch.arange(S), TypeError, r"x must be a tensor \[batch, n_heads, seq, d_head\]; got list"),
        (
            torch.randn(B, S, 8),
            torch.arange(S),
            ValueError,
            r"x must be 4-D .*d_head=8\]; got shape \[2, 5, 8\]",
        ),
        (
            torch.ones(B, H, S, 8, dtype=torch.int64),
            torch.arange(S),
            TypeError,
            r"x must be a floating tensor",
        ),
        (torch.randn(B, H, S, 6), torch.arange(S), ValueError, r"x's last dim must be d_head=8; got shape"),
        (
            torch.randn(B, H, S, 8),
            [0, 1, 2, 3, 4],
            TypeError,
            r"positions must be an integer tensor.*got list",
        ),
        (torch.randn(B, H, S, 8), torch.arange(S).float(), TypeError, r"integer dtype .*got torch.float32"),
        (
            torch.randn(B, H, S, 8),
            torch.ones(S, dtype=torch.bool),
            TypeError,
            r"integer dtype .*got torch.bool",
        ),
        (torch.randn(B, H, S, 8), torch.zeros(1, B, S, dtype=torch.int64), ValueError, r"got 3-D shape"),
        (
            torch.randn(B, H, S, 8),
            torch.arange(S + 1),
            ValueError,
            r"positions must be \[5\] or \[2, 5\].*got \[6\]",
        ),
        (torch.randn(B, H, S, 8), torch.zeros(3, S, dtype=torch.int64), ValueError, r"got \[3, 5\]"),
    ],
)
def test_rotate_errors(x: Any, positions: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Rotary(8).rotate(x, positions)


def test_cos_sin_and_rotation_errors() -> None:
    rot = Rotary(8)
    with pytest.raises(TypeError, match=r"positions must have an integer dtype"):
        rot.cos_sin(torch.zeros(S))
    with pytest.raises(TypeError, match=r"dtype must be a floating torch.dtype; got torch.int32"):
        rot.cos_sin(torch.arange(S), torch.int32)
    with pytest.raises(TypeError, match=r"delta must be an int or an integer tensor; got float 1.5"):
        rot.rotation(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"delta must be an int or an integer tensor; got torch.float32"):
        rot.rotation(torch.tensor(1.0))
    with pytest.raises(TypeError, match=r"dtype must be a floating torch.dtype; got torch.int64"):
        rot.rotation(1, dtype=torch.int64)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((0,), {}, r"d_model must be a positive int; got int 0"),
        ((8.0,), {}, r"d_model must be a positive int; got float 8.0"),
        ((True,), {}, r"d_model must be a positive int; got bool"),
        ((8,), {"eps": -1e-6}, r"eps must be a finite number >= 0; got float -1e-06"),
        ((8,), {"eps": math.nan}, r"eps must be a finite number >= 0; got float nan"),
        ((8,), {"eps": "1e-6"}, r"eps must be a finite number >= 0; got str"),
        ((8,), {"offset": math.inf}, r"offset must be a finite number; got float inf"),
    ],
)
def test_rmsnorm_constructor_errors(args: tuple[Any, ...], kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RMSNorm(*args, **kwargs)


def test_rmsnorm_input_errors() -> None:
    norm = RMSNorm(8)
    with pytest.raises(TypeError, match=r"x must be a tensor \[\.\.\., d_model=8\]; got list"):
        norm([1.0] * 8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"x's last dim must be d_model=8; got shape \[2, 5, 6\]"):
        norm(torch.randn(B, S, 6))
    with pytest.raises(ValueError, match=r"x's last dim must be d_model=8; got shape \[\]"):
        norm(torch.tensor(1.0))
