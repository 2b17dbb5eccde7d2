"""Gemma 4 text (``gemma4_text``, dense) against transformers 5.

References: tiny random models built and saved by transformers itself (eager attention, odd sizes),
every norm and layer scalar set random so that they matter, read back by ``headspace.load(folder)``
without transformers. Logits within 1e-4 of their largest magnitude, every head's pattern within 1e-5,
greedy decoding equal. One checkpoint has it all (sliding and global layers of different head widths
and key/value heads, ``attention_k_eq_v``, proportional partial RoPE, two layers sharing earlier
layers' keys and values with a double-wide MLP, per-layer inputs, final soft-capping); the other is
the plain form (no k_eq_v, no sharing, no per-layer inputs, plain RoPE on the global layers).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

import headspace as hs
from headspace.decode.step import STEP_FEATURES
from headspace.model.gemma_extras import GemmaAttention
from headspace.nn.spec import AttentionSpec, features_of, refuse_unsupported
from headspace.pretrained.families_table import decode_route

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, H = 67, 36, 6, 3
TYPES = ["sliding_attention", "full_attention"] * 3  # (transformers: the last layer is global)
CASES: dict[str, dict[str, Any]] = {
    "all": dict(attention_k_eq_v=True, num_kv_shared_layers=2, use_double_wide_mlp=True,
                hidden_size_per_layer_input=5, vocab_size_per_layer_input=V, global_head_dim=14,
                num_global_key_value_heads=1, final_logit_softcapping=7.0),
    "plain": dict(attention_k_eq_v=False, num_kv_shared_layers=0, hidden_size_per_layer_input=0,
                  global_head_dim=10, tie_word_embeddings=False,
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                   "full_attention": {"rope_type": "default", "rope_theta": 1000.0}}),
    "moe": dict(enable_moe_block=True, num_experts=5, top_k_experts=2, moe_intermediate_size=9,
                attention_k_eq_v=True, num_kv_shared_layers=2, hidden_size_per_layer_input=0,
                global_head_dim=14, num_global_key_value_heads=1),
}  # fmt: skip


def build(case: str, folder: Path) -> Any:
    """A random Gemma 4 of ``case`` saved into ``folder``, read back with eager attention."""
    config = T.Gemma4TextConfig(
        vocab_size=V, hidden_size=D, intermediate_size=22, num_hidden_layers=L, num_attention_heads=H,
        num_key_value_heads=3, head_dim=8, sliding_window=4, layer_types=list(TYPES),
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, **CASES[case],
    )  # fmt: skip
    torch.manual_seed(3)
    model = T.Gemma4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            unit = "norm" in name or "scale" in name  # norms, the router's scales
            p.copy_((1.0 + 0.3 * torch.randn_like(p)) if unit else 0.2 * torch.randn_like(p))
        for i, layer in enumerate(model.model.layers):
            layer.layer_scalar.fill_(0.6 + 0.15 * i)
            if config.enable_moe_block:  # experts 1 and 3 share one router row: every token ties them
                layer.router.proj.weight[3] = layer.router.proj.weight[1]
    model.save_pretrained(folder)
    return T.Gemma4ForCausalLM.from_pretrained(
        folder, attn_implementation="eager", experts_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    return {c: (folder := tmp_path_factory.mktemp(c), build(c, folder)) for c in CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_patterns_equal_transformers(saved: dict, case: str) -> None:
    folder, ref = saved[case]
    ours = hs.load(folder)
    torch.manual_seed(4)
    tokens = torch.randint(3, V, (2, 11))  # longer than the window (4)
    with torch.no_grad():
        want = ref(input_ids=tokens, output_attentions=True, output_router_logits=case == "moe")
        got = ours(tokens)
        names = ["*.hook_pattern"] + (["*.hook_router_logits", "*.hook_top_k"] if case == "moe" else [])
        with hs.trace(ours.model, names=names) as t:
            traced = ours(tokens)
    scale = float(want.logits.abs().max())
    torch.testing.assert_close(got, want.logits, atol=1e-4 * scale, rtol=0)
    torch.testing.assert_close(traced, want.logits, atol=1e-4 * scale, rtol=0)
    for layer in range(L):
        torch.testing.assert_close(t.pattern(layer), want.attentions[layer], atol=1e-5, rtol=0)
    if case == "moe":  # transformers records the router's softmax; the choices are its top k
        for layer in range(L):
            probs = torch.softmax(t[f"blocks.{layer}.mlp.hook_router_logits"].reshape(-1, 5), dim=-1)
            torch.testing.assert_close(probs, want.router_logits[layer], atol=1e-5, rtol=0)
            top = t[f"blocks.{layer}.mlp.hook_top_k"].reshape(-1, 2)
            assert torch.equal(top, torch.topk(want.router_logits[layer], 2, dim=-1).indices)
        tied = t["blocks.0.mlp.hook_top_k"]  # the tie falls at the k-th place somewhere: one is taken
        assert bool(((tied == 3).any(-1) ^ (tied == 1).any(-1)).any())
    # the window has teeth: a key 4 back from a query of a sliding layer gets no weight
    assert float(t.pattern(0)[:, :, 10, :7].abs().max()) == 0.0
    assert float(t.pattern(1)[:, :, 10, :7].abs().max()) > 0.0  # (a global layer sees it)
    # every parameter of the checkpoint is one of ours, once
    assert sum(p.numel() for p in ours.model.parameters()) == sum(p.numel() for p in ref.parameters())


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_decoding_equals_transformers(saved: dict, case: str) -> None:
    folder, ref = saved[case]
    ours = hs.load(folder)
    prompt = torch.tensor([[5, 9, 31, 7, 44, 12]])
    with torch.no_grad():
        # (no end-of-sequence token: both run the nine steps, whatever they pick)
        want = ref.generate(prompt, max_new_tokens=9, do_sample=False, eos_token_id=None, pad_token_id=0)
        got = ours.model.generate(prompt, 9, temperature=0)
    assert got.tolist() == want.tolist()
    assert decode_route(ours) == "forward"
    # a left-padded batch decodes each row as it decodes alone (shared layers read the padded keys)
    short = torch.tensor([[0, 0, 8, 19, 23, 4]])
    padding = torch.tensor([[True] * 6, [False, False, True, True, True, True]])
    with torch.no_grad():
        both = ours.model.generate(torch.cat([prompt, short]), 9, temperature=0, key_padding=padding)
        alone = ours.model.generate(short[:, 2:], 9, temperature=0)
    assert both[0].tolist() == got[0].tolist() and both[1, 2:].tolist() == alone[0].tolist()


def test_sharing_layers_hold_no_cache(saved: dict) -> None:
    """A kv_source layer's cache holds nothing (its keys are its owner's cache's), and decoding through
    those caches equals the full forward."""
    folder, _ = saved["all"]
    model = hs.load(folder).model
    caches = model.make_kv_caches(1, 12)
    held = [c.k.numel() + c.v.numel() for c in caches]
    assert held[4] == held[5] == 0 and all(n > 0 for n in held[:4])
    tokens = torch.tensor([[5, 9, 31, 7, 44, 12, 3, 8]])
    with torch.no_grad():
        full = model(tokens)  # (1, 8, V)
        model(tokens[:, :6], kv_caches=caches)
        steps = [model(tokens[:, i : i + 1], kv_caches=caches)[:, 0] for i in (6, 7)]
    assert torch.allclose(torch.stack(steps, 1), full[:, 6:], atol=1e-5)
    assert caches[2].length == 8 and caches[4].capacity == 12
    with pytest.raises(ValueError, match=r"reads layer 2's keys and values .* field 'kv_source'"):
        caches[4].append(torch.zeros(1, 3, 1, 8), torch.zeros(1, 3, 1, 8))


def test_the_config_says_what_each_layer_is(saved: dict) -> None:
    folder, _ = saved["all"]
    model = hs.load(folder).model
    specs = [b.spec.attention for b in model.blocks]
    assert [(a.d_head, a.n_kv_heads) for a in specs] == [(8, 3), (14, 1)] * 3
    assert [a.kv_source for a in specs] == [None, None, None, None, 2, 3]
    assert [a.k_eq_v for a in specs] == [False, True] * 3
    assert all(a.v_norm and a.score_scale == 1.0 for a in specs)
    assert [a.window for a in specs] == [4, None] * 3
    assert [b.spec.mlp.d_mlp for b in model.blocks] == [22] * 4 + [44] * 2  # double-wide when shared
    rot = specs[1].positions
    assert rot is not None and rot.rope_type == "proportional"
    assert int((rot.inv_freq > 0).sum()) == int(0.25 * 14 // 2)  # the other planes do not turn


def test_shared_layers_views_are_the_owners_tensors(saved: dict) -> None:
    """A layer that reads an earlier layer's keys and values has no W_K / W_V of its own: its views are
    the owner's (same storage); a k_eq_v layer's W_V is its W_K."""
    model = hs.load(saved["all"][0]).model
    owner, shared = model.blocks[2].attn, model.blocks[4].attn
    assert isinstance(shared, GemmaAttention) and shared.kv_owner is owner
    assert shared.W_K.data_ptr() == owner.W_K.data_ptr() and shared.W_V.data_ptr() == owner.W_V.data_ptr()
    assert shared.k_norm is None and torch.equal(shared.qk_norm_gains()[1][0], owner.k_norm.weight)
    k = torch.randn(1, 5, 3, 8)  # the owner's hook_k: the sharing layer's key scales are the owner's
    assert torch.equal(shared.qk_norm_scales(torch.randn(1, 5, H, 8), k)[1], owner.qk_norm_scales(k, k)[1])
    glob = model.blocks[1].attn
    assert glob.W_V.data_ptr() == glob.W_K.data_ptr() and torch.equal(glob.W_V, glob.W_K)
    assert glob.qkv_weight.shape[0] == (H + 1) * 14  # W_Q and W_K only
    # an edit of the owner's keys changes what the sharing layer attends to
    tokens = torch.tensor([[4, 8, 15, 16, 23, 42]])
    with torch.no_grad():
        with hs.trace(model, names=["blocks.4.attn.hook_pattern"]) as before:
            model(tokens)
        owner.W_K.add_(0.5 * torch.randn(owner.W_K.shape, generator=torch.Generator().manual_seed(0)))
        with hs.trace(model, names=["blocks.4.attn.hook_pattern"]) as after:
            model(tokens)
    assert not torch.allclose(before.pattern(4), after.pattern(4))


def test_the_steps_refuse_the_new_fields_by_name(saved: dict) -> None:
    model = hs.load(saved["all"][0]).model
    assert features_of(model.blocks[4].spec) == ["window", "qk_norm", "v_norm", "kv_source"]
    assert features_of(model.blocks[1].spec) == ["qk_norm", "v_norm", "k_eq_v"]
    with pytest.raises(ValueError, match="decoding step does not support the attention field 'v_norm'"):
        refuse_unsupported(model.blocks[0].spec, "the decoding step", STEP_FEATURES)
    with pytest.raises(ValueError, match=r"AttentionSpec\.kv_source must be None or a layer index"):
        AttentionSpec(8, 2, 4, 2, kv_source=-1)
    with pytest.raises(ValueError, match="v_norm must be True, fixed by the layer's weights"):
        model.blocks[0].attn.spec = dataclasses.replace(model.blocks[0].attn.spec, v_norm=False)
    with pytest.raises(RuntimeError, match="field 'kv_source': layer 4 reads the keys and values of layer 2"):
        model.blocks[4].attn(torch.zeros(1, 3, D))  # (alone: never another run's keys)
    model(torch.tensor([[5, 6, 7]]))  # the whole forward leaves no keys behind
    assert not model.blocks[4].attn.kv_store and not model.blocks[4].attn.kv_store.active


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"enable_moe_block": True, "num_experts": 3, "top_k_experts": 4, "moe_intermediate_size": 5},
         "top_k_experts must be at most num_experts=3"),
        ({"enable_moe_block": True}, "num_experts must be an int"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "rope_theta": 1.0, "factor": 2.0},
                              "full_attention": {"rope_type": "default", "rope_theta": 1.0}}},
         "rope_type='yarn' is not supported"),
        ({"num_kv_shared_layers": 6}, "num_kv_shared_layers=6 leaves no layer"),
    ],
)  # fmt: skip
def test_unsupported_configs_are_refused_by_name(
    saved: dict, tmp_path: Path, change: dict, message: str
) -> None:
    folder, _ = saved["plain"]
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message) as e:
        hs.load(tmp_path)
    assert "\n" not in str(e.value)
