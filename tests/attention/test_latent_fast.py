"""The untraced forward of latent attention over several positions (headspace.attention.latent_fast):
taken only while no hook sees the expanded keys, values, scores, pattern or z, and then equal to the
traced path (the reference maths) to float32 rounding: causal calls (blocks of query rows, several
blocks and a ragged last one), padding, a float mask, a prefill onto a filled latent cache."""

from __future__ import annotations

import pytest
import torch

from headspace.attention import latent_fast
from headspace.attention.latent import LatentAttention
from headspace.nn.positions import Rotary, rotary_tables, rotate_fused
from headspace.nn.spec import AttentionSpec, LatentSpec

pytestmark = pytest.mark.usefixtures("single_thread")

D, H, NOPE, ROPE, DV, RQ, RKV = 20, 3, 6, 4, 5, 9, 7  # odd sizes; every width distinct
SEQ = 2 * latent_fast.BLOCK_ROWS + 5  # two whole blocks of query rows and a ragged third


def _layer(q_lora: int | None = RQ) -> LatentAttention:
    torch.manual_seed(2)
    latent = LatentSpec(q_lora, RKV, NOPE, ROPE, DV)
    spec = AttentionSpec(D, H, NOPE + ROPE, H, qkv_bias=True, out_bias=True,
                         positions=Rotary(ROPE, interleaved=True), latent=latent)  # fmt: skip
    layer = LatentAttention.from_spec(spec).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_((1.0 + 0.3 * torch.randn_like(p)) if "layernorm" in name else 0.4 * torch.randn_like(p))
    return layer


def _counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Query lengths of the calls that take the fast path."""
    calls: list[int] = []
    fast = latent_fast.fast_latent_attention
    monkeypatch.setattr(
        "headspace.attention.latent.fast_latent_attention",
        lambda layer, q, c, r, mask: calls.append(q.shape[2]) or fast(layer, q, c, r, mask),
    )
    return calls


def _both(layer: LatentAttention, run, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """(fast result, traced result, fast-path calls) of ``run()``; the traced one with ``hook_z`` active."""
    calls = _counted(monkeypatch)
    with torch.no_grad():
        got = run()
        remove = layer.hook_z.add(lambda t, point: None)  # an active hook point that sees z: traced
        want = run()
        remove()
    return got, want, calls


@pytest.mark.parametrize("q_lora", [RQ, None])
def test_causal_fast_forward_equals_the_traced_path(
    monkeypatch: pytest.MonkeyPatch, q_lora: int | None
) -> None:
    layer = _layer(q_lora)
    x = torch.randn(2, SEQ, D)
    got, want, calls = _both(layer, lambda: layer(x, is_causal=True), monkeypatch)
    assert calls == [SEQ]  # the untraced call took the fast path, the traced one did not
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_padding_and_float_masks_equal_the_traced_path(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _layer()
    x = torch.randn(2, 9, D)
    padding = torch.ones(2, 9, dtype=torch.bool)
    padding[1, :3] = False  # a left-padded row
    got, want, calls = _both(layer, lambda: layer(x, key_padding=padding, is_causal=True), monkeypatch)
    assert calls == [9]
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    bias = torch.randn(9, 9)  # a float mask added to the scores
    got, want, _ = _both(layer, lambda: layer(x, attn_mask=bias), monkeypatch)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_a_prefill_onto_a_filled_cache_equals_the_traced_path(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _layer()
    x = torch.randn(2, SEQ, D)

    def run() -> torch.Tensor:
        cache = layer.make_kv_cache(2, SEQ)
        first = layer(x[:, :7], is_causal=True, kv_cache=cache)
        return torch.cat([first, layer(x[:, 7:], is_causal=True, kv_cache=cache)], dim=1)

    got, want, calls = _both(layer, run, monkeypatch)
    assert calls == [7, SEQ - 7]  # both prefills; the second is masked (its causal mask is offset by 7)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(got, layer(x, is_causal=True), atol=2e-6, rtol=1e-5)


def test_hooks_before_the_keys_keep_the_fast_path_and_their_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """hook_q, hook_latent, hook_rope_k and hook_result see what the fast path computes too: they fire,
    and a replacement there changes the output as on the traced path; hook_k, hook_v, hook_scores,
    hook_pattern or hook_z active, or need_weights, take the traced path."""
    layer = _layer()
    x = torch.randn(2, 11, D)
    calls = _counted(monkeypatch)
    seen: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        removers = [
            getattr(layer, n).add(lambda t, point, n=n: seen.__setitem__(n, t.clone()))
            for n in ("hook_q", "hook_latent", "hook_rope_k", "hook_result")
        ]
        zero_latent = layer.hook_latent.add(lambda t, point: t * 0.5)
        got = layer(x, is_causal=True)
        assert calls == [11] and set(seen) == {"hook_q", "hook_latent", "hook_rope_k", "hook_result"}
        remove_z = layer.hook_z.add(lambda t, point: None)
        want = layer(x, is_causal=True)
        assert calls == [11]
        remove_z()
        for r in (*removers, zero_latent):
            r()
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
        assert not torch.allclose(got, layer(x, is_causal=True))  # the halved latent mattered
        for name in ("hook_k", "hook_v", "hook_scores", "hook_pattern"):
            remove = getattr(layer, name).add(lambda t, point: None)
            layer(x, is_causal=True)
            remove()
        layer(x, is_causal=True, need_weights=True)
    assert calls == [11, 11]  # only the last hook-free call without need_weights


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_rotated_queries_are_bitwise_the_rotation_then_the_concatenation(
    interleaved: bool, fraction: float
) -> None:
    rotary = Rotary(8, fraction=fraction, interleaved=interleaved)
    q = torch.randn(2, 7, 3, NOPE + 8)  # (B, S, H, dqk): hook_q's layout
    cos, sin = rotary_tables(rotary, torch.arange(7), q.dtype, q.device)
    heads = q.transpose(1, 2)  # (B, H, S, dqk)
    want = torch.cat((heads[..., :NOPE], rotate_fused(heads[..., NOPE:], cos, sin, rotary)), dim=-1)
    got = latent_fast.rotated_queries(q, NOPE, cos, sin, rotary, None)
    assert got.is_contiguous() and torch.equal(got, want)
    assert torch.equal(latent_fast.rotated_queries(q, NOPE, cos, sin, rotary, 0.3), want * 0.3)


@pytest.mark.parametrize("q_lora", [RQ, None])
def test_the_stacked_down_projection_follows_edits_of_either_weight(q_lora: int | None) -> None:
    layer = _layer(q_lora)
    x = torch.randn(2, 5, D)
    first = layer.q_proj if layer.q_proj is not None else layer.q_a_proj
    for edited in (first, layer.kv_a_proj_with_mqa):
        with torch.no_grad():
            q, kv = latent_fast.down_projections(layer, x)  # stacks the weights (remembered)
            torch.testing.assert_close(q, first(x), atol=1e-6, rtol=0)
            edited.weight.mul_(-2.0)  # an edit in place
            if edited.bias is not None:  # (q_proj has none: then the linears run unstacked)
                edited.bias.add_(1.0)
            q, kv = latent_fast.down_projections(layer, x)
            torch.testing.assert_close(q, first(x), atol=1e-6, rtol=0)
            torch.testing.assert_close(kv, layer.kv_a_proj_with_mqa(x), atol=1e-6, rtol=0)
    with torch.inference_mode():  # another mode: stacked again, as inference tensors
        torch.testing.assert_close(latent_fast.down_projections(layer, x)[1], layer.kv_a_proj_with_mqa(x))
    x.requires_grad_(True)  # grad wanted: the linears themselves (no stacked copy kept)
    q, kv = latent_fast.down_projections(layer, x)
    (q.sum() + kv.sum()).backward()
    assert first.weight.grad is not None and x.grad is not None


def test_gradients_through_the_fast_path_equal_the_traced_path() -> None:
    layer = _layer()
    x = torch.randn(2, SEQ, D)
    grads = []
    for traced in (False, True):
        layer.zero_grad()
        remove = layer.hook_z.add(lambda t, point: None) if traced else (lambda: None)
        xi = x.clone().requires_grad_(True)
        layer(xi, is_causal=True).square().sum().backward()
        remove()
        grads.append((xi.grad, layer.q_b_proj.weight.grad.clone(), layer.kv_b_proj.weight.grad.clone()))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
