"""Gemma 4 text with eleven or more layers: transformers 5 writes ``per_layer_config`` with its keys
zero-padded to the width of the largest ("03", "10"); the global layers' head width must still be read.

Reference: a tiny random model built and saved by transformers itself (eager attention, odd sizes, every
norm and layer scalar random), read back by ``headspace.load(folder)``: logits within 1e-4 of their
largest magnitude, every head's pattern within 1e-5.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as T

import headspace as hs

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, H = 53, 20, 11, 2
GLOBAL = (3, 10)  # full-attention layers: keys "03" and "10" in the saved config


def _build(folder: Path) -> T.Gemma4ForCausalLM:
    """A random 11-layer Gemma 4 (head_dim 6 on sliding layers, 10 on the global ones) saved into
    ``folder``, read back with eager attention."""
    types = ["full_attention" if i in GLOBAL else "sliding_attention" for i in range(L)]
    config = T.Gemma4TextConfig(
        vocab_size=V, hidden_size=D, intermediate_size=14, num_hidden_layers=L, num_attention_heads=H,
        num_key_value_heads=1, head_dim=6, global_head_dim=10, sliding_window=3, layer_types=types,
        hidden_size_per_layer_input=0, max_position_embeddings=32, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(5)
    model = T.Gemma4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 + 0.3 * torch.randn_like(p)) if "norm" in name else 0.2 * torch.randn_like(p))
        for i, layer in enumerate(model.model.layers):
            layer.layer_scalar.fill_(0.7 + 0.05 * i)
    model.save_pretrained(folder)
    return T.Gemma4ForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def test_zero_padded_layer_keys_give_the_global_head_width(tmp_path: Path) -> None:
    ref = _build(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["per_layer_config"]
    assert sorted(saved) == ["03", "10"]  # what transformers writes (the case this test is about)
    ours = hs.load(tmp_path)
    assert [b.spec.attention.d_head for b in ours.model.blocks] == [
        10 if i in GLOBAL else 6 for i in range(L)
    ]
    tokens = torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(6))  # [2, 9]
    with torch.no_grad():
        want = ref(input_ids=tokens, output_attentions=True)
        with hs.trace(ours.model, names=["*.hook_pattern"]) as t:
            got = ours(tokens)
    scale = float(want.logits.abs().max())
    torch.testing.assert_close(got, want.logits, atol=1e-4 * scale, rtol=0)
    for layer in range(L):
        torch.testing.assert_close(t.pattern(layer), want.attentions[layer], atol=1e-5, rtol=0)


@pytest.mark.parametrize("key", ["11", "x3", "-1"])
def test_a_key_that_is_no_layer_is_refused_in_one_line(tmp_path: Path, key: str) -> None:
    from headspace.pretrained.gemma4 import gemma4_config

    hf = {
        "model_type": "gemma4_text", "vocab_size": V, "hidden_size": D, "num_hidden_layers": L,
        "num_attention_heads": H, "intermediate_size": 14, "per_layer_config": {key: {"head_dim": 10}},
    }  # fmt: skip
    with pytest.raises(ValueError) as e:
        gemma4_config(hf)
    assert str(e.value) == f"config.json: per_layer_config keys must be layer indices 0..10; got {key!r}"
