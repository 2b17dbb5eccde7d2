"""torch.compile(fullgraph=True) on whole models: Encoder and Decoder forward (padding, causal, rotary, GQA)
with no graph break, the eager numbers, no NaN on fully masked rows, and the token-range check kept inside
the compiled graph (headspace.inputs)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import headspace as hs

pytestmark = pytest.mark.usefixtures("single_thread")

B, S, V = 2, 7, 37


def _padding() -> torch.Tensor:
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[1, 4:] = False
    return pad


def _encoder() -> hs.Encoder:
    config = hs.ModelConfig(arch="encoder", vocab_size=V, d_model=24, n_layers=2, n_heads=3, max_seq_len=16)
    return hs.Encoder(config).eval()


def _decoder(kind: str) -> hs.Decoder:
    extra = {}
    if kind == "llama":
        extra = dict(positions="rotary", norm_kind="rmsnorm", mlp_kind="gated", act="silu", bias=False)
    kv_heads = 2 if kind == "llama" else None
    config = hs.ModelConfig(
        arch="decoder", vocab_size=V, d_model=24, n_layers=2, n_heads=4, n_kv_heads=kv_heads, max_seq_len=16,
        **extra,
    )  # fmt: skip
    return hs.Decoder(config).eval()


def _breaks(fn, *args) -> list[str]:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args)
    return [str(r.reason) for r in explained.break_reasons]


def _check(fn, tokens: torch.Tensor) -> None:
    with torch.no_grad():
        assert _breaks(fn, tokens) == []
        compiled = torch.compile(fn, fullgraph=True, backend="eager")
        out = compiled(tokens)
        assert torch.isfinite(out).all()
        assert_close(out, fn(tokens))
    torch._dynamo.reset()


@pytest.mark.parametrize("padded", [False, True])
def test_encoder_forward_compiles_without_graph_breaks(padded: bool) -> None:
    model = _encoder()
    pad = _padding() if padded else None
    _check(lambda t: model(t, key_padding=pad), torch.randint(0, V, (B, S)))


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_decoder_forward_compiles_without_graph_breaks(kind: str, padded: bool) -> None:
    model = _decoder(kind)
    pad = _padding() if padded else None
    _check(lambda t: model(t, key_padding=pad), torch.randint(0, V, (B, S)))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_decoder_left_padded_rows_with_positions_compile(kind: str) -> None:
    model = _decoder(kind)
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[0, :3] = False  # left padding, as generate() builds it
    positions = (pad.long().cumsum(1) - 1).clamp(min=0)
    _check(lambda t: model(t, key_padding=pad, positions=positions), torch.randint(0, V, (B, S)))


def test_fully_masked_rows_stay_finite_compiled() -> None:
    """A sample with no real token: every one of its query rows is dead; no NaN, eager or compiled."""
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[1] = False
    tokens = torch.randint(0, V, (B, S))
    for model in (_encoder(), _decoder("gpt2")):
        with torch.no_grad():
            want = model(tokens, key_padding=pad)
            got = torch.compile(lambda t, m=model: m(t, key_padding=pad), fullgraph=True, backend="eager")(
                tokens
            )
        assert torch.isfinite(want).all() and torch.isfinite(got).all()
        assert_close(got, want)
        torch._dynamo.reset()
    model = _encoder()
    x = torch.randn(B, S, 24, requires_grad=True)
    block = model.blocks[0]
    out = torch.compile(lambda x: block(x, key_padding=pad), fullgraph=True, backend="eager")(x)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    torch._dynamo.reset()


def test_token_ids_out_of_range_are_refused_inside_the_compiled_graph() -> None:
    model = _encoder()
    compiled = torch.compile(lambda t: model(t), fullgraph=True, backend="eager")
    with torch.no_grad():
        compiled(torch.randint(0, V, (B, S)))
        bad = torch.randint(0, V, (B, S))
        bad[1, 2] = V
        with pytest.raises(
            RuntimeError,
            match=rf"tokens contains an id outside \[0, vocab_size={V}\) \(checked in the compiled graph\)",
        ):
            compiled(bad)
        bad[1, 2] = -1
        with pytest.raises(RuntimeError, match="tokens contains an id outside"):
            compiled(bad)
    # eagerly the message names the value, as before
    with pytest.raises(ValueError, match=rf"tokens contains id {V}, outside \[0, vocab_size={V}\)"):
        model(torch.full((1, 3), V))
    # shape and dtype checks are the same compiled
    with pytest.raises(Exception, match=r"tokens must be 2-D \[batch, seq\]"):
        torch.compile(lambda t: model(t), fullgraph=True, backend="eager")(torch.zeros(3, dtype=torch.long))
    torch._dynamo.reset()


@pytest.mark.slow
def test_compiled_encoder_with_inductor_equals_eager() -> None:
    pytest.importorskip("torch._inductor")
    model = _encoder()
    tokens = torch.randint(0, V, (B, S))
    pad = _padding()
    with torch.no_grad():
        compiled = torch.compile(lambda t: model(t, key_padding=pad), fullgraph=True)
        try:
            got = compiled(tokens)
        except Exception as e:  # a machine without a C++ compiler cannot run inductor's CPU code
            if "compiler" in str(e).lower() or "cpp" in str(e).lower():
                pytest.skip(f"inductor cannot build here: {str(e)[:120]}")
            raise
        assert_close(got, model(tokens, key_padding=pad), rtol=1e-4, atol=1e-5)  # fused kernels reorder sums
    torch._dynamo.reset()


@pytest.mark.slow
def test_compile_benchmark_smoke_run(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util
    import json
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "compile.py"
    spec = importlib.util.spec_from_file_location("bench_compile_script", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert (
        module.output_path(None, False, "compile.json", module.RESULTS)
        == module.RESULTS / "local" / "compile.json"
    )
    with pytest.raises(SystemExit):
        module.main(["--save", "--out", str(tmp_path / "x.json")])
    out = tmp_path / "compile.json"
    argv = ["--backend", "eager", "--layers", "1", "--heads", "2", "--d-model", "16", "--vocab", "50"]
    argv += ["--batch", "2", "--seq", "8", "--context", "5", "--rounds", "1", "--out", str(out)]
    threads = torch.get_num_threads()
    try:
        assert module.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
        torch._dynamo.reset()
    doc = json.loads(out.read_text())
    assert [r["case"].split(" (")[0] for r in doc["rows"]] == [
        "encoder forward",
        "encoder infer",
        "decoder step",
    ]
    assert all(r["max_abs_diff"] <= 1e-5 for r in doc["rows"])
    printed = capsys.readouterr().out
    assert "| case | eager ms | compiled ms | speedup | max abs diff |" in printed
