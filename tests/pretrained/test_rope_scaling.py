"""Rotary scalings YaRN, dynamic NTK, LongRoPE and llama3 against transformers 5 itself.

References: tiny random Llama checkpoints built and saved by transformers (eager attention, every norm
weight random), read back with ``headspace.load``. Tolerances (float32): logits within 1e-4 of their
largest magnitude, every head's pattern within 1e-5; greedy decoding token for token. Dynamic NTK is
stateful in transformers (its frequencies follow the longest sequence seen, and reset below the
config's length): the same run of lengths goes through both models, in the same order. ``head.qk(delta)``
is checked against the traced scores for each scaling (YaRN's attention factor included).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

import headspace as hs
from headspace import MultiHeadAttention
from headspace.nn.positions import Rotary

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, H, KV, DH, DM, CTX = 89, 44, 2, 4, 2, 14, 37, 16  # vocab, hidden, layers, heads, kv, head, mlp, ctx
ROPES: dict[str, dict[str, Any]] = {
    # non-default beta_fast / beta_slow and mscale so that every YaRN field matters
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 500.0,
        "factor": 4.0,
        "original_max_position_embeddings": 8,
        "beta_fast": 8.0,
        "beta_slow": 2.0,
        "mscale": 1.3,
        "mscale_all_dim": 0.7,
    },
    "yarn_plain": {
        "rope_type": "yarn",
        "rope_theta": 300.0,
        "factor": 3.0,
        "original_max_position_embeddings": 8,
    },
    "dynamic": {"rope_type": "dynamic", "rope_theta": 300.0, "factor": 2.5},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 400.0,
        "factor": 6.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 3.0,
        "original_max_position_embeddings": 8,
    },
}


def build(rope: dict[str, Any], folder: Path) -> Any:
    """A random transformers Llama with ``rope``, saved into ``folder``, read back with eager attention."""
    torch.manual_seed(0)
    config = T.LlamaConfig(
        vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=KV,
        head_dim=DH, intermediate_size=DM, max_position_embeddings=CTX, initializer_range=0.3,
        pad_token_id=0, bos_token_id=1, eos_token_id=None, tie_word_embeddings=False,
        rope_parameters=dict(rope), rms_norm_eps=1e-5,
    )  # fmt: skip
    model = T.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    return T.LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    out = {}
    for name, rope in ROPES.items():
        folder = tmp_path_factory.mktemp(name)
        out[name] = (folder, build(rope, folder))
    return out


def compare(ours: Any, ref: Any, tokens: torch.Tensor) -> None:
    """Logits within 1e-4 of their largest magnitude and every head's pattern within 1e-5."""
    with torch.no_grad():
        want = ref(input_ids=tokens, output_attentions=True)
        with hs.trace(ours.model, names="*.hook_pattern") as t:
            got = ours(tokens)
    bound = 1e-4 * float(want.logits.abs().max())
    torch.testing.assert_close(got, want.logits, atol=bound, rtol=0)
    for layer in range(L):
        torch.testing.assert_close(t.pattern(layer), want.attentions[layer], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["yarn", "yarn_plain", "llama3"])
def test_static_scalings_equal_transformers(saved: dict, name: str) -> None:
    folder, ref = saved[name]
    ours = hs.load(folder)
    assert ours.model.blocks[0].attn.rotary.rope_type == name.split("_")[0]
    compare(ours, ref, torch.randint(1, V, (2, CTX)))  # past original_max_position_embeddings (8)


def test_yarn_attention_factor_is_transformers_mscale(saved: dict) -> None:
    rotary = hs.load(saved["yarn"][0]).model.blocks[0].attn.rotary
    ref_rotary = saved["yarn"][1].model.rotary_emb
    assert rotary.attention_factor == pytest.approx(ref_rotary.attention_scaling, rel=0, abs=0)
    assert rotary.attention_factor == pytest.approx((0.13 * math.log(4) + 1) / (0.07 * math.log(4) + 1))
    assert torch.equal(rotary.inv_freq, ref_rotary.inv_freq)


def test_dynamic_ntk_follows_the_longest_sequence_as_transformers_keeps_it(saved: dict) -> None:
    folder, ref = saved["dynamic"]
    ours = hs.load(folder)
    assert ours.config.max_seq_len == int(CTX * 2.5)  # dynamic NTK runs past the config's length
    rotary = ours.model.blocks[0].attn.rotary
    # grow, stay (16 is not below 16), reset (10 < 16), grow again, grow further, stay at 30's
    for n in (24, 16, 10, 20, 30, 18):
        compare(ours, ref, torch.randint(1, V, (1, n)))
        assert torch.equal(rotary.inv_freq, ref.model.rotary_emb.inv_freq), n


@pytest.mark.parametrize("name", ["yarn", "dynamic"])
def test_greedy_decoding_equals_transformers(saved: dict, name: str) -> None:
    folder, ref = saved[name]
    ours = hs.load(folder)
    prompt = torch.randint(1, V, (1, 10))
    # dynamic: to position 21, past the config's 16 (its frequencies grow on the way); YaRN: to 15
    new = min(12, ours.config.max_seq_len - 10)
    got = ours.generate(prompt, new, temperature=0)
    with torch.no_grad():
        ref.model.rotary_emb.inv_freq.copy_(ref.model.rotary_emb.original_inv_freq)
        ref.model.rotary_emb.max_seq_len_cached = CTX
        want = ref.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "scaling",
    [
        ROPES["yarn"] | {"rope_theta": 100.0},
        {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 4},
        {
            "rope_type": "longrope",
            "short_factor": [1.0, 1.5, 2.0],
            "long_factor": [3.0, 4.0, 5.0],
            "original_max_position_embeddings": 5,
            "factor": 3.0,
        },
    ],
    ids=["yarn", "dynamic", "longrope"],
)
def test_qk_delta_equals_the_traced_scores(scaling: dict[str, Any]) -> None:
    """x_i qk(i - j) x_j^T == hook_scores * sqrt(d_head) for every (i, j), the scaling's frequencies and
    attention factor included (dynamic and LongRoPE: those of the traced call, 9 positions long)."""
    torch.manual_seed(1)
    rot = Rotary(8, base=100.0, fraction=0.75, scaling=scaling)
    attn = MultiHeadAttention(11, 3, d_head=8, n_kv_heads=1, bias=False, rotary=rot, dtype=torch.float64)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0.0, 0.5)
    x = torch.randn(1, 9, 11, dtype=torch.float64)
    with hs.trace(attn, names="hook_scores") as t:
        attn(x, is_causal=True)
    scores = t["hook_scores"][0] * math.sqrt(8)  # (H, S, S)
    delta = torch.arange(9)[:, None] - torch.arange(9)[None, :]  # (S, S)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    for h in range(3):
        got = torch.einsum("im,ijmn,jn->ij", x[0], attn.heads[h].qk(delta).AB, x[0])  # (S, S)
        torch.testing.assert_close(got[causal], scores[h][causal], rtol=1e-9, atol=1e-9)
    if scaling["rope_type"] == "yarn":
        assert rot.attention_factor > 1  # the factor is there, and qk carries its square
