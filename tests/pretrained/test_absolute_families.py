"""OPT, GPT-Neo and GPT-BigCode against transformers 5 itself: learned absolute positions (OPT's offset
of 2), pre and post layouts, OPT's projected embeddings, GPT-Neo's unscaled scores and local windows,
GPT-BigCode's multi-query attention.

References: tiny random checkpoints built and saved by transformers (odd sizes, every norm weight and
bias random, non-default values of the fields that matter), read back with ``headspace.load`` and
compared with transformers' eager forward: logits within 1e-4 of their largest magnitude, every
head's pattern within 1e-5; greedy decoding token for token.
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

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, H, DM, CTX = 83, 48, 3, 4, 37, 32  # vocab, hidden, layers, heads (d_head 12), mlp, context
ARCHS: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    # pre-LN, projected embeddings (word_embed_proj_dim 20 != 48), relu, biases
    "opt": (
        T.OPTConfig,
        T.OPTForCausalLM,
        dict(
            vocab_size=V,
            hidden_size=D,
            num_hidden_layers=L,
            num_attention_heads=H,
            ffn_dim=DM,
            max_position_embeddings=CTX,
            word_embed_proj_dim=20,
            do_layer_norm_before=True,
            activation_function="relu",
            enable_bias=True,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=None,
        ),
    ),
    # post-LN (OPT-350m), no final LayerNorm, no biases, gelu, untied head
    "opt_post": (
        T.OPTConfig,
        T.OPTForCausalLM,
        dict(
            vocab_size=V,
            hidden_size=D,
            num_hidden_layers=L,
            num_attention_heads=H,
            ffn_dim=DM,
            max_position_embeddings=CTX,
            word_embed_proj_dim=D,
            do_layer_norm_before=False,
            activation_function="gelu",
            enable_bias=False,
            tie_word_embeddings=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=None,
        ),
    ),
    # LayerNorms without parameters, no final LayerNorm, projected embeddings with an untied head
    "opt_plain": (
        T.OPTConfig,
        T.OPTForCausalLM,
        dict(
            vocab_size=V,
            hidden_size=D,
            num_hidden_layers=L,
            num_attention_heads=H,
            ffn_dim=DM,
            max_position_embeddings=CTX,
            word_embed_proj_dim=28,
            layer_norm_elementwise_affine=False,
            _remove_final_layer_norm=True,
            tie_word_embeddings=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=None,
        ),
    ),
    # unscaled scores; local layers (window 4) between global ones
    "gpt_neo": (
        T.GPTNeoConfig,
        T.GPTNeoForCausalLM,
        dict(
            vocab_size=V,
            hidden_size=D,
            num_layers=L,
            num_heads=H,
            intermediate_size=DM,
            max_position_embeddings=CTX,
            attention_types=[[["local", "global", "local"], 1]],
            window_size=4,
            activation_function="gelu_new",
            layer_norm_epsilon=1e-4,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=None,
        ),
    ),
    # multi-query: one key/value head
    "gpt_bigcode": (
        T.GPTBigCodeConfig,
        T.GPTBigCodeForCausalLM,
        dict(
            vocab_size=V,
            n_embd=D,
            n_layer=L,
            n_head=H,
            n_inner=DM,
            n_positions=CTX,
            multi_query=True,
            activation_function="gelu_pytorch_tanh",
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=None,
        ),
    ),
    # every head its own key/value head (c_attn rows per head), unscaled scores, untied head
    "gpt_bigcode_mha": (
        T.GPTBigCodeConfig,
        T.GPTBigCodeForCausalLM,
        dict(
            vocab_size=V,
            n_embd=D,
            n_layer=L,
            n_head=H,
            n_inner=DM,
            n_positions=CTX,
            multi_query=False,
            scale_attn_weights=False,
            tie_word_embeddings=False,
            activation_function="relu",
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=None,
        ),
    ),
}


def build(arch: str, folder: Path) -> Any:
    config_cls, model_cls, kw = ARCHS[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(**kw, initializer_range=0.3)).eval()
    with torch.no_grad():  # norms, biases and positions away from their start, so a wrong one shows
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias") or "pos" in name or "wpe" in name:
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


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_and_every_head_pattern_equal_transformers(saved: dict, arch: str) -> None:
    folder, ref = saved[arch]
    ours = hs.load(folder)
    tokens = torch.randint(1, V, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(input_ids=tokens, output_attentions=True)
        with hs.trace(ours.model, names="*.hook_pattern") as t:
            got = ours(tokens)
    bound = 1e-4 * float(want.logits.abs().max())
    torch.testing.assert_close(got, want.logits, atol=bound, rtol=0)
    for layer in range(L):
        torch.testing.assert_close(t.pattern(layer), want.attentions[layer], atol=1e-5, rtol=0)


def test_configs_say_what_each_family_is(saved: dict) -> None:
    c = {a: hs.load(f).config for a, (f, _) in saved.items()}
    assert (c["opt"].norm, c["opt"].final_ln, c["opt"].act, c["opt"].max_seq_len) == (
        "pre",
        True,
        "relu",
        CTX,
    )
    assert (c["opt_post"].norm, c["opt_post"].final_ln, c["opt_post"].bias) == ("post", False, False)
    assert not c["opt"].tie_embeddings and c["opt"].extra["word_embed_proj_dim"] == 20
    plain = hs.load(saved["opt_plain"][0]).model
    assert (c["opt_plain"].norm, c["opt_plain"].final_ln) == ("pre", False)
    for norm in [n for b in plain.blocks for n in (b.ln1, b.ln2)]:  # no parameters: weight 1, bias 0
        assert bool((norm.weight == 1).all()) and bool((norm.bias == 0).all())
    neo = hs.load(saved["gpt_neo"][0]).model
    assert [b.spec.attention.window for b in neo.blocks] == [4, None, 4]
    assert {b.spec.attention.score_scale for b in neo.blocks} == {1.0}
    assert [b.spec.attention.qkv_bias for b in neo.blocks] == [False] * L
    assert c["gpt_bigcode"].n_kv_heads == 1 and c["gpt_bigcode_mha"].n_kv_heads == H
    assert c["gpt_bigcode_mha"].attn_scale == 1.0


def test_opt_position_table_is_offset_by_two(saved: dict) -> None:
    """Headspace's position row p is OPT's row p + 2 (its first two rows are never read)."""
    folder, ref = saved["opt"]
    ours = hs.load(folder)
    table = ref.model.decoder.embed_positions.weight  # [CTX + 2, D]
    assert table.shape == (CTX + 2, D)
    torch.testing.assert_close(ours.model.pos_embed.weight, table[2:], atol=0, rtol=0)


def test_opt_left_padded_rows_take_their_positions(saved: dict) -> None:
    """A left-padded row with per-row positions (0 at its first real token) is the unpadded row: what
    OPT's cumsum of the attention mask gives transformers."""
    folder, ref = saved["opt"]
    ours = hs.load(folder)
    tokens = torch.randint(1, V, (1, 9), generator=torch.Generator().manual_seed(2))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), tokens], dim=1)  # (1, 12)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 9, dtype=torch.long)], dim=1)
    with torch.no_grad():
        want = ref(input_ids=padded, attention_mask=mask).logits[:, 3:]  # (1, 9, V)
        got = ours.model(tokens)
    torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_decoding_equals_transformers(saved: dict, arch: str) -> None:
    folder, ref = saved[arch]
    ours = hs.load(folder)
    prompt = torch.randint(1, V, (1, 6), generator=torch.Generator().manual_seed(3))
    got = ours.generate(prompt, 10, temperature=0)
    with torch.no_grad():
        want = ref.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False, pad_token_id=0
        )
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("arch", "key", "value"),
    [
        ("gpt_neo", "attention_types", [[["global", "sparse"], 3]]),
        ("gpt_neo", "attention_types", [[["global", "local"], 1]]),
        ("gpt_bigcode", "add_cross_attention", True),
        ("opt", "activation_function", "swish_and_more"),
        ("opt", "max_position_embeddings", CTX - 1),  # the table's CTX + 2 rows are not CTX - 1 + 2
    ],
)
def test_what_headspace_cannot_run_is_refused_by_field_name(
    saved: dict, tmp_path: Path, arch: str, key: str, value: Any
) -> None:
    folder = tmp_path / arch
    shutil.copytree(saved[arch][0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(ValueError, match=key) as info:
        hs.load(folder)
    assert "\n" not in str(info.value)


def test_the_families_table_rows_say_what_loading_builds(saved: dict) -> None:
    """Each row of headspace.pretrained.families_table: its layouts and decoding routes are the loaded
    models' (OPT's pre layout decodes through the native step, its post layout through the Python one)."""
    from headspace.decode.step import blocks_of
    from headspace.pretrained import families_table as ft

    routes = {}
    for arch, (folder, _) in saved.items():
        ours = hs.load(folder)
        row = ft.family(ours.config.extra["model_type"])
        assert (
            row.kind == "decoder" and row.rotation == "none" and row.tested_in.endswith(Path(__file__).name)
        )
        assert {b.spec.layout for b in blocks_of(ours.model)} <= set(row.layouts), arch
        routes[arch] = ft.decode_route(ours)
        assert routes[arch] in row.decode, (arch, routes[arch])
    assert (routes["opt"], routes["opt_post"]) == ("native", "python")


@pytest.mark.parametrize("arch", ["opt", "gpt_neo", "gpt_bigcode", "gpt_bigcode_mha"])
def test_qk_circuit_gives_the_traced_scores(saved: dict, arch: str) -> None:
    """``head.qk(delta)`` (no rotation: the same circuit at every offset) with the biases, applied to the
    traced attention input, is each head's score: GPT-Neo's scale 1, GPT-BigCode's one shared key head."""
    ours = hs.load(saved[arch][0])
    tokens = torch.randint(1, V, (1, 11), generator=torch.Generator().manual_seed(4))
    with hs.trace(ours.model, names=["blocks.1.hook_attn_in", "blocks.1.attn.hook_scores"]) as t:
        ours(tokens)
    attn = ours.model.blocks[1].attn
    x = t["blocks.1.hook_attn_in"][0].double()  # (S, d_model)
    xa = torch.cat([x, torch.ones(11, 1, dtype=torch.float64)], dim=-1)  # (S, d_model + 1): the biases
    scores = t["blocks.1.attn.hook_scores"][0].double() / attn.scale  # (H, S, S)
    causal = torch.ones(11, 11, dtype=torch.bool).tril()
    for h in range(H):
        AB = attn.heads[h].qk(3, augmented=True).AB.double()  # (d_model + 1, d_model + 1)
        got = xa @ AB @ xa.T  # (S, S)
        torch.testing.assert_close(got[causal], scores[h][causal], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_score_decomposition_and_logit_attribution_add_up(saved: dict, arch: str) -> None:
    """The parts of a head's score add up to it on every family; the direct logit attribution's parts
    add up to the logit on the pre-LN ones (OPT's folded projections included) and the post layout
    (OPT-350m) is refused by name: its norms rescale the whole stream."""
    from headspace.analysis.causal.attribution import direct_logit_attribution
    from headspace.analysis.circuits.decomposition import composition_scores, score_decomposition

    ours = hs.load(saved[arch][0])
    tokens = torch.randint(1, V, (1, 9), generator=torch.Generator().manual_seed(5))
    r = score_decomposition(ours.model, tokens, 2, 1, query=8)
    assert abs(r.total - r.score) <= 1e-4 * max(1.0, abs(r.score)), (r.total, r.score)
    assert composition_scores(ours).q.shape[-1] == H
    if arch == "opt_post":
        with pytest.raises(ValueError, match="'layout' \\('post'\\)"):
            direct_logit_attribution(ours, tokens, 5, 7)
        return
    dla = direct_logit_attribution(ours, tokens, 5, 7)
    assert abs(float(dla.total) - float(dla.logit)) <= 1e-4 * max(1.0, abs(float(dla.logit)))


def test_the_atlas_leaves_direct_effects_out_on_the_post_layout(saved: dict) -> None:
    """The atlas's direct effects and copying scores are DLA's: computed on OPT's pre layout, left out
    (NaN) on its post layout, where no part has a fixed direct path to the logits."""
    from headspace.analysis import atlas

    docs = [torch.randint(1, V, (30,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for arch, absent in (("opt", False), ("opt_post", True)):
        model = hs.load(saved[arch][0]).model
        result = atlas(model, docs, window=12, batch_size=2, top_k=3, shard_size=3, progress=False,
                       induction_repeated=False, importance="exact")  # fmt: skip
        for stat in ("direct_effect", "copying"):
            assert bool(result.stats[stat].isnan().all()) is absent, (arch, stat)
        assert not result.stats["ablation"].isnan().any()


@pytest.mark.parametrize("arch", ["opt", "opt_post"])
def test_left_padded_batch_decodes_as_transformers_does(saved: dict, arch: str) -> None:
    """Prompts of different lengths, left-padded with their key_padding: each row's continuation is
    transformers' (OPT counts positions from each row's first real token, offset 2 in its table)."""
    folder, ref = saved[arch]
    ours = hs.load(folder)
    tokens = torch.randint(1, V, (2, 7), generator=torch.Generator().manual_seed(6))
    real = torch.ones(2, 7, dtype=torch.bool)
    tokens[1, :3], real[1, :3] = 0, False  # row 1: 3 padding tokens, then 4 real ones
    positions = (real.long().cumsum(1) - 1).clamp(min=0)  # (2, 7): 0 at each row's first real token
    with torch.no_grad():
        logits = ref(tokens, attention_mask=real.long()).logits  # (2, 7, V)
        mine = ours.model(tokens, real, positions=positions)  # (2, 7, V)
        want = ref.generate(
            tokens, attention_mask=real.long(), max_new_tokens=8, do_sample=False, pad_token_id=0
        )
    torch.testing.assert_close(mine[real], logits[real], atol=1e-4 * float(logits.abs().max()), rtol=0)
    got = ours.generate(tokens, 8, temperature=0, key_padding=real)
    assert torch.equal(got[:, 7:], want[:, 7:])


def test_the_post_layout_decodes_through_the_python_step(
    saved: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OPT-350m's post layout (``h = LN1(x + Attn(x))``, ``out = LN2(h + MLP(h))``) has a cached step,
    the Python backend's: every new token of an unpadded batch goes through it and the greedy tokens
    are transformers' and the whole forward's; a left-padded batch (which decodes by the forward with
    its KV caches, as every family's does) still equals transformers'. The native step, asked for by
    name, refuses the field by name."""
    from headspace.decode import describe, native, python

    folder, ref = saved["opt_post"]
    ours = hs.load(folder)
    step = describe(ours.model)
    assert step is not None and [layer.post for layer in step.layers] == [True] * L
    assert native.native_form(step) is None  # the Python step's only
    calls: list[int] = []
    original = python.layer_rows

    def spy(*args: Any) -> torch.Tensor:
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(python, "layer_rows", spy)
    prompt = torch.randint(1, V, (2, 6), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got = ours.generate(prompt, 10, temperature=0)
        want = ref.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False, pad_token_id=0
        )
        forward = prompt
        for _ in range(10):  # the forward on the whole prefix, no cache, no step
            forward = torch.cat([forward, ours.model(forward)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(got, want) and torch.equal(got, forward)
    # every new token by the step (the prompt's by the forward; the last one needs no step)
    assert len(calls) == L * 9
    assert torch.equal(ours.generate(prompt, 10, temperature=0, backend="python"), want)
    tokens, real = prompt.clone(), torch.ones(2, 6, dtype=torch.bool)
    tokens[1, :2], real[1, :2] = 0, False  # row 1: 2 padding tokens, then 4 real ones
    with torch.no_grad():
        padded = ref.generate(
            tokens, attention_mask=real.long(), max_new_tokens=8, do_sample=False, pad_token_id=0
        )
    assert torch.equal(ours.generate(tokens, 8, temperature=0, key_padding=real), padded)
    refused = "^the native decoding step does not support the block field 'layout' \\('post'\\)$"
    with pytest.raises(ValueError, match=refused):
        native.prepare(step)
    with pytest.raises(ValueError, match=refused):
        ours.generate(prompt, 3, temperature=0, backend="native")
