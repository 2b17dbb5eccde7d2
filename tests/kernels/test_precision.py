"""Reduced precision: ``load(..., precision=)``, the int8 and bfloat16 products, float32 analyses, refusals.

No timing here: the speed of each precision is benchmarks/encode.py's and benchmarks/decode.py's.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import headspace
from headspace import Decoder, Encoder, ModelConfig, trace
from headspace.cli import cli
from headspace.cli import lesson as cli_lesson
from headspace.cli.options import MODEL_PRECISIONS
from headspace.kernels import cpu
from headspace.kernels import int8 as int8_kernels
from headspace.kernels.bf16 import BF16Weight, bf16_linear, round_to_bf16
from headspace.kernels.int8 import (
    Int8Weight,
    dequantize_weight,
    int8_linear,
    int8_linear_reference,
    quantize_activation,
    quantize_weight,
)
from headspace.model.models import PRECISIONS, check_precision

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.kernels]

#: Sentences of every kind the encoder meets: short, long, punctuation, numbers, other scripts.
SENTENCES = [
    "A man is playing a guitar.",
    "Someone is strumming a guitar, loudly, in the rain at night.",
    "The cat sat on the mat because it was tired.",
    "Quantum chromodynamics describes the strong interaction between quarks and gluons.",
    "Prices rose 3.5% in 2024, the third year in a row.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "東京は日本の首都です。",
    "?!",
    " ".join(["attention heads project into subspaces"] * 20),
]


@pytest.fixture(scope="module")
def minilm() -> headspace.PretrainedEncoder:
    return headspace.load("minilm")


@pytest.fixture(scope="module")
def minilm_at() -> dict:
    return {p: headspace.load("minilm", precision=p) for p in ("bfloat16", "int8")}


def _decoder(**kw) -> Decoder:
    """A tiny Llama-shaped decoder (rotary, RMSNorm, gated MLP, grouped-query attention)."""
    args = dict(
        arch="decoder", vocab_size=29, d_model=24, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=40,
        max_seq_len=32, positions="rotary", norm_kind="rmsnorm", mlp_kind="gated", act="silu", bias=False,
        final_ln=True, tie_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return Decoder(ModelConfig(**{**args, **kw})).eval()


# ------------------------------------------------------------------------------------------ the names
def test_precision_names_are_one_list_everywhere() -> None:
    assert PRECISIONS == MODEL_PRECISIONS == ("float32", "bfloat16", "int8")
    assert check_precision("int8") == "int8"


@pytest.mark.parametrize("bad", ["fp8", "bf16", "Float32", "", None, 8])
def test_bad_precision_names_are_refused_listing_the_valid_ones(bad) -> None:
    valid = re.escape("precision must be one of ['float32', 'bfloat16', 'int8']; got ")
    with pytest.raises((ValueError, TypeError), match=valid):
        headspace.load("minilm", precision=bad)
    # every loader refuses the name before it reads anything: the folder here does not even exist
    for loader in (headspace.load_bert, headspace.load_gpt2, headspace.load_llama, headspace.load_gguf):
        with pytest.raises((ValueError, TypeError), match=valid):
            loader("/no/such/folder", precision=bad)
    with pytest.raises((ValueError, TypeError), match=valid):
        _decoder().to_precision(bad)


@pytest.mark.parametrize(
    "args",
    [
        ["explain"],
        ["heads"],
        ["subspaces"],
        ["patch"],
        ["attribute"],
        ["generate", "no-such-run", "--prompt", "x"],
    ],
)
def test_cli_refuses_a_bad_precision_in_one_line(args: list[str], monkeypatch) -> None:
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before --precision was checked")

    monkeypatch.setattr(cli_lesson, "load_model", no_load)
    for flag in ("--precision", "--model-precision"):
        res = CliRunner().invoke(cli, [*args, flag, "fp8"])
        assert res.exit_code == 2, res.output
        name = "--precision"  # the option's name, whichever spelling was typed
        assert res.output.strip() == f"error: {name} must be one of float32, bfloat16, int8; got 'fp8'"


def test_view_keeps_precision_for_the_page_and_takes_model_precision() -> None:
    res = CliRunner().invoke(cli, ["view", "-o", "/tmp/x.html", "--model-precision", "int4"])
    assert res.exit_code == 2
    assert res.output.strip() == "error: --model-precision must be one of float32, bfloat16, int8; got 'int4'"
    res = CliRunner().invoke(cli, ["view", "-o", "/tmp/x.html", "--precision", "bfloat16"])
    assert res.exit_code == 2 and "float16" in res.output  # --precision is still the page's numbers


# --------------------------------------------------------------------------------- load(precision=)
def test_load_gives_the_documented_dtypes(minilm, minilm_at) -> None:
    assert minilm.precision == "float32"
    assert all(p.dtype == torch.float32 and type(p) is nn.Parameter for p in minilm.model.parameters())
    for precision, pre in minilm_at.items():
        assert pre.precision == precision == pre.model.precision
        for block in pre.model.blocks:
            a = block.attn
            for w in (a.qkv_weight, a.o_weight, block.mlp.fc_in.weight, block.mlp.fc_out.weight):
                assert w.dtype == torch.float32 and isinstance(w, nn.Parameter) and not w.requires_grad
                if precision == "int8":
                    assert (
                        type(w) is Int8Weight and w.q.dtype == torch.int8 and w.scale.dtype == torch.float32
                    )
                    torch.testing.assert_close(w.detach(), dequantize_weight(w.q, w.scale), rtol=0, atol=0)
                else:
                    assert type(w) is BF16Weight
                    if cpu.use_onednn_bf16():  # oneDNN's packed copy, where it runs bfloat16 products
                        assert w.packed is not None and w.packed.dtype == torch.bfloat16
                    else:
                        assert w.packed is None
                    assert torch.equal(w.detach(), round_to_bf16(w.detach()))  # bfloat16 numbers
        others = [p for n, p in pre.model.named_parameters() if "embed" in n or "ln" in n]
        assert others and all(p.dtype == torch.float32 for p in others)
        if precision == "bfloat16":  # every weight is a bfloat16 number, not only the products'
            assert all(torch.equal(p.detach(), round_to_bf16(p.detach())) for p in others)
        else:  # int8: what is not a product stays as loaded
            ref = dict(minilm.model.named_parameters())
            assert all(torch.equal(p, ref[n]) for n, p in pre.model.named_parameters() if "ln" in n)


def test_to_precision_is_idempotent_and_refuses_a_second_conversion() -> None:
    m = _decoder()
    assert m.to_precision("float32") is m and m.precision == "float32"
    m.to_precision("int8")
    assert m.to_precision("int8") is m and m.precision == "int8"
    with pytest.raises(ValueError, match=r"already int8; convert from float32 .*precision='bfloat16'"):
        m.to_precision("bfloat16")
    tied = _decoder().to_precision("bfloat16")
    assert type(tied.tok_embed.weight) is BF16Weight  # tied: the unembedding is the embedding table
    untied = _decoder(tie_embeddings=False).to_precision("int8")
    assert type(untied.lm_head.weight) is Int8Weight and type(untied.tok_embed.weight) is nn.Parameter


# ------------------------------------------------------------------------------------ the int8 product
def _no_ties(x: torch.Tensor) -> torch.Tensor:
    """``x`` nudged so that no value lies within 1e-3 of a rounding boundary of its token's quantisation
    (there float32 and float64 may round apart by one level)."""
    x = x.clone()
    for _ in range(5):
        lo = x.amin(1, keepdim=True).clamp(max=0).double()
        hi = x.amax(1, keepdim=True).clamp(min=0).double()
        s = (hi - lo) / 254
        t = x.double() / s + torch.round(-lo / s) + 0.5
        frac = t - t.floor()
        near = (frac < 1e-3) | (frac > 1 - 1e-3)
        if not near.any():
            return x
        x[near] += (0.01 * s.expand_as(x)[near]).float()
    raise AssertionError("could not move the inputs off the rounding boundaries")


@pytest.mark.parametrize("shape", [(7, 13), (2, 3, 64), (1, 1, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_equals_the_hand_written_dequantised_reference(shape, bias) -> None:
    torch.manual_seed(0)
    n_out, n_in = 11, shape[-1]
    w = torch.randn(n_out, n_in)
    w[3] = 0.0  # an all-zero row keeps scale 1 and gives zeros
    b = torch.randn(n_out) if bias else None
    x = torch.randn(*shape) * torch.rand(*shape[:-1], 1) * 4 - 0.3  # rows of different ranges, skewed
    x = _no_ties(x.reshape(-1, n_in)).reshape(shape)
    q, scale = quantize_weight(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127 and float(scale[3]) == 1.0
    torch.testing.assert_close(scale[:3], w[:3].abs().amax(1) / 127)
    assert float((dequantize_weight(q, scale) - w).abs().max()) <= float(scale.max()) / 2 + 1e-7
    weight = Int8Weight.from_float(w)
    y = int8_linear(x, weight, b)
    ref = int8_linear_reference(x, q, scale, b)  # float64, quantise -> dequantise -> multiply
    assert y.dtype == torch.float32 and y.shape == (*shape[:-1], n_out)
    # float32 against float64: the kernel's sums are exact int32; what is left is float32 rounding of
    # the scales and the rank-2 correction (measured <= 3e-6 relative to the largest output)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    assert torch.equal(y, F.linear(x, weight, b))  # F.linear with an Int8Weight is the kernel
    assert torch.equal(y[..., 3], torch.zeros_like(y[..., 3]) + (0 if b is None else b[3]))


def _skewed_rows(rows: int, n_in: int, seed: int) -> torch.Tensor:
    """Rows of different ranges and offsets, one all zeros, one all positive, off rounding boundaries."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n_in, generator=g) * torch.rand(rows, 1, generator=g) * 4 - 0.3
    if rows >= 3:
        x[1] = 0.0
        x[2] = x[2].abs() + 0.5
    return _no_ties(x)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int8_few_rows_quantisation_is_quantize_activation_bit_for_bit(rows) -> None:
    x = _skewed_rows(rows, 97, seed=rows)
    xq, s, z = quantize_activation(x)
    paths = [int8_kernels._quantize_few] + ([int8_kernels._quantize_row] if rows == 1 else [])
    for quantize in paths:
        shifted, s2, z2 = quantize(x)  # x_q - 128 as int8, for torch._int_mm
        assert shifted.dtype == torch.int8
        assert torch.equal(shifted.to(torch.int16) + 128, xq.to(torch.int16)), quantize.__name__
        assert torch.equal(torch.tensor(s2, dtype=torch.float32).reshape(-1), s)
        assert torch.equal(torch.tensor(z2, dtype=torch.float32).reshape(-1), z)


def test_int8_few_rows_path_is_chosen_as_documented() -> None:
    few = int8_kernels._few_rows
    assert few(1, 960, 576) and few(8, 960, 576) and few(8, 576, 1536)  # SmolLM2's decoding layers
    assert few(1, 49152, 576) and not few(8, 49152, 576)  # the unembedding: one row only
    assert not few(2, 2304, 768) and not few(4096, 384, 384)  # a larger weight; an encoder's rows
    assert not few(1, 5, 1)  # torch._int_mm gets one input feature wrong
    x, w = torch.randn(1, 1), torch.randn(5, 1)
    weight = Int8Weight.from_float(w)
    ref = int8_linear_reference(x, weight.q, weight.scale)
    torch.testing.assert_close(int8_linear(x, weight).double(), ref, rtol=1e-5, atol=1e-5)
    for rows in (1, 3):  # a NaN or an infinity in a row: the oneDNN path's result, as before
        x, weight = torch.randn(rows, 8), Int8Weight.from_float(torch.randn(5, 8))
        x[0, 2] = float("nan") if rows == 1 else float("inf")
        assert few(rows, 5, 8)
        y = int8_linear(x, weight)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(int8_kernels, "_few_rows", lambda *a: False)
            torch.testing.assert_close(y, int8_linear(x, weight), equal_nan=True)


def _check_few_rows(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, monkeypatch) -> None:
    """The few-row path equals the float64 reference as the oneDNN path does, and oneDNN's result to
    float32 rounding of the epilogue."""
    weight = Int8Weight.from_float(w)
    n_out, n_in = w.shape
    assert int8_kernels._few_rows(x.reshape(-1, n_in).shape[0], n_out, n_in)
    y = int8_linear(x, weight, b)
    ref = int8_linear_reference(x, weight.q, weight.scale, b)
    assert y.dtype == torch.float32 and y.shape == (*x.shape[:-1], n_out)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    assert torch.equal(y, F.linear(x, weight, b))
    with monkeypatch.context() as m:
        m.setattr(int8_kernels, "_few_rows", lambda *a: False)
        y_onednn = int8_linear(x, weight, b)
    # the same int32 sums; the epilogues round apart (measured <= 5.5e-7 of the largest output over 400
    # random shapes of 1-16 rows)
    assert float((y - y_onednn).abs().max()) <= 1e-6 * float(y_onednn.abs().max())


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("bias", [True, False])
def test_int8_few_rows_on_int_mm_equal_the_reference_and_onednn(rows, bias, monkeypatch) -> None:
    torch.manual_seed(rows)
    n_out, n_in = 40, 97
    w = torch.randn(n_out, n_in)
    w[5] = 0.0  # an all-zero weight row
    b = torch.randn(n_out) if bias else None
    _check_few_rows(_skewed_rows(rows, n_in, seed=rows), w, b, monkeypatch)


@settings(max_examples=25, deadline=None)
@given(
    lead=st.sampled_from([(1,), (2,), (3,), (8,), (1, 1), (2, 4), (16,)]),
    n_in=st.integers(2, 300),  # one input feature runs on oneDNN (see _few_rows)
    n_out=st.integers(1, 200),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_int8_few_rows_any_shape(lead, n_in, n_out, bias, seed) -> None:
    rows = 1
    for d in lead:
        rows *= d
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_out, n_in, generator=g)
    b = torch.randn(n_out, generator=g) if bias else None
    x = _skewed_rows(rows, n_in, seed).reshape(*lead, n_in)
    with pytest.MonkeyPatch.context() as m:
        _check_few_rows(x, w, b, m)


def test_int8_activation_quantisation_per_token() -> None:
    x = torch.tensor([[0.0, 0.0, 0.0], [-1.0, 0.5, 3.0], [2.0, 4.0, 1.0]])
    xq, s, z = quantize_activation(x)
    assert xq.dtype == torch.uint8 and s.tolist()[0] == 1.0  # an all-zero row
    torch.testing.assert_close(s[1:], torch.tensor([4.0 / 254, 4.0 / 254]))  # [lo, hi] includes 0
    back = (xq.float() - z[:, None]) * s[:, None]
    assert float((back - x).abs().max()) <= float(s.max()) / 2 + 1e-6
    assert int(xq[2].min()) >= int(z[2])  # a row of positives starts at its zero point


def test_int8_weight_reads_as_float32_everywhere_else() -> None:
    w = Int8Weight.from_float(torch.randn(6, 4))
    p = nn.Parameter(w, requires_grad=False)
    assert type(p) is Int8Weight and isinstance(p, nn.Parameter)
    v = p.view(2, 3, 4).transpose(1, 2)  # a per-head view: a plain float32 tensor of the same values
    assert type(v) is torch.Tensor and torch.equal(
        v, dequantize_weight(w.q, w.scale).view(2, 3, 4).transpose(1, 2)
    )
    c = copy.deepcopy(p)
    assert type(c) is Int8Weight and isinstance(c, nn.Parameter) and torch.equal(c, p)
    x = torch.randn(3, 4, requires_grad=True)
    y = F.linear(x, p)  # with autograd: float32 product of the dequantised weight, differentiable
    y.sum().backward()
    torch.testing.assert_close(x.grad, p.detach().sum(0).expand(3, 4))
    out = torch.empty(3, 6)
    with torch.no_grad():  # the workspace form (addmm / mm on weight.t()) runs the int8 kernel too
        torch.addmm(torch.zeros(6), x.detach(), p.t(), out=out)
        assert torch.equal(out, int8_linear(x.detach(), w, torch.zeros(6)))
        assert torch.equal(torch.mm(x.detach(), p.t()), int8_linear(x.detach(), w))


def test_bf16_linear_is_the_bfloat16_product() -> None:
    torch.manual_seed(0)
    w, b = torch.randn(9, 16), torch.randn(9)
    weight = BF16Weight.from_float(w)
    for shape in [(1, 16), (5, 16), (2, 3, 16)]:
        x = torch.randn(*shape)
        y = bf16_linear(x, weight, round_to_bf16(b))
        ref = F.linear(x.bfloat16(), w.bfloat16(), b.bfloat16()).float()  # plain bfloat16 linear
        assert y.dtype == torch.float32 and torch.equal(y, ref)
        assert torch.equal(F.linear(x, weight, round_to_bf16(b)), y)


# ----------------------------------------------------------------------- accuracy against float32
def test_embeddings_are_float32_and_close_to_float32(minilm, minilm_at) -> None:
    ref = minilm.encode(SENTENCES)
    # Measured minimum cosines. The 256 sentences of benchmarks/encode.py (its targets): bfloat16 0.99994
    # (>= 0.9999), int8 0.9980 (>= 0.995). Here the hardest is "?!" (3 tokens): bfloat16 0.99989, int8
    # 0.9934; every other sentence here >= 0.99996 and >= 0.9986. The limits leave a little room.
    for precision, worst, others in (("bfloat16", 0.9998, 0.9999), ("int8", 0.99, 0.995)):
        emb = minilm_at[precision].encode(SENTENCES)
        assert emb.dtype == torch.float32
        cos = (emb * ref).sum(1)
        assert float(cos.min()) >= worst
        assert float(torch.cat([cos[:7], cos[8:]]).min()) >= others
        states = minilm_at[precision](SENTENCES[:2])
        assert states.dtype == torch.float32


def test_patterns_and_analyses_come_back_float32(minilm, minilm_at) -> None:
    from headspace import analysis

    tokens, pad = minilm.tokenize(SENTENCES[2:3])
    with trace(minilm.model, names="*.attn.hook_pattern") as t32:
        minilm.model(tokens, key_padding=pad)
    for pre in minilm_at.values():
        with trace(pre.model, names="*.attn.hook_*") as t:
            pre.model(tokens, key_padding=pad)
        for name in ("blocks.3.attn.hook_pattern", "blocks.3.attn.hook_scores", "blocks.3.attn.hook_z"):
            assert t[name].dtype == torch.float32
        # measured max abs pattern difference to float32: bfloat16 4e-3, int8 2e-2 (layer 3)
        diff = float((t["blocks.3.attn.hook_pattern"] - t32["blocks.3.attn.hook_pattern"]).abs().max())
        assert diff <= 0.05
        for result in (
            analysis.head_roles(pre, SENTENCES[:2]),
            analysis.head_mixing(pre, SENTENCES[:2]),
            analysis.subspace_overlaps(pre, "q"),
        ):
            tensors = [getattr(result, f.name) for f in dataclasses.fields(result)]
            floats = [v for v in tensors if isinstance(v, torch.Tensor) and v.is_floating_point()]
            assert floats and all(v.dtype in (torch.float32, torch.float64) for v in floats)
        assert pre.model.blocks[0].attn.W_Q.dtype == torch.float32


@pytest.mark.parametrize("precision", ["bfloat16", "int8"])
def test_decoder_logits_and_generation_close_to_float32(precision) -> None:
    ref = _decoder()
    m = _decoder().to_precision(precision)
    tokens = torch.randint(0, 29, (2, 9))
    logits = m(tokens)
    assert logits.dtype == torch.float32
    # a random tiny model: measured max abs logit difference 0.02 (bfloat16) and 0.05 (int8)
    torch.testing.assert_close(logits, ref(tokens), rtol=0, atol=0.15)
    with trace(m, names="*.hook_pattern") as t:
        m(tokens)
    assert t["blocks.1.attn.hook_pattern"].dtype == torch.float32
    # the cached decoding step (decode_step) equals recomputing the sequence at this precision too
    out = m.generate(tokens, 5, temperature=0)
    assert torch.equal(out, m.generate(tokens, 5, temperature=0, use_cache=False))


@pytest.mark.slow
def test_smollm2_next_token_agreement(smollm2) -> None:
    """Over 300 tokens of the README: top-1 next-token agreement with float32 (benchmarks/decode.py
    measures the same over 2,000 tokens of README.md + docs/*.md)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    ids = torch.tensor([smollm2.tokenizer.encode_ids([text])[0][:300]])
    ref = smollm2.model(ids)[0].argmax(-1)
    # measured here: bfloat16 0.957, int8 0.870 (the benchmark's 2,000 tokens: see docs/benchmarks.md)
    for precision, limit in (("bfloat16", 0.93), ("int8", 0.83)):
        pre = headspace.load("smollm2", precision=precision)
        with torch.inference_mode():
            agree = float((pre.model(ids)[0].argmax(-1) == ref).float().mean())
        assert agree >= limit, (precision, agree)


def test_cli_runs_at_a_reduced_precision(minilm, monkeypatch) -> None:
    import json

    monkeypatch.setattr(cli_lesson, "load_model", lambda spec: headspace.load("minilm"))  # a fresh model
    res = CliRunner().invoke(cli, ["explain", "--precision", "int8", "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert (d["layer"], d["head"]) == (5, 11) and d["top"][0]["token"] == "animal"


def test_encoder_infer_and_forward_agree_at_each_precision(minilm_at) -> None:
    for pre in minilm_at.values():
        tokens, pad = pre.tokenize(SENTENCES[:4])
        with torch.no_grad():
            a = pre.model.infer(tokens, pad)
            b = pre.model(tokens, pad)
        torch.testing.assert_close(a[pad], b[pad], rtol=1e-4, atol=1e-4)  # the same products, two paths


def test_encoder_from_config_converts(minilm) -> None:
    m = Encoder(minilm.config).eval()
    m.load_state_dict(minilm.model.state_dict())
    m.to_precision("int8")
    tokens, pad = minilm.tokenize(SENTENCES[:2])
    with torch.no_grad():
        assert m(tokens, pad).dtype == torch.float32


@pytest.mark.parametrize("mode", ["float32 from many rows", "onednn", "fallback"])
def test_bf16_linear_on_many_rows_is_the_same_arithmetic(mode, monkeypatch) -> None:
    """Many rows may run as a float32 GEMM on the bfloat16-rounded values (CPUs whose bfloat16 dot
    products are slower than float32 FMAs, and every row count where oneDNN has no bfloat16 kernel):
    the same products, float32 sums in another order."""
    import headspace.kernels.bf16 as bf16

    if mode != "fallback" and not cpu.use_onednn_bf16():
        pytest.skip("oneDNN has no bfloat16 kernel on this CPU (or it is forced off): only the fallback runs")
    monkeypatch.setattr(cpu, "bf16_many_rows_in_float32", lambda: mode == "float32 from many rows")
    torch.manual_seed(0)
    w, b = torch.randn(9, 64), round_to_bf16(torch.randn(9))
    weight = BF16Weight.from_float(w)
    expected = {"float32 from many rows": bf16.MANY_ROWS, "onednn": -1, "fallback": 0}[mode]
    with cpu.force_fallback("bf16") if mode == "fallback" else contextlib.nullcontext():
        assert bf16.float32_rows(weight) == expected
        for lead in [(3, bf16.MANY_ROWS), (1,), (5,)]:
            x = torch.randn(*lead, 64)
            y = bf16_linear(x, weight, b)
            ref = F.linear(x.bfloat16(), w.bfloat16(), b.bfloat16()).float()
            assert y.dtype == torch.float32 and torch.equal(y, round_to_bf16(y))  # bfloat16 results
            # the sums' order may move a result by one bfloat16 step (2**-8 relative): measured <= 1 step
            torch.testing.assert_close(y, ref, rtol=2**-7, atol=1e-6)
            exact = F.linear(x.bfloat16().double(), w.bfloat16().double(), b.double())  # float64 sums
            assert float((y.double() - exact).abs().max()) <= 2**-7 * float(exact.abs().max())


def test_bf16_weights_converted_under_the_fallback_hold_no_packed_copy_and_run_it() -> None:
    torch.manual_seed(0)
    w = torch.randn(7, 32)
    with cpu.force_fallback("bf16"):
        weight = BF16Weight.from_float(w)
        assert weight.packed is None
    x = torch.randn(2, 32)
    # no packed copy: the float32 GEMM on the rounded values, whatever the CPU and outside the block
    ref = F.linear(x.bfloat16().float(), w.bfloat16().float()).bfloat16().float()
    assert torch.equal(bf16_linear(x, weight), ref)


def test_int8_is_right_on_every_branch_at_many_rows() -> None:
    """The many-row int8 product on the branch this CPU takes, and with the fallback forced (what a CPU
    without VNNI takes): within 1e-3 of the largest output of int8_linear_reference (a rounding-boundary
    input may move one activation by a level: measured <= 6.8e-4 of it)."""
    torch.manual_seed(0)
    w = Int8Weight.from_float(torch.randn(1536, 576) * 0.05)
    for forced in (False, True):
        with cpu.force_fallback("int8") if forced else contextlib.nullcontext():
            for rows in (1, 3, 8, 64, 512):
                x = torch.randn(rows, 576) * 3
                y = int8_linear(x, w)
                ref = int8_linear_reference(x, w.q, w.scale)
                assert float((y.double() - ref).abs().max()) <= 1e-3 * float(ref.abs().max()), (forced, rows)


def test_int8_fallback_is_the_same_maths_as_the_int32_kernels() -> None:
    """Where the int8 kernels are exact here, the float32 fallback agrees with them to float32 rounding."""
    if cpu.use_onednn_int8() == (False, False):
        pytest.skip("no exact int8 kernel on this CPU (or forced off): nothing to compare the fallback to")
    torch.manual_seed(1)
    w, b = Int8Weight.from_float(torch.randn(97, 61)), torch.randn(97)
    for rows in (1, 5, 300):
        x = torch.randn(rows, 61)
        fast = int8_linear(x, w, b)
        with cpu.force_fallback("int8"):
            slow = int8_linear(x, w, b)
        torch.testing.assert_close(slow, fast, rtol=1e-5, atol=1e-5)


def test_the_int8_probe_finds_a_saturating_kernel(monkeypatch) -> None:
    """int8_products_exact says False for a kernel that sums pairs in saturating int16 (stood in for by
    a wrapper that clamps as vpmaddubsw does), and True for the kernels of this CPU where they are exact."""
    real = torch._int_mm

    def saturating(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        # oneDNN's s8 x s8 without VNNI: the source shifted to u8 (+128), u8 x s8 pairs summed in
        # saturating int16 (vpmaddubsw), then the shift taken off again (128 sum_k b[k, n])
        u = a.long() + 128  # (m, k)
        pairs = (u.unflatten(1, (-1, 2))[..., None] * b.long().unflatten(0, (-1, 2))[None]).sum(2)
        acc = pairs.clamp(-32768, 32767).sum(1)  # (m, n): pairs saturated to int16, then summed
        return (acc - 128 * b.long().sum(0)).int()

    cpu.int8_products_exact.cache_clear()
    try:
        monkeypatch.setattr(torch, "_int_mm", saturating)
        assert cpu.int8_products_exact()[1] is False
        monkeypatch.setattr(torch, "_int_mm", real)
        cpu.int8_products_exact.cache_clear()
        a = torch.randint(-128, 128, (5, 64), dtype=torch.int8)
        b = torch.randint(-127, 128, (64, 3), dtype=torch.int8)
        exact = bool(torch.equal(real(a, b).long(), a.long() @ b.long()))
        assert not exact or cpu.int8_products_exact()[1] is True
    finally:
        cpu.int8_products_exact.cache_clear()


def test_forcing_fallbacks_is_checked(monkeypatch) -> None:
    with pytest.raises(ValueError, match="bf16, int8, prepack, native"):
        with cpu.force_fallback("bf17"):
            pass
    monkeypatch.setenv(cpu.ENV, "int8, prepack")
    assert cpu.forced("int8") and cpu.forced("prepack") and not cpu.forced("bf16")
    monkeypatch.setenv(cpu.ENV, "all")
    assert all(cpu.forced(n) for n in cpu.FALLBACKS)
    monkeypatch.setenv(cpu.ENV, "int9")
    with pytest.raises(ValueError, match=r"HEADSPACE_FORCE_FALLBACK .*got 'int9'"):
        cpu.forced("int8")
    monkeypatch.delenv(cpu.ENV)
    report = cpu.report()
    assert report["aten_capability"] == torch.backends.cpu.get_cpu_capability()
    assert report["onednn_bf16"] == torch.ops.mkldnn._is_mkldnn_bf16_supported()
