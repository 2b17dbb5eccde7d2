"""DiffLlama (differential attention) against transformers 5.

Reference: a tiny random DiffLlama built and saved by transformers itself (eager attention, odd sizes,
grouped key/value heads), every parameter random (the lambdas at a scale where lambda varies from 1),
read back by ``headspace.load(folder)``. Logits within 1e-4 of their largest magnitude, every head's
softmax map within 1e-5 (``hook_pattern``, as transformers returns it), the pairs' difference maps
from transformers' own maps and lambda, greedy decoding token for token.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

import headspace as hs
from headspace.attention.differential import DifferentialAttention, lambda_init_of
from headspace.decode import Stepper, describe, native, python
from headspace.pretrained import families_table
from headspace.pretrained.diffllama import diffllama_config

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, H, HKV, DH = 71, 36, 3, 6, 2, 6
CONFIG = dict(vocab_size=V, hidden_size=D, intermediate_size=22, num_hidden_layers=L, num_attention_heads=H,
              num_key_value_heads=HKV, head_dim=DH, max_position_embeddings=64, tie_word_embeddings=False,
              pad_token_id=0, bos_token_id=1, eos_token_id=None)  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """(folder, transformers model read back with eager attention) of the tiny random DiffLlama."""
    folder = tmp_path_factory.mktemp("diffllama")
    torch.manual_seed(0)
    model = T.DiffLlamaForCausalLM(T.DiffLlamaConfig(**CONFIG)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.5 if "lambda" in name else 0.3
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else scale * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder, T.DiffLlamaForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def test_logits_patterns_difference_maps_and_greedy_decoding_equal_transformers(
    saved: tuple[Path, Any],
) -> None:
    folder, ref = saved
    ours = hs.load(folder)
    assert sum(p.numel() for p in ours.model.parameters()) == sum(p.numel() for p in ref.parameters())
    tokens = torch.randint(3, V, (2, 11))
    with torch.no_grad():
        want = ref(input_ids=tokens, output_attentions=True)
        with hs.trace(ours.model, names=["*.hook_pattern", "*.hook_diff_pattern"]) as t:
            got = ours(tokens)
    torch.testing.assert_close(got, want.logits, atol=1e-4 * float(want.logits.abs().max()), rtol=0)
    for layer in range(L):
        a, theirs = ours.model.blocks[layer].attn, ref.model.layers[layer].self_attn
        assert isinstance(a, DifferentialAttention) and a.pairs == [(0, 3), (1, 4), (2, 5)]
        assert a.lambda_init == theirs.lambda_init == lambda_init_of(layer)
        with torch.no_grad():
            lam = (torch.exp((theirs.lambda_q1 * theirs.lambda_k1).sum()) - torch.exp((theirs.lambda_q2 *
                   theirs.lambda_k2).sum()) + theirs.lambda_init)  # fmt: skip
        assert abs(float(lam)) > 0.1  # the second map of each pair matters
        torch.testing.assert_close(a.lambda_full(), lam, atol=1e-6, rtol=0)
        p = want.attentions[layer]  # (batch, heads, seq, seq)
        torch.testing.assert_close(t.pattern(layer), p, atol=1e-5, rtol=0)
        diff = t[f"blocks.{layer}.attn.hook_diff_pattern"]  # (batch, pairs, seq, seq)
        torch.testing.assert_close(diff, p[:, :3] - lam * p[:, 3:], atol=1e-5, rtol=0)
    prompt = tokens[:1, :4]
    with torch.no_grad():
        want_ids = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8,
                                do_sample=False, pad_token_id=0)  # fmt: skip
    assert torch.equal(ours.generate(prompt, 8, temperature=0), want_ids)


def test_pair_outputs_norm_and_head_circuits(saved: tuple[Path, Any]) -> None:
    """Each pair's result sums to the output; the normed pair output has RMS (1 - lambda_init); each
    head's QK circuit gives its scores (the maps are classic softmax maps)."""
    folder, _ = saved
    ours = hs.load(folder)
    tokens = torch.randint(3, V, (1, 9))
    with torch.no_grad(), hs.trace(ours.model) as t:
        ours(tokens)
    a = ours.model.blocks[1].attn
    normed = t["blocks.1.attn.hook_z_normed"]  # (batch, seq, pairs, 2 d_head)
    assert normed.shape == (1, 9, 3, 2 * DH)
    rms = normed.pow(2).mean(-1).sqrt()  # (batch, seq, pairs)
    torch.testing.assert_close(rms, torch.full_like(rms, 1 - a.lambda_init), atol=1e-4, rtol=0)
    out = t["blocks.1.hook_attn_out"]
    torch.testing.assert_close(t["blocks.1.attn.hook_result"].sum(2), out, atol=1e-5, rtol=0)
    x, scores = (
        t["blocks.1.hook_attn_in"][0],
        t["blocks.1.attn.hook_scores"][0] / a.scale,
    )  # (S, d), (H, S, S)
    for h in (0, 4):
        for i, j in ((8, 3), (5, 5)):
            value = x[i] @ a.heads[h].qk(i - j).AB @ x[j]
            torch.testing.assert_close(value, scores[h, i, j], atol=1e-4, rtol=1e-4)
    with pytest.raises(
        ValueError, match="head 4: the attention field 'differential' mixes each pair's values"
    ):
        a.heads[4].ov()


def test_a_heads_z_is_its_maps_share_of_its_pair(saved: tuple[Path, Any]) -> None:
    """hook_z is per head (its map on its pair's values): zeroing head 4's z is zeroing its map."""
    folder, _ = saved
    ours = hs.load(folder)
    a, tokens = ours.model.blocks[1].attn, torch.randint(3, V, (1, 9))

    def zero_head(value: torch.Tensor, axis: int) -> torch.Tensor:
        value = value.clone()
        value.select(axis, 4).zero_()
        return value

    with torch.no_grad():
        base = ours(tokens)
        remove = a.hook_z.add(lambda z, _p: zero_head(z, 2))  # (batch, seq, heads, 2 d_head)
        by_z = ours(tokens)
        remove()
        remove = a.hook_pattern.add(lambda m, _p: zero_head(m, 1))  # (batch, heads, seq, seq)
        by_pattern = ours(tokens)
        remove()
    assert float((by_z - base).abs().max()) > 1e-3
    torch.testing.assert_close(by_z, by_pattern, atol=1e-5, rtol=0)


def test_the_description_names_the_differential_field(saved: tuple[Path, Any]) -> None:
    folder, _ = saved
    ours = hs.load(folder)
    block = ours.model.blocks[2]
    assert block.spec.attention.differential == lambda_init_of(2)
    block.spec = block.spec  # a differential layer takes its own description back
    plain = hs.Decoder(dataclasses.replace(ours.config, diff_attention=False)).blocks[2]
    with pytest.raises(ValueError, match="differential is None must be True, fixed by the layer's weights"):
        plain.spec = block.spec
    row = families_table.family("diffllama")  # the generated tables' row says what loads
    assert row.rotation == "half-split" and families_table.decode_route(ours) in row.decode
    step = describe(ours.model)
    assert step is not None and all(
        x.differential is ours.model.blocks[i].attn for i, x in enumerate(step.layers)
    )
    with pytest.raises(
        ValueError, match="the native decoding step does not support the attention field 'differential'"
    ):
        native.prepare(step)  # asked for by name
    without = dataclasses.replace(
        step, layers=tuple(dataclasses.replace(x, differential=None) for x in step.layers)
    )
    with pytest.raises(
        ValueError, match="the Python decoding step does not support the attention field 'differential'"
    ):
        python.prepare(without)  # a description without its layer: named, never run as a plain one


def test_the_python_step_runs_differential_attention_as_forward(saved: tuple[Path, Any]) -> None:
    """Each differential block's step is its layer's own forward on the new position with its KV cache
    (LayerStep.differential): the step's logits equal the full forward's at every decoded position
    (greedy decoding through it equals transformers': tested above)."""
    ours = hs.load(saved[0])
    step = describe(ours.model)
    assert step is not None
    stepper, tokens = Stepper(step), torch.randint(3, V, (2, 12))
    caches = ours.model.make_kv_caches(2, 16)
    with torch.no_grad():
        full = ours.model(tokens)  # (2, 12, V)
        ours.model(tokens[:, :4], kv_caches=caches)
        stepped = torch.stack([stepper.logits(tokens[:, i : i + 1], caches) for i in range(4, 12)], 1)
    assert stepper.backend_used == "python" and caches[0].length == 12
    torch.testing.assert_close(stepped, full[:, 4:], atol=1e-5 * float(full.abs().max()), rtol=0)


def test_bad_diffllama_fields_are_refused_naming_the_field() -> None:
    cfg = dict(CONFIG, model_type="diffllama")
    with pytest.raises(
        ValueError, match="num_key_value_heads must be even for differential attention; got 3"
    ):
        diffllama_config({**cfg, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="needs an even n_kv_heads"):
        DifferentialAttention(12, 4, n_kv_heads=1, lambda_init=0.2)
    with pytest.raises(ValueError, match=r"AttentionSpec.differential must be None or a finite float"):
        hs.nn.spec.AttentionSpec(D, H, DH, HKV, differential=float("nan"))


def test_one_query_head_per_key_head_equals_transformers(tmp_path: Path) -> None:
    """num_key_value_heads == num_attention_heads (the 125M benchmark's form: no key or value copies):
    logits, patterns and cached greedy decoding as transformers'."""
    torch.manual_seed(1)
    model = T.DiffLlamaForCausalLM(T.DiffLlamaConfig(**{**CONFIG, "num_key_value_heads": H})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.4 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    ref = T.DiffLlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ours = hs.load(tmp_path)
    assert ours.model.blocks[0].attn.group_size == 1
    tokens = torch.randint(3, V, (2, 9))
    with torch.no_grad():
        want = ref(input_ids=tokens, output_attentions=True)
        with hs.trace(ours.model, names=["*.hook_pattern"]) as t:
            got = ours(tokens)
        want_ids = ref.generate(tokens[:1, :4], attention_mask=torch.ones(1, 4, dtype=torch.long),
                                max_new_tokens=6, do_sample=False, pad_token_id=0)  # fmt: skip
    torch.testing.assert_close(got, want.logits, atol=1e-4 * float(want.logits.abs().max()), rtol=0)
    for layer in range(L):
        torch.testing.assert_close(t.pattern(layer), want.attentions[layer], atol=1e-5, rtol=0)
    assert torch.equal(ours.generate(tokens[:1, :4], 6, temperature=0), want_ids)
