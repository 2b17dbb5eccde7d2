"""The table of families (headspace.pretrained.families_table) against what loads: its model_types are
exactly the registry's, and a row's layout, rotation and decoding route are what loading a tiny
checkpoint of that family, written by transformers itself, builds; the README's and docs/families.md's
tables are what the table generates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

import headspace as hs
from headspace.decode.step import blocks_of
from headspace.pretrained import PretrainedEncoder
from headspace.pretrained import families_table as ft
from headspace.pretrained.registry import FOLDER_LOADERS

pytestmark = pytest.mark.usefixtures("single_thread")

ROOT = Path(__file__).resolve().parents[2]
V, D, L, H = 61, 24, 2, 2  # vocab, hidden, layers, heads (d_head 12)
COMMON = dict(vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, intermediate_size=19,
              max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=None)  # fmt: skip
PARTIAL = {"rope_type": "default", "rope_theta": 300.0, "partial_rotary_factor": 0.5}
# name -> (config class, model class, config arguments): one layout, rotation or decoding route each
CASES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "gpt_neox_parallel": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM,
                          {"use_parallel_residual": True, "rope_parameters": PARTIAL}),
    "gpt_neox_sequential": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM,
                            {"use_parallel_residual": False, "rope_parameters": PARTIAL}),
    "gptj": (T.GPTJConfig, T.GPTJForCausalLM, {"rotary_dim": 8, "n_inner": None}),
    "cohere": (T.CohereConfig, T.CohereForCausalLM, {"num_key_value_heads": 1}),
    "olmo3": (T.Olmo3Config, T.Olmo3ForCausalLM,
              {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}),
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, {"num_key_value_heads": 1,
                                                     "attn_logit_softcapping": 2.0}),
    "llama_yarn": (T.LlamaConfig, T.LlamaForCausalLM, {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 8}}),
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, {"num_local_experts": 3, "num_experts_per_tok": 2,
                                                        "num_key_value_heads": 1}),
    "gpt2": (T.GPT2Config, T.GPT2LMHeadModel, {"n_embd": D, "n_layer": L, "n_head": H, "n_positions": 32,
                                           "bos_token_id": None, "eos_token_id": None}),
    "bert": (T.BertConfig, T.BertModel, {}),
    "modernbert": (T.ModernBertConfig, T.ModernBertModel, {"local_attention": 4}),
    "bart": (T.BartConfig, T.BartForConditionalGeneration, {
        "d_model": D, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": H,
        "decoder_attention_heads": H, "encoder_ffn_dim": 19, "decoder_ffn_dim": 19,
        "max_position_embeddings": 32}),
}  # fmt: skip


def build(case: str, folder: Path) -> None:
    config_cls, model_cls, extra = CASES[case]
    torch.manual_seed(0)
    kw = {"vocab_size": V} if config_cls in (T.GPT2Config, T.BartConfig) else dict(COMMON)
    kw.update(extra)
    model_cls(config_cls(**kw)).eval().save_pretrained(folder)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Any]]:
    out = {}
    for case in CASES:
        folder = tmp_path_factory.mktemp(case)
        build(case, folder)
        model = hs.load(folder)
        out[case] = (json.loads((folder / "config.json").read_text())["model_type"], model)
    return out


def test_the_table_lists_exactly_the_model_types_the_registry_loads() -> None:
    types = [row.model_type for row in ft.FAMILIES]
    assert len(types) == len(set(types)), "a model_type listed twice"
    assert set(types) == set(FOLDER_LOADERS), (
        f"missing from the table: {sorted(set(FOLDER_LOADERS) - set(types))}; "
        f"listed but not loadable: {sorted(set(types) - set(FOLDER_LOADERS))}"
    )


@pytest.mark.parametrize("case", list(CASES))
def test_each_row_says_what_loading_its_family_builds(loaded: dict, case: str) -> None:
    model_type, model = loaded[case]
    row = ft.family(model_type)
    if isinstance(model, hs.EncoderDecoder):
        assert row.kind == "encoder-decoder" and row.decode == ("encdec",)
        assert row.layouts == (model.config.layout,) and row.rotation == "none"
        return
    blocks = blocks_of(model.model)
    layouts = {b.spec.layout for b in blocks}
    assert layouts <= set(row.layouts), (model_type, layouts, row.layouts)
    rotaries = [b.spec.attention.positions for b in blocks if b.spec.attention.positions is not None]
    if row.rotation == "none":
        assert not rotaries, model_type
    else:
        assert rotaries, model_type
        assert {r.interleaved for r in rotaries} == {row.rotation == "interleaved"}, model_type
        assert {r.rope_type for r in rotaries} <= set(row.rope_types), model_type
    if any(r.rotary_dim < r.d_head for r in rotaries):
        assert row.partial, f"{model_type} built a partial rotation; the row says it is not partial"
    if isinstance(model, PretrainedEncoder):
        assert row.kind == "encoder" and row.decode == ("-",)
        return
    assert row.kind == "decoder"
    assert ft.decode_route(model) in row.decode, (model_type, ft.decode_route(model), row.decode)


def test_a_configurable_layout_and_route_are_each_reached(loaded: dict) -> None:
    """gpt_neox's row names two layouts and two routes: both configurations reach one of each."""
    parallel, sequential = loaded["gpt_neox_parallel"][1], loaded["gpt_neox_sequential"][1]
    assert {b.spec.layout for b in blocks_of(parallel.model)} == {"parallel"}
    assert {b.spec.layout for b in blocks_of(sequential.model)} == {"pre"}
    assert (ft.decode_route(parallel), ft.decode_route(sequential)) == ("python", "native")
    assert ft.family("gpt_neox").layouts == ("parallel", "pre")
    assert ft.decode_route(loaded["gemma2"][1]) == "python"  # score soft-capping: the Python step only
    assert ft.decode_route(loaded["mixtral"][1]) == "python"  # experts: the native step refuses 'mlp.kind'


def test_the_readme_and_docs_tables_are_the_generated_ones() -> None:
    assert ft.sync_markdown(ROOT) == [], "run: python -m headspace.pretrained.families_table --write"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert ft.START + "\n" + ft.compact_table() + ft.END in readme
    for row in ft.FAMILIES:
        assert f"`{row.model_type}`" in readme


def test_sync_rewrites_a_stale_table_and_refuses_missing_markers(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(f"# x\n{ft.START}\nold table\n{ft.END}\nafter\n", encoding="utf-8")
    (tmp_path / "docs/families.md").write_text(
        f"{ft.START}\n{ft.markdown_table()}{ft.END}\n", encoding="utf-8"
    )
    assert ft.sync_markdown(tmp_path) == ["README.md"]
    assert ft.main([str(tmp_path)]) == 1
    assert ft.sync_markdown(tmp_path, write=True) == ["README.md"]
    assert ft.sync_markdown(tmp_path) == []
    text = (tmp_path / "README.md").read_text(encoding="utf-8")
    assert text == f"# x\n{ft.START}\n{ft.compact_table()}{ft.END}\nafter\n"
    (tmp_path / "README.md").write_text("no markers\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"README.md: expected one .* line and then one .* found 0 and 0$"):
        ft.sync_markdown(tmp_path)


def test_a_row_with_an_unknown_value_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"^Family.decode must be a tuple of \[.*\]; got \('cached',\)$"):
        ft.Family("x", "decoder", "rotary", ("pre",), "RMSNorm", "", ("cached",), "", "")
    with pytest.raises(ValueError, match=r"^Family.rotation must be one of .*; got 'spiral'$"):
        ft.Family("x", "decoder", "rotary", ("pre",), "RMSNorm", "", ("native",), "", "", rotation="spiral")
    with pytest.raises(KeyError, match="no family 'no_such_family'"):
        ft.family("no_such_family")
