"""Direct logit attribution through the decoder, ``why`` for a cross-attention score and the atlas's
cross-attention statistics on tiny encoder-decoders (issue #40), against transformers' eager forward."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from tiny_tokenizer import add_tokenizer

import headspace
from conftest import inputs_of
from headspace.analysis.atlas.cross import cross_atlas, head_entropy
from headspace.analysis.causal.encdec_dla import encdec_logit_attribution
from headspace.analysis.circuits.encdec_why import why_cross_score
from headspace.analysis.lesson.cross_explain import CrossPatterns, monotonic_scores

DEC = torch.tensor([[1, 5, 7, 9, 4]])


def _theirs(theirs: object, kind: str, x: torch.Tensor) -> object:
    key = "input_features" if kind == "whisper" else "input_ids"
    with torch.no_grad():
        return theirs(**{key: x}, decoder_input_ids=DEC, output_attentions=True)  # type: ignore[operator]


@pytest.mark.parametrize("kind", ["t5", "t5-relu", "whisper"])
def test_dla_adds_up_to_transformers_logit(tiny, kind: str) -> None:
    folder, theirs = tiny(kind)
    m, x = headspace.load(str(folder)), inputs_of(kind, batch=1)
    want = _theirs(theirs, kind, x).logits[0, 3]  # type: ignore[attr-defined]
    for token in (4, 11, int(want.argmax())):
        a = encdec_logit_attribution(m, x, DEC, token, position=3)
        assert a.cross_heads.shape == a.self_heads.shape == (m.config.n_decoder_layers, m.config.n_heads)
        assert abs(a.total - float(want[token])) <= 1e-4 * float(want.abs().max())
        assert abs(a.total - a.logit) <= 1e-5 * float(want.abs().max())
    # a cross head's share is its own result's: zero that head's W_O and its share leaves the sum
    block = m.decoder.blocks[1].cross_attn
    with torch.no_grad():
        block.heads[0].W_O.zero_()
    b = encdec_logit_attribution(m, x, DEC, 11, position=3)
    assert b.cross_heads[1, 0] == 0.0 and abs(b.total - b.logit) <= 1e-4 * float(want.abs().max())


@pytest.mark.parametrize("kind", ["t5", "whisper"])
def test_why_cross_score_adds_up_to_transformers_pattern(tiny, kind: str) -> None:
    folder, theirs = tiny(kind)
    m, x = headspace.load(str(folder)), inputs_of(kind, batch=1)
    want = _theirs(theirs, kind, x).cross_attentions[2][0, 1, 3]  # type: ignore[attr-defined]
    splits = [why_cross_score(m, x, DEC, layer=2, head=1, query=3, key=j) for j in range(want.shape[0])]
    for s in splits:
        assert s.matrix.shape == (len(s.query_parts), len(s.key_parts))
        assert abs(s.total - s.score) <= 1e-5 * max(1.0, abs(s.score))
    assert splits[0].query_parts[0] == "decoder.embed" and splits[0].query_parts[-2] == "decoder.2.attn"
    assert splits[0].key_parts[-2] == f"encoder.{m.config.n_encoder_layers - 1}.mlp"
    got = torch.tensor([s.total for s in splits]).softmax(0)
    assert (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("kind", ["bart", "marian"])
def test_post_ln_models_are_refused_by_name(tiny, kind: str) -> None:
    m, x = headspace.load(str(tiny(kind)[0])), inputs_of(kind, batch=1)
    with pytest.raises(ValueError, match=r"needs a pre-LN model \(T5, Whisper\); .* is post-LN"):
        encdec_logit_attribution(m, x, DEC, 4)
    with pytest.raises(ValueError, match=r"needs a pre-LN model \(T5, Whisper\); .* is post-LN"):
        why_cross_score(m, x, DEC, layer=0, head=0)


def test_monotonic_score_tells_a_walking_head_from_a_sink_and_a_diffuse_one() -> None:
    rows, keys = 6, 30  # the walk steps 5 keys a row
    walk = torch.zeros(rows, keys)
    walk[torch.arange(rows), 5 * torch.arange(rows) + 2] = (
        1.0  # its widened path stretch holds the next row's peak: ~0.8
    )
    sink = torch.zeros(rows, keys)
    sink[:, 0] = 1.0
    flat = torch.full((rows, keys), 1 / keys)
    patterns = torch.stack([walk, sink, flat])[None] * 0.98 + 0.02 / keys  # [1 layer, 3 heads, rows, keys]
    from headspace.analysis.lesson.alignment import normalise

    p = CrossPatterns(torch.zeros(1), [0], [1] * (rows - 1), patterns, normalise(patterns, width=1), None)
    score = monotonic_scores(p)[0]
    assert score[0] > 0.7 and abs(score[1]) < 0.05 and abs(score[2]) < 0.05
    entropy = head_entropy(patterns)[0]
    assert entropy[0] < 0.2 and abs(entropy[2] - torch.log(torch.tensor(30.0))) < 1e-5


def test_cross_atlas_over_sentence_pairs(tiny, tmp_path: Path) -> None:
    folder, theirs = tiny("t5")
    for f in folder.iterdir():
        shutil.copy(f, tmp_path / f.name)
    add_tokenizer(tmp_path)
    m = headspace.load(str(tmp_path))
    corpus = [("w5 w9 w12", "w7 w8"), ("w3 w4 w30 w31", "w10 w11 w12"), "w6 w7"]
    atlas = cross_atlas(m, corpus)
    assert atlas.n_inputs == 3 and atlas.entropy.shape == atlas.monotonic.shape == (3, 3)
    with torch.no_grad():  # the first pair's entropy from transformers' own cross-attention
        out = theirs(input_ids=torch.tensor([[5, 9, 12, 1]]), decoder_input_ids=torch.tensor([[0, 7, 8, 1]]),
                     output_attentions=True)  # fmt: skip
    p = torch.stack(out.cross_attentions)[:, 0, :, :3]  # [L, H, 3 rows (predicting w7 w8 </s>), 4 keys]
    want = -(p * p.log()).sum(-1).mean(-1)
    assert (atlas.per_input[0][0] - want).abs().max() < 1e-5
    assert torch.allclose(atlas.entropy, torch.stack([e for e, _ in atlas.per_input]).mean(0))
    assert sorted(atlas.ranking()) == [(lay, h) for lay in range(3) for h in range(3)]
    with pytest.raises(ValueError, match=r"corpus item 1 must be a sentence or a \(source, target\)"):
        cross_atlas(m, ["w5", 3])
