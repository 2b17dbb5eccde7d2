"""Weights read from a safetensors folder start on 64-byte boundaries.

safetensors hands float32 tensors out at 8-byte offsets (``data_ptr() % 64 == 40`` with safetensors
0.8); the matrix products reading such weights ran some 7% slower than transformers' on the same
checkpoint (benchmarks/families.py at 125m). Reference: a tiny random Llama saved by transformers itself,
and its logits, which the copy must not change.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as T

import headspace as hs
from headspace.pretrained.hf import WEIGHT_ALIGNMENT

pytestmark = pytest.mark.usefixtures("single_thread")


def test_every_weight_loaded_from_safetensors_is_64_byte_aligned(tmp_path: Path) -> None:
    config = T.LlamaConfig(
        vocab_size=61, hidden_size=24, intermediate_size=37, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = T.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    ref.save_pretrained(tmp_path)
    ours = hs.load(tmp_path).model
    assert WEIGHT_ALIGNMENT == 64
    odd = {n: p.data_ptr() % 64 for n, p in ours.named_parameters() if p.data_ptr() % 64}
    assert odd == {}
    tokens = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(1))  # [2, 7]
    with torch.no_grad():
        want = ref(input_ids=tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0)
