"""``explain``'s learned-sink step (analysis/lesson/sink_steps.py) on a tiny gpt-oss checkpoint built by
transformers: the explained row's key weights sum to ``1 - sink``, with the head's sink logit and the
sink's mass for the token, checked against ``hook_sink`` and transformers' own attention weights; the
step is in the printed lesson and in ``--json``; a model without sinks has no such step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

import headspace as hs
from headspace.analysis.lesson.explain import explain
from headspace.analysis.lesson.sink_steps import sink_from_scores
from headspace.cli.render import EXPLAIN_WIDTH, render_explanation, scheme_lines

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, H, DH, DM, E, K, W = 53, 24, 2, 4, 6, 10, 3, 2, 3  # vocab, hidden, layers, heads, ..., window


def build_gpt_oss(folder: Path) -> Any:
    """A random gpt-oss (sliding then full layer) saved into ``folder``, every parameter random (the
    zero-initialised sinks too); returns transformers' model read back with eager attention."""
    torch.manual_seed(5)
    config = T.GptOssConfig(
        vocab_size=V, hidden_size=D, intermediate_size=DM, num_hidden_layers=L, num_attention_heads=H,
        num_key_value_heads=2, head_dim=DH, num_local_experts=E, num_experts_per_tok=K, sliding_window=W,
        max_position_embeddings=32, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, pad_token_id=0, eos_token_id=None,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = T.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1.0 if ("router" in name or "sinks" in name) else 0.3
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else scale * torch.randn_like(p))
    model.save_pretrained(folder)
    return T.GptOssForCausalLM.from_pretrained(
        folder, attn_implementation="eager", experts_implementation="eager"
    ).eval()


class Words:
    """A loaded tiny model with a tokenizer of one token per word (ids from a fixed rule)."""

    def __init__(self, loaded: Any) -> None:
        self.model, self.config, self.tokenizer = loaded.model, loaded.model.config, self

    def tokens(self, sentence: str) -> list[str]:
        return sentence.split()

    def tokenize_padded(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor([[(7 * n + 3) % V for n, _ in enumerate(t.split())] for t in texts])  # (1, seq)
        return ids, torch.ones_like(ids, dtype=torch.bool)


SENTENCE = "w0 w1 w2 w3 w4 w5 w6"


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    folder = tmp_path_factory.mktemp("gpt_oss")
    ref = build_gpt_oss(folder)
    return hs.load(folder), ref


@pytest.mark.parametrize(("layer", "head", "index"), [(0, 1, 6), (1, 3, 4), (1, 0, 0)])
def test_sink_step_sums_the_row_to_one_minus_the_sink(
    gpt_oss: tuple, layer: int, head: int, index: int
) -> None:
    loaded, ref = gpt_oss
    words = Words(loaded)
    e = explain(words, SENTENCE, index, layer=layer, head=head)
    steps = {s.scheme: s for s in e.scheme_steps}
    step = steps["sink"]
    ids, _ = words.tokenize_padded([SENTENCE])  # (1, seq)
    with torch.no_grad(), hs.trace(loaded.model, names=["*.hook_sink"]) as t:
        loaded.model(ids)
    hooked = float(t[f"blocks.{layer}.attn.hook_sink"][0, head, index])
    with torch.no_grad():  # transformers' key weights: the sink took what the row lacks
        want = ref(input_ids=ids, output_attentions=True).attentions[layer][0, head, index]  # (seq,)
    s_h = float(ref.model.layers[layer].self_attn.sinks.detach()[head])
    n = step.numbers
    assert n["sink_logit"] == pytest.approx(s_h, abs=0) and n["index"] == index
    assert n["sink_mass"] == pytest.approx(hooked, abs=1e-6)
    assert n["sink_mass"] == pytest.approx(1.0 - float(want.sum()), abs=1e-5)
    assert n["key_weights_sum"] == pytest.approx(sum(e.pattern), abs=1e-6)
    assert n["sink_mass"] + n["key_weights_sum"] == pytest.approx(1.0, abs=1e-12)
    assert n["sink_from_scores"] == pytest.approx(n["sink_mass"], abs=1e-5)
    assert 0.0 < n["sink_mass"] < 1.0  # the sink took mass and left some
    assert f"s_h = {s_h:.4g}" in step.lines[0] and f"1 - sink = {n['key_weights_sum']:.6f}" in step.lines[3]


def test_sink_from_scores_is_the_softmax_column_of_the_sink() -> None:
    scores = torch.tensor([0.5, -1.0, float("-inf"), 2.0])
    s = 1.25
    want = torch.exp(torch.tensor(s)) / (torch.exp(scores).sum() + torch.exp(torch.tensor(s)))
    assert sink_from_scores(scores, s) == pytest.approx(float(want), rel=1e-6)
    assert sink_from_scores(torch.full((3,), float("-inf")), 0.3) == pytest.approx(1.0)  # no key: all to sink


def test_sink_step_is_printed_within_the_width_and_carried_by_json(gpt_oss: tuple, capsys) -> None:
    e = explain(Words(gpt_oss[0]), SENTENCE, 5, layer=1, head=2)
    assert [s.scheme for s in e.scheme_steps][-2:] == ["sink", "experts"]  # experts: after the attention
    lines = scheme_lines(e)
    assert any("learned sink: the row sums to 1 - sink" in line for line in lines)
    assert all(len(line) <= EXPLAIN_WIDTH for line in lines)
    render_explanation(e)
    out = capsys.readouterr().out
    assert "learned sink logit s_h" in out and "so the key weights sum to 1 - sink" in out
    d = json.loads(json.dumps(e.to_dict(top=2)))
    sink = next(s for s in d["scheme_steps"] if s["scheme"] == "sink")
    assert set(sink["numbers"]) == {"sink_logit", "index", "sink_mass", "key_weights_sum", "sink_from_scores"}


def test_a_model_without_sinks_has_no_sink_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=V, hidden_size=D, num_hidden_layers=1, num_attention_heads=H,
                           intermediate_size=DM, max_position_embeddings=32, pad_token_id=0)  # fmt: skip
    T.LlamaForCausalLM(config).save_pretrained(tmp_path)
    e = explain(Words(hs.load(tmp_path)), SENTENCE, 3, layer=0, head=1)
    assert "sink" not in [s.scheme for s in e.scheme_steps]


def test_analyses_that_recompute_patterns_from_q_and_k_refuse_sinks_by_name(gpt_oss: tuple) -> None:
    from headspace.analysis.lesson.roles import head_roles

    model = gpt_oss[0].model
    ids = torch.randint(3, V, (1, 7))
    roles = head_roles(model, ids, chunk_size=None)  # the traced path reads hook_pattern: the key weights
    assert roles.current.shape == (L, H)
    # induction_scores takes the traced patterns there (tests/cli/test_every_family_cli.py, gpt_oss)
    for run in (lambda: head_roles(model, ids, chunk_size=4),):
        with pytest.raises(
            ValueError, match=r"layer 0 \(blocks.0.attn\) has learned sinks \(attention field 'sink'\)"
        ) as e:
            run()
        assert "\n" not in str(e.value)
