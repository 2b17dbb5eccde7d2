"""ModernBERT against transformers 5 itself: alternating local (bidirectional window) and global
attention with two RoPE bases, GeGLU, a first layer without attention norm, and the masked-LM head.

References: tiny random checkpoints built and saved by transformers (odd sizes, a non-default window,
pattern and bases, every norm and bias random), read back with ``headspace.load`` and compared with
transformers' eager forward: states / logits within 1e-4 of their largest magnitude, every head's
pattern within 1e-5, with and without padding (padding rows: the real queries' rows only).
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
from headspace.analysis.circuits.decomposition import score_decomposition
from headspace.analysis.lesson.chunked import each_layer_qk
from headspace.analysis.lesson.explain import TokenizedSentence, explain
from headspace.cli.render import window_line
from headspace.distributed.head_parallel import attention_shard
from headspace.nn.masks import window_mask
from headspace.nn.spec import AttentionSpec, BlockSpec, MLPSpec
from headspace.pretrained import PretrainedEncoder

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, H, DM, CTX, PAD, WIN = 83, 36, 4, 3, 29, 64, 5, 7  # d_head 12; local window 7 -> |i - j| <= 3


def _config(**over: Any) -> Any:
    kw = dict(vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, intermediate_size=DM,
              max_position_embeddings=CTX, pad_token_id=PAD, bos_token_id=0, eos_token_id=2, cls_token_id=0,
              sep_token_id=2, local_attention=WIN, global_attn_every_n_layers=2, global_rope_theta=1234.0,
              local_rope_theta=77.0, norm_eps=1e-6, initializer_range=0.3, norm_bias=True,
              attention_bias=True, mlp_bias=True, classifier_bias=True)  # fmt: skip
    return T.ModernBertConfig(**{**kw, **over})


def _randomise(model: Any) -> None:
    with torch.no_grad():  # norms and biases away from their start, so a wrong one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    torch.manual_seed(0)
    model = T.ModernBertModel(_config())
    _randomise(model)
    folder = tmp_path_factory.mktemp("modernbert")
    model.save_pretrained(folder)
    return folder, T.ModernBertModel.from_pretrained(folder, attn_implementation="eager").eval()


def _batch(padded: bool, seq: int = 13) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(PAD + 1, V, (2, seq), generator=torch.Generator().manual_seed(1))
    real = torch.ones(2, seq, dtype=torch.bool)
    if padded:
        tokens[1, 8:] = PAD
        real[1, 8:] = False
    return tokens, real


def _compare(ours: PretrainedEncoder, ref: Any, padded: bool) -> Any:
    tokens, real = _batch(padded)
    with torch.no_grad():
        want = ref(input_ids=tokens, attention_mask=real.long(), output_attentions=True)
        with hs.trace(ours.model, names="*.hook_pattern") as t:
            got = ours.model(tokens, real)
    states = want.last_hidden_state if hasattr(want, "last_hidden_state") else want.hidden_states[-1]
    bound = 1e-4 * float(states.abs().max())
    torch.testing.assert_close(got[real], states[real], atol=bound, rtol=0)
    for layer in range(L):
        ours_p, theirs = t.pattern(layer), want.attentions[layer]  # (2, H, 13, 13)
        torch.testing.assert_close(
            ours_p.transpose(1, 2)[real], theirs.transpose(1, 2)[real], atol=1e-5, rtol=0
        )
    return got


@pytest.mark.parametrize("padded", [False, True])
def test_states_and_every_head_pattern_equal_transformers(saved: tuple[Path, Any], padded: bool) -> None:
    folder, ref = saved
    ours = hs.load(folder)
    assert isinstance(ours, PretrainedEncoder)
    specs = [b.spec for b in ours.model.blocks]
    assert [s.attention.window for s in specs] == [None, WIN // 2 + 1, None, WIN // 2 + 1]
    assert [s.attn_norm for s in specs] == [False, True, True, True]
    assert isinstance(ours.model.blocks[0].ln1, torch.nn.Identity)
    assert [s.attention.positions.base for s in specs] == [1234.0, 77.0, 1234.0, 77.0]  # type: ignore[union-attr]
    _compare(ours, ref, padded)


def test_the_local_layers_see_exactly_half_the_window_on_each_side(saved: tuple[Path, Any]) -> None:
    ours = hs.load(saved[0])
    with torch.no_grad(), hs.trace(ours.model, names="*.hook_pattern") as t:
        ours.model(_batch(False, seq=11)[0])
    seen = t.pattern(1)[0, 0] > 0  # (11, 11)
    i = torch.arange(11)
    torch.testing.assert_close(seen, (i[:, None] - i[None, :]).abs() <= WIN // 2, atol=0, rtol=0)
    assert bool((t.pattern(0)[0, 0] > 0).all())  # a global layer sees every key


def test_a_masked_lm_checkpoint_gives_transformers_logits(tmp_path: Path) -> None:
    torch.manual_seed(3)
    types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    config = _config(
        layer_types=types,
        norm_bias=False,
        attention_bias=False,
        mlp_bias=False,
        hidden_activation="gelu_pytorch_tanh",
    )
    model = T.ModernBertForMaskedLM(config)
    _randomise(model)
    model.save_pretrained(tmp_path / "mlm")
    ref = T.ModernBertForMaskedLM.from_pretrained(tmp_path / "mlm", attn_implementation="eager").eval()
    ours = hs.load(tmp_path / "mlm")
    assert ours.mlm_head is not None  # type: ignore[attr-defined]
    assert [b.spec.attention.window is None for b in ours.model.blocks] == [True, False, False, True]
    for padded in (False, True):
        tokens, real = _batch(padded)
        with torch.no_grad():
            want = ref(input_ids=tokens, attention_mask=real.long()).logits
            got = ours.mlm_head(ours.model(tokens, real))  # type: ignore[attr-defined]
        torch.testing.assert_close(got[real], want[real], atol=1e-4 * float(want.abs().max()), rtol=0)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("hidden_activation", "swish", "hidden_activation"),
        ("rope_parameters", {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 9.0}},
         r"rope_parameters\['full_attention'\].rope_type='linear'"),
        ("layer_types", ["full_attention"], "layer_types must list"),
    ],
)  # fmt: skip
def test_what_headspace_cannot_run_is_refused_by_field_name(
    saved: tuple[Path, Any], tmp_path: Path, key: str, value: Any, match: str
) -> None:
    folder = tmp_path / "modernbert"
    shutil.copytree(saved[0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(ValueError, match=match) as info:
        hs.load(folder)
    assert "\n" not in str(info.value)


def test_the_bidirectional_window_is_a_field_the_other_executors_refuse_by_name() -> None:
    attention = AttentionSpec(24, 2, 12, 2, window=3, window_sides="both")
    torch.testing.assert_close(
        window_mask(5, 5, 3, sides="both"),
        (torch.arange(5)[:, None] - torch.arange(5)[None, :]).abs() < 3,
        atol=0,
        rtol=0,
    )
    with pytest.raises(ValueError, match="window_sides must be None without a window"):
        AttentionSpec(24, 2, 12, 2, window_sides="both")
    with pytest.raises(ValueError, match="attn_norm must be True for layout='post'"):
        BlockSpec(attention, MLPSpec(10), layout="post", attn_norm=False)
    from headspace.nn.spec import refuse_unsupported

    with pytest.raises(ValueError, match="does not support the attention field 'window_sides'"):
        refuse_unsupported(attention, "the decoding step", ("window",))
    block = BlockSpec(AttentionSpec(24, 2, 12, 2), MLPSpec(10), attn_norm=False)
    with pytest.raises(ValueError, match="does not support the block field 'attn_norm'"):
        refuse_unsupported(block, "the decoding step", ())


def test_the_chunked_statistics_refuse_the_bidirectional_window_by_name(saved: tuple[Path, Any]) -> None:
    ours = hs.load(saved[0])
    tokens = _batch(False)[0]
    seen: list[int] = []
    each_layer_qk(ours.model, lambda: ours.model(tokens), lambda call: seen.append(call.layer), layers=[0])
    assert seen == [0]  # a global layer: no window
    with pytest.raises(ValueError, match="do not support the attention field 'window_sides'") as info:
        each_layer_qk(ours.model, lambda: ours.model(tokens), lambda call: None, layers=[1])
    assert "\n" not in str(info.value)


def test_explain_states_the_bidirectional_window(saved: tuple[Path, Any]) -> None:
    ours = hs.load(saved[0])
    ids = _batch(False, 11)[0][:1]  # (1, 11)
    sentence = TokenizedSentence("eleven tokens", [f"t{i}" for i in range(11)], ids, None)
    e = explain(ours, "eleven tokens", 5, layer=1, head=0, tokenized=sentence)
    assert (e.window, e.window_sides) == (WIN // 2 + 1, "both")
    line = window_line(e)
    assert "|5 - j| < 4 (both sides): 4 keys are" in line  # keys 0, 1, 9 and 10 of 11
    assert [j for j, p in enumerate(e.pattern) if p > 0] == [2, 3, 4, 5, 6, 7, 8]


def test_a_head_parallel_shard_refuses_the_bidirectional_window_by_name(saved: tuple[Path, Any]) -> None:
    ours = hs.load(saved[0])
    attention_shard(ours.model.blocks[0].attn, 0, 3)  # a global layer shards
    with pytest.raises(ValueError, match="does not support the attention field 'window_sides'"):
        attention_shard(ours.model.blocks[1].attn, 0, 3)


@pytest.mark.parametrize("layer", [0, 1])  # a global layer (base 1234) and a local one (base 77)
def test_head_qk_delta_equals_the_traced_scores_on_both_sides(saved: tuple[Path, Any], layer: int) -> None:
    ours = hs.load(saved[0])
    tokens, real = _batch(False, seq=11)
    with (
        torch.no_grad(),
        hs.trace(ours.model, names=[f"blocks.{layer}.hook_attn_in", f"blocks.{layer}.attn.hook_scores"]) as t,
    ):
        ours.model(tokens, real)
    attn = ours.model.blocks[layer].attn
    x = t[f"blocks.{layer}.hook_attn_in"][0].double()  # (11, D): the attention's input
    xa = torch.cat([x, torch.ones(11, 1, dtype=torch.float64)], dim=-1)  # (11, D + 1): bias rows
    scores = t[f"blocks.{layer}.attn.hook_scores"][0].double() / attn.spec.score_scale  # (H, 11, 11)
    i = torch.arange(11)
    delta = i[:, None] - i[None, :]  # (11, 11): query - key, both signs
    seen = torch.isfinite(scores[0])  # the window's band on a local layer, every pair on a global one
    assert bool(seen.all()) == (layer == 0) and bool(seen[5, 8]) and bool(seen[8, 5])
    for h in range(H):
        circuit = attn.heads[h].qk(delta, augmented=True).AB.double()  # (11, 11, D + 1, D + 1)
        got = torch.einsum("im,ijmn,jn->ij", xa, circuit, xa)  # (11, 11)
        bound = 1e-4 * float(scores[h][seen].abs().max())
        torch.testing.assert_close(got[seen], scores[h][seen], atol=bound, rtol=0)


@pytest.mark.parametrize("layer", [0, 1])  # layer 0 reads its input without a norm; layer 1 slides
def test_the_score_decomposition_adds_up_without_the_first_attention_norm(
    saved: tuple[Path, Any], layer: int
) -> None:
    ours = hs.load(saved[0])
    ids = _batch(False, seq=10)[0][:1]  # (1, 10)
    for query, key in ((2, 0), (9, 7)):  # both within the local window of 3 on each side
        d = score_decomposition(ours.model, ids, layer, 1, query=query, key=key)
        assert abs(d.total - d.score) <= 1e-5 * max(1.0, abs(d.score)), (layer, query, d.total, d.score)


def test_the_config_fields_are_checked_and_round_trip(saved: tuple[Path, Any]) -> None:
    config = hs.load(saved[0]).config
    assert (config.window_sides, config.no_attn_norm_layers) == ("both", [0])
    assert hs.ModelConfig.from_dict(config.to_dict()) == config
    assert "window 4 (both sides) on 2/4 layers" in config.summary()
    small = dict(vocab_size=10, d_model=8, n_layers=2, n_heads=2, sliding_window=2)
    with pytest.raises(ValueError, match=r"window_sides must be None or 'both'.*arch='decoder'"):
        hs.ModelConfig(arch="decoder", window_sides="both", **small)
    with pytest.raises(
        ValueError, match=r"no_attn_norm_layers must be a list of layer indices in \[0, n_layers=2\)"
    ):
        hs.ModelConfig(arch="encoder", norm="pre", no_attn_norm_layers=[2], **small)
    with pytest.raises(ValueError, match="no_attn_norm_layers needs norm='pre'; got norm='post'"):
        hs.ModelConfig(arch="encoder", no_attn_norm_layers=[0], **small)


def test_a_full_trace_runs_the_block_without_attention_norm(saved: tuple[Path, Any]) -> None:
    folder, ref = saved
    ours = hs.load(folder)
    tokens = _batch(False)[0]
    with torch.no_grad():
        want = ref(input_ids=tokens).last_hidden_state
        with hs.trace(ours.model) as t:  # every hook point: the recorded executor of each block
            got = ours.model(tokens)
    torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0)
    torch.testing.assert_close(t["blocks.0.hook_attn_in"], t["blocks.0.hook_resid_pre"], atol=0, rtol=0)
