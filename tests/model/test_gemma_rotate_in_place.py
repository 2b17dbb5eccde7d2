"""Gemma 4 attention's rotation in place (issue 38, speed): the QK-norms' fresh outputs are rotated in
their [batch, seq, heads, d_head] layout when no hook point has a function and no autograd graph records
them. These tests hold that fast path against the hooked path (the same q, k, v bit for bit, the same
logits) and check that tensors handed to hooks are never overwritten."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

import headspace as hs
from headspace.model import gemma_extras

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L = 53, 32, 6


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny Gemma 4 (k = v and partial proportional rotation on global layers, two sharing layers,
    per-layer inputs) written by transformers and read by headspace."""
    config = T.Gemma4TextConfig(
        vocab_size=V, hidden_size=D, intermediate_size=22, num_hidden_layers=L, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, global_head_dim=12, num_global_key_value_heads=1,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 3, attention_k_eq_v=True,
        num_kv_shared_layers=2, hidden_size_per_layer_input=5, vocab_size_per_layer_input=V,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = T.Gemma4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_((1.0 + 0.3 * torch.randn_like(p)) if "norm" in name else 0.2 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("gemma4_rotate")
    ref.save_pretrained(folder)
    return hs.load(Path(folder)).model.eval()


def test_fast_rotation_is_the_hooked_rotation_bit_for_bit(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = gemma_extras.rotate_heads_

    def spy(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(gemma_extras, "rotate_heads_", spy)
    torch.manual_seed(1)
    x = torch.randn(2, 7, D)
    seen: list[torch.Tensor] = []
    for i, block in enumerate(model.blocks):
        attn = block.attn
        with torch.inference_mode():
            fast = attn._new_qkv(x, None, None)
            assert len(calls) == i + 1  # the fast path was taken, sharing layers (no k) included
            remove = attn.hook_rot_q.add(lambda t, hook: seen.append(t.clone()))
            try:
                hooked = attn._new_qkv(x, None, None)
            finally:
                remove()
        assert len(calls) == i + 1  # a hook with a function: the ordinary rotation
        for a, b in zip(fast, hooked):
            assert (a is None and b is None) or torch.equal(a, b)
        assert torch.equal(seen[-1], fast[0].transpose(1, 2))
    assert model.blocks[4].attn.kv_owner is not None  # (a sharing layer was among them)


def test_values_handed_to_hooks_are_not_rotated_over(model: Any) -> None:
    torch.manual_seed(2)
    tokens = torch.randint(3, V, (2, 9))
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    record = lambda t, hook: kept.append((t, t.clone()))  # noqa: E731
    with torch.inference_mode():
        fast = model(tokens)
        for block in model.blocks:
            block.attn.hook_q_normed.add(record)
            if block.attn.kv_owner is None:
                block.attn.hook_k_normed.add(record)
        try:
            hooked = model(tokens)
        finally:
            for block in model.blocks:
                block.attn.hook_q_normed.clear()
                block.attn.hook_k_normed.clear()
    assert len(kept) == 2 * L - 2
    for t, copy in kept:
        assert torch.equal(t, copy)  # the tensor the hook holds was not rotated in place
    torch.testing.assert_close(fast, hooked, atol=1e-5 * float(fast.abs().max()), rtol=0)


def test_a_graph_takes_the_ordinary_rotation(model: Any) -> None:
    torch.manual_seed(3)
    tokens = torch.randint(3, V, (2, 9))
    with torch.inference_mode():
        want = model(tokens)
    got = model(tokens)  # parameters require grad: q and k are in the graph, not overwritten
    got.square().mean().backward()
    assert model.blocks[1].attn.qkv_weight.grad is not None
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(got.detach(), want, atol=1e-5 * float(want.abs().max()), rtol=0)


def test_per_layer_inputs_summed_in_place_equal_the_hooked_sum(model: Any) -> None:
    torch.manual_seed(4)
    tokens = torch.randint(3, V, (2, 9))
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.inference_mode():
        fast = model(tokens)
        for ple in model.ple:
            ple.hook_out.add(lambda t, hook: kept.append((t, t.clone())))
        try:
            hooked = model(tokens)
        finally:
            for ple in model.ple:
                ple.hook_out.clear()
    assert len(kept) == L
    for t, copy in kept:
        assert torch.equal(t, copy)  # the term the hook holds was not summed over
    assert torch.equal(fast, hooked)  # h + term, times the layer scalar: the same values either way
