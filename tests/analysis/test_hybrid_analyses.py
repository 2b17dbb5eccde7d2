"""Analyses on gated and hybrid models (issue #39): Qwen3-Next / Qwen3.5 built by transformers 5.25.

Direct logit attribution per head on the gated softmax layers (gate frozen at its run's value) and on the
Gated DeltaNet layers (each value head's ``z_h W_O[h]``), against transformers' own logit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

import headspace as hs
from headspace.analysis.causal.attribution import direct_logit_attribution
from headspace.analysis.causal.patching import patch
from headspace.analysis.circuits.decomposition import score_decomposition
from headspace.analysis.lesson.explain import TokenizedSentence, explain
from headspace.analysis.trace.trace import hooked
from headspace.viz.explorer.data import build_page_data, capture_layers, unpack

pytestmark = pytest.mark.usefixtures("single_thread")

V, D = 61, 24
COMMON = dict(vocab_size=V, hidden_size=D, intermediate_size=20, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=5,
              linear_value_head_dim=7, linear_conv_kernel_dim=3, max_position_embeddings=64, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)  # fmt: skip
FAMILIES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "qwen3_next": (T.Qwen3NextConfig, T.Qwen3NextForCausalLM,
                   dict(head_dim=6, partial_rotary_factor=1 / 3, num_experts=5, num_experts_per_tok=2,
                        moe_intermediate_size=9, shared_expert_intermediate_size=11, decoder_sparse_step=1,
                        mlp_only_layers=[])),
    "qwen3_5_text": (T.Qwen3_5TextConfig, T.Qwen3_5ForCausalLM, dict(head_dim=8)),
}  # fmt: skip


def _build(family: str, folder: Path) -> Any:
    """A random transformers model of ``family`` (every zero-initialised parameter set random), saved."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(3)
    model = model_cls(config_cls(**COMMON, **extra)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith("gate.weight") and "proj" not in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model_cls.from_pretrained(
        folder, attn_implementation="eager", experts_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    return {f: (folder := tmp_path_factory.mktemp(f), _build(f, folder)) for f in FAMILIES}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_dla_per_head_on_hybrids_adds_up_to_transformers_logit(saved: dict, family: str) -> None:
    folder, ref = saved[family]
    ours = hs.load(folder)
    tokens = torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(0))
    dla = direct_logit_attribution(ours.model, tokens, 5, 7)
    with torch.no_grad():
        logits = ref(tokens).logits[:, -1]  # (2, vocab)
    expected = logits[:, 5] - logits[:, 7]  # (2,)
    scale = float(logits.abs().max())
    assert torch.allclose(dla.per_prompt["logit"], expected, atol=1e-4 * scale)
    assert torch.allclose(dla.per_prompt["total"], expected, atol=1e-4 * scale)
    assert dla.mixers == ["gated_deltanet"] * 3 + ["attention"]
    assert dla.layer_heads == [6, 6, 6, 4] and dla.gated == [False, False, False, True]
    assert dla.heads.shape == (4, 6)
    assert torch.equal(dla.heads[3, 4:], torch.zeros(2))  # the softmax layer's padding
    assert all(head < dla.layer_heads[layer] for layer, head, _ in dla.top_heads(24))
    assert len(dla.top_heads(24)) == 3 * 6 + 4


def test_dla_deltanet_heads_are_their_outputs_through_w_o(saved: dict) -> None:
    """A DeltaNet head's part is (z_h W_O[h]) * (w / sigma) . W_U[:, a]: recomputed by hand from hook_z,
    the layer's W_O view and the final norm's own output (RMSNorm: y / x = w / sigma)."""
    folder, _ = saved["qwen3_5_text"]
    model = hs.load(folder).model
    tokens = torch.randint(3, V, (1, 7), generator=torch.Generator().manual_seed(1))
    dla = direct_logit_attribution(model, tokens, 9)
    names = ["blocks.1.attn.hook_z", "blocks.3.hook_resid_post"]
    with torch.no_grad(), hs.trace(model, names=names) as t:
        model(tokens)
        x = t["blocks.3.hook_resid_post"][0, -1]  # (d_model,)
        ratio = model.ln_final(x) / x  # (d_model,): w / sigma
        z = t["blocks.1.attn.hook_z"][0, -1]  # (n_v_heads, d_v)
        out = torch.einsum("hd,hdm->hm", z, model.blocks[1].attn.W_O)  # (n_v_heads, d_model)
        by_hand = (out * ratio) @ model.W_U[:, 9]  # (n_v_heads,)
    assert torch.allclose(dla.heads[1], by_hand, atol=1e-5 * float(by_hand.abs().max()))


def _manual_patch(model: Any, clean: torch.Tensor, corrupt: torch.Tensor, layer: int, head: int) -> float:
    """logit(5) - logit(7) of the corrupt run with head ``head`` of ``layer``'s ``hook_z`` (a gated head's
    gated z; a DeltaNet head's gated-norm output) replaced by the clean run's, all positions."""
    name = f"blocks.{layer}.attn.hook_z"
    with torch.no_grad(), hs.trace(model, names=[name]) as t:
        model(clean)
    clean_z = t[name]  # (1, seq, n_heads, d_head)

    def put(z: torch.Tensor, point: Any) -> torch.Tensor:  # (1, seq, n_heads, d_head)
        z = z.clone()
        z[:, :, head] = clean_z[:, :, head]
        return z

    with torch.no_grad(), hooked(model, {name: put}):
        logits = model(corrupt)[0, -1]  # (vocab,)
    return float(logits[5] - logits[7])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_patching_per_head_on_gated_and_deltanet_layers_equals_a_manual_patch(
    saved: dict, family: str
) -> None:
    folder, ref = saved[family]
    model = hs.load(folder).model
    g = torch.Generator().manual_seed(2)
    clean = torch.randint(3, V, (1, 8), generator=g)
    corrupt = clean.clone()
    corrupt[0, 3] = (clean[0, 3] + 11) % (V - 3) + 3  # one token differs, at position 3
    result = patch(model, clean, corrupt, answer=5, other=7, site="heads")
    with torch.no_grad():
        lc, lk = ref(clean).logits[0, -1], ref(corrupt).logits[0, -1]  # (vocab,) x 2
    c, k = float(lc[5] - lc[7]), float(lk[5] - lk[7])
    assert result.clean_metric == pytest.approx(c, abs=1e-4) and result.corrupt_metric == pytest.approx(
        k, abs=1e-4
    )
    assert result.effect.shape == (4, 6)
    assert float(result.effect[:3, 4:].abs().min()) > 1e-4  # DeltaNet heads matter (not all zero)
    for layer, head in [(0, 0), (1, 5), (2, 3), (3, 0), (3, 3)]:  # DeltaNet heads, then gated softmax heads
        manual = (_manual_patch(model, clean, corrupt, layer, head) - k) / (c - k)
        assert float(result.effect[layer, head]) == pytest.approx(manual, abs=1e-4), (layer, head)


def test_explain_walks_a_softmax_layer_of_a_hybrid_and_a_deltanet_layer_by_the_delta_rule(
    saved: dict,
) -> None:
    folder, ref = saved["qwen3_next"]
    ours = hs.load(folder)
    text = "the cat sat on the mat"
    tokens = torch.tensor([[3, 7, 11, 13, 3, 17]])  # one id per word, "the" twice
    tokenized = TokenizedSentence(text, text.split(), tokens, None)
    e = explain(ours, text, "mat", layer=3, head=1, tokenized=tokenized)
    with torch.no_grad():
        pattern = ref(tokens, output_attentions=True).attentions[-1][
            0, 1, 5
        ]  # (seq,): the one softmax layer, 3
    assert (e.layer, e.head) == (3, 1)
    assert torch.allclose(torch.tensor(e.pattern), pattern, atol=1e-5)
    assert len(e.gate) == 6  # the output gate of head 1 at "mat", shown in the lesson
    chosen = explain(ours, text, "mat", tokenized=tokenized)  # no layer: the softmax layers are ranked
    assert chosen.layer == 3 and {f.layer for f in chosen.ranking} == {3}
    for layer in (0, 2):  # DeltaNet layers: walked by the delta rule (tests/analysis/test_delta_walk.py)
        walked = explain(ours, text, "mat", layer=layer, head=0, tokenized=tokenized)
        assert [s.scheme for s in walked.scheme_steps] == ["delta_rule", "experts"] and walked.n_heads == 6


def test_why_decomposes_a_softmax_head_of_a_hybrid_and_refuses_a_deltanet_layer_by_name(saved: dict) -> None:
    folder, ref = saved["qwen3_5_text"]
    model = hs.load(folder).model
    tokens = torch.tensor([[3, 7, 11, 13, 3, 17, 19]])
    d = score_decomposition(model, tokens, 3, 2, query=6)
    with torch.no_grad():
        pattern = ref(tokens, output_attentions=True).attentions[-1][0, 2, 6]  # (seq,): layer 3
    assert d.pattern == pytest.approx(float(pattern[d.key]), abs=1e-5)
    assert d.total == pytest.approx(d.score, abs=1e-4 * max(1.0, abs(d.score)))
    assert "L0H5" in d.components and "mlp2" in d.components  # DeltaNet heads (6 per layer) are parts
    with pytest.raises(ValueError, match=r"score_decomposition \(why\) of layer 1 needs a softmax .*'mixer'"):
        score_decomposition(model, tokens, 1, 0)


def test_the_explorer_page_shows_each_gated_heads_gate(saved: dict) -> None:
    """The page data of a gated layer holds its gate per token and head, equal to sigmoid(x W_G[h]) from
    the layer's own input and W_G view; the DeltaNet layers are not drawn (no pattern)."""
    model = hs.load(saved["qwen3_next"][0]).model
    tokens = torch.tensor([[3, 7, 11, 13, 3, 17]])
    captures = capture_layers(model, lambda: model(tokens))
    data = build_page_data(captures, [str(i) for i in tokens[0].tolist()], precision="float32")
    (layer,) = data["layers"]  # the one softmax layer, block 3
    assert layer["name"].endswith("blocks.3.attn")
    assert layer["gate_kind"] == "elementwise" and "frozen" in layer["gate_label"]
    gate = torch.from_numpy(unpack(layer["gate"]).copy())  # (seq, n_heads, d_head)
    attn = model.blocks[3].attn
    with torch.no_grad(), hs.trace(model, names=["blocks.3.hook_attn_in"]) as t:
        model(tokens)
        x = t["blocks.3.hook_attn_in"][0]  # (seq, d_model)
        by_hand = torch.sigmoid(torch.einsum("sd,hdw->shw", x, attn.W_G))  # (seq, n_heads, d_head)
    assert gate.shape == (6, 4, 6)
    assert torch.allclose(gate, by_hand, atol=1e-6)
    mean = torch.from_numpy(unpack(layer["gate_mean"]).copy())  # (seq, n_heads)
    assert torch.allclose(mean, by_hand.mean(-1), atol=1e-6)
