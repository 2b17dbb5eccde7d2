"""Differential attention's unwatched path (``DifferentialAttention._pair_z``): with no hook on a map or a
head's z, each pair's ``(p_1 - lambda p_2) v`` is one product of half the heads; it equals the hooked
path (per-head maps and z) and transformers' DiffLlama, prompt, padding and cached decoding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

import headspace as hs
from headspace.attention.differential import DifferentialAttention

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, H, HKV, DH = 53, 28, 2, 4, 2, 6


def _pair(tmp_path: Path) -> tuple[Any, Any]:
    """(transformers eager DiffLlama, headspace's load of the same folder), every parameter random."""
    torch.manual_seed(3)
    config = T.DiffLlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=18, num_hidden_layers=L,
                               num_attention_heads=H, num_key_value_heads=HKV, head_dim=DH,
                               max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0,
                               bos_token_id=1, eos_token_id=None)  # fmt: skip
    model = T.DiffLlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.5 if "lambda" in name else 0.3
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else scale * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    ref = T.DiffLlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    return ref, hs.load(tmp_path)


def _count_pair_products(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = DifferentialAttention._pair_z

    def counted(self: DifferentialAttention, *args: Any) -> Any:
        calls.append(1)
        return real(self, *args)

    monkeypatch.setattr(DifferentialAttention, "_pair_z", counted)
    return calls


def test_the_unwatched_path_equals_the_hooked_path_and_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref, ours = _pair(tmp_path)
    calls = _count_pair_products(monkeypatch)
    tokens = torch.randint(3, V, (2, 10))
    with torch.no_grad():
        want = ref(input_ids=tokens).logits
        fast = ours(tokens)
        assert len(calls) == L  # one pair product per layer
        with hs.trace(ours.model, names=["*.hook_z"]):
            hooked = ours(tokens)
        assert len(calls) == L  # a watched head's z: the per-head path
    bound = 1e-4 * float(want.abs().max())
    torch.testing.assert_close(fast, want, atol=bound, rtol=0)
    torch.testing.assert_close(fast, hooked, atol=1e-5 * float(want.abs().max()), rtol=0)
    prompt = tokens[:1, :4]
    with torch.no_grad():
        want_ids = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                                do_sample=False, pad_token_id=0)  # fmt: skip
        got_ids = ours.generate(prompt, 6, temperature=0)
    assert torch.equal(got_ids, want_ids) and len(calls) > L  # the cached steps took it too


def test_padding_and_gradients_through_the_pair_product(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref, ours = _pair(tmp_path)
    tokens = torch.randint(3, V, (2, 8))
    padding = torch.ones(2, 8, dtype=torch.long)
    padding[1, :3] = 0  # left padding: a bool mask over the keys
    with torch.no_grad():
        want = ref(input_ids=tokens, attention_mask=padding).logits
    calls = _count_pair_products(monkeypatch)
    got = ours.model(tokens, key_padding=padding.bool())
    assert calls
    real = padding.bool()
    bound = 1e-4 * float(want[real].abs().max())
    torch.testing.assert_close(got.detach()[real], want[real], atol=bound, rtol=0)
    with torch.no_grad(), hs.trace(ours.model, names=["*.hook_pattern"]):
        hooked = ours.model(tokens, key_padding=padding.bool())  # dead rows included: the same values
    torch.testing.assert_close(got.detach(), hooked, atol=1e-5 * float(hooked.abs().max()), rtol=0)
    got[real].sum().backward()  # a graph through the pair product: lambda's parameters get gradients
    a = ours.model.blocks[0].attn
    assert a.lambda_q1.grad is not None and bool(a.lambda_q1.grad.abs().sum() > 0)
