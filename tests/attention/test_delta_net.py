"""Gated DeltaNet (issue #39; attention/delta_net.py, delta_rule.py) against transformers' torch fallback:
the rule (chunked and recurrent, grouped heads, a starting state) and the whole layer
(Qwen3_5GatedDeltaNet on the same weights); cached decoding against the full forward; the per-head views."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next import modeling_qwen3_next as qn

import headspace as hs
from headspace.attention.delta_net import DeltaNetCache, GatedDeltaNet
from headspace.attention.delta_rule import chunk_rule, recurrent_rule
from headspace.nn.delta_spec import DeltaNetSpec

pytestmark = pytest.mark.usefixtures("single_thread")

D, HK, HV, DK, DV, K = 20, 2, 4, 5, 7, 3


def rule_inputs(seq: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    q, k = torch.randn(2, seq, HK, DK), torch.randn(2, seq, HK, DK)
    v = torch.randn(2, seq, HV, DV)
    g = -torch.rand(2, seq, HV)  # log decays <= 0
    beta = torch.rand(2, seq, HV)
    return [q, k, v, g, beta]


@pytest.mark.parametrize("seq", [1, 9, 70])
def test_the_rule_equals_transformers_torch_fallback(seq: int) -> None:
    q, k, v, g, beta = rule_inputs(seq)
    state = torch.randn(2, HV, DK, DV)
    for ours, theirs in ((chunk_rule, qn.torch_chunk_gated_delta_rule),
                         (recurrent_rule, qn.torch_recurrent_gated_delta_rule)):  # fmt: skip
        want, want_state = theirs(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True)  # fmt: skip
        got, got_state = ours(q, k, v, g, beta, state)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        torch.testing.assert_close(got_state, want_state, atol=1e-6, rtol=0)
    chunked, s1 = chunk_rule(q, k, v, g, beta)  # the two forms are one maths
    stepped, s2 = recurrent_rule(q, k, v, g, beta)
    torch.testing.assert_close(chunked, stepped, atol=1e-5, rtol=0)
    torch.testing.assert_close(s1, s2, atol=1e-5, rtol=0)


def layers() -> tuple[GatedDeltaNet, Qwen3_5GatedDeltaNet]:
    torch.manual_seed(1)
    config = T.Qwen3_5TextConfig(hidden_size=D, linear_num_key_heads=HK, linear_num_value_heads=HV,
                                 linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=K,
                                 num_hidden_layers=1, layer_types=["linear_attention"])  # fmt: skip
    ref = Qwen3_5GatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    ours = GatedDeltaNet(DeltaNetSpec(D, HK, HV, DK, DV, conv_kernel=K, norm_eps=config.rms_norm_eps)).eval()
    sd = {"in_qkv.weight": ref.in_proj_qkv.weight, "in_z.weight": ref.in_proj_z.weight,
          "in_b.weight": ref.in_proj_b.weight, "in_a.weight": ref.in_proj_a.weight,
          "conv_weight": ref.conv1d.weight[:, 0], "dt_bias": ref.dt_bias, "A_log": ref.A_log,
          "norm_weight": ref.norm.weight, "out_proj.weight": ref.out_proj.weight}  # fmt: skip
    ours.load_state_dict({k: v.detach().clone() for k, v in sd.items()})
    return ours, ref


def test_the_layer_equals_transformers_and_decodes_as_its_forward() -> None:
    ours, ref = layers()
    x = torch.randn(2, 11, D)
    with torch.no_grad():
        want = ref(x)
        torch.testing.assert_close(ours(x), want, atol=1e-5, rtol=0)
        cache = ours.make_kv_cache(2, 16)
        assert isinstance(cache, DeltaNetCache) and cache.state.shape == (2, HV, DK, DV)
        first = ours(x[:, :6], kv_cache=cache)  # a prompt, then one position at a time (recurrent rule)
        steps = [ours(x[:, i : i + 1], kv_cache=cache) for i in range(6, 11)]
    torch.testing.assert_close(torch.cat([first, *steps], dim=1), want, atol=1e-5, rtol=0)
    assert cache.length == 11
    with pytest.raises(ValueError, match="kv_cache overflow: 11 positions filled \\+ 6 new > capacity 16"):
        ours(x[:, :6], kv_cache=cache)


def test_hook_points_views_and_per_head_results() -> None:
    ours, _ = layers()
    x = torch.randn(1, 8, D)
    names = ["hook_q", "hook_k", "hook_v", "hook_gate", "hook_beta", "hook_state", "hook_o", "hook_z",
             "hook_result"]  # fmt: skip
    with torch.no_grad(), hs.trace(ours, names=names) as t:
        out = ours(x)
    shapes = {"hook_q": (1, 8, HK, DK), "hook_k": (1, 8, HK, DK), "hook_v": (1, 8, HV, DV),
              "hook_gate": (1, 8, HV), "hook_beta": (1, 8, HV), "hook_state": (1, HV, DK, DV),
              "hook_o": (1, 8, HV, DV), "hook_z": (1, 8, HV, DV), "hook_result": (1, 8, HV, D)}  # fmt: skip
    assert {n: tuple(t[n].shape) for n in names} == shapes
    assert bool((t["hook_gate"] <= 0).all()) and bool(((t["hook_beta"] > 0) & (t["hook_beta"] < 1)).all())
    torch.testing.assert_close(t["hook_result"].sum(2), out, atol=1e-6, rtol=0)  # per value head, exact
    # the views are of the fused storage: q, k, v before the convolution are x W_Q / W_K / W_V
    mixed = torch.nn.functional.linear(x, ours.in_qkv.weight)  # (1, 8, conv_dim)
    torch.testing.assert_close(mixed[..., DK : 2 * DK], x @ ours.W_Q[1])
    torch.testing.assert_close(mixed[..., HK * DK + DK : HK * DK + 2 * DK], x @ ours.W_K[1])
    torch.testing.assert_close(mixed[..., 2 * HK * DK + 3 * DV :], x @ ours.W_V[3])
    assert ours.W_O.shape == (HV, DV, D) and ours.W_Z.shape == (HV, D, DV)
    with torch.no_grad():
        ours.W_V[3].zero_()
    assert float(ours.in_qkv.weight.detach()[-DV:].abs().max()) == 0.0


def test_bad_specs_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"DeltaNetSpec\.d_k must be a positive int; got 0"):
        DeltaNetSpec(D, HK, HV, 0, DV)
    with pytest.raises(
        ValueError, match=r"DeltaNetSpec\.norm_eps must be a finite positive float; got -1\.0"
    ):
        DeltaNetSpec(D, HK, HV, DK, DV, norm_eps=-1.0)
    with pytest.raises(TypeError, match="GatedDeltaNet expects a DeltaNetSpec; got dict"):
        GatedDeltaNet({})  # type: ignore[arg-type]
