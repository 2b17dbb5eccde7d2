"""The latent layer's decoding step with W_kb / W_vb absorbed (headspace.attention.latent_absorbed):
the same output and pattern as the expanded keys and values (to float32 rounding), taken only where
no hook sees the expanded keys, values, scores or z."""

from __future__ import annotations

import pytest
import torch

from headspace.attention import latent_fast
from headspace.attention.latent import LatentAttention
from headspace.nn.positions import Rotary
from headspace.nn.spec import AttentionSpec, LatentSpec

pytestmark = pytest.mark.usefixtures("single_thread")

D, H, NOPE, ROPE, DV, RQ, RKV = 20, 3, 6, 4, 5, 9, 7  # odd sizes; every width distinct


def _layer() -> LatentAttention:
    torch.manual_seed(1)
    latent = LatentSpec(RQ, RKV, NOPE, ROPE, DV)
    spec = AttentionSpec(D, H, NOPE + ROPE, H, qkv_bias=True, out_bias=True,
                         positions=Rotary(ROPE, interleaved=True), latent=latent)  # fmt: skip
    layer = LatentAttention.from_spec(spec).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_((1.0 + 0.3 * torch.randn_like(p)) if "layernorm" in name else 0.4 * torch.randn_like(p))
    return layer


def _decode(layer: LatentAttention, x: torch.Tensor, padding: torch.Tensor) -> list[torch.Tensor]:
    """Outputs and patterns of a 5-position prefill then one position at a time."""
    cache = layer.make_kv_cache(2, 16)
    out = [layer(x[:, :5], is_causal=True, kv_cache=cache, key_padding=padding[:, :5])]
    for i in range(5, x.shape[1]):
        o, p = layer(x[:, i : i + 1], kv_cache=cache, key_padding=padding[:, : i + 1], need_weights=True)
        out += [o, p]
    return out


def test_absorbed_step_equals_the_expanded_keys_and_values(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _layer()
    x = torch.randn(2, 9, D)
    padding = torch.ones(2, 9, dtype=torch.bool)
    padding[1, :2] = False  # a left-padded row
    with torch.no_grad():
        remove = layer.hook_v.add(lambda t, point: None)  # an active hook point: the expanded path
        want = _decode(layer, x, padding)
        remove()
        assert not layer.hook_v.active
        calls: list[int] = []
        expand = layer.expand_kv
        monkeypatch.setattr(layer, "expand_kv", lambda c, r: calls.append(c.shape[2]) or expand(c, r))
        heads_kv = latent_fast._heads_kv  # the untraced prefill's expansion (latent_fast)
        monkeypatch.setattr(
            latent_fast, "_heads_kv", lambda lay, c, r: calls.append(c.shape[2]) or heads_kv(lay, c, r)
        )
        got = _decode(layer, x, padding)
    assert calls == [5]  # only the prefill expands the keys and values; the steps absorb W_kb, W_vb
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-6, rtol=1e-5)
    assert float(got[2][1, :, 0, :2].abs().max()) == 0.0  # the padded keys take no weight
