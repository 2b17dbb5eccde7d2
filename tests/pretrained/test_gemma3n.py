"""Gemma 3n text (``gemma3n_text``) against transformers 5.

References: tiny random models built and saved by transformers itself (eager attention, odd sizes),
every norm, scale and zero-initialised AltUp parameter set random so that it matters, read back by
``headspace.load(folder)`` without transformers: AltUp over three streams, LAuReL, per-layer inputs
(with token ids beyond their table), activation sparsity on two layers, per-layer MLP widths, two
layers sharing earlier layers' keys and values. Logits within 1e-4 of their largest magnitude, every
head's pattern within 1e-5, greedy decoding equal.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

import headspace as hs
from headspace.model.gemma3n_model import Gemma3nDecoder, SparseGatedFeedForward
from headspace.pretrained.families_table import decode_route

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, H = 71, 36, 4, 3


def build(folder: Path, **change: Any) -> Any:
    """A random Gemma 3n saved into ``folder``, read back with eager attention."""
    config = T.Gemma3nTextConfig(
        vocab_size=V, hidden_size=D, intermediate_size=[26, 22, 26, 18], num_hidden_layers=L,
        num_attention_heads=H, num_key_value_heads=1, head_dim=12, max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=4,
        hidden_size_per_layer_input=5, vocab_size_per_layer_input=40, num_kv_shared_layers=2,
        laurel_rank=3, altup_num_inputs=3, activation_sparsity_pattern=[0.95, 0.6, 0.0, 0.0],
        pad_token_id=0, bos_token_id=1, eos_token_id=2, **change,
    )  # fmt: skip
    torch.manual_seed(5)
    model = T.Gemma3nForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            unit = "norm" in name or "scale" in name
            p.copy_((1.0 + 0.3 * torch.randn_like(p)) if unit else 0.2 * torch.randn_like(p))
    model.save_pretrained(folder)
    return T.Gemma3nForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("gemma3n")
    return folder, build(folder)


def test_logits_and_patterns_equal_transformers(saved: tuple[Path, Any]) -> None:
    folder, ref = saved
    ours = hs.load(folder)
    assert isinstance(ours.model, Gemma3nDecoder)
    torch.manual_seed(6)
    tokens = torch.randint(3, V, (2, 11))  # ids >= 40 read row 0 of the per-layer table
    assert bool((tokens >= 40).any())
    with torch.no_grad():
        want = ref(input_ids=tokens, output_attentions=True)
        got = ours(tokens)
        with hs.trace(ours.model, names=["*.hook_pattern", "altup.0.hook_predict", "laurel.1.hook_out"]) as t:
            traced = ours(tokens)
    scale = float(want.logits.abs().max())
    torch.testing.assert_close(got, want.logits, atol=1e-4 * scale, rtol=0)
    torch.testing.assert_close(traced, want.logits, atol=1e-4 * scale, rtol=0)
    for layer in range(L):
        torch.testing.assert_close(t.pattern(layer), want.attentions[layer], atol=1e-5, rtol=0)
    assert t["altup.0.hook_predict"].shape == (3, 2, 11, D) and t["laurel.1.hook_out"].shape == (2, 11, D)
    assert float(t.pattern(2)[:, :, 10, :7].abs().max()) == 0.0  # a sliding layer's window (shared keys)
    assert sum(p.numel() for p in ours.model.parameters()) == sum(p.numel() for p in ref.parameters())


def test_greedy_decoding_equals_transformers(saved: tuple[Path, Any]) -> None:
    folder, ref = saved
    ours = hs.load(folder)
    prompt = torch.tensor([[5, 9, 31, 7, 44, 12]])
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=9, do_sample=False, eos_token_id=None, pad_token_id=0)
        got = ours.model.generate(prompt, 9, temperature=0)
    assert got.tolist() == want.tolist()
    assert decode_route(ours) == "forward"


def test_layers_say_what_they_are(saved: tuple[Path, Any]) -> None:
    model = hs.load(saved[0]).model
    assert [b.spec.mlp.d_mlp for b in model.blocks] == [26, 22, 26, 18]
    assert [type(b.mlp) is SparseGatedFeedForward for b in model.blocks] == [True, True, False, False]
    assert [b.mlp.sparsity for b in model.blocks[:2]] == [0.95, 0.6]
    assert [b.spec.attention.kv_source for b in model.blocks] == [None, None, 0, 1]
    assert all(b.spec.attention.v_norm and b.spec.attention.score_scale == 1.0 for b in model.blocks)
    assert model.blocks[2].attn.W_V.data_ptr() == model.blocks[0].attn.W_V.data_ptr()


def test_sparsity_keeps_what_lies_above_the_gaussian_quantile() -> None:
    mlp = SparseGatedFeedForward(8, 64, "gelu_tanh", 0.9)
    x = torch.randn(2, 3, 8)
    with hs.trace(mlp, names=["hook_pre"]) as t:
        mlp(x)
    kept = (t["hook_pre"] > 0).float().mean()
    assert 0.0 < float(kept) < 0.35  # about 10% of a Gaussian row lies above its 0.9 quantile


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"altup_active_idx": 3}, "altup_active_idx must be < altup_num_inputs=3"),
        ({"activation_sparsity_pattern": [1.0, 0.0, 0.0, 0.0]},
         r"activation_sparsity_pattern values must be in \[0, 1\)"),
        ({"intermediate_size": [26, 22]}, "intermediate_size must be a number or a list of 4 numbers"),
        ({"attention_bias": True}, "attention_bias=true is not supported"),
    ],
)  # fmt: skip
def test_unsupported_configs_are_refused_by_name(
    saved: tuple[Path, Any], tmp_path: Path, change: dict, message: str
) -> None:
    folder, _ = saved
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message) as e:
        hs.load(tmp_path)
    assert "\n" not in str(e.value)
