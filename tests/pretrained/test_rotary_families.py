"""Phi-3 (with and without LongRoPE, partial rotary), Gemma, Seed-OSS, OLMo 3 and EXAONE 4 against
transformers 5 itself.

References: tiny random checkpoints built and saved by transformers (odd sizes, every norm weight and
bias random, non-default values of every field that matters), read back with ``headspace.load`` and
compared with transformers' eager forward: logits within 1e-4 of their largest magnitude, every
head's pattern within 1e-5; greedy decoding through the cached step token for token; ``head.qk(delta)``
against the traced scores for Phi-3's partial rotary with LongRoPE's attention factor.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

import headspace as hs
from headspace.decode import describe

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, H, KV, DM, CTX = 83, 48, 3, 4, 2, 37, 24  # vocab, hidden, layers, heads, kv heads, mlp, context
SLIDING = ["sliding_attention", "full_attention", "sliding_attention"]
# phi3: head_dim 12, rotary_dim 8 (fraction 2/3), 4 planes
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 300.0,
    "short_factor": [1.0, 1.3, 1.7, 2.2],
    "long_factor": [2.0, 3.5, 5.0, 7.5],
    "partial_rotary_factor": 2 / 3,
}
# name -> (config class, model class, config arguments)
ARCHS: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "phi3_longrope": (
        T.Phi3Config,
        T.Phi3ForCausalLM,
        {"original_max_position_embeddings": 10, "rope_parameters": LONGROPE, "partial_rotary_factor": 2 / 3},
    ),
    "phi3": (
        T.Phi3Config,
        T.Phi3ForCausalLM,
        {
            "rope_parameters": {"rope_type": "default", "rope_theta": 200.0, "partial_rotary_factor": 0.5},
            "partial_rotary_factor": 0.5,
            "sliding_window": 5,
        },
    ),
    "gemma": (T.GemmaConfig, T.GemmaForCausalLM, {"head_dim": 10, "hidden_activation": "gelu_pytorch_tanh"}),
    # every multiplier away from 1 (tied: the unembedding's 1 / logits_scaling goes on a copy)
    "granite": (
        T.GraniteConfig,
        T.GraniteForCausalLM,
        {
            "embedding_multiplier": 3.5,
            "attention_multiplier": 0.21,
            "residual_multiplier": 0.37,
            "logits_scaling": 2.6,
            "attention_bias": True,
            "mlp_bias": True,
            "tie_word_embeddings": True,
        },
    ),
    "olmo": (
        T.OlmoConfig,
        T.OlmoForCausalLM,
        {"rope_parameters": {"rope_type": "default", "rope_theta": 80.0}},
    ),
    "seed_oss": (
        T.SeedOssConfig,
        T.SeedOssForCausalLM,
        {"head_dim": 10, "attention_bias": True, "attention_out_bias": True, "mlp_bias": True},
    ),
    "olmo3": (
        T.Olmo3Config,
        T.Olmo3ForCausalLM,
        {
            "sliding_window": 5,
            "layer_types": SLIDING,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 700.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 90.0},
            },
        },
    ),
    "exaone4": (
        T.Exaone4Config,
        T.Exaone4ForCausalLM,
        {"head_dim": 10, "sliding_window": 5, "layer_types": SLIDING},
    ),
}


def build(arch: str, folder: Path) -> Any:
    """A random transformers model of ``arch`` saved into ``folder``, read back with eager attention."""
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    kw = dict(
        vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=KV,
        intermediate_size=DM, max_position_embeddings=CTX, initializer_range=0.3, pad_token_id=0,
        bos_token_id=1, eos_token_id=None, tie_word_embeddings=arch == "gemma", rms_norm_eps=1e-5,
    )  # fmt: skip
    kw.update(extra)
    model = model_cls(config_cls(**kw)).eval()
    with torch.no_grad():  # norms and biases away from their start, so a wrong or skipped one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    return model_cls.from_pretrained(folder, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    out = {}
    for arch in ARCHS:
        folder = tmp_path_factory.mktemp(arch)
        out[arch] = (folder, build(arch, folder))
    return out


def compare(ours: Any, ref: Any, tokens: torch.Tensor) -> None:
    with torch.no_grad():
        want = ref(input_ids=tokens, output_attentions=True)
        with hs.trace(ours.model, names="*.hook_pattern") as t:
            got = ours(tokens)
    bound = 1e-4 * float(want.logits.abs().max())
    torch.testing.assert_close(got, want.logits, atol=bound, rtol=0)
    for layer in range(L):
        torch.testing.assert_close(t.pattern(layer), want.attentions[layer], atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_and_every_head_pattern_equal_transformers(saved: dict, arch: str) -> None:
    folder, ref = saved[arch]
    ours = hs.load(folder)
    assert ours.config.extra["model_type"] == arch.split("_longrope")[0]
    compare(ours, ref, torch.randint(1, V, (2, 13)))  # past the windows (5) and LongRoPE's original 10
    compare(ours, ref, torch.randint(1, V, (1, 7)))  # LongRoPE: back to the short factors


def test_configs_say_what_each_family_is(saved: dict) -> None:
    c = {arch: hs.load(folder).config for arch, (folder, _) in saved.items()}
    assert (c["phi3"].rotary_fraction, c["phi3"].sliding_window, c["phi3"].rope_theta) == (0.5, 5, 200.0)
    rotary = hs.load(saved["phi3_longrope"][0]).model.blocks[0].attn.rotary
    assert (rotary.rotary_dim, rotary.rope_type) == (8, "longrope")
    assert rotary.attention_factor == pytest.approx(math.sqrt(1 + math.log(CTX / 10) / math.log(10)))
    assert (c["gemma"].norm_offset, c["gemma"].embed_scale) == (1.0, pytest.approx(D**0.5, rel=1e-7))
    g = c["granite"]
    assert (g.embed_scale, g.attn_scale, g.tie_embeddings) == (3.5, pytest.approx(0.21, rel=1e-12), False)
    assert g.extra["granite"]["residual_multiplier"] == 0.37 and g.extra["tied_checkpoint"] is True
    assert (c["seed_oss"].qkv_bias, c["seed_oss"].out_bias, c["seed_oss"].mlp_bias) == (True, True, True)
    assert (c["olmo3"].norm, c["olmo3"].qk_norm, c["olmo3"].layer_types) == (
        "post_sublayer",
        "all",
        ["sliding", "full", "sliding"],
    )
    assert (c["olmo3"].rope_theta, c["olmo3"].rope_local_theta) == (700.0, 90.0)
    assert (c["exaone4"].qk_norm, c["exaone4"].nope_layers) == ("head", [1])


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_decoding_through_the_cached_step_equals_transformers(saved: dict, arch: str) -> None:
    folder, ref = saved[arch]
    ours = hs.load(folder)
    assert describe(ours.model) is not None  # the cached step covers the family: no fallback
    prompt = torch.randint(1, V, (1, 6))
    new = 12  # to position 17: past the windows and LongRoPE's original 10 (the long factors)
    got = ours.generate(prompt, new, temperature=0)
    with torch.no_grad():
        want = ref.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
    assert torch.equal(got, want)


def test_phi3_qk_delta_is_the_partial_longrope_circuit(saved: dict) -> None:
    """x_i qk(i - j) x_j^T == hook_scores / scale: rotation on the first 8 of 12 features, LongRoPE's
    long frequencies (a 13-token call) and its attention factor squared."""
    ours = hs.load(saved["phi3_longrope"][0])
    tokens = torch.randint(1, V, (1, 13))
    with hs.trace(ours.model, names=["blocks.1.hook_attn_in", "blocks.1.attn.hook_scores"]) as t:
        ours(tokens)
    attn = ours.model.blocks[1].attn
    x = t["blocks.1.hook_attn_in"][0].double()  # (S, d_model)
    scores = t["blocks.1.attn.hook_scores"][0].double() / attn.scale  # (H, S, S)
    delta = torch.arange(13)[:, None] - torch.arange(13)[None, :]  # (S, S)
    causal = torch.ones(13, 13, dtype=torch.bool).tril()
    for h in range(H):
        AB = attn.heads[h].qk(delta).AB.double()  # (S, S, d_model, d_model)
        got = torch.einsum("im,ijmn,jn->ij", x, AB, x)  # (S, S)
        torch.testing.assert_close(got[causal], scores[h][causal], rtol=1e-4, atol=1e-4)


def test_what_is_not_exact_is_refused_naming_the_field(saved: dict, tmp_path: Path) -> None:
    for arch, change, field in (
        ("olmo", {"clip_qkv": 8.0}, "clip_qkv=8.0"),
        ("olmo3", {"sliding_window": None}, "rope_parameters['sliding_attention']"),
        ("phi3_longrope", {"rope_parameters": {**LONGROPE, "short_factor": [1.0]}}, "'short_factor'"),
    ):
        folder = tmp_path / arch
        shutil.copytree(saved[arch][0], folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError) as info:
            hs.load(folder)
        message = str(info.value)
        assert field in message and "\n" not in message, message
