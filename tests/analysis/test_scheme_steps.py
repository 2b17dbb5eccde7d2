"""``explain``'s positional steps (analysis/lesson/scheme_steps.py) on tiny transformers checkpoints.

Partial rotary (Phi, GPT-J), interleaved against half-split pairs (GPT-J against Phi), LongRoPE's short and
long factors (Phi-3), YaRN's scaled frequencies and attention factor, dynamic NTK and llama3 (Llama): every
number a step shows is checked against the loaded rotary module and against transformers' own rotary
embedding.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

import headspace as hs
from headspace.analysis.lesson.explain import explain
from headspace.analysis.lesson.scheme_steps import (
    SCHEME_STEPS,
    SchemeStep,
    register_scheme_step,
    scheme_steps,
    unscaled_frequencies,
)
from headspace.cli.render import EXPLAIN_WIDTH, render_explanation, scheme_lines

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, H, DM, CTX = 61, 48, 2, 4, 37, 32  # vocab, hidden, layers, heads (d_head 12), mlp, context
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 300.0,
    "short_factor": [1.0, 1.3, 1.7, 2.2],
    "long_factor": [2.0, 3.5, 5.0, 7.5],
    "partial_rotary_factor": 2 / 3,
}
YARN = {
    "rope_type": "yarn",
    "rope_theta": 500.0,
    "factor": 4.0,
    "original_max_position_embeddings": 8,
    "beta_fast": 8.0,
    "beta_slow": 2.0,
}
ARCHS: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "phi": (
        T.PhiConfig,
        T.PhiForCausalLM,
        {"rope_parameters": {"rope_type": "default", "rope_theta": 60.0, "partial_rotary_factor": 0.5}},
    ),
    "gptj": (T.GPTJConfig, T.GPTJForCausalLM, {"rotary_dim": 8, "n_inner": None}),
    "phi3": (
        T.Phi3Config,
        T.Phi3ForCausalLM,
        {"original_max_position_embeddings": 10, "rope_parameters": LONGROPE, "partial_rotary_factor": 2 / 3},
    ),
    "llama_yarn": (T.LlamaConfig, T.LlamaForCausalLM, {"rope_parameters": YARN, "num_key_value_heads": 2}),
    "llama_dynamic": (
        T.LlamaConfig,
        T.LlamaForCausalLM,
        {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 300.0, "factor": 2.5}},
    ),
    "llama3": (
        T.LlamaConfig,
        T.LlamaForCausalLM,
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 400.0,
                "factor": 6.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 3.0,
                "original_max_position_embeddings": 8,
            }
        },
    ),
}


def build(arch: str, folder: Path) -> Any:
    """A random transformers model of ``arch`` saved into ``folder``, read back with eager attention."""
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    kw = dict(
        vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, intermediate_size=DM,
        max_position_embeddings=CTX, initializer_range=0.3, pad_token_id=0, bos_token_id=1, eos_token_id=None,
    )  # fmt: skip
    kw.update(extra)
    model = model_cls(config_cls(**kw)).eval()
    model.save_pretrained(folder)
    return model_cls.from_pretrained(folder, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Any]]:
    out = {}
    for arch in ARCHS:
        folder = tmp_path_factory.mktemp(arch)
        ref = build(arch, folder)
        out[arch] = (hs.load(folder), ref)
    return out


class Words:
    """A loaded tiny model with a tokenizer of one token per word (ids from a fixed list)."""

    def __init__(self, loaded: Any) -> None:
        self.model, self.config, self.tokenizer = loaded.model, loaded.model.config, self

    def tokens(self, sentence: str) -> list[str]:
        return sentence.split()

    def tokenize_padded(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor([[(7 * n + 3) % V for n, _ in enumerate(t.split())] for t in texts])  # (1, seq)
        return ids, torch.ones_like(ids, dtype=torch.bool)


def sentence(n: int) -> str:
    return " ".join(f"w{i}" for i in range(n))


def steps_of(loaded: Any, n_tokens: int, layer: int = 1, head: int = 2) -> dict[str, SchemeStep]:
    e = explain(Words(loaded), sentence(n_tokens), n_tokens - 1, layer=layer, head=head)
    return {s.scheme: s for s in e.scheme_steps}


def ref_inv_freq(ref: Any, arch: str, n_tokens: int) -> tuple[torch.Tensor, float]:
    """transformers' frequencies and attention scaling after its forward of ``n_tokens`` tokens."""
    with torch.no_grad():
        ref(input_ids=torch.zeros(1, n_tokens, dtype=torch.long))
    if arch == "gptj":  # GPT-J keeps sin/cos tables; rebuild their frequencies the way it does
        rd = ref.config.rotary_dim
        return 1.0 / (10000 ** (torch.arange(0, rd, 2, dtype=torch.int64) / rd)), 1.0
    emb = ref.model.rotary_emb
    return emb.inv_freq.float(), float(emb.attention_scaling)


@pytest.mark.parametrize(("arch", "rotary_dim"), [("phi", 6), ("gptj", 8), ("phi3", 8)])
def test_partial_rotary_names_the_dims_that_rotate_and_those_that_pass(
    saved: dict, arch: str, rotary_dim: int
) -> None:
    loaded, ref = saved[arch]
    rotary = loaded.model.blocks[1].attn.rotary
    assert rotary.rotary_dim == rotary_dim  # the loader's, as transformers' config has it
    ref_freq, _ = ref_inv_freq(ref, arch, 5)
    assert 2 * ref_freq.numel() == rotary_dim
    step = steps_of(loaded, 5)["partial_rotary"]
    assert step.numbers == {
        "rotary_dim": rotary_dim,
        "d_head": 12,
        "rotate": [0, rotary_dim - 1],
        "pass": [rotary_dim, 11],
    }
    assert f"dims 0..{rotary_dim - 1} rotate, the rest pass" in step.title
    assert f"dims {rotary_dim}..11 pass through unchanged" in step.lines[1]


def test_full_rotary_has_no_partial_step_and_default_rope_no_scaling_step(saved: dict) -> None:
    steps = steps_of(saved["llama_yarn"][0], 5)
    assert "partial_rotary" not in steps and "rope_scaling" in steps
    assert "rope_scaling" not in steps_of(saved["phi"][0], 5)


def test_interleaved_pairs_against_half_split_pairs(saved: dict) -> None:
    gptj = steps_of(saved["gptj"][0], 5)["rotary_pairs"]
    phi = steps_of(saved["phi"][0], 5)["rotary_pairs"]
    assert gptj.numbers == {"pairing": "interleaved", "planes": [[0, 1], [2, 3], [4, 5], [6, 7]]}
    assert phi.numbers == {"pairing": "half-split", "planes": [[0, 3], [1, 4], [2, 5]]}
    for loaded, step in ((saved["gptj"][0], gptj), (saved["phi"][0], phi)):
        assert step.numbers["planes"] == [list(p) for p in loaded.model.blocks[1].attn.rotary.planes()]
    assert "(2i, 2i + 1)" in gptj.title and "(i, i + 3)" in phi.title


@pytest.mark.parametrize(("n_tokens", "long"), [(6, False), (13, True)])
def test_longrope_frequencies_are_the_factors_the_call_chose(saved: dict, n_tokens: int, long: bool) -> None:
    loaded, ref = saved["phi3"]
    step = steps_of(loaded, n_tokens)["rope_scaling"]
    want, scaling = ref_inv_freq(ref, "phi3", n_tokens)
    planes = step.numbers["planes"]
    assert planes == [0, 1, 2, 3] and step.numbers["long"] is long
    assert step.numbers["after"] == [float(want[i]) for i in planes]
    assert step.numbers["after"] == [float(loaded.model.blocks[1].attn.rotary.inv_freq[i]) for i in planes]
    factors = LONGROPE["long_factor" if long else "short_factor"]
    before = [300.0 ** (-2 * i / 8) for i in planes]
    torch.testing.assert_close(torch.tensor(step.numbers["before"]), torch.tensor(before))
    torch.testing.assert_close(
        torch.tensor(step.numbers["after"]), torch.tensor([b / f for b, f in zip(before, factors)])
    )
    assert step.numbers["attention_factor"] == pytest.approx(scaling, rel=1e-7) and scaling > 1
    assert f"{'long' if long else 'short'}_factor_i" in step.lines[0]


def test_yarn_shows_scaled_frequencies_and_its_attention_factor(saved: dict) -> None:
    loaded, ref = saved["llama_yarn"]
    step = steps_of(loaded, 6)["rope_scaling"]
    want, scaling = ref_inv_freq(ref, "llama_yarn", 6)
    rotary = loaded.model.blocks[1].attn.rotary
    planes = step.numbers["planes"]
    assert planes == [0, 2, 3, 5]  # 6 planes: the first, the last and two between
    assert step.numbers["after"] == [float(want[i]) for i in planes]
    assert step.numbers["after"] == [float(rotary.inv_freq[i]) for i in planes]
    assert step.numbers["before"] == [float(unscaled_frequencies(12, 500.0)[i]) for i in planes]
    assert step.numbers["after"][0] == step.numbers["before"][0]  # the fastest plane keeps its frequency
    assert step.numbers["after"][-1] == pytest.approx(step.numbers["before"][-1] / 4)  # the slowest: / factor
    a = step.numbers["attention_factor"]
    assert a == scaling == rotary.attention_factor and a != 1.0
    assert any(f"a = {a:.6g}" in line for line in step.lines)
    assert any(f"a^2 = {a * a:.6g}" in line for line in step.lines)


def test_explain_prints_the_steps_within_its_width_and_json_carries_them(saved: dict, capsys) -> None:
    e = explain(Words(saved["phi3"][0]), sentence(13), "w12", layer=0, head=1)
    assert [s.scheme for s in e.scheme_steps] == ["partial_rotary", "rotary_pairs", "rope_scaling"]
    lines = scheme_lines(e)
    assert lines[0].startswith("2c. partial rotary: dims 0..7 rotate")
    assert all(len(line) <= EXPLAIN_WIDTH for line in lines)
    render_explanation(e)
    out = capsys.readouterr().out
    assert "2e. longrope rotary scaling" in out and "plane 3: w = " in out
    assert f"(|q| was {torch.tensor(e.q).norm():.3f})" in out  # the attention factor changes lengths
    d = json.loads(json.dumps(e.to_dict(top=2)))
    assert [s["scheme"] for s in d["scheme_steps"]] == ["partial_rotary", "rotary_pairs", "rope_scaling"]
    assert d["scheme_steps"][2]["numbers"]["long"] is True


def test_a_new_mechanism_registers_one_function(saved: dict) -> None:
    def marker(c: Any) -> SchemeStep | None:
        return SchemeStep("marker", f"head {c.head} of {c.seq_len} tokens", ["x"], {"head": c.head})

    register_scheme_step("test_marker", marker)
    try:
        steps = scheme_steps(saved["phi"][0].model.blocks[0].attn, 3, 4)
        assert steps[-1].numbers == {"head": 3} and steps[-1].title == "head 3 of 4 tokens"
        with pytest.raises(ValueError, match="'test_marker' is registered already"):
            register_scheme_step("test_marker", marker)
    finally:
        del SCHEME_STEPS["test_marker"]
    with pytest.raises(TypeError, match="must be callable"):
        register_scheme_step("other", 3)  # type: ignore[arg-type]


@pytest.mark.parametrize(("arch", "n_tokens"), [("llama_dynamic", 40), ("llama3", 6)])
def test_dynamic_and_llama3_frequencies_are_transformers(saved: dict, arch: str, n_tokens: int) -> None:
    loaded, ref = saved[arch]
    step = steps_of(loaded, n_tokens)["rope_scaling"]
    want, scaling = ref_inv_freq(ref, arch, n_tokens)
    planes = step.numbers["planes"]
    assert step.numbers["after"] == [float(want[i]) for i in planes]
    assert step.numbers["before"] == [
        float(unscaled_frequencies(12, float(ref.config.rope_parameters["rope_theta"]))[i]) for i in planes
    ]
    assert step.numbers["after"] != step.numbers["before"]  # 40 tokens > 32: dynamic NTK's base has grown
    assert step.numbers["attention_factor"] == scaling == 1.0
    if arch == "llama_dynamic":
        assert "longest call seen (40 tokens)" in step.lines[1]
