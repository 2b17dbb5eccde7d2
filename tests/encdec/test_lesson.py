"""The lesson on an encoder-decoder: one output token through one cross-attention head, and a T5 head's
bucket bias, recomputed from the head's views and equal to what the model ran."""

from __future__ import annotations

import pytest
import torch

import headspace
from conftest import SIZES, inputs_of
from headspace.analysis.cross_lesson import explain_encdec


@pytest.mark.parametrize(
    ("kind", "stack", "attention", "layer"),
    [("bart", "decoder", "cross", 1), ("whisper", "decoder", "cross", 2), ("t5", "decoder", "cross", 0),
     ("t5", "encoder", "self", 1), ("t5", "decoder", "self", 2), ("marian", "decoder", "self", 1)],
)  # fmt: skip
def test_lesson_steps_equal_the_run(tiny, kind: str, stack: str, attention: str, layer: int) -> None:
    m = headspace.load(tiny(kind)[0])
    x = inputs_of(kind, batch=1)
    y = torch.randint(0, SIZES[kind]["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(2))
    lesson = explain_encdec(m, x, y, layer=layer, head=1, position=4, stack=stack, attention=attention)
    _, cache = m.run_with_cache(x, y)
    p = f"{stack}.blocks.{layer}.{'cross_attn' if attention == 'cross' else 'attn'}."
    pos = 4  # the query position, in the decoder or the encoder
    torch.testing.assert_close(
        torch.tensor(lesson.pattern), cache[p + "hook_pattern"][0, 1, pos], atol=1e-5, rtol=0
    )
    torch.testing.assert_close(torch.tensor(lesson.q), cache[p + "hook_q"][0, pos, 1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.tensor(lesson.z), cache[p + "hook_z"][0, pos, 1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        torch.tensor(lesson.out), cache[p + "hook_result"][0, pos, 1], atol=1e-5, rtol=1e-5
    )
    seq_k = cache[p + "hook_pattern"].shape[-1]
    assert len(lesson.keys) == len(lesson.values) == seq_k
    assert lesson.top[0][1] == pytest.approx(max(lesson.pattern))
    text = lesson.text()
    assert f"{stack} layer {layer} head 1, {attention}-attention" in text
    if kind == "t5" and attention == "self":
        assert lesson.bias is not None and "relative-position bias by bucket" in text
        table = getattr(m, stack).rel_bias
        for j, (bucket, bias) in enumerate(zip(lesson.buckets, lesson.bias)):
            assert bias == pytest.approx(float(table.weight[bucket, 1].detach()))
            assert bucket == int(table.bucket(torch.tensor(4 - j)))
        scores = cache[p + "hook_scores"][0, 1, 4]  # the model's scores include the bias
        visible = torch.isfinite(scores)
        torch.testing.assert_close(
            torch.tensor(lesson.scores)[visible], scores[visible], atol=1e-4, rtol=1e-4
        )
    else:
        assert lesson.bias is None


def test_lesson_refuses_bad_choices(tiny) -> None:
    m = headspace.load(tiny("bart")[0])
    x, y = inputs_of("bart", batch=1), torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"layer must be in \[0, 3\) for the decoder's 3 layers; got 3"):
        explain_encdec(m, x, y, layer=3, head=0)
    with pytest.raises(ValueError, match=r"head must be in \[0, 3\); got 7"):
        explain_encdec(m, x, y, layer=0, head=7)
    with pytest.raises(ValueError, match=r"\(stack, attention\) must be"):
        explain_encdec(m, x, y, layer=0, head=0, stack="encoder", attention="cross")


def test_cross_pattern_picture(tiny, tmp_path) -> None:
    from headspace.viz.cross_attention import plot_cross_pattern

    m = headspace.load(tiny("whisper")[0])
    x, y = inputs_of("whisper", batch=1), torch.tensor([[1, 4, 5, 6]])
    _, cache = m.run_with_cache(x, y)
    pattern = cache["decoder.blocks.2.cross_attn.hook_pattern"][0, 1]  # (4, 11)
    out = plot_cross_pattern(
        pattern, tmp_path / "cross.png", targets=["<s>", "a", "b", "c"], seconds_per_key=0.02,
        boundaries=[0.04, 0.1], title="decoder layer 2 head 1",
    )  # fmt: skip
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match=r"pattern must be \[seq_dec=3, seq_enc\]"):
        plot_cross_pattern(pattern, tmp_path / "bad.png", targets=["a", "b", "c"])
