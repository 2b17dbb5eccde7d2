"""``explain``'s ALiBi step (analysis/lesson/scheme_steps.py, ``"alibi"``) on tiny BLOOM and MPT checkpoints.

The checkpoints are built and saved by transformers 5 itself (6 heads: BLOOM's slopes past the largest power
of 2; MPT with its own ``softmax_scale``) and read back with ``headspace.load``. Every number of the step is
checked against the traced ``hook_scores`` of an independent forward, against ``head.alibi_slope`` /
``head.alibi_bias`` and against the slopes transformers builds; a model without ALiBi gets no such step.
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
from headspace.cli.render import EXPLAIN_WIDTH, render_explanation, scheme_lines

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, H = 53, 48, 2, 6  # vocab, hidden, layers, heads (d_head 8)
ARCHS: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "bloom": (T.BloomConfig, T.BloomForCausalLM, dict(vocab_size=V, hidden_size=D, n_layer=L, n_head=H)),
    "mpt": (T.MptConfig, T.MptForCausalLM, dict(
        vocab_size=V, d_model=D, n_layers=L, n_heads=H, max_seq_len=40, attn_config={"softmax_scale": 0.3})),
    "gpt2": (T.GPT2Config, T.GPT2LMHeadModel, dict(
        vocab_size=V, n_embd=D, n_layer=L, n_head=H, n_positions=40)),
}  # fmt: skip


def _build(arch: str, folder: Path) -> Any:
    config_cls, model_cls, kw = ARCHS[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(initializer_range=0.3, pad_token_id=0, **kw)).eval()
    with torch.no_grad():  # norms and biases away from their start
        for name, p in model.named_parameters():
            if "norm" in name or "ln" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Any]]:
    out = {}
    for arch in ARCHS:
        folder = tmp_path_factory.mktemp(arch)
        ref = _build(arch, folder)
        out[arch] = (hs.load(folder), ref)
    return out


class Words:
    """A loaded tiny model with a tokenizer of one token per word (ids from a fixed rule)."""

    def __init__(self, loaded: Any) -> None:
        self.model, self.config, self.tokenizer = loaded.model, loaded.model.config, self

    def tokens(self, sentence: str) -> list[str]:
        return sentence.split()

    def tokenize_padded(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor([[(7 * n + 3) % V for n, _ in enumerate(t.split())] for t in texts])  # (1, seq)
        return ids, torch.ones_like(ids, dtype=torch.bool)


SENTENCE = " ".join(f"w{i}" for i in range(9))
IDS = torch.tensor([[(7 * n + 3) % V for n in range(9)]])  # (1, 9): what Words gives the sentence


def _ref_slopes(arch: str, ref: Any) -> list[float]:
    """The slopes transformers itself builds for ``ref`` (its alibi tensor at key position 1)."""
    if arch == "bloom":
        from transformers.models.bloom.modeling_bloom import build_alibi_tensor

        alibi = build_alibi_tensor(torch.ones(1, 2), H, torch.float32)  # (H, 1, 2): m_h * j
        return [float(a) for a in alibi[:, 0, 1]]
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    alibi = build_mpt_alibi_tensor(H, 2)  # (H, 1, 2): m_h * (j - 1)
    return [float(a[0, 1] - a[0, 0]) for a in alibi]


@pytest.mark.parametrize("arch", ["bloom", "mpt"])
@pytest.mark.parametrize(("layer", "head", "index"), [(1, 4, 8), (0, 1, 5)])
def test_alibi_step_shows_the_slope_and_each_top_keys_score_before_and_after_the_bias(
    saved: dict, arch: str, layer: int, head: int, index: int
) -> None:
    loaded, ref = saved[arch]
    e = explain(Words(loaded), SENTENCE, index, layer=layer, head=head)
    step = {s.scheme: s for s in e.scheme_steps}["alibi"]
    attn_head = loaded.model.blocks[layer].attn.heads[head]
    n = step.numbers
    assert n["slope"] == attn_head.alibi_slope == pytest.approx(_ref_slopes(arch, ref)[head], rel=1e-6)
    assert n["query"] == index and n["keys"] == [a.index for a in e.top if a.index <= index]
    assert n["delta"] == [index - j for j in n["keys"]] and len(n["keys"]) == 5
    assert n["bias"] == [float(attn_head.alibi_bias(d)) for d in n["delta"]]
    assert all(b < 0 for b, d in zip(n["bias"], n["delta"]) if d > 0)
    name = f"blocks.{layer}.attn.hook_scores"
    with hs.trace(loaded.model, names=[name]) as t:
        loaded.model(IDS)
    row = t[name][0, head, index]  # (9,): the scaled score plus the bias, what softmax reads
    torch.testing.assert_close(torch.tensor(n["after"]), row[n["keys"]].float(), rtol=1e-5, atol=1e-5)
    want_before = row[n["keys"]].double() + n["slope"] * torch.tensor(n["delta"], dtype=torch.float64)
    torch.testing.assert_close(
        torch.tensor(n["before"], dtype=torch.float64), want_before, rtol=1e-5, atol=1e-5
    )
    lines = scheme_lines(e)
    assert any(line.startswith("2") and "ALiBi" in line and f"{n['slope']:.6g}" in line for line in lines)
    j, d = n["keys"][0], n["delta"][0]
    assert any(f"key {j} (i - j = {d}): {n['before'][0]:.4f}" in line for line in lines)
    assert all(len(line) <= EXPLAIN_WIDTH for line in lines)
    carried = json.loads(json.dumps(e.to_dict()))["scheme_steps"]
    assert next(s for s in carried if s["scheme"] == "alibi")["numbers"] == n


def test_the_scores_step_says_its_scores_include_the_bias(saved: dict, capsys: pytest.CaptureFixture) -> None:
    render_explanation(explain(Words(saved["mpt"][0]), SENTENCE, 6, layer=1, head=3))
    assert "- m_h (i - j) (ALiBi, 2c)" in capsys.readouterr().out
    render_explanation(explain(Words(saved["gpt2"][0]), SENTENCE, 6, layer=1, head=3))
    assert "ALiBi" not in capsys.readouterr().out


def test_first_token_keeps_only_its_own_key_and_a_model_without_alibi_has_no_step(saved: dict) -> None:
    e = explain(Words(saved["bloom"][0]), SENTENCE, 0, layer=1, head=2)
    n = {s.scheme: s for s in e.scheme_steps}["alibi"].numbers
    assert n["keys"] == [0] and n["delta"] == [0] and n["before"] == n["after"]  # masked keys are left out
    plain = explain(Words(saved["gpt2"][0]), SENTENCE, 4, layer=1, head=2)
    assert "alibi" not in {s.scheme for s in plain.scheme_steps}
