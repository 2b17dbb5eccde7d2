"""Multi-head latent attention (headspace.attention.latent): its per-head views through the latent at a
run's frozen norm scales, ``head.qk(delta)`` against the traced scores, the latent cache (its size and
cached decoding equal to the full forward), DLA and ablation per head through hook_result / hook_z,
and the description's checks. The layer against transformers: tests/pretrained/test_deepseek.py."""

from __future__ import annotations

import pytest
import torch

import headspace as hs
from headspace.attention.circuits import FactoredMatrix
from headspace.attention.latent import LatentAttention
from headspace.nn.latent_cache import LatentCache
from headspace.nn.positions import Rotary
from headspace.nn.spec import AttentionSpec, LatentSpec

pytestmark = pytest.mark.usefixtures("single_thread")

D, H, NOPE, ROPE, DV, RQ, RKV = 20, 3, 6, 4, 5, 9, 7  # odd sizes; every width distinct


def make_layer(q_lora: int | None = RQ, seed: int = 0) -> LatentAttention:
    """A random latent layer (every norm weight random, q/kv biases on) in eval mode."""
    torch.manual_seed(seed)
    latent = LatentSpec(q_lora, RKV, NOPE, ROPE, DV)
    spec = AttentionSpec(D, H, NOPE + ROPE, H, qkv_bias=True, out_bias=True,
                         positions=Rotary(ROPE, interleaved=True), latent=latent)  # fmt: skip
    layer = LatentAttention.from_spec(spec).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_((1.0 + 0.3 * torch.randn_like(p)) if "layernorm" in name else 0.4 * torch.randn_like(p))
    return layer


def traced(layer: LatentAttention, x: torch.Tensor) -> dict[str, torch.Tensor]:
    names = ["hook_q", "hook_k", "hook_v", "hook_latent", "hook_rope_k", "hook_scores", "hook_pattern",
             "hook_z", "hook_result"]  # fmt: skip
    with torch.no_grad(), hs.trace(layer, names=names) as t:
        out = layer(x, is_causal=True)
    return {**{n: t[n] for n in names}, "out": out}


@pytest.mark.parametrize("q_lora", [RQ, None])
def test_head_views_give_q_k_v_at_the_frozen_latent_scales(q_lora: int | None) -> None:
    layer = make_layer(q_lora)
    x = torch.randn(2, 7, D)
    t = traced(layer, x)
    s_q, s_c = layer.latent_norm_scales(x)  # (2, 7) each; s_q None without a query latent
    assert (s_q is None) == (q_lora is None)
    bq = 0.0 if layer.q_a_proj is None else layer.q_a_proj.bias
    for h, head in enumerate(layer.heads):
        assert isinstance(head.W_Q, FactoredMatrix) and isinstance(head.W_K, FactoredMatrix)
        assert (
            head.W_Q.shape == (D, NOPE + ROPE) and head.W_K.shape == (D, NOPE) and head.W_V.shape == (D, DV)
        )
        assert head.W_K_rope.shape == (D, ROPE) and head.W_O.shape == (DV, D)
        if q_lora is None:  # no latent, no bias, no scale: q is x W_Q exactly
            torch.testing.assert_close(t["hook_q"][:, :, h], x @ head.W_Q.AB, atol=1e-5, rtol=0)
        else:  # the bias of the down projection rides through the latent (x -> [x, 1])
            w_q = layer.q_a_layernorm.weight
            want = s_q[..., None] * (x @ head.W_Q.AB + (bq * w_q) @ layer.W_QB[h])
            torch.testing.assert_close(t["hook_q"][:, :, h], want, atol=1e-5, rtol=0)
        b_c = layer.kv_a_proj_with_mqa.bias[:RKV] * layer.kv_a_layernorm.weight  # (RKV,)
        k_nope = s_c[..., None] * (x @ head.W_K.AB + b_c @ layer.W_KB[h])  # (2, 7, NOPE)
        torch.testing.assert_close(t["hook_k"][:, :, h, :NOPE], k_nope, atol=1e-5, rtol=0)
        v = s_c[..., None] * (x @ head.W_V.AB + b_c @ layer.W_VB[h])  # (2, 7, DV)
        torch.testing.assert_close(t["hook_v"][:, :, h], v, atol=1e-5, rtol=0)
        # the rotary key part is one for all heads; at position 0 the rotation is the identity
        torch.testing.assert_close(t["hook_k"][:, :, h, NOPE:], t["hook_rope_k"], atol=0, rtol=0)
    b_r = layer.kv_a_proj_with_mqa.bias[RKV:]
    torch.testing.assert_close(t["hook_rope_k"][:, 0], x[:, 0] @ layer.W_K_rope + b_r, atol=1e-5, rtol=0)
    with torch.no_grad():  # the views are views: writing through W_O changes the layer
        layer.heads[1].W_O.zero_()
    assert float(layer.o_proj.weight.detach()[:, DV : 2 * DV].abs().max()) == 0.0


@pytest.mark.parametrize("q_lora", [RQ, None])
def test_qk_with_delta_gives_the_traced_scores_at_the_frozen_scales(q_lora: int | None) -> None:
    layer = make_layer(q_lora, seed=1)
    with torch.no_grad():  # the identity is stated without biases (as MultiHeadAttention's qk())
        for m in (layer.q_a_proj, layer.kv_a_proj_with_mqa):
            if m is not None:
                m.bias.zero_()
    x = torch.randn(2, 6, D)
    t = traced(layer, x)
    s_q, s_c = layer.latent_norm_scales(x)
    s_q = torch.ones_like(s_c) if s_q is None else s_q
    for h in range(H):
        head = layer.heads[h]
        for i in range(6):
            for j in range(i + 1):
                for b in range(2):
                    with torch.no_grad():
                        circuit = head.qk(i - j, key_scale=s_c[b, j])
                        got = x[b, i] @ circuit.AB @ x[b, j] * s_q[b, i]
                    want = t["hook_scores"][b, h, i, j] / layer.scale
                    assert abs(float(got - want)) <= 1e-4 * max(1.0, abs(float(want))), (h, i, j, b)
    # the rotation matters: the same pair at another offset scores otherwise
    assert not torch.allclose(head.qk(0).AB, head.qk(3).AB)


def test_the_latent_cache_holds_the_latent_and_decodes_as_the_full_forward() -> None:
    layer = make_layer()
    cache = layer.make_kv_cache(2, 16)
    assert isinstance(cache, LatentCache)
    assert cache.numbers_per_token == RKV + ROPE  # not 2 x n_heads x d_head (= 2 x 3 x 10)
    assert cache.k.numel() + cache.v.numel() == 2 * 16 * (RKV + ROPE)
    x = torch.randn(2, 9, D)
    with torch.no_grad():
        full = layer(x, is_causal=True)
        first = layer(x[:, :5], is_causal=True, kv_cache=cache)
        steps = [layer(x[:, i : i + 1], kv_cache=cache) for i in range(5, 9)]
    assert cache.length == 9
    torch.testing.assert_close(torch.cat([first, *steps], dim=1), full, atol=1e-5, rtol=0)
    # the cache holds the normalised latent and the rotated shared key part, as the hooks show them
    t = traced(layer, x)
    torch.testing.assert_close(cache.k[:, 0, :9], t["hook_latent"], atol=1e-6, rtol=0)
    torch.testing.assert_close(cache.v[:, 0, :9], t["hook_rope_k"], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match=r"kv_cache overflow: 9 positions filled \+ 8 new > capacity 16"):
        layer(torch.randn(2, 8, D), kv_cache=cache)
    with pytest.raises(ValueError, match="key_padding"):  # a refused mask leaves the cache as it was
        layer(torch.randn(2, 2, D), kv_cache=cache, key_padding=torch.ones(2, 3, dtype=torch.bool))
    assert cache.length == 9
    with pytest.raises(TypeError, match="kv_cache must be a LatentCache"):
        layer(x, kv_cache=hs.KVCache(2, H, NOPE + ROPE, 16))


def test_dla_and_ablation_per_head_through_hook_result_and_hook_z() -> None:
    layer = make_layer(seed=2)
    x = torch.randn(1, 8, D)
    t = traced(layer, x)
    assert t["hook_result"].shape == (1, 8, H, D) and t["hook_z"].shape == (1, 8, H, DV)
    total = t["hook_result"].sum(dim=2) + layer.o_proj.bias  # the heads' direct contributions add up
    torch.testing.assert_close(total, t["out"], atol=1e-5, rtol=0)
    for h in range(H):  # each head's result is its z times its rows of W_O
        torch.testing.assert_close(
            t["hook_result"][:, :, h], t["hook_z"][:, :, h] @ layer.W_O[h], atol=1e-5, rtol=0
        )
    with torch.no_grad(), hs.ablate(layer, [(0, 1)]):  # zero-ablating head 1 removes exactly its result
        ablated = layer(x, is_causal=True)
    torch.testing.assert_close(ablated, t["out"] - t["hook_result"][:, :, 1], atol=1e-5, rtol=0)


def test_bad_latent_descriptions_are_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^LatentSpec.kv_lora_rank must be a positive int; got 0$"):
        LatentSpec(None, 0, 4, 2, 4)
    with pytest.raises(ValueError, match=r"^LatentSpec.q_lora_rank must be None or a positive int; got -1$"):
        LatentSpec(-1, 8, 4, 2, 4)
    latent = LatentSpec(None, 8, 4, 2, 4)
    with pytest.raises(
        ValueError, match=r"^AttentionSpec.d_head must be latent.qk_head_dim=6 with a latent; got 4$"
    ):
        AttentionSpec(16, 2, 4, 2, latent=latent)
    with pytest.raises(
        ValueError, match=r"^AttentionSpec.n_kv_heads must be n_heads=2 with a latent; got 1$"
    ):
        AttentionSpec(16, 2, 6, 1, latent=latent)
    with pytest.raises(ValueError, match=r"^AttentionSpec.positions must be a Rotary made for d_head=2"):
        AttentionSpec(16, 2, 6, 2, latent=latent, positions=Rotary(6))
    with pytest.raises(ValueError, match="LatentAttention is self-attention only"):
        make_layer()(torch.randn(1, 3, D), torch.randn(1, 3, D))
