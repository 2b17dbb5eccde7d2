"""ALiBi (headspace.nn.alibi, AttentionSpec.bias="alibi"): the slopes against transformers' own functions,
the layer's every path (fused, explicit, traced, KV cache, padding) against scores written out by hand in
BLOOM's form (``+ m_h j``: the same pattern as ``-m_h (i - j)``), ``hook_scores`` as the QK circuit plus
``head.alibi_bias(delta)``, and the spec's checks and the native step's refusal by field name."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
from transformers.models.falcon.modeling_falcon import build_alibi_tensor as falcon_alibi
from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

import headspace as hs
from headspace.attention.layer import MultiHeadAttention
from headspace.decode import describe, native
from headspace.decode.native import native_form
from headspace.nn.alibi import alibi_bias, bloom_slopes, mpt_slopes
from headspace.nn.spec import AttentionSpec

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("n_heads", [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 20, 32, 71])
def test_bloom_and_mpt_slopes_are_transformers_bit_for_bit(n_heads: int) -> None:
    assert torch.equal(torch.tensor(bloom_slopes(n_heads)), _get_alibi_slopes(n_heads, torch.device("cpu")))
    for bias_max in (8, 4, 11):
        # MPT's bias at key j of L positions is m_h (j - (L - 1)): its slopes are the last key but one's
        want = -build_mpt_alibi_tensor(n_heads, 2, bias_max)[:, 0, 0]  # (n_heads,)
        assert torch.equal(torch.tensor(mpt_slopes(n_heads, bias_max)), want), bias_max


@pytest.mark.parametrize("n_heads", [1, 2, 3, 4, 6, 7, 8])
def test_falcon_bias_in_bfloat16_is_exact_up_to_8_heads(n_heads: int) -> None:
    """Falcon rounds the bias to bfloat16: up to 8 heads every slope is a power of 2, so each m_h j
    (j < 256) is exact; 16 heads have slopes 2^(-k/2), rounded (the loader refuses them)."""
    bias = falcon_alibi(torch.ones(1, 200, dtype=torch.long), n_heads, torch.float32)  # (H, 1, 200)
    want = torch.tensor(bloom_slopes(n_heads))[:, None] * torch.arange(200)  # (H, 200)
    assert torch.equal(bias[:, 0], want)
    if n_heads == 8:
        assert not torch.equal(falcon_alibi(torch.ones(1, 200, dtype=torch.long), 16, torch.float32)[:, 0],
                               torch.tensor(bloom_slopes(16))[:, None] * torch.arange(200))  # fmt: skip


def _reference(attn: MultiHeadAttention, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The causal pattern written out with BLOOM's bias ``+ m_h j``: [B, H, S, S]."""
    B, S, _ = x.shape
    H, dh = attn.n_heads, attn.d_head
    q, k, _ = (x @ attn.qkv_weight.T + attn.qkv_bias).split(H * dh, dim=-1)  # (B, S, H dh) x 3
    q = q.view(B, S, H, dh).transpose(1, 2)  # (B, H, S, dh)
    k = k.view(B, S, H, dh).transpose(1, 2)  # (B, H, S, dh)
    slopes = torch.tensor(attn.spec.alibi_slopes)  # (H,)
    scores = q @ k.transpose(-1, -2) * attn.scale + slopes[:, None, None] * torch.arange(S)  # (B, H, S, S)
    allowed = torch.ones(S, S, dtype=torch.bool).tril()
    if keep is not None:
        allowed = allowed & keep[:, None, None, :]  # (B, 1, S, S)
    return scores.masked_fill(~allowed, -math.inf).softmax(-1)


@pytest.fixture
def layer() -> MultiHeadAttention:
    torch.manual_seed(0)
    attn = MultiHeadAttention(30, 6, alibi_slopes=bloom_slopes(6)).eval()
    with torch.no_grad():
        attn.qkv_bias.normal_()
    return attn


def test_every_path_of_the_layer_adds_the_bias(layer: MultiHeadAttention) -> None:
    x = torch.randn(2, 9, 30)
    want = _reference(layer, x)
    with torch.no_grad():
        out, pattern = layer(x, is_causal=True, need_weights=True)  # explicit backend
        fused = layer(x, is_causal=True)  # sdpa
        torch.testing.assert_close(pattern, want, atol=1e-6, rtol=0)
        torch.testing.assert_close(fused, out, atol=1e-6, rtol=0)
        with hs.trace(layer, names=["hook_pattern"]) as t:  # the traced path
            traced = layer(x, is_causal=True)
        torch.testing.assert_close(t["hook_pattern"], want, atol=1e-6, rtol=0)
        torch.testing.assert_close(traced, out, atol=1e-6, rtol=0)
        cache = layer.make_kv_cache(2, 16)  # 4 positions, then 1, then 4: each query its own position
        steps = [layer(x[:, a:b], is_causal=True, kv_cache=cache) for a, b in ((0, 4), (4, 5), (5, 9))]
        torch.testing.assert_close(torch.cat(steps, dim=1), out, atol=1e-5, rtol=0)


def test_padding_masks_keys_and_keeps_the_bias(layer: MultiHeadAttention) -> None:
    x = torch.randn(2, 7, 30)
    keep = torch.tensor([[True] * 7, [False, False] + [True] * 5])
    with torch.no_grad():
        _, pattern = layer(x, is_causal=True, key_padding=keep, need_weights=True)
    want = _reference(layer, x, keep)
    torch.testing.assert_close(pattern[:, :, 2:], want[:, :, 2:], atol=1e-6, rtol=0)


def test_hook_scores_are_the_circuit_plus_the_heads_bias(layer: MultiHeadAttention) -> None:
    S = 8
    x = torch.randn(1, S, 30)
    with torch.no_grad(), hs.trace(layer, names=["hook_scores"]) as t:
        layer(x, is_causal=True)
    scores = t["hook_scores"][0].double()  # (H, S, S)
    xa = torch.cat([x[0], torch.ones(S, 1)], dim=-1).double()  # (S, d_model + 1)
    delta = torch.arange(S)[:, None] - torch.arange(S)[None, :]  # (S, S)
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    for h in range(6):
        head = layer.heads[h]
        assert head.alibi_slope == bloom_slopes(6)[h]
        AB = head.qk(3, augmented=True).AB.double()  # (d + 1, d + 1): the same at every delta
        got = xa @ AB @ xa.T * layer.scale + head.alibi_bias(delta)  # (S, S)
        torch.testing.assert_close(got[causal], scores[h][causal], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="head 0 has no ALiBi bias"):
        MultiHeadAttention(30, 6).heads[0].alibi_bias(1)


def test_the_bias_depends_on_the_distance_only() -> None:
    bias = alibi_bias([0.5, 0.25], 3, 5)  # (2, 3, 5): queries at key positions 2, 3, 4
    assert bias[0, 0].tolist() == [-1.0, -0.5, 0.0, 0.5, 1.0]
    assert torch.equal(bias[1, 2], -0.25 * (4 - torch.arange(5.0)))


def test_the_spec_checks_the_slopes_by_name() -> None:
    base = AttentionSpec(8, 2, 4, 2)
    with pytest.raises(
        ValueError, match=r"^AttentionSpec.alibi_slopes must be 2 finite floats, one per head; "
    ):
        dataclasses.replace(base, bias="alibi")
    with pytest.raises(ValueError, match=r"^AttentionSpec.alibi_slopes must be 2 finite floats"):
        dataclasses.replace(base, bias="alibi", alibi_slopes=(0.5, float("nan")))
    with pytest.raises(ValueError, match=r"^AttentionSpec.alibi_slopes must be None without bias='alibi'"):
        dataclasses.replace(base, alibi_slopes=(0.5, 0.25))
    spec = dataclasses.replace(base, bias="alibi", alibi_slopes=[0.5, 0.25])
    assert spec.alibi_slopes == (0.5, 0.25)
    with pytest.raises(ValueError, match=r"^ModelConfig.alibi_slopes must be 2 finite floats"):
        hs.ModelConfig(arch="decoder", d_model=8, n_heads=2, n_layers=1, alibi_slopes=[1.0])


def test_a_decoder_with_alibi_decodes_through_the_python_step_and_the_native_one_refuses_it() -> None:
    torch.manual_seed(1)
    config = hs.ModelConfig(arch="decoder", vocab_size=31, d_model=24, n_layers=2, n_heads=3,
                            positions="none", max_seq_len=32, alibi_slopes=bloom_slopes(3))  # fmt: skip
    model = hs.Decoder(config).eval()
    prompt = torch.randint(0, 31, (2, 5))
    got = model.generate(prompt, 6, temperature=0, backend="python")
    with torch.no_grad():  # greedy by the whole forward, token by token
        want = prompt
        for _ in range(6):
            want = torch.cat([want, model(want)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(got, want)
    assert torch.equal(model.generate(prompt, 6, temperature=0), want)  # default: the Python step
    step = describe(model)  # the native step, asked for by name, refuses the field by name
    assert step is not None and native_form(step) is None
    with pytest.raises(
        ValueError, match=r"^the native decoding step does not support the attention field 'bias'"
    ):
        native.prepare(step)


def test_head_parallel_shards_refuse_alibi_by_name(layer: MultiHeadAttention) -> None:
    from headspace.distributed.head_parallel import attention_shard

    with pytest.raises(
        ValueError, match=r"^head-parallel attention does not split the attention field 'bias'"
    ):
        attention_shard(layer, 0, 2)


def test_the_default_backend_takes_the_python_step_even_once_the_native_library_is_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from headspace.decode.backends import Stepper
    from headspace.kernels import native as library

    config = hs.ModelConfig(arch="decoder", vocab_size=31, d_model=24, n_layers=1, n_heads=3,
                            positions="none", max_seq_len=16, alibi_slopes=bloom_slopes(3))  # fmt: skip
    step = describe(hs.Decoder(config).eval())
    assert step is not None
    monkeypatch.setattr(library, "ready", lambda: True)  # as if built: the native step is asked first
    stepper = Stepper(step)
    stepper._run()
    assert stepper.backend_used == "python"
    with pytest.raises(ValueError, match=r"attention field 'bias'"):
        Stepper(step, "native")._run()
