"""The RMS statistic written once (headspace.nn.norms.rms_inverse): bitwise torch's F.rms_norm roundings,
and the one statistic that RMSNorm and every analysis freezing an RMS norm use.

References: ``torch.nn.functional.rms_norm`` (bitwise), transformers' ``LlamaRMSNorm`` (its variance).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from headspace.analysis.atlas_measure import norm_split
from headspace.analysis.causal_inputs import frozen_norm
from headspace.analysis.graph import _norm_pullback
from headspace.attention.layer import MultiHeadAttention
from headspace.nn.norms import RMSNorm, rms_inverse, rms_norm


@pytest.mark.parametrize("shape", [(3, 7, 64), (2, 5, 576), (4, 1, 640), (1, 3, 2, 256), (5, 1000)])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 37.0])
def test_rms_inverse_has_f_rms_norms_roundings(shape: tuple[int, ...], scale: float) -> None:
    x = torch.randn(shape) * scale
    w = torch.randn(shape[-1])
    r = rms_inverse(x, 1e-6)
    assert r.shape == (*shape[:-1], 1) and r.dtype == torch.float32
    assert torch.equal(x * r * w, F.rms_norm(x, (shape[-1],), w, 1e-6))
    # rms_norm's transformers-order path (offset 0, float64 -> float32 weight) normalises by the same bits
    hf = LlamaRMSNorm(shape[-1], eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(w)
    assert torch.equal(rms_norm(x, w, 1e-6), hf(x))


def test_rms_inverse_dtypes_and_dims() -> None:
    x = torch.randn(2, 3, 4, 8, dtype=torch.float64)
    r = rms_inverse(x, 1e-5)
    assert r.dtype == torch.float64  # float64 stays float64 (gradcheck, references)
    torch.testing.assert_close(r, 1 / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-5), rtol=1e-15, atol=0)
    both = rms_inverse(x, 1e-5, (-2, -1))  # over the last two dims: one statistic per [4, 8] block
    assert both.shape == (2, 3, 1, 1)
    assert torch.equal(both, rms_inverse(x.flatten(-2), 1e-5)[..., None])
    half = x.to(torch.bfloat16)
    assert rms_inverse(half, 1e-5).dtype == torch.float32  # promoted, as transformers normalises
    assert torch.equal(rms_inverse(half, 1e-5), rms_inverse(half.float(), 1e-5))


@pytest.mark.parametrize("qk_norm", ["head", "all"])
def test_qk_norm_scales_are_the_one_statistic(qk_norm: str) -> None:
    attn = MultiHeadAttention(16, 4, n_kv_heads=2, qk_norm=qk_norm)
    q, k = torch.randn(2, 5, 4, 4), torch.randn(2, 5, 2, 4)  # (B, S, H, dh), (B, S, Hkv, dh)
    s_q, s_k = attn.qk_norm_scales(q, k)
    over = (-1,) if qk_norm == "head" else (-2, -1)
    assert torch.equal(s_q, rms_inverse(q, attn.q_norm.eps, over).expand(2, 5, 4, 1)[..., 0])
    assert torch.equal(s_k, rms_inverse(k, attn.k_norm.eps, over).expand(2, 5, 2, 1)[..., 0])


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_frozen_final_norms_use_the_one_statistic(offset: float) -> None:
    norm = RMSNorm(8, eps=1e-5, offset=offset)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8))
    x = torch.randn(3, 4, 8)
    r = rms_inverse(x, norm.eps)  # (3, 4, 1)
    scale, bias = frozen_norm(norm, x)
    assert torch.equal(scale, ((norm.weight + offset) * r).expand_as(x)) and not bias.any()
    torch.testing.assert_close(x * scale, norm(x), rtol=1e-6, atol=1e-6)  # the norm itself, frozen
    w, c = norm_split(norm, x)
    assert torch.equal(c, r[..., 0]) and torch.equal(w, norm.weight + offset)
    # the circuit runner's pullback through the norm: J^T g by the closed form at the same statistic
    g = torch.randn(2, 3, 4, 8, dtype=torch.float64)
    xd = x.double()
    norm64 = RMSNorm(8, eps=1e-5, offset=offset).double()
    with torch.no_grad():
        norm64.weight.copy_(norm.weight.double())
    want = torch.stack([torch.autograd.functional.vjp(norm64, xd, gi)[1] for gi in g])
    torch.testing.assert_close(_norm_pullback(norm64, xd, g), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape", [(3, 7, 64), (2, 5, 576), (4, 1, 768), (5, 1000)])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 37.0])
def test_gemma_offset_norm_is_transformers_bit_for_bit(shape: tuple[int, ...], scale: float) -> None:
    """Offset 1 on float32 takes F.rms_norm with the gain (1 + w): Gemma2RMSNorm's values, bit for bit,
    and those of the written-out order (x * rms_inverse(x)) * (1 + w)."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    x = torch.randn(shape) * scale
    w = torch.randn(shape[-1]) * 0.3
    hf = Gemma2RMSNorm(shape[-1], eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(w)
    ours = rms_norm(x, w, 1e-6, offset=1.0)
    assert torch.equal(ours, hf(x))
    assert torch.equal(ours, (x * rms_inverse(x, 1e-6)) * (1.0 + w))
    # the gain keeps its gradient through the fast path (offset + weight is part of the graph)
    wg = w.clone().requires_grad_(True)
    rms_norm(x, wg, 1e-6, offset=1.0).sum().backward()
    assert wg.grad is not None and torch.allclose(
        wg.grad, (x * rms_inverse(x, 1e-6)).reshape(-1, shape[-1]).sum(0)
    )
