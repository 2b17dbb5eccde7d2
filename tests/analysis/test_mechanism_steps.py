"""``explain``'s steps for the 2025-26 attention mechanisms (analysis/lesson/mechanism_steps.py), on tiny
checkpoints built and saved by transformers 5 (as tests/pretrained/test_llama4.py, test_diffllama.py
and test_gemma4.py build them, every parameter random) and read back by ``headspace.load``:

* Llama 4: ``chunk`` (against :func:`headspace.nn.masks.chunk_mask` and transformers' own pattern),
  ``temperature`` (against :func:`headspace.attention.temperature.temperatures` and the traced scores),
  ``l2_norm`` (against the traced ``hook_q_normed`` / ``hook_k_normed``);
* DiffLlama: ``differential`` (against ``hook_diff_pattern``, transformers' maps and its lambda);
* Gemma 4 (no shared keys and values): ``v_norm`` (against ``hook_v_normed``) and ``k_eq_v``.

Latent attention, differential attention and shared keys/values are walked, their steps checked, in
tests/analysis/test_mechanism_walks.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

import headspace as hs
from headspace.analysis.lesson.explain import explain
from headspace.attention.temperature import temperatures
from headspace.cli.render import EXPLAIN_WIDTH, scheme_lines
from headspace.nn.masks import chunk_mask

pytestmark = pytest.mark.usefixtures("single_thread")

SENTENCE = " ".join(f"w{n}" for n in range(11))  # longer than the chunk (5) and floor_scale (3)
SEQ = 11


class Words:
    """A loaded tiny model with a tokenizer of one token per word (ids from a fixed rule)."""

    def __init__(self, loaded: Any) -> None:
        self.model, self.config, self.tokenizer = loaded.model, loaded.model.config, self
        self.vocab = int(loaded.model.config.vocab_size)

    def tokens(self, sentence: str) -> list[str]:
        return sentence.split()

    def tokenize_padded(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(
            [[(7 * n + 3) % self.vocab for n, _ in enumerate(t.split())] for t in texts]
        )  # (1, seq)
        return ids, torch.ones_like(ids, dtype=torch.bool)


def _randomise(model: Any, lambda_scale: float = 0.3) -> None:
    """Every parameter random: norms around 1, the router at scale 1, lambdas at ``lambda_scale``."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1.0 if "router" in name else lambda_scale if "lambda" in name else 0.3
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else scale * torch.randn_like(p))


def _saved(folder: Path, model: Any, cls: Any) -> tuple[Any, Any]:
    model.save_pretrained(folder)
    ref = cls.from_pretrained(folder, attn_implementation="eager", experts_implementation="eager").eval()
    return hs.load(folder), ref


@pytest.fixture(scope="module")
def llama4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    torch.manual_seed(0)
    config = T.Llama4TextConfig(
        vocab_size=71, hidden_size=30, intermediate_size=14, intermediate_size_mlp=22, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=3, head_dim=10, num_local_experts=3, num_experts_per_tok=1,
        interleave_moe_layer_step=2, attention_chunk_size=5, floor_scale=3, attn_scale=0.4,
        no_rope_layer_interval=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 300.0}, tie_word_embeddings=False,
    )  # fmt: skip
    model = T.Llama4ForCausalLM(config).eval()
    _randomise(model)
    return _saved(tmp_path_factory.mktemp("llama4_steps"), model, T.Llama4ForCausalLM)


@pytest.fixture(scope="module")
def diffllama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    torch.manual_seed(0)
    config = T.DiffLlamaConfig(
        vocab_size=71, hidden_size=36, intermediate_size=22, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=6, max_position_embeddings=64, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=None,
    )  # fmt: skip
    model = T.DiffLlamaForCausalLM(config).eval()
    _randomise(model, lambda_scale=0.5)
    return _saved(tmp_path_factory.mktemp("diffllama_steps"), model, T.DiffLlamaForCausalLM)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    torch.manual_seed(3)
    config = T.Gemma4TextConfig(
        vocab_size=67, hidden_size=36, intermediate_size=22, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=3, head_dim=8, sliding_window=4, max_position_embeddings=64, pad_token_id=0,
        layer_types=["sliding_attention", "full_attention"], bos_token_id=1, eos_token_id=2,
        attention_k_eq_v=True, num_kv_shared_layers=0, hidden_size_per_layer_input=0, global_head_dim=14,
        num_global_key_value_heads=1,
    )  # fmt: skip
    model = T.Gemma4ForCausalLM(config).eval()
    _randomise(model)
    return _saved(tmp_path_factory.mktemp("gemma4_steps"), model, T.Gemma4ForCausalLM)


@pytest.fixture(scope="module")
def gemma3n(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    torch.manual_seed(5)
    config = T.Gemma3nTextConfig(
        vocab_size=53, hidden_size=24, intermediate_size=[26, 22], num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=12, max_position_embeddings=64, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=5,
        vocab_size_per_layer_input=40, num_kv_shared_layers=0, laurel_rank=3, altup_num_inputs=3,
        activation_sparsity_pattern=[0.95, 0.0], pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = T.Gemma3nForCausalLM(config).eval()
    _randomise(model)
    return _saved(tmp_path_factory.mktemp("gemma3n_steps"), model, T.Gemma3nForCausalLM)


def _steps(loaded: Any, index: int, layer: int, head: int) -> tuple[Any, dict[str, Any]]:
    e = explain(Words(loaded), SENTENCE, index, layer=layer, head=head)
    return e, {s.scheme: s for s in e.scheme_steps}


def _ids(loaded: Any) -> torch.Tensor:
    return Words(loaded).tokenize_padded([SENTENCE])[0]  # (1, seq)


@pytest.mark.parametrize(("index", "head"), [(2, 0), (7, 1), (10, 5)])
def test_chunk_step_shows_the_querys_chunk_and_its_visible_keys(llama4: tuple, index: int, head: int) -> None:
    loaded, ref = llama4
    e, steps = _steps(loaded, index, 0, head)
    n = steps["chunk"].numbers
    want = chunk_mask(SEQ, SEQ, 5)[index].nonzero().flatten().tolist()  # (visible,)
    assert n["visible"] == want and n["chunk"] == 5 and n["start"] == want[0] and n["end"] == want[0] + 5
    assert n["start"] <= index < n["end"]
    with torch.no_grad():  # transformers' own weights are zero outside the chunk, positive inside
        row = ref(input_ids=_ids(loaded), output_attentions=True).attentions[0][0, head, index]  # (seq,)
    assert (row > 0).nonzero().flatten().tolist() == want
    assert sum(e.pattern[j] for j in want) == pytest.approx(1.0, abs=1e-6)
    assert "temperature" not in steps  # a chunked layer keeps its rotary positions, no temperature


@pytest.mark.parametrize(("index", "head"), [(0, 2), (5, 0), (10, 4)])
def test_temperature_step_gives_t_p_and_scales_the_untempered_scores(
    llama4: tuple, index: int, head: int
) -> None:
    loaded, _ = llama4
    e, steps = _steps(loaded, index, 1, head)
    assert "chunk" not in steps and "l2_norm" not in steps and "rotary_pairs" not in steps  # a NoPE layer
    n = steps["temperature"].numbers
    want = float(temperatures(torch.tensor([index]), 3.0, 0.4)[0])
    assert n["position"] == index and n["factor"] == pytest.approx(want, rel=1e-6)
    assert n["floor"] == (index + 1) // 3 and (n["factor"] == 1.0) == (index < 2)
    assert n["keys"] and n["after"] == [e.scores[j] for j in n["keys"]]
    for before, after in zip(n["before"], n["after"]):
        assert after == pytest.approx(n["factor"] * before, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize(("index", "head"), [(3, 0), (9, 5)])
def test_l2_norm_step_takes_q_and_k_to_rms_one(llama4: tuple, index: int, head: int) -> None:
    loaded, _ = llama4
    _, steps = _steps(loaded, index, 0, head)
    n = steps["l2_norm"].numbers
    kv = head // 2
    with torch.no_grad(), hs.trace(loaded.model, names=["blocks.0.attn.hook_*"]) as t:
        loaded.model(_ids(loaded))
    q, q_normed = t["blocks.0.attn.hook_q"][0, index, head], t["blocks.0.attn.hook_q_normed"][0, index, head]
    k, k_normed = (
        t["blocks.0.attn.hook_k"][0, n["keys"], kv],
        t["blocks.0.attn.hook_k_normed"][0, n["keys"], kv],
    )
    assert n["q_before"] == pytest.approx(float(q.norm()), rel=1e-6)
    assert n["q_after"] == pytest.approx(float(q_normed.norm()), rel=1e-5)
    assert n["k_before"] == pytest.approx(k.norm(dim=-1).tolist(), rel=1e-6)
    assert n["k_after"] == pytest.approx(k_normed.norm(dim=-1).tolist(), rel=1e-5)
    assert n["q_after"] == pytest.approx(math.sqrt(10), rel=1e-4) and n["q_before"] != pytest.approx(
        math.sqrt(10)
    )
    assert all(j in range(5 * (index // 5), index + 1) for j in n["keys"])  # only the keys the query sees


@pytest.mark.parametrize(("family", "layer", "head"), [("gemma4", 0, 1), ("gemma4", 1, 2), ("gemma3n", 1, 1)])
def test_v_norm_step_gives_each_values_length_before_and_after(
    request: pytest.FixtureRequest, family: str, layer: int, head: int
) -> None:
    loaded, _ = request.getfixturevalue(family)
    _, steps = _steps(loaded, 8, layer, head)
    n = steps["v_norm"].numbers
    attn = loaded.model.blocks[layer].attn
    kv = head // attn.group_size
    with torch.no_grad(), hs.trace(loaded.model, names=[f"blocks.{layer}.attn.hook_v*"]) as t:
        loaded.model(_ids(loaded))
    v = t[f"blocks.{layer}.attn.hook_v"][0, n["keys"], kv]  # (n_keys, d_head)
    normed = t[f"blocks.{layer}.attn.hook_v_normed"][0, n["keys"], kv]  # (n_keys, d_head)
    assert n["before"] == pytest.approx(v.norm(dim=-1).tolist(), rel=1e-6)
    assert n["after"] == pytest.approx(normed.norm(dim=-1).tolist(), rel=1e-5)
    assert n["after"] == pytest.approx([math.sqrt(attn.d_head)] * len(n["keys"]), rel=1e-4)


def test_k_eq_v_step_only_on_the_global_layer(gemma4: tuple) -> None:
    loaded, ref = gemma4
    assert "k_eq_v" not in _steps(loaded, 6, 0, 0)[1]
    assert ref.model.layers[0].self_attn.v_proj is not None and ref.model.layers[1].self_attn.v_proj is None
    n = _steps(loaded, 6, 1, 0)[1]["k_eq_v"].numbers
    assert n == {"max_gap": 0.0, "shared_storage": True}


def test_steps_print_within_the_width_and_travel_in_json(llama4: tuple, gemma4: tuple) -> None:
    cases = [(llama4[0], 0, {"chunk", "l2_norm"}), (llama4[0], 1, {"temperature"}),
             (gemma4[0], 1, {"v_norm", "k_eq_v"})]  # fmt: skip
    for loaded, layer, want in cases:
        e = explain(Words(loaded), SENTENCE, 9, layer=layer, head=0)
        assert want <= {s.scheme for s in e.scheme_steps}
        assert all(len(line) <= EXPLAIN_WIDTH for line in scheme_lines(e))
        d = json.loads(json.dumps(e.to_dict(top=2)))
        assert want <= {s["scheme"] for s in d["scheme_steps"]}
