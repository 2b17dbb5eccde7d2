"""DeepSeek V3 (dense then mixture-of-experts layers) and V2 (no query latent; greedy and group-limited
routing) against transformers 5.

References: tiny random models built and saved by transformers itself (eager attention and experts,
odd sizes), every norm, router and e_score_correction_bias set random so that they matter, read back
by ``headspace.load(folder)`` without transformers. Logits within 1e-4 of their largest magnitude,
every head's pattern within 1e-5, greedy decoding (forward with the latent cache) equal to
transformers' ``generate``; the routing equal to transformers' router's choices, ties included.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

import headspace as hs
from headspace.attention.latent import LatentAttention
from headspace.decode import describe, native, python
from headspace.model.moe import MixtureOfExperts
from headspace.nn.latent_cache import LatentCache
from headspace.nn.spec import MLPSpec

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, H, E, K = 67, 24, 3, 3, 8, 3
RQ, RKV, NOPE, ROPE, DV = 14, 10, 8, 4, 6
COMMON = dict(vocab_size=V, hidden_size=D, intermediate_size=40, moe_intermediate_size=12,
              num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=H, n_shared_experts=1,
              n_routed_experts=E,
              routed_scaling_factor=1.7, kv_lora_rank=RKV, qk_rope_head_dim=ROPE, v_head_dim=DV,
              qk_nope_head_dim=NOPE, num_experts_per_tok=K, first_k_dense_replace=1, n_group=4, topk_group=2,
              max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)  # fmt: skip
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 0.9, "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1}  # fmt: skip
MOE = MLPSpec(12, "moe", "silu", False, n_experts=E, top_k=K)
# name -> (config class, model class, overrides)
FAMILIES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "v3": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM, {"q_lora_rank": RQ, "norm_topk_prob": True}),
    # YaRN as DeepSeek V3 ships it: mscale_all_dim folded into the softmax scale; half-split pairs
    "v3_yarn": (
        T.DeepseekV3Config,
        T.DeepseekV3ForCausalLM,
        {"q_lora_rank": RQ, "norm_topk_prob": False, "rope_interleave": False, "rope_parameters": YARN},
    ),
    "v2_greedy": (
        T.DeepseekV2Config,
        T.DeepseekV2ForCausalLM,
        {"q_lora_rank": None, "topk_method": "greedy"},
    ),
    "v2_group": (
        T.DeepseekV2Config,
        T.DeepseekV2ForCausalLM,
        {"q_lora_rank": None, "topk_method": "group_limited_greedy"},
    ),
}


def build(family: str, folder: Path) -> Any:
    """A random transformers model of ``family`` saved into ``folder``, read back with eager attention.
    Layer 1's experts 2 and 3 share one router row (and V3's correction bias): every token ties them."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(1)
    model = model_cls(config_cls(**{**COMMON, **extra})).eval()
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "inv_freq" in name:
                continue
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith(("mlp.gate.weight", "e_score_correction_bias")):
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
        router = model.model.layers[1].mlp.gate
        router.weight[3] = router.weight[2]
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias[3] = router.e_score_correction_bias[2]
    model.save_pretrained(folder)
    return model_cls.from_pretrained(
        folder, attn_implementation="eager", experts_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    return {f: (folder := tmp_path_factory.mktemp(f), build(f, folder)) for f in FAMILIES}


def test_blocks_say_what_each_family_is(saved: dict) -> None:
    for family, (folder, ref) in saved.items():
        ours = hs.load(folder).model
        theirs = [*ref.parameters(), *(b for n, b in ref.named_buffers() if "correction" in n)]  # (a buffer)
        assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs), family
        specs = [b.spec for b in ours.blocks]
        assert all(isinstance(b.attn, LatentAttention) for b in ours.blocks)
        latent = specs[0].attention.latent
        want_q = RQ if family.startswith("v3") else None
        assert (latent.q_lora_rank, latent.kv_lora_rank, latent.qk_rope_head_dim, latent.v_head_dim) == (
            want_q,
            RKV,
            ROPE,
            DV,
        )
        assert specs[0].mlp.kind == "gated" and [s.mlp.kind for s in specs[1:]] == ["moe", "moe"]
        moe = specs[1].mlp
        v3 = family.startswith("v3")
        routing = (
            "sigmoid_group_topk"
            if v3
            else {"v2_greedy": "softmax_topk", "v2_group": "softmax_group_topk"}[family]
        )
        assert (moe.routing, moe.routed_scale, moe.score_bias) == (routing, 1.7, v3)
        assert moe.d_shared == 12 and not moe.shared_gate and moe.norm_topk == (family == "v3")
        rotary = ours.blocks[0].attn.rotary
        assert (rotary.d_head, rotary.interleaved) == (ROPE, family != "v3_yarn")
        scale = ref.model.layers[0].self_attn.scaling  # (NOPE + ROPE) ** -0.5, times mscale ** 2 with YaRN
        assert ours.blocks[0].attn.scale == pytest.approx(scale, rel=1e-12)
        assert (scale != (NOPE + ROPE) ** -0.5) == (family == "v3_yarn")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_patterns_and_greedy_decoding_equal_transformers(saved: dict, family: str) -> None:
    folder, ref = saved[family]
    ours = hs.load(folder)
    torch.manual_seed(2)
    tokens = torch.randint(3, V, (2, 21))  # longer than YaRN's original 16 positions
    with torch.no_grad():
        want = ref(input_ids=tokens, output_attentions=True)
        with hs.trace(ours.model, names=["*.hook_pattern"]) as t:
            got = ours(tokens)
    scale = float(want.logits.abs().max())
    torch.testing.assert_close(got, want.logits, atol=1e-4 * scale, rtol=0)
    for layer in range(L):
        torch.testing.assert_close(t.pattern(layer), want.attentions[layer], atol=1e-5, rtol=0)
    prompt = tokens[:1, :5]
    with torch.no_grad():
        expected = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                                do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
    assert expected.shape[1] == 11
    assert torch.equal(ours.generate(prompt, 6, temperature=0), expected)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_routing_equals_transformers_router_ties_included(saved: dict, family: str) -> None:
    folder, ref = saved[family]
    ours = hs.load(folder).model
    mlp, gate = ours.blocks[1].mlp, ref.model.layers[1].mlp.gate
    assert isinstance(mlp, MixtureOfExperts)
    torch.manual_seed(3)
    x = torch.randn(40, D)
    with torch.no_grad():
        _, weights, indices = gate(x)  # (40, K) each
        dense = mlp.route(x[None])[0]  # (40, E)
    chosen = dense.ne(0).nonzero()[:, 1].reshape(-1, K)
    assert torch.equal(chosen.sort(-1).values, indices.sort(-1).values)
    torch.testing.assert_close(dense.gather(-1, indices), weights, atol=1e-6, rtol=0)
    tied = chosen.eq(2).any(-1) ^ chosen.eq(3).any(-1)  # only one of the twins taken: the tie was broken
    assert bool(tied.any()) or family == "v2_group", "the tie never fell at the k-th place"


def test_the_latent_cache_and_the_decoding_steps(saved: dict) -> None:
    folder, ref = saved["v3"]
    ours = hs.load(folder)
    caches = ours.model.make_kv_caches(1, 20)
    assert all(isinstance(c, LatentCache) for c in caches)
    assert {c.numbers_per_token for c in caches} == {RKV + ROPE}  # per token per layer, not 2 x H x d_head
    tokens = torch.randint(3, V, (1, 9))
    with torch.no_grad():
        full = ours.model(tokens)
        first = ours.model(tokens[:, :6], kv_caches=caches)
        rest = [ours.model(tokens[:, i : i + 1], kv_caches=caches) for i in range(6, 9)]
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), full, atol=1e-5, rtol=0)
    with torch.no_grad():  # transformers' cache holds the same per token: the latent and the rotary key
        theirs = ref(input_ids=tokens, use_cache=True).past_key_values.layers[0]
    assert theirs.keys.shape[-1] + theirs.values.shape[-1] == RKV + ROPE
    # left-padded prompts of two lengths decode as each alone (rotation per row, the padding masked)
    from headspace.decode.loop import generate

    a, b = tokens[:, :6], tokens[:, 6:]
    batch = torch.cat([a, torch.cat([torch.zeros(1, 3, dtype=torch.long), b], dim=1)])
    real = torch.ones(2, 6, dtype=torch.bool)
    real[1, :3] = False
    both = generate(ours.model, batch, 5, key_padding=real, temperature=0)
    assert torch.equal(both[:1], generate(ours.model, a, 5, temperature=0))
    assert torch.equal(both[1:, 3:], generate(ours.model, b, 5, temperature=0))
    step = describe(ours.model)  # its MoE blocks: the Python step runs the experts' own forward
    assert step is not None and any(layer.moe is not None for layer in step.layers)
    assert all(layer.latent is not None for layer in step.layers)
    with torch.no_grad():
        want = ref.generate(
            a, attention_mask=torch.ones_like(a), max_new_tokens=5, do_sample=False, pad_token_id=0
        )
    assert torch.equal(generate(ours.model, a, 5, temperature=0), want)
    from headspace.pretrained import families_table as ft

    assert ft.decode_route(ours) == "python" and "python" in ft.family("deepseek_v3").decode


def test_the_python_step_runs_latent_blocks_and_the_native_step_leaves_them_to_it(tmp_path: Path) -> None:
    """A DeepSeek V3 of dense blocks only (first_k_dense_replace = every layer): the cached step runs in
    Python (each latent layer's forward on the new position with its LatentCache), equal to forward
    and to transformers' greedy decoding; the native step names the field it lacks."""
    from headspace.decode.backends import Stepper

    torch.manual_seed(6)
    config = T.DeepseekV3Config(**{**COMMON, "q_lora_rank": RQ, "first_k_dense_replace": L})
    ref = T.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_((1.0 + 0.3 * torch.randn_like(p)) if "norm" in name else 0.2 * torch.randn_like(p))
    ref.save_pretrained(tmp_path)
    ours = hs.load(tmp_path)
    step = describe(ours.model)
    assert step is not None and all(layer.latent is not None for layer in step.layers)
    assert native.native_form(step) is None and native.prepare(step) is None  # the Python step runs it
    from headspace.pretrained import families_table as ft

    assert ft.decode_route(ours) == "python" and "python" in ft.family("deepseek_v3").decode
    stepper = Stepper(step)
    tokens = torch.randint(3, V, (2, 8))
    caches = ours.model.make_kv_caches(2, 16)
    with torch.no_grad():
        full = ours.model(tokens)  # (2, 8, V)
        ours.model(tokens[:, :5], kv_caches=caches)
        stepped = [stepper.logits(tokens[:, i : i + 1], caches) for i in range(5, 8)]
    assert stepper.backend_used == "python" and caches[0].length == 8
    torch.testing.assert_close(torch.stack(stepped, dim=1), full[:, 5:], atol=1e-5, rtol=0)
    prompt = tokens[:1, :5]
    with torch.no_grad():
        expected = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                                do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
    assert torch.equal(ours.generate(prompt, 6, temperature=0), expected)
    latent_moe = dataclasses.replace(step.layers[0], spec=dataclasses.replace(step.layers[0].spec, mlp=MOE))
    with pytest.raises(
        ValueError, match=r"the Python decoding step does not support the block field 'mlp\.kind'"
    ):
        python.prepare(dataclasses.replace(step, layers=(latent_moe,)))


def test_bad_deepseek_fields_are_refused_naming_the_field() -> None:
    from headspace.pretrained.deepseek import deepseek_config

    cfg = dict(COMMON, model_type="deepseek_v2", q_lora_rank=None, topk_method="greedy")
    with pytest.raises(ValueError, match=r"topk_method must be one of \['greedy', 'group_limited_greedy'\]"):
        deepseek_config({**cfg, "topk_method": "noaux_tc"})
    with pytest.raises(ValueError, match="mlp_bias=true is not supported"):
        deepseek_config({**cfg, "mlp_bias": True})
    with pytest.raises(ValueError, match="kv_lora_rank"):
        deepseek_config({**cfg, "kv_lora_rank": "ten"})


def test_dla_and_patching_per_latent_head(saved: dict) -> None:
    """Direct logit attribution adds up to the logit through every latent head's hook_result, and
    activation patching of each head (its hook_z, the prefix through the latent cache) equals patching
    that head's z by hand."""
    from headspace.analysis.causal.attribution import direct_logit_attribution
    from headspace.analysis.causal.patching import patch

    folder, _ = saved["v3"]
    model = hs.load(folder).model
    torch.manual_seed(5)
    clean = torch.randint(3, V, (1, 9))
    corrupt = clean.clone()
    corrupt[0, 4] = 3 + (int(clean[0, 4]) + 7) % (V - 3)  # differs from position 4 on: a prefix of 4
    dla = direct_logit_attribution(model, clean, 5, 7)
    assert dla.heads.shape == (L, H) and float(dla.heads.abs().max()) > 0
    torch.testing.assert_close(dla.total, dla.logit, atol=1e-4, rtol=0)
    result = patch(model, clean, corrupt, answer=5, other=7)
    assert result.effect.shape == (L, H) and float(result.effect.abs().max()) > 0

    def metric(tokens: torch.Tensor) -> float:
        logits = model(tokens)[0, -1]
        return float(logits[5] - logits[7])

    with torch.no_grad(), hs.trace(model, names=["blocks.*.attn.hook_z"]) as t:
        model(clean)
    for layer, head in ((0, 1), (2, 2)):
        z_clean = t[f"blocks.{layer}.attn.hook_z"]  # (1, 9, H, DV)

        def put(
            z: torch.Tensor, _point: Any, head: int = head, z_clean: torch.Tensor = z_clean
        ) -> torch.Tensor:
            z = z.clone()
            z[:, :, head] = z_clean[:, :, head]
            return z

        with torch.no_grad(), hs.trace(model, hooks={f"blocks.{layer}.attn.hook_z": put}):
            patched = metric(corrupt)
        assert patched == pytest.approx(float(result.patched_metric[layer, head]), abs=1e-4)


@pytest.mark.parametrize("precision", ["bfloat16", "int8"])
def test_reduced_precision_converts_the_latent_projections(saved: dict, precision: str) -> None:
    from headspace.kernels.bf16 import is_bf16
    from headspace.kernels.int8 import is_int8

    folder, _ = saved["v3"]
    exact, ours = hs.load(folder), hs.load(folder, precision=precision)
    reduced = is_bf16 if precision == "bfloat16" else is_int8
    attn = ours.model.blocks[0].attn
    for lin in (attn.q_a_proj, attn.q_b_proj, attn.kv_a_proj_with_mqa, attn.kv_b_proj, attn.o_proj):
        assert reduced(lin.weight), precision
    tokens = torch.randint(3, V, (2, 9))
    name = "blocks.0.hook_attn_out"  # the first latent layer (later, a routing choice may flip)
    with (
        torch.no_grad(),
        hs.trace(exact.model, names=[name]) as want,
        hs.trace(ours.model, names=[name]) as got,
    ):
        exact(tokens), ours(tokens)
    scale = float(want[name].abs().max())
    torch.testing.assert_close(got[name], want[name], atol=0.05 * scale, rtol=0)
    assert not torch.equal(got[name], want[name])


def test_weight_based_analyses_refuse_the_latent_by_name(saved: dict) -> None:
    """Analyses reading a layer's W_Q / W_K / W_V tensors name the field rather than fail obscurely."""
    import headspace.analysis as A

    for family in ("v3", "v2_greedy"):  # (V2 without a query latent has a W_Q; its W_K is refused)
        model = hs.load(saved[family][0]).model
        for analysis in (A.composition_scores, A.circuit_spectra):
            with pytest.raises(
                AttributeError, match=r"^a latent attention layer \(the attention field 'latent'\)"
            ):
                analysis(model)
    attn = model.blocks[0].attn
    assert attn.W_Q.shape == (H, D, NOPE + ROPE) and not hasattr(attn, "W_K")


def test_the_released_configs_read_with_transformers_softmax_scale() -> None:
    """DeepSeek-V3's and DeepSeek-V2-Lite's config.json as released (legacy ``rope_scaling`` YaRN,
    ``topk_method``, ``scoring_func``, ``moe_layer_freq``; V3's fp8 quantization_config left out): the
    blocks they describe and the softmax scale transformers computes from them."""
    from transformers.modeling_rope_utils import yarn_apply_mscale

    from headspace.pretrained.deepseek import deepseek_block_specs, deepseek_config

    yarn = {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    }
    shared = dict(hidden_act="silu", attention_bias=False, kv_lora_rank=512, max_position_embeddings=163840,
                  moe_layer_freq=1, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                  rms_norm_eps=1e-6, rope_theta=10000, tie_word_embeddings=False)  # fmt: skip
    v3 = dict(shared, model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432,
              first_k_dense_replace=3, moe_intermediate_size=2048, n_group=8, topk_group=4,
              n_routed_experts=256, n_shared_experts=1, norm_topk_prob=True, num_attention_heads=128,
              num_key_value_heads=128, num_experts_per_tok=8, num_hidden_layers=61, q_lora_rank=1536,
              routed_scaling_factor=2.5, scoring_func="sigmoid", topk_method="noaux_tc", vocab_size=129280,
              rope_scaling={**yarn, "mscale": 1.0, "mscale_all_dim": 1.0})  # fmt: skip
    lite = dict(shared, model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944,
                first_k_dense_replace=1, moe_intermediate_size=1408, n_group=1, topk_group=1,
                n_routed_experts=64, n_shared_experts=2, norm_topk_prob=False, num_attention_heads=16,
                num_key_value_heads=16, num_experts_per_tok=6, num_hidden_layers=27, q_lora_rank=None,
                routed_scaling_factor=1.0, scoring_func="softmax", topk_method="greedy", vocab_size=102400,
                rope_scaling={**yarn, "mscale": 0.707, "mscale_all_dim": 0.707})  # fmt: skip
    for hf, dense, d_shared, routing in (
        (v3, 3, 2048, "sigmoid_group_topk"),
        (lite, 1, 2816, "softmax_topk"),
    ):
        specs = deepseek_block_specs(deepseek_config(hf))
        assert [s.mlp.kind for s in specs[: dense + 1]] == ["gated"] * dense + ["moe"]
        assert (specs[-1].mlp.routing, specs[-1].mlp.d_shared) == (routing, d_shared)
        attention = specs[0].attention
        assert (attention.d_head, attention.positions.rope_type, attention.positions.d_head) == (
            192,
            "yarn",
            64,
        )
        want = yarn_apply_mscale({**hf["rope_scaling"], "rope_type": "yarn"}, 192**-0.5)
        assert attention.scale == pytest.approx(want, rel=1e-12) and want != 192**-0.5
