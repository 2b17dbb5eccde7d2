"""Output gates (issue #39; attention/gates.py): ``z_h = softmax(...) v_h * sigmoid(x W_G[h] + b_G[h])``
before W_O, against transformers' Qwen3NextAttention on the same weights and against the formula written
out; W_G per-head views, hook_gate, and per-head results exact with the gate frozen at the run's value."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import transformers as T
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention, Qwen3NextRotaryEmbedding

import headspace as hs
from headspace.attention.layer import MultiHeadAttention
from headspace.nn.positions import Rotary

pytestmark = pytest.mark.usefixtures("single_thread")

D, H, HKV, DH = 20, 4, 2, 6


def gated_layer(gate: str = "elementwise", bias: bool = False) -> MultiHeadAttention:
    torch.manual_seed(0)
    layer = MultiHeadAttention(D, H, d_head=DH, n_kv_heads=HKV, bias=bias, gate=gate).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    return layer


def reference(layer: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """The formula written out, head by head."""
    B, S, _ = x.shape
    out = torch.zeros(B, S, D) + (0 if layer.o_bias is None else layer.o_bias)
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    for h in range(H):
        g = h // (H // HKV)
        q = x @ layer.W_Q[h] + (0 if layer.b_Q is None else layer.b_Q[h])
        k = x @ layer.W_K[g] + (0 if layer.b_K is None else layer.b_K[g])
        v = x @ layer.W_V[g] + (0 if layer.b_V is None else layer.b_V[g])
        scores = (q @ k.transpose(-1, -2) / DH**0.5).masked_fill(~causal, float("-inf"))
        gate = torch.sigmoid(x @ layer.W_G[h] + (0 if layer.b_G is None else layer.b_G[h]))
        out = out + (torch.softmax(scores, -1) @ v * gate) @ layer.W_O[h]
    return out


@pytest.mark.parametrize(
    ("gate", "bias"), [("elementwise", False), ("elementwise", True), ("headwise", True)]
)
def test_gated_layer_is_the_formula(gate: str, bias: bool) -> None:
    layer = gated_layer(gate, bias)
    x = torch.randn(2, 7, D)
    with torch.no_grad():
        torch.testing.assert_close(layer(x, is_causal=True), reference(layer, x), atol=1e-5, rtol=0)
    width = DH if gate == "elementwise" else 1
    assert layer.W_G.shape == (H, D, width) and layer.heads[2].W_G.shape == (D, width)
    assert layer.spec.gate == gate


def test_w_g_is_a_view_and_hook_gate_sees_and_replaces_the_gate() -> None:
    layer = gated_layer()
    x = torch.randn(1, 5, D)
    seen = {}
    with hs.trace(layer, names=["hook_gate", "hook_z", "hook_result"]) as t:
        out = layer(x, is_causal=True)
    gate = t["hook_gate"]  # (1, 5, H, DH)
    torch.testing.assert_close(gate, torch.sigmoid(F.linear(x, layer.gate_weight)).reshape(1, 5, H, DH))
    # per head exact: out = sum_h z_h W_O[h] (+ b_O), z the gated output of each head (the input of W_O)
    torch.testing.assert_close(t["hook_result"].sum(2), out, atol=1e-6, rtol=0)
    torch.testing.assert_close(t["hook_result"], torch.einsum("bshd,hdm->bshm", t["hook_z"], layer.W_O))
    with torch.no_grad():  # writing through the view changes the layer
        layer.W_G[1].zero_()
    remove = layer.hook_gate.add(lambda value, point: seen.setdefault("g", value))
    layer(x, is_causal=True)
    remove()
    assert bool((seen["g"][:, :, 1] == 0.5).all())
    # what a hook returns replaces the gate: gate 0 on every head silences the layer (no bias)
    remove = layer.hook_gate.add(lambda value, point: torch.zeros_like(value))
    with torch.no_grad():
        silenced = layer(x, is_causal=True)
    remove()
    assert float(silenced.abs().max()) == 0.0


def test_gated_attention_equals_transformers_qwen3_next_attention() -> None:
    torch.manual_seed(3)
    config = T.Qwen3NextConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=HKV, head_dim=DH,
                               partial_rotary_factor=1 / 3, attn_implementation="eager")  # fmt: skip
    ref = Qwen3NextAttention(config, layer_idx=3).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    rotary = Rotary(DH, base=config.rope_parameters["rope_theta"], fraction=1 / 3)
    ours = MultiHeadAttention(
        D, H, d_head=DH, n_kv_heads=HKV, bias=False, gate="elementwise", rotary=rotary, qk_norm="head",
        qk_norm_eps=config.rms_norm_eps, qk_norm_offset=1.0,
    )  # fmt: skip
    qg = ref.q_proj.weight.view(H, 2, DH, D)  # (H, [q, gate], dh, d): interleaved per head
    with torch.no_grad():
        ours.qkv_weight.copy_(torch.cat([qg[:, 0].reshape(-1, D), ref.k_proj.weight, ref.v_proj.weight]))
        ours.gate_weight.copy_(qg[:, 1].reshape(-1, D))
        ours.o_weight.copy_(ref.o_proj.weight)
        ours.q_norm.weight.copy_(ref.q_norm.weight)
        ours.k_norm.weight.copy_(ref.k_norm.weight)
    x = torch.randn(2, 9, D)
    positions = torch.arange(9)
    cos, sin = Qwen3NextRotaryEmbedding(config)(x, positions[None])
    mask = torch.full((9, 9), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want, want_pattern = ref(x, (cos, sin), mask)
        got, pattern = ours(x, is_causal=True, need_weights=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(pattern, want_pattern, atol=1e-6, rtol=0)


def test_a_bad_gate_is_refused_naming_the_field() -> None:
    expected = r"AttentionSpec\.gate must be None or one of \['headwise', 'elementwise'\]; got 'x'"
    with pytest.raises(ValueError, match=expected):
        MultiHeadAttention(D, H, gate="x")
    layer = gated_layer()
    with pytest.raises(
        ValueError, match="gate is None must be False, fixed by the layer's weights; got True"
    ):
        layer.spec = dataclasses.replace(layer.spec, gate=None)


def test_pruning_a_gated_layer_keeps_the_gates_of_the_kept_heads() -> None:
    from headspace.attention.pruning import shrink_attention

    layer = gated_layer("elementwise", bias=True)
    x = torch.randn(1, 6, D)

    def zero_first_group(value: torch.Tensor, point: object) -> torch.Tensor:
        out = value.clone()
        out[:, :, :2] = 0  # heads 0 and 1 (key/value head 0) silenced
        return out

    remove = layer.hook_z.add(zero_first_group)
    with torch.no_grad():
        want = layer(x, is_causal=True)
    remove()
    shrink_attention(layer, [2, 3])
    assert layer.gate_weight.shape == (2 * DH, D) and layer.gate_bias.shape == (2 * DH,)
    with torch.no_grad():
        torch.testing.assert_close(layer(x, is_causal=True), want, atol=1e-6, rtol=0)


def test_the_lesson_shows_the_gate_and_the_gated_z(capsys: pytest.CaptureFixture[str]) -> None:
    from headspace.analysis.lesson.explain import explain
    from headspace.cli.render import render_explanation

    torch.manual_seed(0)
    config = hs.ModelConfig(
        arch="decoder", vocab_size=29, d_model=D, n_layers=2, n_heads=H, n_kv_heads=HKV, d_head=DH, d_mlp=16,
        max_seq_len=16, bias=False, attn_gate="elementwise",
    )  # fmt: skip
    model = hs.Decoder(config).eval()

    class Words:  # a loaded model with a tokenizer of one token per word
        def __init__(self) -> None:
            self.model, self.config, self.tokenizer = model, config, self

        def tokens(self, sentence: str) -> list[str]:
            return sentence.split()

        def tokenize_padded(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
            ids = torch.tensor([[hash(w) % 29 for w in t.split()] for t in texts])
            return ids, torch.ones_like(ids, dtype=torch.bool)

    e = explain(Words(), "a b c d e f", "d", layer=1, head=3)
    assert len(e.gate) == DH and all(0 < g < 1 for g in e.gate)
    mixed = torch.tensor(e.pattern) @ torch.tensor(e.v)  # (d_head,): sum_j p_j v_j
    torch.testing.assert_close(torch.tensor(e.z), mixed * torch.tensor(e.gate), atol=1e-6, rtol=0)
    render_explanation(e)
    out = capsys.readouterr().out
    assert "gate = sigmoid(x W_G[3])" in out and "4. z = (sum_j softmax_j v_j) * gate" in out
