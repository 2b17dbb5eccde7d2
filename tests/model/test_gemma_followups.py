"""Gemma 4 / 3n follow-ups: score_decomposition on a layer that reads another layer's keys and values
(``kv_source``) refuses by the field's name; a plain Decoder (or the wrong Gemma class) built from a
Gemma 4 / 3n config refuses by name instead of silently building another model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

import headspace as hs
from headspace.analysis.circuits.decomposition import score_decomposition
from headspace.model.gemma3n_model import Gemma3nDecoder
from headspace.model.gemma4_model import Gemma4Decoder

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, H = 41, 24, 4, 2


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny random Gemma 4 whose last two layers share layers 0 and 1's keys and values."""
    folder: Path = tmp_path_factory.mktemp("gemma4")
    config = T.Gemma4TextConfig(
        vocab_size=V, hidden_size=D, intermediate_size=14, num_hidden_layers=L, num_attention_heads=H,
        num_key_value_heads=1, head_dim=8, sliding_window=4, layer_types=["sliding_attention",
        "full_attention"] * 2, max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        num_kv_shared_layers=2, hidden_size_per_layer_input=0, global_head_dim=8, attention_k_eq_v=False,
    )  # fmt: skip
    torch.manual_seed(0)
    T.Gemma4ForCausalLM(config).save_pretrained(folder)
    return hs.load(folder)


def test_score_decomposition_refuses_a_layer_without_its_own_keys(gemma4: Any) -> None:
    model = gemma4.model
    assert [b.attn.spec.kv_source for b in model.blocks] == [None, None, 0, 1]
    tokens = torch.tensor([5, 6, 7, 8, 9])
    with pytest.raises(
        ValueError, match=r"layer 2 has no keys of its own \(attention field kv_source=0"
    ) as e:
        score_decomposition(model, tokens, 2, 1)
    assert "\n" not in str(e.value)
    d = score_decomposition(model, tokens, 1, 1)  # a layer that owns its keys still decomposes exactly
    assert d.total == pytest.approx(d.score, abs=1e-4 * max(1.0, abs(d.score)))


def test_a_plain_decoder_refuses_a_gemma_config_by_name(gemma4: Any) -> None:
    config = gemma4.model.config
    with pytest.raises(ValueError, match=r"Decoder: config.extra\['gemma4'\] describes a Gemma4Decoder") as e:
        hs.Decoder(config)
    assert "\n" not in str(e.value)
    rebuilt = Gemma4Decoder(config)  # the right class builds it: the same parameters as the loaded model
    assert {n: p.shape for n, p in rebuilt.named_parameters()} == {
        n: p.shape for n, p in gemma4.model.named_parameters()
    }
    with pytest.raises(
        ValueError, match=r"Gemma4Decoder: config.extra\['gemma3n'\] describes a Gemma3nDecoder"
    ):
        Gemma4Decoder(
            hs.ModelConfig.from_dict({**config.to_dict(), "extra": {**config.extra, "gemma3n": {}}})
        )
    with pytest.raises(ValueError, match=r"Gemma3nDecoder needs config.extra\['gemma3n'\]"):
        Gemma3nDecoder(config)
