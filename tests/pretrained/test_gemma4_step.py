"""Gemma 4's lean one-token step (:mod:`headspace.model.gemma4_step`) against the module path.

A tiny random Gemma 4 written by transformers (every norm and layer scalar random; k_eq_v, shared keys
and values, per-layer inputs, soft-capping; and the MoE form): decoding steps without any hook take the
lean path, a hook with a function sends them through the modules, and both give the same logits and
caches bit for bit; greedy decoding still equals transformers.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

import headspace as hs
from headspace.model import gemma4_step

pytestmark = pytest.mark.usefixtures("single_thread")

V = 61
CASES: dict[str, dict[str, Any]] = {
    "all": dict(attention_k_eq_v=True, num_kv_shared_layers=2, hidden_size_per_layer_input=5,
                vocab_size_per_layer_input=V, global_head_dim=14, num_global_key_value_heads=1,
                final_logit_softcapping=7.0),
    "moe": dict(enable_moe_block=True, num_experts=5, top_k_experts=2, moe_intermediate_size=9,
                attention_k_eq_v=True, num_kv_shared_layers=2, hidden_size_per_layer_input=0,
                global_head_dim=14, num_global_key_value_heads=1),
}  # fmt: skip


def build(case: str, folder: Path) -> Any:
    """A random Gemma 4 of ``case`` saved into ``folder``; transformers' eager model of it."""
    config = T.Gemma4TextConfig(
        vocab_size=V, hidden_size=36, intermediate_size=22, num_hidden_layers=6, num_attention_heads=3,
        num_key_value_heads=3, head_dim=8, sliding_window=4, layer_types=["sliding_attention",
        "full_attention"] * 3, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        **CASES[case],
    )  # fmt: skip
    torch.manual_seed(5)
    model = T.Gemma4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            unit = "norm" in name or "scale" in name
            p.copy_((1.0 + 0.3 * torch.randn_like(p)) if unit else 0.2 * torch.randn_like(p))
        for i, layer in enumerate(model.model.layers):
            layer.layer_scalar.fill_(0.6 + 0.15 * i)
    model.save_pretrained(folder)
    return T.Gemma4ForCausalLM.from_pretrained(
        folder, attn_implementation="eager", experts_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    return {c: (folder := tmp_path_factory.mktemp(c), build(c, folder)) for c in CASES}


def _steps(model: Any, tokens: torch.Tensor, prefix: int) -> tuple[list[torch.Tensor], list[Any]]:
    """Logits [batch, V] of each one-token step after a ``prefix``-token prefill, and the caches."""
    caches = model.make_kv_caches(tokens.shape[0], tokens.shape[1])
    out = []
    with torch.no_grad():
        model(tokens[:, :prefix], kv_caches=caches)
        for i in range(prefix, tokens.shape[1]):
            out.append(model(tokens[:, i : i + 1], kv_caches=caches)[:, 0])
    return out, caches


@pytest.mark.parametrize("case", list(CASES))
def test_lean_step_equals_the_module_path_bit_for_bit(
    saved: dict, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, _ = saved[case]
    model = hs.load(folder).model.eval()
    taken: list[int] = []
    lean = gemma4_step.hidden_states
    monkeypatch.setattr(gemma4_step, "hidden_states", lambda *a: taken.append(1) or lean(*a))
    tokens = torch.randint(3, V, (2, 11), generator=torch.Generator().manual_seed(6))  # past the window
    fast, fast_caches = _steps(model, tokens, 5)
    assert len(taken) == 6  # every step took the lean path (the prefill did not)
    seen: list[torch.Tensor] = []
    point = model.blocks[2].hook_mlp_in  # an intermediate only the module path shows (outside the
    # attention: a hook there would send it down its traced path, another order of sums)
    remove = point.add(lambda v, hp: seen.append(v.clone()))
    try:
        slow, slow_caches = _steps(model, tokens, 5)
    finally:
        remove()
    assert len(taken) == 6 and len(seen) == 7  # watched: the module path ran (prefill + 6 steps)
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(fast_caches, slow_caches, strict=True):
        assert a.length == b.length and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    with torch.no_grad():
        full = model(tokens)  # (2, 11, V): the steps are the forward's last positions
    scale = float(full.abs().max())
    torch.testing.assert_close(torch.stack(fast, 1), full[:, 5:], atol=1e-4 * scale, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_decoding_through_the_lean_step_equals_transformers(saved: dict, case: str) -> None:
    folder, ref = saved[case]
    ours = hs.load(folder)
    prompt = torch.tensor([[5, 9, 31, 7, 44, 12]])
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=9, do_sample=False, eos_token_id=None, pad_token_id=0)
        got = ours.model.generate(prompt, 9, temperature=0)
    assert got.tolist() == want.tolist()


def test_the_lean_step_is_not_taken_in_training_or_with_padding(saved: dict) -> None:
    folder, _ = saved["all"]
    model = hs.load(folder).model
    tokens = torch.tensor([[5]])
    caches = model.make_kv_caches(1, 4)
    assert gemma4_step.takes(model.eval(), tokens, None, caches, None)
    assert not gemma4_step.takes(model, tokens, torch.ones(1, 1, dtype=torch.bool), caches, None)
    assert not gemma4_step.takes(model, tokens, None, None, None)
    assert not gemma4_step.takes(model, torch.tensor([[5, 6]]), None, caches, None)
    assert not gemma4_step.takes(model.train(), tokens, None, caches, None)


def test_a_module_swapped_in_between_generations_is_watched(saved: dict) -> None:
    """The hook points are read again at each prefill: a hook on a module put in after a generation
    fires at every step of the next one."""
    folder, _ = saved["all"]
    model = hs.load(folder).model
    prompt = torch.tensor([[5, 9, 31, 7]])
    with torch.no_grad():
        want = model.generate(prompt, 4, temperature=0)  # (the lean steps read the hook points)
        model.ple[1] = copy.deepcopy(model.ple[1])
        seen: list[int] = []
        model.ple[1].hook_out.add(lambda v, hp: seen.append(v.shape[1]))
        got = model.generate(prompt, 4, temperature=0)
    assert seen == [4, 1, 1, 1] and torch.equal(got, want)  # the prefill, then every step
