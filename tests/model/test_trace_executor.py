"""Trace recording is an executor of its own (issue 37): the block's and the attention layer's code hold
only their maths; a fully recorded block's attention is run by the trace's executor
(``headspace.model.recorded``) from the layer's description and weights, bit for bit the forward."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch

import headspace as hs
from headspace import MultiHeadAttention
from headspace.model.block import TransformerBlock
from headspace.nn.positions import Rotary

SRC = Path(__file__).resolve().parents[2] / "src" / "headspace"
B, S, D, H, HKV, DH = 2, 40, 35, 7, 1, 6

#: what the trace's executor alone may mention
RECORDING_WORDS = re.compile(r"deferred|recomputed|noting|source_of", re.IGNORECASE)


@pytest.mark.parametrize("path", ["model/block.py", "attention/layer.py"])
def test_the_block_and_the_layer_hold_no_recording_machinery(path: str) -> None:
    text = (SRC / path).read_text(encoding="utf-8")
    found = [
        f"{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if RECORDING_WORDS.search(line)
    ]
    assert not found, f"{path} mentions the trace's deferred/recomputed values: {found}"


def test_the_block_forward_is_short() -> None:
    lines, _ = inspect.getsourcelines(TransformerBlock.forward)
    assert len(lines) <= 30, f"TransformerBlock.forward is {len(lines)} lines"


def test_attention_files_and_functions_fit() -> None:
    """No file of attention/ over 700 lines, no function there over 80."""
    too_long = []
    for path in sorted((SRC / "attention").glob("*.py")):
        text = path.read_text(encoding="utf-8")
        if len(text.splitlines()) > 700:
            too_long.append(f"{path.name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if n > 80:
                    too_long.append(f"{path.name}:{node.lineno} {node.name}: {n} lines")
    assert not too_long, too_long


def gemma_like(**attention: object) -> TransformerBlock:
    torch.manual_seed(0)
    block = hs.TransformerBlock(
        D, H, 23, d_head=DH, n_kv_heads=HKV, norm="sandwich", norm_kind="rmsnorm", mlp_kind="gated",
        act="gelu_tanh", bias=False, qk_norm="head", rotary=Rotary(DH, base=100.0), norm_offset=1.0,
        **attention,
    ).eval()  # fmt: skip
    with torch.no_grad():
        for p in block.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return block


def test_a_description_edited_by_hand_is_what_the_trace_executor_runs() -> None:
    """A block whose window and scale were set by editing its description: the fully recorded trace
    (q, k, every value recomputed) equals the stored trace and the block built with them, bit for bit."""
    built = gemma_like(window=5, scale=0.3)
    edited = gemma_like()
    attention = dataclasses.replace(edited.spec.attention, window=5, scale=0.3)
    edited.spec = dataclasses.replace(edited.spec, attention=attention)
    x = torch.randn(B, S, D)
    with torch.no_grad():
        with hs.trace(built, detach=False) as reference:
            want = built(x, is_causal=True)
        with hs.trace(edited) as lazy:
            got = edited(x, is_causal=True)
        with hs.trace(edited, detach=False) as stored:
            edited(x, is_causal=True)
    assert torch.equal(got, want)
    assert lazy.is_deferred("attn.hook_q") and lazy.is_deferred("attn.hook_pattern")  # the executor ran
    for name in stored:
        assert torch.equal(lazy[name], stored[name].detach()), name
        assert torch.equal(lazy[name], reference[name]), name
    assert float(lazy.pattern(0)[0, 0, 20, :15].abs().sum()) == 0.0  # outside the window


def test_a_fully_recorded_block_runs_its_attention_without_the_layer_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trace's executor runs the attention itself (from the description and the weights); a partial
    trace runs the layer's own forward, hook points firing."""
    calls: list[int] = []
    original = MultiHeadAttention.forward

    def spy(self: MultiHeadAttention, *args: object, **kwargs: object) -> object:
        calls.append(id(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(MultiHeadAttention, "forward", spy)
    block = gemma_like(window=5)
    x = torch.randn(B, S, D)
    with torch.no_grad():
        with hs.trace(block) as t:
            got = block(x, is_causal=True)
        assert calls == [] and t.is_deferred("attn.hook_q")
        with hs.trace(block, "attn.hook_pattern") as partial:
            want = block(x, is_causal=True)
        assert calls == [id(block.attn)]
    torch.testing.assert_close(got, want)  # (the untraced MLP rounds apart from the traced one)
    assert torch.equal(partial.pattern(0), t.pattern(0))
