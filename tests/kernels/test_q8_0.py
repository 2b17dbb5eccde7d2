"""Matrices held as Q8_0 blocks (headspace.kernels.q8_0): the blocks found exactly, the product from
them equal to torch.mm on the float32 matrix to float32 rounding at every vector width torch allows
here, and the decoding step's unembedding from them: the same greedy tokens and logits to rounding as
the float32 one, on random models and on Gemma-3-270M's own Q8_0 embedding read from the file."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from headspace import Decoder, ModelConfig
from headspace.decode import Stepper, describe, generation_caches
from headspace.decode.loop import choose_unembed_q8
from headspace.kernels import cpu, native, q8_0
from headspace.kernels.bf16 import BF16Weight
from headspace.kernels.prepack import MIN_PACK_BYTES

pytestmark = pytest.mark.kernels

needs_library = pytest.mark.skipif(
    native.compiler() is None or sys.platform == "win32",
    reason="q8_0_mm is in the native library (a C++ build)",
)


def q8_matrix(out: int, n_in: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float32 matrix [out, n_in] made of Q8_0 blocks as llama.cpp quantises (the block's largest
    magnitude 127), with its integers and float16 scales."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, n_in, generator=g)
    blocks = w.view(out, n_in // 32, 32)
    d = (blocks.abs().amax(dim=2) / 127).half().float()  # (out, n_in / 32): stored as float16
    q = torch.round(blocks / blocks.abs().amax(dim=2, keepdim=True) * 127).to(torch.int8)  # (out, blocks, 32)
    return (q.float() * d[..., None]).view(out, n_in), q.view(out, n_in), d


def built_blocks(out: int, n_in: int) -> tuple[torch.Tensor, q8_0.Q8Blocks]:
    """The native library built, and a Q8_0 matrix [out, n_in] with the blocks found of it."""
    assert native.build()
    w, _, _ = q8_matrix(out, n_in)
    blocks = q8_0.q8_0_blocks(w)
    assert blocks is not None
    return w, blocks


def levels() -> list[int]:
    """The vector widths torch reports this CPU can run (0 always)."""
    return list(range(q8_0.simd_level() + 1))


def test_blocks_are_found_exactly_and_only_where_they_exist() -> None:
    w, q, d = q8_matrix(37, 96)
    blocks = q8_0.q8_0_blocks(w)
    assert blocks is not None
    assert torch.equal(blocks.q, q) and torch.equal(blocks.d, d)
    assert torch.equal((blocks.q.float().view(37, 3, 32) * blocks.d[..., None]).view(37, 96), w)
    assert q8_0.q8_0_blocks(w) is blocks  # kept while the weight is unchanged
    w[5, 7] += 0.001  # an in-place edit: no longer a scale times integers
    assert q8_0.q8_0_blocks(w) is None
    assert q8_0.q8_0_blocks(torch.randn(11, 64)) is None  # ordinary float32 weights
    assert q8_0.q8_0_blocks(q8_matrix(5, 64)[0][:, :48]) is None  # columns not a multiple of 32
    assert q8_0.q8_0_blocks(q8_matrix(5, 64)[0].double()) is None
    assert q8_0.q8_0_blocks(BF16Weight.from_float(q8_matrix(5, 64)[0])) is None  # a carrier keeps its product
    zero = torch.zeros(3, 32)
    found = q8_0.q8_0_blocks(zero)
    assert found is not None and not found.q.any() and not found.d.any()


@needs_library
@pytest.mark.parametrize("rows", [1, 3, 8, 17])
def test_product_equals_torch_mm_to_rounding_at_every_width(rows: int) -> None:
    w, blocks = built_blocks(1031, 160)  # 1031 outputs: not a multiple of the kernel's tile of 4
    x = torch.randn(rows, 160)
    ref = torch.mm(x.double(), w.double().t())  # (rows, 1031)
    bound = 1e-5 * torch.mm(x.abs().double(), w.abs().double().t()).max()  # float32 rounding of the sums
    for level in levels():
        y = torch.ops.headspace.q8_0_mm(x, blocks.q, blocks.d, level)
        assert y.shape == (rows, 1031) and y.dtype == torch.float32
        assert (y.double() - ref).abs().max() <= bound, level
    plain = torch.mm(x, w.t())
    assert (plain.double() - ref).abs().max() <= bound  # the fallback, on the same scale


@needs_library
def test_product_does_not_depend_on_the_thread_count() -> None:
    _, blocks = built_blocks(4099, 64)
    x = torch.randn(2, 64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [torch.ops.headspace.q8_0_mm(x, blocks.q, blocks.d, lv) for lv in levels()]
        torch.set_num_threads(2)
        two = [torch.ops.headspace.q8_0_mm(x, blocks.q, blocks.d, lv) for lv in levels()]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


@needs_library
def test_bad_inputs_are_refused_by_name() -> None:
    _, b = built_blocks(7, 64)
    op = torch.ops.headspace.q8_0_mm
    with pytest.raises(RuntimeError, match=r"x must be float32 CPU rows \[n, in\]"):
        op(torch.randn(2, 64).double(), b.q, b.d, 0)
    with pytest.raises(RuntimeError, match="columns, a multiple of 32"):
        op(torch.randn(2, 32), b.q, b.d, 0)
    with pytest.raises(RuntimeError, match=r"d must be contiguous float32 \[7, 2\]"):
        op(torch.randn(2, 64), b.q, b.d[:, :1].contiguous(), 0)
    with pytest.raises(RuntimeError, match="level must be 0, 1 or 2"):
        op(torch.randn(2, 64), b.q, b.d, 3)


def q8_decoder(**kw) -> Decoder:
    """A small decoder whose tied embedding is Q8_0 blocks and at least MIN_PACK_BYTES (the size from
    which the step multiplies from them): vocab 16411 (prime) x d_model 512."""
    args = {"vocab_size": 16411, "d_model": 512, "n_layers": 2, "n_heads": 8, "d_mlp": 64, "max_seq_len": 31}
    model = Decoder(ModelConfig(arch="decoder", **{**args, **kw})).eval()
    w, _, _ = q8_matrix(16411, 512, seed=3)
    with torch.no_grad():
        model.tok_embed.weight.copy_(w)
    assert model.tok_embed.weight.numel() * 4 >= MIN_PACK_BYTES
    return model


@needs_library
@pytest.mark.parametrize(
    "kw",
    [
        {},  # GPT-2-like, tied
        {"positions": "rotary", "norm_kind": "rmsnorm", "mlp_kind": "gated", "act": "gelu_tanh",
         "bias": False, "n_kv_heads": 1, "norm": "sandwich", "norm_offset": 1.0, "qk_norm": "head",
         "sliding_window": 5, "layer_types": ["sliding", "full"], "embed_scale": 512**0.5},  # Gemma-3-like
    ],
)  # fmt: skip
def test_decoding_from_the_blocks_equals_the_float32_unembedding(kw: dict, automatic_choices: None) -> None:
    assert native.build()
    model = q8_decoder(**kw)
    if q8_0.simd_level() < 1:
        assert choose_unembed_q8(model, 1) is None  # plain C++ is slower than the GEMM: not chosen
        return
    blocks = choose_unembed_q8(model, 1)
    assert blocks is not None and choose_unembed_q8(model, q8_0.MAX_ROWS + 1) is None
    with cpu.force_fallback("q8_0"):
        assert choose_unembed_q8(model, 1) is None
    tokens = torch.randint(0, 16411, (3, 9))
    fast_step, plain_step = describe(model, unembed_q8=blocks), describe(model)
    assert fast_step is not None and plain_step is not None and fast_step.unembed.kind == "q8_0"
    fast, plain = Stepper(fast_step), Stepper(plain_step)
    caches_a, caches_b = generation_caches(model, 3, 20), generation_caches(model, 3, 20)
    with torch.inference_mode():
        for pos in range(9):
            a = fast.logits(tokens[:, pos : pos + 1], caches_a)
            b = plain.logits(tokens[:, pos : pos + 1], caches_b)
            assert (a - b).abs().max() <= 1e-5 * max(1.0, float(b.abs().max()))
        ref = model(tokens)[:, -1]  # (3, vocab)
    assert (a - ref).abs().max() <= 1e-4 * max(1.0, float(ref.abs().max()))
    greedy = model.generate(tokens, 12, temperature=0)
    with cpu.force_fallback("q8_0"):
        assert torch.equal(greedy, model.generate(tokens, 12, temperature=0))


@pytest.mark.slow
def test_gemma3_embedding_is_its_file_q8_0_blocks(gemma3, gemma3_file) -> None:
    """Gemma-3-270M's embedding (and unembedding) is the GGUF's Q8_0 tensor: the blocks found from the
    float32 weight are the file's own integers and float16 scales, read here with the gguf package."""
    import gguf

    reader = gguf.GGUFReader(str(gemma3_file))
    (t,) = [t for t in reader.tensors if t.name == "token_embd.weight"]
    assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
    raw = np.asarray(t.data).reshape(-1, 34)  # a block: float16 scale, then 32 int8
    d_file = torch.from_numpy(raw[:, :2].copy().view(np.float16).astype(np.float32)).view(262144, 20)
    q_file = torch.from_numpy(raw[:, 2:].copy().view(np.int8)).view(262144, 640)
    blocks = q8_0.q8_0_blocks(gemma3.model.tok_embed.weight)
    assert blocks is not None
    assert torch.equal(blocks.q, q_file)
    assert torch.equal(blocks.d, d_file)


@pytest.mark.slow
@needs_library
def test_gemma3_decodes_the_same_tokens_from_its_blocks(gemma3, automatic_choices: None) -> None:
    assert native.build()
    model = gemma3.model
    if q8_0.simd_level() >= 1:
        assert choose_unembed_q8(model, 1) is not None
    for ids in gemma3.tokenizer.encode_ids(["The capital of France is", "def add(a, b):"]):
        tokens = torch.tensor([ids])  # (1, seq): batch 1, the step's rows
        fast = model.generate(tokens, 6, temperature=0)
        with cpu.force_fallback("q8_0"):
            assert torch.equal(fast, model.generate(tokens, 6, temperature=0))


_OTHER_BUILD = """
import sys, torch
from safetensors.torch import load_file, save_file
from headspace.kernels import native
assert native.build(), native.status()
given = load_file(sys.argv[1])
torch.set_num_threads(2)
x, q, d = given["x"], given["q"], given["d"]
save_file({k: torch.ops.headspace.q8_0_mm(x, q, d, int(k)) for k in sys.argv[3:]}, sys.argv[2])
"""


@pytest.mark.slow
@needs_library
def test_the_build_without_openmp_gives_the_same_bits(tmp_path) -> None:
    """Built with -fopenmp (torch's libgomp, at::parallel_for: this session's library, where torch's
    runtime allows it) or without (threads of its own: built here in a child), each output is the same
    fixed-order sum: the two libraries' products are equal bit for bit."""
    import os
    import subprocess

    from safetensors.torch import load_file, save_file

    assert native.build()
    q = torch.randint(-127, 128, (4099, 96), dtype=torch.int8)
    d = torch.rand(4099, 3) + 0.01
    x = torch.randn(3, 96)
    save_file({"x": x, "q": q, "d": d}, tmp_path / "in.safetensors")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        here = {str(lv): torch.ops.headspace.q8_0_mm(x, q, d, lv) for lv in levels()}
    finally:
        torch.set_num_threads(before)
    env = dict(os.environ, HEADSPACE_CACHE=str(tmp_path / "cache"), HEADSPACE_NATIVE_OPENMP="0")
    out = tmp_path / "out.safetensors"
    cmd = [sys.executable, "-c", _OTHER_BUILD, str(tmp_path / "in.safetensors"), str(out), *here]
    subprocess.run(cmd, env=env, check=True, timeout=600)
    there = load_file(out)
    built = {p.name for p in (tmp_path / "cache").rglob("*.so")}  # the child's: built without -fopenmp
    assert built and (
        native.library_path().name not in built or not native.openmp_flags(native.compiler() or "")
    )
    assert there.keys() == here.keys() and all(torch.equal(here[k], there[k]) for k in here)
