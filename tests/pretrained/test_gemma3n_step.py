"""Gemma 3n's lean one-token step (:mod:`headspace.model.gemma3n_step`) against the module path.

A tiny random Gemma 3n written by transformers (AltUp over three streams, LAuReL, per-layer inputs,
activation sparsity, shared keys and values; every norm and scale random): decoding steps without any
hook take the lean layers, a hook with a function sends them through the modules, and both give the
same logits and caches bit for bit; greedy decoding still equals transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

import headspace as hs
from headspace.model import gemma3n_step

pytestmark = pytest.mark.usefixtures("single_thread")

V = 71


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("gemma3n_step")
    config = T.Gemma3nTextConfig(
        vocab_size=V, hidden_size=36, intermediate_size=[26, 22, 26, 18], num_hidden_layers=4,
        num_attention_heads=3, num_key_value_heads=1, head_dim=12, max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=4,
        hidden_size_per_layer_input=5, vocab_size_per_layer_input=40, num_kv_shared_layers=2,
        laurel_rank=3, altup_num_inputs=3, activation_sparsity_pattern=[0.95, 0.6, 0.0, 0.0],
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(7)
    model = T.Gemma3nForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            unit = "norm" in name or "scale" in name
            p.copy_((1.0 + 0.3 * torch.randn_like(p)) if unit else 0.2 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder, T.Gemma3nForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def _steps(model: Any, tokens: torch.Tensor, prefix: int) -> tuple[list[torch.Tensor], list[Any]]:
    """Logits [batch, V] of each one-token step after a ``prefix``-token prefill, and the caches."""
    caches = model.make_kv_caches(tokens.shape[0], tokens.shape[1])
    out = []
    with torch.no_grad():
        model(tokens[:, :prefix], kv_caches=caches)
        for i in range(prefix, tokens.shape[1]):
            out.append(model(tokens[:, i : i + 1], kv_caches=caches)[:, 0])
    return out, caches


def test_lean_layers_equal_the_module_path_bit_for_bit(
    saved: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = hs.load(saved[0]).model.eval()
    taken: list[int] = []
    lean = gemma3n_step.layer
    monkeypatch.setattr(gemma3n_step, "layer", lambda *a: taken.append(1) or lean(*a))
    tokens = torch.randint(3, V, (2, 11), generator=torch.Generator().manual_seed(8))  # past the window
    fast, fast_caches = _steps(model, tokens, 5)
    assert len(taken) == 6 * 4  # every layer of every step (not the prefill)
    seen: list[torch.Tensor] = []
    remove = model.laurel[1].hook_out.add(lambda v, hp: seen.append(v.clone()))  # skipped by the lean step
    try:
        slow, slow_caches = _steps(model, tokens, 5)
    finally:
        remove()
    assert len(taken) == 6 * 4 and len(seen) == 7  # watched: the modules ran (prefill + 6 steps)
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(fast_caches, slow_caches, strict=True):
        assert a.length == b.length and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    with torch.no_grad():
        full = model(tokens)  # (2, 11, V): the steps are the forward's last positions
    scale = float(full.abs().max())
    torch.testing.assert_close(torch.stack(fast, 1), full[:, 5:], atol=1e-4 * scale, rtol=0)


def test_greedy_decoding_through_the_lean_layers_equals_transformers(saved: tuple[Path, Any]) -> None:
    folder, ref = saved
    ours = hs.load(folder)
    prompt = torch.tensor([[5, 9, 31, 7, 44, 12]])
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=9, do_sample=False, eos_token_id=None, pad_token_id=0)
        got = ours.model.generate(prompt, 9, temperature=0)
    assert got.tolist() == want.tolist()


def test_the_sparsity_quantile_is_transformers_and_follows_the_field(saved: tuple[Path, Any]) -> None:
    mlp = hs.load(saved[0]).model.blocks[0].mlp
    x = torch.randn(1, 3, 36, generator=torch.Generator().manual_seed(9))
    first = mlp(x)
    mlp.sparsity = 0.6  # a changed field is read again, not a stale quantile
    assert not torch.equal(mlp(x), first)
    with torch.inference_mode():
        mlp.sparsity = 0.95
        assert torch.equal(mlp(x), first)
    x.requires_grad_(True)  # the quantile made under inference mode still works with autograd
    mlp(x).sum().backward()
    assert x.grad is not None
