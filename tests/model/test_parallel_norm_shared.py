"""A one-norm parallel block (Falcon, GPT-J, Phi: LN2 a copy of LN1) computes its norm once while the two
are equal and nothing watches them (issue 38, speed: headspace.model.parallel_norm), with the same output
bit for bit; an edited LN2, a hook, a module hook or autograd get both norms."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from headspace.model.block import TransformerBlock
from headspace.model.parallel_norm import same_norm

D = 24


def _block(norm_kind: str = "layernorm") -> TransformerBlock:
    torch.manual_seed(0)
    block = TransformerBlock(D, 4, 40, norm="parallel", norm_kind=norm_kind, act="gelu").eval()
    with torch.no_grad():
        for p in block.ln1.parameters():
            p.normal_()
        block.ln2.load_state_dict(block.ln1.state_dict())  # a one-norm family's copy
    return block


def _reference(block: TransformerBlock, x: torch.Tensor) -> torch.Tensor:
    """x + Attn(LN1(x)) + MLP(LN2(x)), written out."""
    return x + block.attn(block.ln1(x), is_causal=True) + block.mlp(block.ln2(x))


def _norm_calls(block: TransformerBlock, x: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> int:
    calls = []
    layer_norm = F.layer_norm

    def counting(*args, **kwargs):
        calls.append(1)
        return layer_norm(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(F, "layer_norm", counting)
        block(x, is_causal=True)
    return len(calls)


def test_equal_norms_are_computed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    block, x = _block(), torch.randn(2, 7, D)
    with torch.no_grad():
        assert _norm_calls(block, x, monkeypatch) == 1
        out = block(x, is_causal=True)
        want = _reference(block, x)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
    with torch.no_grad():  # the two-norm path (LN2's module hooked): the same output, bit for bit
        handle = block.ln2.register_forward_hook(lambda mod, args, out: None)
        try:
            assert _norm_calls(block, x, monkeypatch) == 2
            both = block(x, is_causal=True)
        finally:
            handle.remove()
    assert torch.equal(out, both)


def test_an_edited_ln2_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    block, x = _block(), torch.randn(2, 7, D)
    with torch.no_grad():
        block.ln2.bias.add_(0.5)
        assert _norm_calls(block, x, monkeypatch) == 2
        torch.testing.assert_close(block(x, is_causal=True), _reference(block, x), rtol=0, atol=1e-6)


def test_a_watched_mlp_input_sees_ln2_and_keeps_the_output() -> None:
    block, x = _block(), torch.randn(2, 7, D)
    seen = {}
    with torch.no_grad():
        fast = block(x, is_causal=True)
        remove = block.hook_mlp_in.add(lambda t, hook: seen.setdefault("mlp_in", t.clone()))
        try:
            hooked = block(x, is_causal=True)
        finally:
            remove()
        assert torch.equal(seen["mlp_in"], block.ln2(x))
    assert torch.equal(hooked, fast)


def test_autograd_reaches_both_norms() -> None:
    block, x = _block(), torch.randn(2, 7, D)
    block(x, is_causal=True).sum().backward()
    assert block.ln1.weight.grad is not None and block.ln2.weight.grad is not None


def test_rms_norms_and_what_counts_as_the_same() -> None:
    block = _block("rmsnorm")
    assert same_norm(block.ln1, block.ln2)
    block.ln2.eps = block.ln1.eps * 2
    assert not same_norm(block.ln1, block.ln2)
    assert not same_norm(block.ln1, torch.nn.LayerNorm(D))
    x = torch.randn(2, 5, D)
    block.ln2.eps = block.ln1.eps
    with torch.no_grad():
        torch.testing.assert_close(block(x, is_causal=True), _reference(block, x), rtol=0, atol=1e-6)
