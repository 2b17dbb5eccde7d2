"""Gemma 2's final-logit and score soft-capping, in place on the untraced forward (issue 38, speed): the
fast path (no graph, nobody holding the logits) equals the out-of-place path and transformers' eager
forward; a forward hook on ``lm_head`` keeps the logits it saw uncapped; hooked scores are the same.

Reference: a tiny random Gemma 2 built and saved by transformers 5 (eager attention), untied unembedding,
small caps (so that they bend), every norm away from its start.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers as T

import headspace as hs

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, H, HKV, DH, DM, W = 89, 36, 2, 4, 2, 10, 45, 4  # vocab, hidden, layers, heads, kv heads, ...


def build(folder: Path) -> T.Gemma2ForCausalLM:
    """A random transformers Gemma 2 saved into ``folder``, read back with eager attention."""
    torch.manual_seed(0)
    config = T.Gemma2Config(
        vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=HKV,
        head_dim=DH, intermediate_size=DM, max_position_embeddings=64, sliding_window=W,
        query_pre_attn_scalar=11, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    model = T.Gemma2ForCausalLM(config).eval()
    with torch.no_grad():  # norms away from their start, so a swapped or skipped one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    return T.Gemma2ForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def test_in_place_caps_equal_the_graph_path_and_transformers(tmp_path: Path) -> None:
    ref = build(tmp_path)
    model = hs.load(tmp_path).model
    assert model.lm_head is not None
    tokens = torch.randint(3, V, (2, 11))
    with torch.inference_mode():
        fast = model(tokens)  # (2, 11, V): caps in place
        want = ref(input_ids=tokens, use_cache=False).logits
    graph = model(tokens)  # grad enabled, parameters require grad: out of place
    assert graph.requires_grad and torch.equal(graph.detach(), fast)
    assert (fast - want).abs().max() <= 1e-4 * want.abs().max()
    assert fast.abs().max() < 3.0  # capped
    graph.sum().backward()  # the out-of-place caps keep their graph
    assert model.lm_head.weight.grad is not None


def test_a_hook_on_lm_head_keeps_the_uncapped_logits(tmp_path: Path) -> None:
    build(tmp_path)
    model = hs.load(tmp_path).model
    tokens = torch.randint(3, V, (2, 11))
    seen: list[torch.Tensor] = []
    handle = model.lm_head.register_forward_hook(lambda m, i, out: seen.append(out))
    try:
        with torch.inference_mode():
            capped = model(tokens)  # (2, 11, V)
            h = model.hidden_states(tokens)  # (2, 11, D)
            uncapped = F.linear(h, model.lm_head.weight)  # (2, 11, V)
    finally:
        handle.remove()
    assert torch.equal(seen[0], uncapped) and seen[0].abs().max() > 3.0  # not capped behind the hook
    assert torch.equal(capped, torch.tanh(uncapped / 3.0) * 3.0)


def test_hooked_scores_are_the_capped_scores_of_the_fast_path(tmp_path: Path) -> None:
    build(tmp_path)
    model = hs.load(tmp_path)
    tokens = torch.randint(3, V, (1, 9))
    with torch.inference_mode():
        fast = model.model(tokens)  # (1, 9, V)
        with hs.trace(model.model, names=["blocks.0.attn.hook_scores"]) as t:
            traced = model.model(tokens)  # (1, 9, V)
    assert torch.equal(traced, fast)
    scores = t["blocks.0.attn.hook_scores"]  # (1, H, 9, 9)
    finite = scores[scores.isfinite()]
    assert finite.abs().max() <= 2.0 and finite.abs().max() > 1.0  # capped at 2, and bent
