"""BLOOM, Falcon (new decoder architecture with grouped kv; the old one, multi-query or per-head q/k/v,
parallel or sequential; rotary or ALiBi) and MPT against transformers 5 itself.

References: tiny random checkpoints built and saved by transformers (odd sizes, non-power-of-2 head
counts where the family allows them, every norm weight and bias random, non-default values of the
fields that matter), read back with ``headspace.load`` and compared with transformers' eager forward:
logits within 1e-4 of their largest magnitude, every head's pattern within 1e-5; greedy decoding
token for token through the Python cached step (the native one refuses ALiBi by name); the traced
scores as each head's QK circuit plus its ALiBi bias ``-m_h * delta``; the fields that cannot be exact
refused by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

import headspace as hs
from headspace.decode import describe
from headspace.pretrained import families_table as ft

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, DM = 83, 48, 3, 37  # vocab, hidden, layers, Falcon's ffn_hidden_size
ROPE = {"rope_type": "default", "rope_theta": 300.0}
FALCON = dict(
    vocab_size=V, hidden_size=D, num_hidden_layers=L, ffn_hidden_size=DM, max_position_embeddings=40
)
ARCHS: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    # 6 heads: BLOOM's slopes past the largest power of 2 below the head count
    "bloom": (T.BloomConfig, T.BloomForCausalLM, dict(vocab_size=V, hidden_size=D, n_layer=L, n_head=6)),
    "bloom_untied": (T.BloomConfig, T.BloomForCausalLM,
                     dict(vocab_size=V, hidden_size=D, n_layer=L, n_head=8, tie_word_embeddings=False)),
    "falcon_new": (T.FalconConfig, T.FalconForCausalLM, dict(
        FALCON, num_attention_heads=6, num_kv_heads=2, new_decoder_architecture=True, bias=True,
        rope_parameters=ROPE)),
    "falcon_new_one_norm_alibi": (T.FalconConfig, T.FalconForCausalLM, dict(
        FALCON, num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
        num_ln_in_parallel_attn=1, alibi=True)),
    "falcon_multi_query_alibi": (T.FalconConfig, T.FalconForCausalLM, dict(
        FALCON, num_attention_heads=8, multi_query=True, parallel_attn=True, alibi=True)),
    "falcon_sequential": (T.FalconConfig, T.FalconForCausalLM, dict(
        FALCON, num_attention_heads=4, multi_query=False, parallel_attn=False, bias=True,
        rope_parameters=ROPE)),
    "falcon_multi_query_rotary": (T.FalconConfig, T.FalconForCausalLM, dict(
        FALCON, num_attention_heads=6, multi_query=True, parallel_attn=True, rope_parameters=ROPE,
        tie_word_embeddings=False)),
    "mpt": (T.MptConfig, T.MptForCausalLM, dict(
        vocab_size=V, d_model=D, n_layers=L, n_heads=6, max_seq_len=40, attn_config={"softmax_scale": 0.3})),
}  # fmt: skip
LAYOUT = {"falcon_sequential": "pre", "bloom": "pre", "bloom_untied": "pre", "mpt": "pre"}


def build(arch: str, folder: Path) -> Any:
    config_cls, model_cls, kw = ARCHS[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(initializer_range=0.3, pad_token_id=0, **kw)).eval()
    with torch.no_grad():  # norms and biases away from their start, so a wrong or skipped one shows
        for name, p in model.named_parameters():
            if "norm" in name or "ln" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    return model_cls.from_pretrained(folder, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    out = {}
    for arch in ARCHS:
        folder = tmp_path_factory.mktemp(arch)
        out[arch] = (folder, build(arch, folder))
    return out


def _heads(config: Any) -> int:
    return int(getattr(config, "num_attention_heads", None) or config.n_heads)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_and_every_head_pattern_equal_transformers(saved: dict, arch: str) -> None:
    folder, ref = saved[arch]
    ours = hs.load(folder)
    assert {b.spec.layout for b in ours.model.blocks} == {LAYOUT.get(arch, "parallel")}
    alibi = "alibi" in arch or arch.startswith(("bloom", "mpt"))
    assert (ours.config.alibi_slopes is not None) == alibi and (ours.config.positions == "rotary") != alibi
    tokens = torch.randint(1, V, (2, 13))
    with torch.no_grad():
        want = ref(input_ids=tokens, output_attentions=True)
        with hs.trace(ours.model, names="*.hook_pattern") as t:
            got = ours(tokens)
    bound = 1e-4 * float(want.logits.abs().max())
    torch.testing.assert_close(got, want.logits, atol=bound, rtol=0)
    for layer in range(L):
        torch.testing.assert_close(t.pattern(layer), want.attentions[layer], atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_decoding_equals_transformers_through_the_python_step(saved: dict, arch: str) -> None:
    folder, ref = saved[arch]
    ours = hs.load(folder)
    step = describe(ours.model)
    assert step is not None
    assert ft.decode_route(ours) in ft.family(ours.config.extra["model_type"]).decode
    prompt = torch.randint(1, V, (1, 6))
    got = ours.generate(prompt, 10, temperature=0, backend="python")
    with torch.no_grad():
        want = ref.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False, pad_token_id=0
        )
    assert torch.equal(got, want)


def test_configs_say_what_each_family_is(saved: dict) -> None:
    from headspace.nn.alibi import bloom_slopes, mpt_slopes

    load = {arch: hs.load(folder) for arch, (folder, _) in saved.items()}
    assert load["bloom"].config.alibi_slopes == bloom_slopes(6) and load["bloom"].config.embed_ln
    assert ", ALiBi" in load["bloom"].config.summary() and "ALiBi" not in load["falcon_new"].config.summary()
    again = hs.ModelConfig.from_dict(json.loads(json.dumps(load["mpt"].config.to_dict())))
    assert again.alibi_slopes == mpt_slopes(6) and again.block_spec(0).attention.bias == "alibi"
    assert load["mpt"].config.alibi_slopes == mpt_slopes(6) and load["mpt"].model.blocks[0].attn.scale == 0.3
    assert load["falcon_multi_query_alibi"].config.alibi_slopes == [m / 6**0.5 for m in bloom_slopes(8)]
    assert load["falcon_multi_query_alibi"].config.max_seq_len == 40  # under the 256 cap
    kv = {a: m.model.blocks[0].attn.n_kv_heads for a, m in load.items() if a.startswith("falcon")}
    assert kv == {"falcon_new": 2, "falcon_new_one_norm_alibi": 2, "falcon_multi_query_alibi": 1,
                  "falcon_sequential": 4, "falcon_multi_query_rotary": 1}  # fmt: skip
    assert load["falcon_new"].model.blocks[0].attn.qkv_bias is not None
    assert load["falcon_multi_query_alibi"].model.blocks[0].attn.qkv_bias is None
    assert load["bloom_untied"].model.lm_head is not None and load["bloom"].model.lm_head is None


@pytest.mark.parametrize("arch", ["bloom", "falcon_multi_query_alibi", "mpt"])
def test_traced_scores_are_the_qk_circuit_plus_the_alibi_bias(saved: dict, arch: str) -> None:
    ours = hs.load(saved[arch][0])
    S = 11
    tokens = torch.randint(1, V, (1, S))
    with hs.trace(ours.model, names=["blocks.1.hook_attn_in", "blocks.1.attn.hook_scores"]) as t:
        ours(tokens)
    attn = ours.model.blocks[1].attn
    x = t["blocks.1.hook_attn_in"][0].double()  # (S, d_model)
    xa = torch.cat([x, torch.ones(S, 1, dtype=torch.float64)], dim=-1)  # (S, d_model + 1): the biases
    scores = t["blocks.1.attn.hook_scores"][0].double()  # (H, S, S)
    delta = torch.arange(S)[:, None] - torch.arange(S)[None, :]  # (S, S)
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    for h in range(attn.n_heads):
        head = attn.heads[h]
        AB = head.qk(5, augmented=True).AB.double()  # (d_model + 1, d_model + 1): no rotation
        got = xa @ AB @ xa.T * attn.scale + head.alibi_bias(delta)  # (S, S)
        torch.testing.assert_close(got[causal], scores[h][causal], rtol=1e-4, atol=1e-4)


def _edited(saved: dict, tmp_path: Path, arch: str, **changes: Any) -> Path:
    folder = tmp_path / arch
    shutil.copytree(saved[arch][0], folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    attn = changes.pop("attn_config", None)
    config.update(changes)
    if attn is not None:
        config["attn_config"] = {**config["attn_config"], **attn}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("arch", "changes", "key"),
    [
        (
            "bloom",
            {"apply_residual_connection_post_layernorm": True},
            "apply_residual_connection_post_layernorm",
        ),
        ("falcon_multi_query_alibi", {"num_attention_heads": 16}, "num_attention_heads=16"),
        ("falcon_sequential", {"num_kv_heads": 2}, "num_kv_heads=2"),
        ("mpt", {"attn_config": {"clip_qkv": 6.0}}, "clip_qkv=6.0"),
        ("mpt", {"attn_config": {"qk_ln": True}}, "qk_ln=True"),
        ("mpt", {"attn_config": {"alibi_bias_max": 4}}, "alibi_bias_max=4"),
        ("mpt", {"attn_config": {"alibi": False}}, "alibi=False"),
        ("mpt", {"no_bias": False}, "no_bias=False"),
        ("mpt", {"logit_scale": 2.0}, "logit_scale=2.0"),
    ],
)
def test_fields_that_cannot_be_exact_are_refused_by_name(
    saved: dict, tmp_path: Path, arch: str, changes: dict, key: str
) -> None:
    with pytest.raises(ValueError, match=key) as info:
        hs.load(_edited(saved, tmp_path, arch, **changes))
    assert "\n" not in str(info.value) and "not supported" in str(info.value)


@pytest.mark.parametrize("arch", ["bloom", "mpt"])
def test_score_decomposition_adds_up_with_the_alibi_bias(saved: dict, arch: str) -> None:
    """The parts of a head's score add up to the traced score: ALiBi's -m_h (i - j) is in the bias part."""
    from headspace.analysis.decomposition import score_decomposition

    model = hs.load(saved[arch][0]).model
    tokens = torch.randint(1, V, (1, 9), generator=torch.Generator().manual_seed(3))
    for layer, head, q, k in [(0, 1, 4, 0), (2, 5, 8, 3)]:
        r = score_decomposition(model, tokens, layer, head, query=q, key=k)
        assert abs(r.total - r.score) <= 1e-4 * max(1.0, abs(r.score)), (layer, r.total, r.score)


def test_the_chunked_statistics_refuse_alibi_by_name_and_head_roles_trace_it(saved: dict) -> None:
    from headspace.analysis import each_layer_qk
    from headspace.analysis.lesson.roles import head_roles

    model = hs.load(saved["bloom"][0]).model
    tokens = torch.randint(1, V, (1, 9), generator=torch.Generator().manual_seed(4))
    with pytest.raises(ValueError, match=r"^layer 0 \(.*\): the chunked statistics do not add the attention "
                                         r"field 'bias' \('alibi'\)"):  # fmt: skip
        each_layer_qk(model, lambda: model(tokens), lambda call: None)
    roles = head_roles(model, tokens)  # "auto": the traced patterns, ALiBi included
    with hs.trace(model, names="*.hook_pattern") as t:
        model(tokens)
    for layer in range(L):
        pattern = t.pattern(layer)[0]  # (H, S, S)
        previous = pattern.diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1)  # (H,): queries 1.. on i - 1
        torch.testing.assert_close(roles.mass("previous")[layer], previous, atol=1e-5, rtol=0)


def test_pruned_heads_keep_their_own_slopes(saved: dict, tmp_path: Path) -> None:
    """Pruning heads 1 and 4 of an ALiBi layer computes what zero-ablating them does (each kept head keeps
    its slope), and a model rebuilt from the pruned config does too."""
    from headspace.analysis.interventions import prune_heads

    ours = hs.load(saved["bloom"][0]).model
    tokens = torch.randint(1, V, (1, 9), generator=torch.Generator().manual_seed(5))
    slopes = ours.blocks[0].attn.spec.alibi_slopes
    with torch.no_grad():
        with hs.ablate(ours, {(0, 1): "zero", (0, 4): "zero"}):
            want = ours(tokens)
        prune_heads(ours, {0: [1, 4]})
        assert ours.blocks[0].attn.spec.alibi_slopes == tuple(slopes[h] for h in (0, 2, 3, 5))
        torch.testing.assert_close(ours(tokens), want, atol=1e-5, rtol=0)
        rebuilt = hs.Decoder(ours.config).eval()
        rebuilt.load_state_dict(ours.state_dict())
        torch.testing.assert_close(rebuilt(tokens), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["bloom", "falcon_multi_query_alibi", "mpt"])
def test_a_left_padded_batch_equals_transformers_on_the_real_tokens(saved: dict, arch: str) -> None:
    """Transformers' BLOOM and Falcon place keys by the padding mask's cumulative sum, MPT by index:
    either way only the distance between real tokens reaches the pattern, as headspace's -m_h (i - j)."""
    folder, ref = saved[arch]
    ours = hs.load(folder)
    tokens = torch.randint(1, V, (2, 10))
    real = torch.ones(2, 10, dtype=torch.bool)
    real[1, :3] = False  # row 1: three pads on the left
    with torch.no_grad():
        want = ref(input_ids=tokens, attention_mask=real.long()).logits
        got = ours.model(tokens, key_padding=real)
    bound = 1e-4 * float(want[real].abs().max())
    torch.testing.assert_close(got[real], want[real], atol=bound, rtol=0)


def test_falcon_alibi_context_is_capped_where_transformers_bias_stays_exact(saved: dict) -> None:
    from headspace.pretrained.alibi_families import FALCON_ALIBI_CONTEXT, alibi_family_config

    hf = json.loads((saved["falcon_multi_query_alibi"][0] / "config.json").read_text())
    long = alibi_family_config({**hf, "max_position_embeddings": 2048})
    assert long.max_seq_len == FALCON_ALIBI_CONTEXT == 256
    rotary = json.loads((saved["falcon_new"][0] / "config.json").read_text())
    assert alibi_family_config({**rotary, "max_position_embeddings": 2048}).max_seq_len == 2048
