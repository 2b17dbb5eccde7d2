"""Qwen3-Next and Qwen3.5 (text) against transformers 5: hybrids of gated softmax attention and Gated
DeltaNet layers (issue #39).

References: tiny random models built and saved by transformers itself (eager attention, odd sizes,
grouped value heads, a 3-tap convolution), every zero-initialised parameter ((1 + w) norms, routers,
the shared-expert gate) and the DeltaNet's decay parameters set random, read back by
``headspace.load(folder)`` without transformers. 70 positions: the chunked rule runs two chunks of 64,
the second padded. Logits within 1e-4 of their largest magnitude, every softmax head's pattern (the
full-attention layers') within 1e-5, greedy decoding equal.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

import headspace as hs
from headspace.analysis.atlas.run import atlas
from headspace.analysis.circuits.decomposition import composition_scores, score_decomposition
from headspace.attention.delta_net import DeltaNetCache, GatedDeltaNet
from headspace.decode import describe, native, python
from headspace.pretrained.qwen_next import qwen_next_config

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L = 61, 24, 4
COMMON = dict(vocab_size=V, hidden_size=D, intermediate_size=20, num_hidden_layers=L, num_attention_heads=4,
              num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=5,
              linear_value_head_dim=7, linear_conv_kernel_dim=3, max_position_embeddings=128, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)  # fmt: skip
FAMILIES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "qwen3_next": (T.Qwen3NextConfig, T.Qwen3NextForCausalLM,
                   dict(head_dim=6, partial_rotary_factor=1 / 3, num_experts=5, num_experts_per_tok=2,
                        moe_intermediate_size=9, shared_expert_intermediate_size=11, decoder_sparse_step=1,
                        mlp_only_layers=[])),
    "qwen3_5_text": (T.Qwen3_5TextConfig, T.Qwen3_5ForCausalLM, dict(head_dim=8)),  # 0.25 of 8: 2 rotate
}  # fmt: skip


def build(family: str, folder: Path) -> Any:
    """A random transformers model of ``family`` saved into ``folder``, read back with eager attention."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(1)
    model = model_cls(config_cls(**COMMON, **extra)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # the gated norm scales by w (ones)
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif "norm" in name:  # (1 + w) norms: w starts at zero
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith("gate.weight") and "proj" not in name:  # router, shared-expert gate
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model_cls.from_pretrained(
        folder, attn_implementation="eager", experts_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    return {f: (folder := tmp_path_factory.mktemp(f), build(f, folder)) for f in FAMILIES}


def test_configs_say_what_each_family_is(saved: dict) -> None:
    for family, (folder, ref) in saved.items():
        ours = hs.load(folder)
        c = ours.config
        assert c.layer_types == ["linear", "linear", "linear", "full"], family
        assert (c.attn_gate, c.qk_norm, c.norm_offset) == ("elementwise", "head", 1.0)
        assert c.delta_net == dict(n_k_heads=2, n_v_heads=4, d_k=5, d_v=7, conv_kernel=3)
        assert [type(b.attn).__name__ for b in ours.model.blocks] == ["GatedDeltaNet"] * 3 + [
            "MultiHeadAttention"
        ]
        assert [b.spec.mixer for b in ours.model.blocks] == ["gated_deltanet"] * 3 + ["attention"]
        assert ours.model.blocks[3].attn.rotary.rotary_dim == 2
        assert c.summary().endswith("Gated DeltaNet on 3/4 layers, elementwise output gates")
        assert hs.ModelConfig.from_dict(c.to_dict()) == c  # the new fields round-trip through JSON
        assert sum(p.numel() for p in ours.model.parameters()) == sum(p.numel() for p in ref.parameters())
    assert hs.load(saved["qwen3_next"][0]).config.mlp_kind == "moe"
    assert hs.load(saved["qwen3_5_text"][0]).config.mlp_kind == "gated"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_patterns_equal_transformers(saved: dict, family: str) -> None:
    folder, ref = saved[family]
    ours = hs.load(folder)
    torch.manual_seed(2)
    tokens = torch.randint(3, V, (2, 70))
    with torch.no_grad():
        want = ref(input_ids=tokens, output_attentions=True)
        with hs.trace(ours.model, names=["*.hook_pattern", "*.hook_gate", "*.hook_state"]) as t:
            got = ours(tokens)
    scale = float(want.logits.abs().max())
    torch.testing.assert_close(got, want.logits, atol=1e-4 * scale, rtol=0)
    assert len(want.attentions) == 1 and t.n_layers == 1  # transformers and the trace: softmax layers only
    assert t.layer_paths == ["blocks.3.attn"]
    torch.testing.assert_close(t.pattern(0), want.attentions[0], atol=1e-5, rtol=0)
    refused = r"blocks\.0\.attn is a Gated DeltaNet layer \(the block field 'mixer'"
    with pytest.raises(ValueError, match=refused):
        t["blocks.0.attn.hook_pattern"]
    assert t["blocks.3.attn.hook_gate"].shape == (2, 70, 4, 6 if family == "qwen3_next" else 8)
    assert t["blocks.0.attn.hook_gate"].shape == (2, 70, 4)  # the DeltaNet's log decay
    assert bool((t["blocks.0.attn.hook_gate"] < 0).all())
    assert t["blocks.1.attn.hook_state"].shape == (2, 4, 5, 7)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_decoding_equals_transformers(saved: dict, family: str) -> None:
    folder, ref = saved[family]
    ours = hs.load(folder)
    assert describe(ours.model) is not None  # the Python cached step (DeltaNet layers by their forward)
    assert isinstance(ours.model.make_kv_caches(1, 8)[0], DeltaNetCache)
    prompt = torch.randint(3, V, (1, 5))
    with torch.no_grad():
        want = ref.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False, pad_token_id=0
        )
    assert torch.equal(ours.generate(prompt, 10, temperature=0), want)


def test_a_left_padded_batch_decodes_each_row_as_alone(saved: dict) -> None:
    """Padded positions' inputs are zeroed in the DeltaNet layers (as transformers does): they write
    nothing into the state, so a left-padded row generates what it generates alone."""
    model = hs.load(saved["qwen3_5_text"][0]).model
    a, b = torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[11, 12, 13]])
    batch = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 11, 12, 13]])
    real = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]).bool()
    both = model.generate(batch, 5, temperature=0, key_padding=real)
    assert torch.equal(both[:1], model.generate(a, 5, temperature=0))
    assert torch.equal(both[1:, 2:], model.generate(b, 5, temperature=0))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_python_step_runs_gates_and_deltanet_layers(saved: dict, family: str) -> None:
    """The Python cached step runs each DeltaNet block by its layer's forward on the new position with
    its DeltaNetCache (LayerStep.mixer) and each gated full-attention block with its output gate
    (LayerStep.out_gate) and, in Qwen3-Next, its experts: its logits equal forward's with the caches,
    one token at a time, and the full forward's within 1e-4 of their largest magnitude (the recurrent
    rule against the chunked one)."""
    from headspace.decode import Stepper

    ours = hs.load(saved[family][0])
    step = describe(ours.model)
    assert step is not None
    assert [(x.mixer is not None, x.out_gate is not None) for x in step.layers] == [(True, False)] * 3 + [
        (False, True)
    ]
    assert all((x.moe is not None) == (family == "qwen3_next") for x in step.layers)
    stepper, tokens = Stepper(step), torch.randint(3, V, (2, 12))
    caches, theirs = ours.model.make_kv_caches(2, 16), ours.model.make_kv_caches(2, 16)
    with torch.no_grad():
        full = ours.model(tokens)  # (2, 12, V)
        ours.model(tokens[:, :4], kv_caches=caches)
        ours.model(tokens[:, :4], kv_caches=theirs)
        for i in range(4, 12):
            got = stepper.logits(tokens[:, i : i + 1], caches)  # (2, V)
            want = ours.model(tokens[:, i : i + 1], kv_caches=theirs)[:, -1]  # (2, V)
            torch.testing.assert_close(got, want, atol=1e-6 * float(want.abs().max()), rtol=0)
            torch.testing.assert_close(got, full[:, i], atol=1e-4 * float(full.abs().max()), rtol=0)
    assert stepper.backend_used == "python"
    from headspace.pretrained import families_table as ft

    assert ft.decode_route(ours) == "python" and "python" in ft.family(family).decode


def test_the_decoding_steps_name_gates_and_deltanet_where_they_lack_them(saved: dict) -> None:
    ours = hs.load(saved["qwen3_5_text"][0])
    step = describe(ours.model)
    assert step is not None
    for block, field in ((0, "block field 'mixer'"), (3, "attention field 'gate'")):
        with pytest.raises(ValueError, match=f"the native decoding step does not support the {field}"):
            native.prepare(dataclasses.replace(step, layers=(step.layers[block],)))  # asked for by name
    # a dense step given the hybrid's descriptions (no layer or gate of theirs): each backend names them
    dense = hs.Decoder(
        dataclasses.replace(ours.config, attn_gate=None, delta_net=None, layer_types=None)
    ).eval()
    step = describe(dense)
    assert step is not None
    for block, field in ((0, "block field 'mixer'"), (3, "attention field 'gate'")):
        layers = tuple(dataclasses.replace(x, spec=ours.model.blocks[block].spec) for x in step.layers)
        hybrid = dataclasses.replace(step, layers=layers)
        with pytest.raises(ValueError, match=f"the native decoding step does not support the {field}"):
            native.native_form(hybrid)
        with pytest.raises(ValueError, match=f"the Python decoding step does not support the {field}"):
            python.prepare(hybrid)


def test_analyses_that_need_a_pattern_refuse_deltanet_layers_by_name(saved: dict) -> None:
    ours = hs.load(saved["qwen3_5_text"][0])
    tokens = torch.randint(3, V, (1, 6))
    named = r"blocks \[0, 1, 2\] are Gated DeltaNet \(the block field 'mixer' is 'gated_deltanet'"
    with pytest.raises(ValueError, match=r"score_decomposition \(why\) of layer 0 needs a softmax .*'mixer'"):
        score_decomposition(ours.model, tokens, 0, 0)
    with pytest.raises(ValueError, match="composition_scores needs a softmax .*" + named):
        composition_scores(ours.model)
    with pytest.raises(ValueError, match="atlas needs a softmax .*" + named):
        atlas(ours, ["some text"])
    layer = ours.model.blocks[0].attn
    assert isinstance(layer, GatedDeltaNet)
    with pytest.raises(ValueError, match="a Gated DeltaNet layer has no softmax pattern and takes no mask"):
        layer(torch.randn(1, 3, D), need_weights=True)


def test_bad_fields_are_refused_naming_the_field() -> None:
    base = dict(
        COMMON,
        model_type="qwen3_next",
        head_dim=6,
        num_experts=5,
        num_experts_per_tok=2,
        moe_intermediate_size=9,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
    )
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[0\] is not supported"):
        qwen_next_config({**base, "mlp_only_layers": [0]})
    with pytest.raises(ValueError, match="decoder_sparse_step must be 1"):
        qwen_next_config({**base, "decoder_sparse_step": 2})
    with pytest.raises(ValueError, match="rope_type='yarn' is not supported"):
        qwen_next_config({**base, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="layer_types must list"):
        qwen_next_config({**base, "layer_types": ["mamba"] * 4})
    with pytest.raises(ValueError, match=r"DeltaNetSpec\.n_v_heads must be a multiple of n_k_heads=2; got 3"):
        qwen_next_config({**base, "linear_num_value_heads": 3})
