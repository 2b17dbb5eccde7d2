"""Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE (mixtures of experts) against transformers 5.

References: tiny random models built and saved by transformers itself (eager attention, odd sizes),
every norm and the (zero-initialised) routers set random so that they matter, read back by
``headspace.load(folder)`` without transformers. Logits within 1e-4 of their largest magnitude, every
head's pattern within 1e-5, the router logits within 1e-5; the routing includes exact ties (two
experts with the same router row), broken as torch.topk breaks them in transformers.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers as T

import headspace as hs
from headspace.decode import Stepper, describe, native, python
from headspace.model.moe import MixtureOfExperts
from headspace.nn.spec import MLPSpec

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, H, DH, DM, E, K, W = 67, 36, 2, 6, 8, 21, 5, 2, 4  # vocab, hidden, layers, heads, ..., window
COMMON = dict(vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, head_dim=DH,
              num_key_value_heads=3, num_experts_per_tok=K, max_position_embeddings=64,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)  # fmt: skip
# name -> (config class, model class, overrides)
FAMILIES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "mixtral": (
        T.MixtralConfig,
        T.MixtralForCausalLM,
        {"num_local_experts": E, "intermediate_size": DM, "sliding_window": W},
    ),
    "qwen2_moe": (
        T.Qwen2MoeConfig,
        T.Qwen2MoeForCausalLM,
        {
            "num_experts": E,
            "moe_intermediate_size": DM,
            "intermediate_size": 30,
            "shared_expert_intermediate_size": 17,
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            "use_sliding_window": True,
            "sliding_window": W,
        },
    ),
    "qwen3_moe": (
        T.Qwen3MoeConfig,
        T.Qwen3MoeForCausalLM,
        {
            "num_experts": E,
            "moe_intermediate_size": DM,
            "intermediate_size": 30,
            "norm_topk_prob": True,
            "use_sliding_window": True,
            "sliding_window": W,
        },
    ),
    # OLMoE's QK-norm widths follow hidden_size: head_dim must be hidden_size / heads (6)
    "olmoe": (
        T.OlmoeConfig,
        T.OlmoeForCausalLM,
        {"num_experts": E, "intermediate_size": DM, "head_dim": D // H},
    ),
}


def build(family: str, folder: Path) -> Any:
    """A random transformers model of ``family`` saved into ``folder``, read back with eager attention.
    Layer 0's experts 1 and 3 share one router row: every token ties them."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(1)
    model = model_cls(config_cls(**{**COMMON, **extra})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("gate.weight") and "proj" not in name:  # routers, shared-expert gate
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
        router = model.model.layers[0].mlp.gate
        router.weight[3] = router.weight[1]
    model.save_pretrained(folder)
    return model_cls.from_pretrained(
        folder, attn_implementation="eager", experts_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    return {f: (folder := tmp_path_factory.mktemp(f), build(f, folder)) for f in FAMILIES}


def test_configs_say_what_each_family_is(saved: dict) -> None:
    c = {f: hs.load(folder).config for f, (folder, _) in saved.items()}
    for f, config in c.items():
        assert (config.mlp_kind, config.n_experts, config.experts_top_k, config.d_mlp) == ("moe", E, K, DM), f
    assert c["mixtral"].experts_norm_topk and c["mixtral"].layer_types == ["sliding"] * L
    assert (c["qwen2_moe"].shared_expert_d_mlp, c["qwen2_moe"].qkv_bias) == (17, True)
    assert not c["qwen2_moe"].experts_norm_topk and c["qwen3_moe"].experts_norm_topk
    assert c["qwen2_moe"].layer_types == ["sliding", "full"] and c["qwen3_moe"].layer_types == ["sliding"] * L
    assert (c["qwen3_moe"].qk_norm, c["olmoe"].qk_norm, c["olmoe"].norm) == ("head", "all", "pre")
    for f, (folder, ref) in saved.items():  # every parameter of the checkpoint is one of ours
        ours = hs.load(folder).model
        assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in ref.parameters()), f


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_patterns_and_router_equal_transformers(saved: dict, family: str) -> None:
    folder, ref = saved[family]
    ours = hs.load(folder)
    torch.manual_seed(2)
    tokens = torch.randint(3, V, (2, 11))  # longer than Mixtral's window (4)
    with torch.no_grad():
        want = ref(input_ids=tokens, output_attentions=True, output_router_logits=True)
        with hs.trace(ours.model, names=["*.hook_pattern", "*.hook_router_logits", "*.hook_top_k"]) as t:
            got = ours(tokens)
    scale = float(want.logits.abs().max())
    torch.testing.assert_close(got, want.logits, atol=1e-4 * scale, rtol=0)
    for layer in range(L):
        torch.testing.assert_close(t.pattern(layer), want.attentions[layer], atol=1e-5, rtol=0)
        logits = t[f"blocks.{layer}.mlp.hook_router_logits"]  # (batch, seq, E)
        torch.testing.assert_close(logits.reshape(-1, E), want.router_logits[layer], atol=1e-5, rtol=0)
        top = t[f"blocks.{layer}.mlp.hook_top_k"]  # (batch, seq, K)
        probs = torch.softmax(want.router_logits[layer].float(), dim=-1)
        assert torch.equal(top.reshape(-1, K), torch.topk(probs, K, dim=-1).indices)
    # experts 1 and 3 tie on every token; where the tie falls at the k-th place only one of them is
    # taken, as torch.topk breaks it in transformers (checked above): such tokens exist
    tied = t["blocks.0.mlp.hook_top_k"]
    assert bool(((tied == 3).any(-1) ^ (tied == 1).any(-1)).any())
    if family != "olmoe":  # the windows have teeth (layer 0 slides): a key W back gets no weight
        assert float(t.pattern(0)[:, :, W:, 0].abs().max()) == 0.0


def test_expert_outputs_sum_to_the_mlp_and_ablation_removes_one(saved: dict) -> None:
    folder, _ = saved["qwen2_moe"]
    ours = hs.load(folder)
    tokens = torch.randint(3, V, (1, 9))
    mlp = ours.model.blocks[1].mlp
    assert isinstance(mlp, MixtureOfExperts)
    names = ["blocks.1.mlp.hook_expert_out", "blocks.1.mlp.hook_shared_out", "blocks.1.hook_mlp_out",
             "blocks.1.mlp.hook_routing"]  # fmt: skip
    with torch.no_grad(), hs.trace(ours.model, names=names) as t:
        plain = ours(tokens)
    per_expert = t["blocks.1.mlp.hook_expert_out"]  # (1, 9, E, D)
    assert per_expert.shape == (1, 9, E, D)
    unused = t["blocks.1.mlp.hook_routing"] == 0  # (1, 9, E)
    assert bool((per_expert[unused] == 0).all()) and int((~unused).sum(-1).max()) == K
    total = per_expert.sum(2) + t["blocks.1.mlp.hook_shared_out"]
    torch.testing.assert_close(total, t["blocks.1.hook_mlp_out"], atol=1e-6, rtol=0)
    with torch.no_grad():  # the fast path (no dense expert axis) agrees with the hooked one
        torch.testing.assert_close(ours(tokens), plain, atol=1e-6, rtol=0)
    chosen = int(t["blocks.1.mlp.hook_routing"][0, 4].argmax())
    mlp.ablate_experts([chosen])
    with torch.no_grad(), hs.trace(ours.model, names=["blocks.1.mlp.hook_expert_out"]) as t2:
        ours(tokens)
    mlp.ablate_experts([])
    assert float(t2["blocks.1.mlp.hook_expert_out"][..., chosen, :].abs().max()) == 0.0
    kept = [e for e in range(E) if e != chosen]
    torch.testing.assert_close(t2["blocks.1.mlp.hook_expert_out"][..., kept, :], per_expert[..., kept, :])
    with pytest.raises(ValueError, match=r"experts must be ints in \[0, 5\); got 5"):
        mlp.ablate_experts([E])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_decodes_through_the_python_step_and_the_native_step_refuses_it_by_name(
    saved: dict, family: str
) -> None:
    folder, ref = saved[family]
    ours = hs.load(folder)
    step = describe(ours.model)  # the Python step runs each block's experts by their forward
    assert step is not None and [x.moe for x in step.layers] == [b.mlp for b in ours.model.blocks]
    assert native.native_form(step) is None  # generate's default: the Python step
    moe_field = r"does not support the block field 'mlp.kind' \('moe"
    with pytest.raises(ValueError, match="the native decoding step " + moe_field):
        native.prepare(step)  # asked for by name
    stepper = Stepper(step)
    tokens = torch.randint(3, V, (2, 11), generator=torch.Generator().manual_seed(4))  # past the window
    caches = ours.model.make_kv_caches(2, 16)
    with torch.no_grad():
        full = ours.model(tokens)  # (2, 11, V)
        ours.model(tokens[:, :3], kv_caches=caches)
        stepped = torch.stack([stepper.logits(tokens[:, i : i + 1], caches) for i in range(3, 11)], 1)
    assert stepper.backend_used == "python"
    torch.testing.assert_close(stepped, full[:, 3:], atol=1e-5 * float(full.abs().max()), rtol=0)
    prompt = tokens[:1, :5]
    with torch.no_grad():
        want = ref.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False, pad_token_id=0
        )
    assert torch.equal(ours.generate(prompt, 6, temperature=0), want)
    seen: list[torch.Tensor] = []  # a hooked expert output: decoding takes forward, same tokens
    remove = ours.model.blocks[0].mlp.hook_top_k.add(lambda t, hook: seen.append(t))
    try:
        assert torch.equal(ours.generate(prompt, 6, temperature=0), want) and len(seen) == 6
    finally:
        remove()


def test_a_dense_step_given_an_moe_spec_refuses_it_by_name(saved: dict) -> None:
    folder, _ = saved["olmoe"]
    ours = hs.load(folder)
    moe_field = r"does not support the block field 'mlp.kind' \('moe"
    # a step whose description carries the experts but not the experts themselves (a dense step given
    # an MoE block's spec): each backend names the field rather than running a dense MLP in its place
    dense = hs.Decoder(dataclasses.replace(ours.config, mlp_kind="gated", n_experts=None, experts_top_k=None,
                                           experts_norm_topk=False)).eval()  # fmt: skip
    step = describe(dense)
    assert step is not None
    layers = tuple(
        dataclasses.replace(x, spec=b.spec) for x, b in zip(step.layers, ours.model.blocks, strict=True)
    )
    moe_step = dataclasses.replace(step, layers=layers)
    with pytest.raises(ValueError, match="the native decoding step " + moe_field):
        native.native_form(moe_step)
    with pytest.raises(ValueError, match="the Python decoding step " + moe_field):
        python.prepare(moe_step)


def test_bad_moe_fields_are_refused_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"MLPSpec.top_k must be at most n_experts=4; got 5"):
        MLPSpec(8, "moe", "silu", False, n_experts=4, top_k=5)
    with pytest.raises(ValueError, match=r"MLPSpec.n_experts must be None for kind='gated'; got 4"):
        MLPSpec(8, "gated", "silu", False, n_experts=4)
    from headspace.pretrained.moe_families import moe_config

    cfg = dict(COMMON, model_type="qwen3_moe", num_experts=E, moe_intermediate_size=DM, intermediate_size=9)
    with pytest.raises(ValueError, match="mlp_only_layers=\\[0\\] is not supported"):
        moe_config({**cfg, "mlp_only_layers": [0]})
    with pytest.raises(ValueError, match="num_experts_per_tok must be at most the 5 experts; got 6"):
        moe_config({**cfg, "num_experts_per_tok": 6})


def test_gpt_oss_experts_equal_transformers_mlp() -> None:
    """gpt-oss's MLP alone (router bias, top-k before the softmax, expert biases, clamped SwiGLU with
    gate and up interleaved) against transformers' GptOssMLP on the same random weights."""
    from headspace.model.moe import moe_of
    from headspace.pretrained.gpt_oss import GPT_OSS_MLP, gpt_oss_mlp_state

    torch.manual_seed(3)
    config = T.GptOssConfig(
        hidden_size=D, intermediate_size=DM, num_local_experts=E, num_experts_per_tok=K, swiglu_limit=0.9
    )  # fmt: skip  (a small limit, so that the clamps bite)
    ref = transformers_gpt_oss_mlp(config)
    ours = moe_of(D, MLPSpec(DM, act="silu", n_experts=E, top_k=K, swiglu_limit=0.9, swiglu_alpha=1.702,
                             **GPT_OSS_MLP))  # fmt: skip
    ours.load_state_dict(gpt_oss_mlp_state(ref.state_dict()), strict=True)
    x = torch.randn(2, 7, D)
    with torch.no_grad():
        want, _ = ref(x)
        got = ours(x)
        gate = F.linear(x, ours.experts_gate[0], ours.experts_gate_bias[0])
    assert bool((gate > 0.9).any())  # the clamp changes some values
    torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=0)
    with torch.no_grad():  # the routing: the same experts, weights the softmax over their k logits
        _, scores, indices = ref.router(x.reshape(-1, D))
        dense = ours.route(x).reshape(-1, E)
    assert torch.equal(dense.ne(0).nonzero()[:, 1].reshape(-1, K).sort(-1).values, indices.sort(-1).values)
    torch.testing.assert_close(dense.gather(-1, indices), scores, atol=1e-6, rtol=0)


def transformers_gpt_oss_mlp(config: Any) -> Any:
    """transformers' GptOssMLP of ``config`` with every parameter random (the router's bias too)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    mlp = GptOssMLP(config).eval()
    with torch.no_grad():
        for name, p in mlp.named_parameters():
            p.copy_((1.0 if name.startswith("router") else 0.3) * torch.randn_like(p))
    return mlp


def test_gpt_oss_logits_patterns_and_sinks_equal_transformers(tmp_path: Path) -> None:
    """gpt-oss (plain RoPE, then YaRN as gpt-oss ships it): sinks, q/k/v/o biases, sliding / full layers,
    the experts; every zero-initialised parameter (sinks, router and expert biases) random."""
    torch.manual_seed(4)
    config = T.GptOssConfig(
        vocab_size=V, hidden_size=D, intermediate_size=DM, num_hidden_layers=L, num_attention_heads=H,
        num_key_value_heads=3, head_dim=DH, num_local_experts=E, num_experts_per_tok=K, sliding_window=W,
        max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"], swiglu_limit=1.5,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, pad_token_id=0, eos_token_id=None,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = T.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1.0 if ("router" in name or "sinks" in name) else 0.2
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else scale * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    ref = T.GptOssForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", experts_implementation="eager"
    )
    ours = hs.load(tmp_path)
    assert ours.config.layer_types == ["sliding", "full"] and ours.config.attn_sink
    assert sum(p.numel() for p in ours.model.parameters()) == sum(p.numel() for p in ref.parameters())
    tokens = torch.randint(3, V, (2, 11))
    with torch.no_grad():
        want = ref.eval()(input_ids=tokens, output_attentions=True, output_router_logits=True)
        with hs.trace(ours.model, names=["*.hook_pattern", "*.hook_sink", "*.hook_router_logits"]) as t:
            got = ours(tokens)
    torch.testing.assert_close(got, want.logits, atol=1e-4 * float(want.logits.abs().max()), rtol=0)
    for layer in range(L):
        torch.testing.assert_close(t.pattern(layer), want.attentions[layer], atol=1e-5, rtol=0)
        sink = t[f"blocks.{layer}.attn.hook_sink"]  # (batch, heads, seq)
        torch.testing.assert_close(t.pattern(layer).sum(-1), 1 - sink, atol=1e-6, rtol=0)
        router, want_router = (
            t[f"blocks.{layer}.mlp.hook_router_logits"].reshape(-1, E),
            want.router_logits[layer],
        )
        atol = 1e-5 * max(1.0, float(want_router.abs().max()))  # (scaled to their largest magnitude)
        torch.testing.assert_close(router, want_router, atol=atol, rtol=0)
    assert float(t.pattern(0)[:, :, W:, 0].abs().max()) == 0.0  # the sliding layer's window
    prompt = tokens[:1, :5]  # greedy decoding (forward with the KV cache) past the window, as transformers
    with torch.no_grad():
        want_ids = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=2 * W + 1,
                                do_sample=False, pad_token_id=0)  # fmt: skip
    assert torch.equal(ours.generate(prompt, 2 * W + 1, temperature=0), want_ids)
    yarn = {**json.loads((tmp_path / "config.json").read_text()), "rope_parameters": {"rope_type": "yarn",
            "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16}}  # fmt: skip
    yarn["rope_parameters"] |= {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}  # as gpt-oss ships
    (tmp_path / "config.json").write_text(json.dumps(yarn))
    ref = T.GptOssForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    ours, long = hs.load(tmp_path), torch.randint(3, V, (2, 23))  # past original_max_position_embeddings
    with torch.no_grad():
        want = ref(input_ids=long).logits
        torch.testing.assert_close(ours(long), want, atol=1e-4 * float(want.abs().max()), rtol=0)
