"""Llama 4's text model (``llama4_text``) against transformers 5: chunked attention, NoPE layers with the
query temperature, the weightless L2 QK-norm, interleaved (complex-pair) RoPE, sigmoid-routed experts with
an ungated shared expert, and dense layers between them.

Reference: a tiny random model built and saved by transformers itself (eager attention, odd sizes), every
parameter random (norms around 1, the router at scale 1 so that routing varies), read back by
``headspace.load(folder)``. The input is longer than the chunk and the temperature's ``floor_scale``, so
each mechanism changes the output (checked: dropping any one of them breaks the match). Logits within
1e-4 of their largest magnitude, every head's pattern within 1e-5, greedy decoding token for token.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

import headspace as hs
from headspace.attention.temperature import temperatures
from headspace.decode import describe, native, python
from headspace.nn.masks import canonical_mask, chunk_mask
from headspace.pretrained import families_table
from headspace.pretrained.llama4 import llama4_config

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, H, HKV, DH, E, CHUNK, FLOOR = 71, 30, 4, 6, 3, 10, 3, 5, 3
CONFIG = dict(
    vocab_size=V, hidden_size=D, intermediate_size=14, intermediate_size_mlp=22, num_hidden_layers=L,
    num_attention_heads=H, num_key_value_heads=HKV, head_dim=DH, num_local_experts=E, num_experts_per_tok=1,
    interleave_moe_layer_step=2, attention_chunk_size=CHUNK, floor_scale=FLOOR, attn_scale=0.4,
    no_rope_layer_interval=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    rope_parameters={"rope_type": "default", "rope_theta": 300.0}, tie_word_embeddings=False,
)  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """(folder, transformers model read back with eager attention) of the tiny random Llama 4."""
    folder = tmp_path_factory.mktemp("llama4")
    torch.manual_seed(0)
    model = T.Llama4ForCausalLM(T.Llama4TextConfig(**CONFIG)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1.0 if "router" in name else 0.3
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else scale * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder, T.Llama4ForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def test_config_reads_every_llama4_field(saved: tuple[Path, Any]) -> None:
    folder, ref = saved
    c = hs.load(folder).config
    assert ref.config.layer_types == ["chunked_attention", "full_attention"] * 2
    assert c.layer_types == ["chunked", "full", "chunked", "full"] and c.attention_chunk == CHUNK
    assert c.nope_layers == [1, 3] and c.attn_temperature == [FLOOR, 0.4]
    assert c.moe_layers == ref.config.moe_layers == [1, 3] and c.dense_d_mlp == 22 and c.d_mlp == 14
    assert c.qk_norm == "l2" and c.rope_interleaved and c.experts_routing == "topk_sigmoid"
    specs = c.block_specs()
    assert [s.attention.chunk for s in specs] == [CHUNK, None, CHUNK, None]
    assert [s.attention.temperature for s in specs] == [None, (FLOOR, 0.4), None, (FLOOR, 0.4)]
    assert [s.attention.qk_norm for s in specs] == ["l2", None, "l2", None]  # not on the NoPE layers
    assert [s.mlp.kind for s in specs] == ["gated", "moe", "gated", "moe"]
    from headspace.analysis.lesson.chunked import supports_qk_capture

    model = hs.load(folder).model  # the chunked statistics apply neither chunks nor the temperature
    assert not any(supports_qk_capture(b.attn) for b in model.blocks)
    row = families_table.family("llama4_text")  # the generated tables' row says what loads
    assert row.rotation == "interleaved" and families_table.decode_route(hs.load(folder)) in row.decode


def test_logits_patterns_router_and_greedy_decoding_equal_transformers(saved: tuple[Path, Any]) -> None:
    folder, ref = saved
    ours = hs.load(folder)
    assert sum(p.numel() for p in ours.model.parameters()) == sum(p.numel() for p in ref.parameters())
    tokens = torch.randint(3, V, (2, 13))  # past two chunk boundaries and the temperature's first steps
    with torch.no_grad():
        want = ref(input_ids=tokens, output_attentions=True, output_router_logits=True)
        names = ["*.hook_pattern", "*.hook_router_logits"]
        with hs.trace(ours.model, names=names) as t:
            got = ours(tokens)
    torch.testing.assert_close(got, want.logits, atol=1e-4 * float(want.logits.abs().max()), rtol=0)
    for layer in range(L):
        torch.testing.assert_close(t.pattern(layer), want.attentions[layer], atol=1e-5, rtol=0)
    for k, layer in enumerate((1, 3)):
        router, want_router = (
            t[f"blocks.{layer}.mlp.hook_router_logits"].reshape(-1, E),
            want.router_logits[k],
        )
        atol = 1e-5 * max(1.0, float(want_router.abs().max()))  # (scaled to their largest magnitude)
        torch.testing.assert_close(router, want_router, atol=atol, rtol=0)
    with torch.no_grad(), hs.trace(ours.model) as full:  # every hook point: the trace's own executor
        ours(tokens)
    with torch.no_grad():  # and no hook point: the fused path
        torch.testing.assert_close(
            ours(tokens), want.logits, atol=1e-4 * float(want.logits.abs().max()), rtol=0
        )
    for layer in range(L):
        torch.testing.assert_close(full.pattern(layer), want.attentions[layer], atol=1e-5, rtol=0)
    allowed = chunk_mask(13, 13, CHUNK)  # the chunked layers see only their own chunk
    assert float(t.pattern(0)[..., ~allowed].abs().max()) == 0.0
    assert float(t.pattern(1)[..., CHUNK:, 0].min()) > 0.0  # the full layers see the first token
    prompt = tokens[:1, :4]  # greedy decoding (the forward with its KV cache) across chunks
    with torch.no_grad():
        want_ids = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3 * CHUNK,
                                do_sample=False, pad_token_id=0)  # fmt: skip
    assert torch.equal(ours.generate(prompt, 3 * CHUNK, temperature=0), want_ids)


def test_a_left_padded_batch_counts_chunks_from_each_rows_first_token(saved: tuple[Path, Any]) -> None:
    """As transformers' chunked mask: a left-padded row's chunks start at its first real token (greedy
    decoding of the padded batch equals transformers', and each row equals itself decoded alone)."""
    folder, ref = saved
    ours = hs.load(folder)
    lengths, seq, new = (9, 4, 7), 9, 2 * CHUNK
    tokens = torch.zeros(len(lengths), seq, dtype=torch.long)  # (batch, seq), pad id 0
    key_padding = torch.zeros(len(lengths), seq, dtype=torch.bool)  # (batch, seq)
    for i, n in enumerate(lengths):
        tokens[i, seq - n :] = torch.randint(3, V, (n,))
        key_padding[i, seq - n :] = True
    got = ours.generate(tokens, new, key_padding=key_padding, temperature=0)
    with torch.no_grad():
        want = ref.generate(
            tokens, attention_mask=key_padding.long(), max_new_tokens=new, do_sample=False, pad_token_id=0
        )
    assert torch.equal(got, want)


@pytest.mark.parametrize("change", ["chunk", "temperature", "qk_norm", "interleaved"])
def test_each_mechanism_changes_the_output(saved: tuple[Path, Any], change: str) -> None:
    """Without any one of the mechanisms the model no longer matches transformers: each one matters here."""
    folder, ref = saved
    ours = hs.load(folder)
    tokens = torch.randint(3, V, (1, 13))
    with torch.no_grad():
        want = ref(input_ids=tokens).logits
        for block in ours.model.blocks:
            a = block.attn
            if change == "chunk" and a.spec.chunk is not None:
                a.spec = dataclasses.replace(a.spec, chunk=None)
            if change == "temperature" and a.spec.temperature is not None:
                a.spec = dataclasses.replace(a.spec, temperature=None)
            if change == "qk_norm" and a.q_norm is not None:
                a.q_norm.eps = a.k_norm.eps = 1e9  # (the L2 norm made inert: q and k scaled by ~1e-4.5)
            if change == "interleaved" and a.rotary is not None:
                a.rotary = hs.positions.Rotary(DH, base=300.0)  # rotate-half pairs instead
        got = ours(tokens)
    assert float((got - want).abs().max()) > 1e-2 * float(want.abs().max())


def test_temperature_and_chunk_mask_formulas() -> None:
    """t(p) as transformers writes it; the chunk mask as transformers' chunked causal mask (no padding)."""
    positions = torch.arange(40)
    want = torch.log1p(torch.floor((positions.float() + 1.0) / 8)) * 0.1 + 1.0
    assert torch.equal(temperatures(positions, 8, 0.1), want)
    from transformers.masking_utils import and_masks, causal_mask_function, chunked_overlay

    fn = and_masks(chunked_overlay(4, torch.zeros(1, dtype=torch.long)), causal_mask_function)
    t = torch.tensor  # (transformers' mask functions take index tensors)
    ref = torch.tensor([[bool(fn(t(0), t(0), t(q), t(k))) for k in range(11)] for q in range(11)])
    assert torch.equal(chunk_mask(11, 11, 4), ref)
    assert torch.equal(chunk_mask(3, 11, 4), ref[-3:])  # bottom-right: the last queries of a KV cache
    m = canonical_mask(batch=1, n_heads=1, seq_q=11, seq_k=11, is_causal=True, chunk=4, window=3).mask
    assert torch.equal(m[0, 0], ref & hs.masks.window_mask(11, 11, 3))


def test_head_qk_is_exact_at_frozen_l2_scales(saved: tuple[Path, Any]) -> None:
    """On a rotary layer with the L2 QK-norm: x_i qk(i - j) x_j^T s_q s_k == scores / scale, the circuit
    built on the interleaved rotation with the norm's gains (1) folded in and its scales frozen."""
    folder, _ = saved
    ours = hs.load(folder)
    a = ours.model.blocks[2].attn
    tokens = torch.randint(3, V, (1, 9))
    with torch.no_grad(), hs.trace(ours.model) as t:
        ours(tokens)
    x = t["blocks.2.hook_attn_in"][0]  # (seq, d_model)
    s_q, s_k = a.qk_norm_scales(
        t["blocks.2.attn.hook_q"], t["blocks.2.attn.hook_k"]
    )  # (1, S, H), (1, S, Hkv)
    scores = t["blocks.2.attn.hook_scores"][0] / a.scale  # (H, S, S)
    for h in (0, 5):
        g = a.heads[h].kv_index
        for i, j in ((8, 5), (4, 0), (7, 7)):
            circuit = a.heads[h].qk(i - j).AB  # (d_model, d_model)
            value = x[i] @ circuit @ x[j] * s_q[0, i, h] * s_k[0, j, g]
            torch.testing.assert_close(value, scores[h, i, j], atol=1e-4, rtol=1e-4)


def test_the_python_step_runs_chunks_temperature_and_the_l2_norm(
    saved: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Llama 4 decodes by the Python cached step (its experts by their own forward, the dense model
    below without them): its chunk mask, query temperature and L2 QK-norm give the forward's own
    greedy choice at every step, across chunk boundaries and past the temperature's first step; the
    native step has no form for them (Python only), and a step asked for a field it lacks names it."""
    folder, _ = saved
    ours = hs.load(folder)
    moe_step = describe(ours.model)  # the experts: LayerStep.moe, run by the Python step
    assert moe_step is not None and [x.moe is not None for x in moe_step.layers] == [False, True] * 2
    prompt = torch.randint(3, V, (1, 3), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = prompt
        for _ in range(2 * CHUNK):  # the forward on the whole prefix, no cache, no step
            want = torch.cat([want, ours.model(want)[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert torch.equal(ours.model.generate(prompt, 2 * CHUNK, temperature=0), want)
    dense = dataclasses.replace(
        ours.config,
        moe_layers=None,
        mlp_kind="gated",
        n_experts=None,
        experts_top_k=None,
        experts_routing="softmax_topk",
        shared_expert_d_mlp=None,
    )
    torch.manual_seed(5)
    model = hs.Decoder(dense).eval()  # fmt: skip
    with torch.no_grad():
        for block in model.blocks:  # larger queries and keys: sharper maps, so the masks matter
            block.attn.qkv_weight.mul_(4.0)
    step = describe(model)
    assert step is not None and native.native_form(step) is None
    assert [layer.chunk for layer in step.layers] == [CHUNK, None, CHUNK, None]
    assert step.layers[1].temperature == (FLOOR, 0.4) and step.layers[0].qk_norm == "l2"
    calls: list[int] = []
    original = python.layer_rows

    def spy(*args: Any) -> torch.Tensor:
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(python, "layer_rows", spy)
    prompt = torch.randint(3, V, (2, 3))
    with torch.no_grad():
        got = model.generate(prompt, 3 * CHUNK, temperature=0)
        want = prompt
        for _ in range(3 * CHUNK):  # the forward on the whole prefix, no cache, no step
            want = torch.cat([want, model(want)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(got, want) and len(calls) >= L * (3 * CHUNK - 1)  # every new token by the step
    sunk = dataclasses.replace(step.layers[0].spec.attention, sink="learned")
    asked = dataclasses.replace(step.layers[0], spec=dataclasses.replace(step.layers[0].spec, attention=sunk))
    with pytest.raises(
        ValueError, match="the Python decoding step does not support the attention field 'sink'"
    ):
        python.prepare(dataclasses.replace(step, layers=(asked,)))


def test_bad_llama4_fields_are_refused_naming_the_field() -> None:
    cfg = dict(CONFIG, model_type="llama4_text")
    with pytest.raises(ValueError, match="layer_types must list"):
        llama4_config({**cfg, "layer_types": ["sliding_attention"] * L})
    with pytest.raises(ValueError, match="no_rope_layers must have one entry per layer"):
        llama4_config({**cfg, "no_rope_layers": [1, 0]})
    with pytest.raises(ValueError, match="num_experts_per_tok must be at most the 3 experts; got 4"):
        llama4_config({**cfg, "num_experts_per_tok": 4})
    with pytest.raises(ValueError, match=r"AttentionSpec.temperature must be None or \(floor_scale > 0"):
        hs.nn.spec.AttentionSpec(D, H, DH, HKV, temperature=(0.0, 1.0))
    with pytest.raises(ValueError, match="attention_chunk is None"):
        hs.ModelConfig(arch="decoder", n_layers=1, layer_types=["chunked"])
