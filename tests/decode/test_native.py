"""The native decoding step (headspace.kernels.native): every block of a cached step in one C++ call,
bit for bit the Python step (headspace.decode.python.layer_rows), Gemma 3's and its relatives'
operations included, built once, and a Python fallback wherever it cannot be built or has no form
for the model."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headspace import Decoder, ModelConfig
from headspace.decode import DecodeStep, Stepper, describe, generation_caches, named_fields
from headspace.decode.native import native_form
from headspace.kernels import native, prepack
from headspace.nn.norms import RMSNorm

pytestmark = pytest.mark.kernels

B, H, DH, V, L = 3, 7, 5, 13, 2  # batch, n_heads, d_head, vocab, layers: distinct primes

needs_compiler = pytest.mark.skipif(
    native.compiler() is None or sys.platform == "win32", reason="the native step needs a C++ compiler"
)

CONFIGS = [
    {},  # GPT-2-like: learned positions, LayerNorm, biases everywhere, plain gelu_tanh MLP
    {"positions": "rotary", "norm_kind": "rmsnorm", "mlp_kind": "gated", "act": "silu", "bias": False,
     "n_heads": 6, "n_kv_heads": 2, "d_model": 36},  # Llama-like, grouped-query (d_head 6)
    {"positions": "rotary", "norm_kind": "rmsnorm", "mlp_kind": "gated", "act": "gelu", "bias": False,
     "qkv_bias": True, "n_heads": 6, "n_kv_heads": 3, "d_model": 36, "tie_embeddings": False},  # Qwen2-like
    {"positions": "rotary", "rope_interleaved": True, "rotary_fraction": 0.25, "norm_kind": "layernorm",
     "act": "relu", "n_heads": 2, "n_kv_heads": 1, "d_model": 52},  # interleaved, 6 of d_head 26
]  # fmt: skip


LLAMA = {"positions": "rotary", "norm_kind": "rmsnorm", "mlp_kind": "gated", "bias": False, "n_heads": 6,
         "d_model": 36}  # fmt: skip
GEMMA_LIKE = [  # as tests/decode/test_decoding.py's
    # Gemma 3: sandwich norms of 1 + w, QK-norm over d_head, one key/value head, a window of 3 on the
    # first layer (crossed) with its own rotary base, scaled embeddings and scores; Gemma 2's
    # final-logit soft-capping on top
    {**LLAMA, "act": "gelu_tanh", "norm": "sandwich", "norm_offset": 1.0, "qk_norm": "head",
     "n_kv_heads": 1, "sliding_window": 3, "layer_types": ["sliding", "full"], "rope_local_theta": 100.0,
     "embed_scale": 36**0.5, "query_pre_attn_scalar": 17, "final_softcap": 3.0},
    # OLMo 2: norms after each sublayer only, QK-norm over all heads at once; Mistral's window on both
    {**LLAMA, "act": "silu", "norm": "post_sublayer", "qk_norm": "all", "n_kv_heads": 3, "sliding_window": 4},
    # SmolLM3: a first layer without positions (NoPE), the step's own rotation from the second; a
    # window of 7 that the steps fill (written in place) and then cross (the oldest key dropped)
    {**LLAMA, "act": "silu", "n_kv_heads": 2, "nope_layers": [0], "sliding_window": 7},
]  # fmt: skip


def decoder(**kw) -> Decoder:
    args = {"vocab_size": V, "d_model": H * DH, "n_layers": L, "n_heads": H, "d_mlp": 11, "max_seq_len": 23}
    return Decoder(ModelConfig(arch="decoder", **{**args, **kw})).eval()


def native_step(model: Decoder, pack_rows: int | None = None) -> DecodeStep:
    """The model's described step, which must have a native form."""
    step = describe(model, pack_rows)
    assert step is not None and native_form(step) is not None
    return step


def assert_native_equals_python(model: Decoder, step: DecodeStep, tokens: torch.Tensor, primed: int) -> None:
    """After ``tokens[:, :primed]``, each later token's step logits on the native and the Python
    backend, on caches of their own, are equal bit for bit, and so are the caches' contents."""
    batch, n = tokens.shape
    ours, ref = generation_caches(model, batch, n), generation_caches(model, batch, n)
    model(tokens[:, :primed], kv_caches=ours)
    model(tokens[:, :primed], kv_caches=ref)
    fast, slow = Stepper(step, "native"), Stepper(step, "python")
    for i in range(primed, n):
        a = fast.logits(tokens[:, i : i + 1], ours)  # (batch, V)
        b = slow.logits(tokens[:, i : i + 1], ref)
        assert fast.backend_used == "native" and slow.backend_used == "python"
        assert a.shape == b.shape and torch.equal(a, b)
        assert ours[0].length == ref[0].length == i + 1
    for c, r in zip(ours, ref):  # the new keys (rotated) and values written where the Python step writes
        assert torch.equal(c.k, r.k) and torch.equal(c.v, r.v)


@pytest.fixture(scope="module")
def built() -> None:
    if not native.build():
        pytest.fail(f"the native step did not build: {native.status()}")


@needs_compiler
@pytest.mark.parametrize("kw", CONFIGS)
@torch.no_grad()
def test_native_steps_are_bit_for_bit_the_python_steps(kw: dict, built: None) -> None:
    torch.manual_seed(0)
    model = decoder(**kw)
    for p in model.parameters():  # no zero biases or unit norms: every parameter must enter
        p.add_(0.1 * torch.randn_like(p))
    assert_native_equals_python(model, native_step(model), torch.randint(0, V, (B, 11)), 4)


@needs_compiler
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("kw", GEMMA_LIKE, ids=["gemma3", "olmo2", "smollm3"])
@torch.no_grad()
def test_native_steps_of_gemma_and_its_relatives_are_bit_for_bit_the_python_steps(
    kw: dict, batch: int, built: None
) -> None:
    """QK-norm (per head, over all heads), 1 + w norms, sandwich and post-sublayer norms, per-layer
    rotary bases and NoPE, sliding windows filled in place and then crossed (the 2 + 9 positions pass
    every window): logits and every cache's contents, the windowed caches' too."""
    torch.manual_seed(8)
    model = decoder(**kw)
    for p in model.parameters():
        p.add_(0.2 * torch.randn_like(p))
    step = native_step(model)
    assert any(layer.window for layer in step.layers)
    assert not any(c.stack for c in generation_caches(model, 1, 4))  # a window's cache is its own
    assert_native_equals_python(model, step, torch.randint(0, V, (batch, 11)), 2)
    prompt = torch.randint(0, V, (batch, 3))
    a = model.generate(prompt, 8, temperature=0, native=True)
    assert torch.equal(a, model.generate(prompt, 8, temperature=0, native=False))
    assert torch.equal(a, model.generate(prompt, 8, temperature=0, use_cache=False))


@needs_compiler
def test_with_gradients_a_windowed_step_is_the_python_steps(built: None) -> None:
    """With gradients on, a windowed cache keeps its keys' history (KVCache._append_windowed): the
    native backend hands such a call to the Python step, so the caches stay what that step makes them."""
    torch.manual_seed(9)
    model = decoder(**GEMMA_LIKE[2])
    tokens = torch.randint(0, V, (2, 10))
    ours, ref = model.make_kv_caches(2, 10), model.make_kv_caches(2, 10)
    model(tokens[:, :2], kv_caches=ours)
    model(tokens[:, :2], kv_caches=ref)
    step = native_step(model)
    fast, slow = Stepper(step, "native"), Stepper(step, "python")
    for i in range(2, 10):
        a, b = fast.logits(tokens[:, i : i + 1], ours), slow.logits(tokens[:, i : i + 1], ref)
        assert torch.equal(a, b) and a.requires_grad
    for c, r in zip(ours, ref):
        assert torch.equal(c.k, r.k) and len(c._k_parts) == len(r._k_parts) == 1
    a.sum().backward()  # through the kept keys' history
    assert model.blocks[0].attn.qkv_weight.grad is not None


@st.composite
def configs(draw: st.DrawFn) -> dict:
    """A decoder the native step covers: any head grouping, d_head, rotary pairing and fraction, norm,
    MLP, activation and bias switches; pre, sandwich or post-sublayer norms; with RMSNorm, QK-norm
    and Gemma's 1 + w; sliding windows on some layers, their own rotary base, NoPE layers."""
    n_kv = draw(st.sampled_from([1, 2, 3]))
    n_heads = n_kv * draw(st.sampled_from([1, 2, 3]))
    d_head = draw(st.sampled_from([2, 4, 6, 10, 14]))
    kw: dict = {
        "n_heads": n_heads, "n_kv_heads": n_kv, "d_model": n_heads * d_head,
        "n_layers": draw(st.integers(1, 3)), "d_mlp": draw(st.sampled_from([5, 7, 13])),
        "norm_kind": draw(st.sampled_from(["rmsnorm", "layernorm"])),
        "mlp_kind": draw(st.sampled_from(["plain", "gated"])),
        "act": draw(st.sampled_from(["silu", "relu", "gelu", "gelu_tanh"])),
        "bias": draw(st.booleans()),
    }  # fmt: skip
    if draw(st.booleans()):
        kw["qkv_bias"] = draw(st.booleans())
    positions = draw(st.sampled_from(["rotary", "learned", "none"]))
    kw["positions"] = positions
    if positions == "rotary":
        fractions = [f for f in (1.0, 0.5) if int(d_head * f) % 2 == 0 and int(d_head * f) >= 2]
        kw["rotary_fraction"] = draw(st.sampled_from(fractions))
        kw["rope_interleaved"] = draw(st.booleans())
    kw["norm"] = draw(st.sampled_from(["pre", "sandwich", "post_sublayer"]))
    if kw["norm_kind"] == "rmsnorm":
        kw["qk_norm"] = draw(st.sampled_from([None, "head", "all"]))
        kw["norm_offset"] = draw(st.sampled_from([0.0, 1.0]))
    if draw(st.booleans()):
        kw["sliding_window"] = draw(st.integers(1, 5))  # crossed by the 9 positions
        kw["layer_types"] = draw(st.lists(st.sampled_from(["sliding", "full"]), min_size=kw["n_layers"],
                                          max_size=kw["n_layers"]))  # fmt: skip
        if positions == "rotary" and draw(st.booleans()):
            kw["rope_local_theta"] = 100.0
    if positions == "rotary":
        kw["nope_layers"] = draw(st.lists(st.integers(0, kw["n_layers"] - 1), max_size=1))
    return kw


@pytest.mark.slow
@needs_compiler
@settings(max_examples=25, deadline=None)
@given(kw=configs(), batch=st.integers(1, 3), seed=st.integers(0, 2**16))
@torch.no_grad()
def test_native_steps_equal_python_steps_on_any_covered_decoder(kw: dict, batch: int, seed: int) -> None:
    assert native.build()
    torch.manual_seed(seed)
    model = decoder(**kw)
    for p in model.parameters():
        p.add_(0.3 * torch.randn_like(p))
    assert_native_equals_python(model, native_step(model), torch.randint(0, V, (batch, 9)), 3)


@pytest.mark.slow
@needs_compiler
@pytest.mark.parametrize("kw", CONFIGS[:2])
def test_generate_native_equals_generate_python(kw: dict, built: None) -> None:
    torch.manual_seed(1)
    model = decoder(**kw)
    prompt = torch.randint(0, V, (B, 4))
    for temperature in (0, 0.8):
        a = model.generate(prompt, 9, temperature=temperature, seed=3, native=True)
        b = model.generate(prompt, 9, temperature=temperature, seed=3, native=False)
        c = model.generate(prompt, 9, temperature=temperature, seed=3, use_cache=False)
        assert torch.equal(a, b) and torch.equal(a, c)
    one = model.generate(prompt[:1], 9, temperature=0, native=True)
    assert torch.equal(one, model.generate(prompt[:1], 9, temperature=0, native=False))


@pytest.mark.slow
@needs_compiler
@pytest.mark.skipif(not prepack.prepack_available(), reason="MKL's packed linear (x86 builds with MKL)")
@pytest.mark.parametrize("kw", CONFIGS + GEMMA_LIKE[:1])
@torch.no_grad()
def test_native_steps_on_packed_weights_are_bit_for_bit_the_python_steps(
    kw: dict, built: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(4)
    model = decoder(**kw)
    for p in model.parameters():
        p.add_(0.1 * torch.randn_like(p))
    calls: list[tuple[int, ...]] = []
    pack = prepack.pack_weight
    monkeypatch.setattr(
        "headspace.decode.step.pack_weight", lambda w, rows: calls.append(tuple(w.shape)) or pack(w, rows)
    )
    step = native_step(model, pack_rows=B)
    assert {(layer.o.kind, layer.o.rows) for layer in step.layers} == {("packed", B)}  # packed for B rows
    n_products = 5 if hasattr(model.blocks[0].mlp, "fc_gate") else 4
    assert len(calls) == L * n_products + 1  # one packed copy per weight (and the unembedding), shared
    tokens = torch.randint(0, V, (B, 9))
    assert_native_equals_python(model, step, tokens, 4)
    prompt = tokens[:, :4]
    assert torch.equal(
        model.generate(prompt, 5, temperature=0, prepack=True, native=True),
        model.generate(prompt, 5, temperature=0, prepack=True, native=False),
    )


@pytest.mark.slow
@needs_compiler
@pytest.mark.parametrize("mode", ["onednn", "float32 from many rows", "fallback"])
@pytest.mark.parametrize("kw", CONFIGS[:3] + GEMMA_LIKE[:1])
@torch.no_grad()
def test_native_steps_on_bfloat16_weights_are_bit_for_bit_the_python_steps(
    kw: dict, mode: str, built: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both steps decide alike which products run as float32 GEMMs on the rounded values: none
    (oneDNN), those of MANY_ROWS rows or more, or all of them (oneDNN without bfloat16, forced here)."""
    from headspace.kernels import bf16, cpu

    if mode != "fallback" and not cpu.use_onednn_bf16():
        pytest.skip("oneDNN has no bfloat16 kernel on this CPU (or it is forced off): only the fallback runs")
    monkeypatch.setattr(cpu, "bf16_many_rows_in_float32", lambda: mode == "float32 from many rows")
    forced = cpu.force_fallback("bf16") if mode == "fallback" else contextlib.nullcontext()
    with forced:
        torch.manual_seed(5)
        model = decoder(**kw)
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        model.to_precision("bfloat16")
        assert (model.blocks[0].attn.qkv_weight.packed is None) == (mode == "fallback")
        step = native_step(model)
        rows = {"onednn": -1, "float32 from many rows": bf16.MANY_ROWS, "fallback": 0}[mode]
        assert {(layer.qkv.kind, layer.qkv.float32_rows) for layer in step.layers} == {("bfloat16", rows)}
        for batch in (1, 3, 130):  # 130 rows: past MANY_ROWS (128), the float32-arithmetic branch
            assert_native_equals_python(model, step, torch.randint(0, V, (batch, 7)), 4)
        prompt = torch.randint(0, V, (2, 4))
        assert torch.equal(
            model.generate(prompt, 5, temperature=0, native=True),
            model.generate(prompt, 5, temperature=0, native=False),
        )


@needs_compiler
@torch.no_grad()
def test_the_native_step_sees_in_place_edits_and_steps_aside_for_hooks(built: None) -> None:
    torch.manual_seed(2)
    model = decoder(**CONFIGS[1])
    prompt = torch.randint(0, V, (1, 4))
    before = model.generate(prompt, 6, temperature=0, native=True)
    model.blocks[1].attn.qkv_weight.mul_(-3.0)  # in place: the plan's views show it
    model.blocks[0].mlp.fc_out.weight.mul_(2.0)
    after = model.generate(prompt, 6, temperature=0, native=True)
    assert torch.equal(after, model.generate(prompt, 6, temperature=0, native=False))
    assert torch.equal(after, model.generate(prompt, 6, temperature=0, use_cache=False))
    assert not torch.equal(before, after)
    seen: list[int] = []
    remove = model.blocks[1].attn.hook_rot_k.add(lambda t, hook: seen.append(t.shape[1]))
    model.generate(prompt, 3, temperature=0, native=True)  # a hook sends every step to forward
    remove()
    assert seen == [4, 1, 1]


def test_models_without_a_native_form_decode_in_python() -> None:
    class OwnNorm(RMSNorm):  # another norm class: run as a module, with no native form
        pass

    torch.manual_seed(3)
    own = decoder(**CONFIGS[1])
    for b in own.blocks:
        b.ln1 = OwnNorm(36)
    step = describe(own)
    assert step is not None and step.layers[0].norm1.kind == "module"  # type: ignore[union-attr]
    assert native_form(step) is None and named_fields(step.layers[0]) is None
    prompt = torch.randint(0, V, (B, 4))
    assert torch.equal(
        own.generate(prompt, 5, temperature=0),
        own.generate(prompt, 5, temperature=0, use_cache=False),
    )
    step = describe(decoder(**CONFIGS[1]).to_precision("int8"))
    assert step is not None and native_form(step) is None
    gemma_like = describe(decoder(**GEMMA_LIKE[0]))  # 1 + w norms, QK-norm, windows: a native form
    assert gemma_like is not None and native_form(gemma_like) is not None


def test_generate_checks_native() -> None:
    model = decoder()
    prompt = torch.randint(0, V, (1, 3))
    with pytest.raises(TypeError, match="native must be None"):
        model.generate(prompt, 2, native="yes")  # type: ignore[arg-type]


@pytest.fixture
def fresh_state(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """The module as in a new process (nothing loaded or built), with its cache in ``tmp_path``."""
    monkeypatch.setattr(native, "_op", None)
    monkeypatch.setattr(native, "_state", {"status": "not built", "thread": None, "warned": False})
    monkeypatch.setenv("HEADSPACE_CACHE", str(tmp_path))
    return tmp_path


@pytest.mark.usefixtures("automatic_choices")
def test_a_failed_build_warns_once_and_decoding_stays_python(
    fresh_state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails
    model = decoder(**CONFIGS[1])
    prompt = torch.randint(0, V, (1, 3))
    with pytest.raises(RuntimeError, match="native=True: headspace's native decoding step is unavailable"):
        model.generate(prompt, 4, native=True)
    assert native.status().startswith("failed: ") and "exited with" in native.status()
    assert not any(fresh_state.rglob("*.so"))  # nothing half-written left behind
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = model.generate(prompt, 4, temperature=0)
        b = model.generate(prompt, 4, temperature=0)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "native decoding step is unavailable" in messages[0]
    assert torch.equal(a, b) and torch.equal(a, model.generate(prompt, 4, temperature=0, use_cache=False))


def test_no_compiler_and_off_are_said(fresh_state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HEADSPACE_NATIVE", "0")
    assert native.status() == "off" and not native.build()
    monkeypatch.delenv("HEADSPACE_NATIVE")
    monkeypatch.setenv("CXX", "")
    monkeypatch.setenv("PATH", str(fresh_state))  # no c++, g++ or clang++ on it
    assert not native.build()
    assert native.status() == "failed: no C++ compiler found (set CXX, or install g++ or clang++)"


@pytest.mark.slow
@needs_compiler
def test_a_build_is_kept_and_loaded_by_later_processes(fresh_state: Path) -> None:
    native.start_build()
    assert native.status() == "building"  # in the background: the caller goes on
    thread = native._state["thread"]
    assert isinstance(thread, threading.Thread) and thread.name == "headspace-native-build"
    assert native.build() and native.status() == "loaded"
    (lib,) = fresh_state.rglob("*.so")
    assert lib == native.library_path() and not list(fresh_state.rglob("*.tmp*"))
    code = (
        "from headspace.kernels import native; native.start_build(); s = native.status(); "
        "print(s, native.ready(), native.status())"
    )
    env = {**os.environ, "HEADSPACE_CACHE": str(fresh_state)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["built", "True", "loaded"]  # found, not compiled again


@pytest.mark.slow
@needs_compiler
@pytest.mark.skipif(not hasattr(os, "getuid"), reason="file ownership and modes are POSIX")
def test_a_library_others_could_have_written_is_not_loaded(fresh_state: Path) -> None:
    assert native.build()  # compiled into fresh_state
    path = native.library_path()
    monkey_state = {"status": "not built", "thread": None, "warned": False}
    native._state, native._op = monkey_state, None  # as a new process (restored by fresh_state)
    path.chmod(0o666)  # anyone could have replaced it
    native.start_build()
    assert not native.ready(warn=False)
    assert native.status() == (
        f"failed: {path} belongs to another user or is writable by others, so {path.name} was not loaded "
        "(remove it, or point HEADSPACE_CACHE at a folder of your own)"
    )


@needs_compiler
def test_the_native_step_reads_its_description_by_name(built: None) -> None:
    """The C++ step takes each layer's fields by name: one it needs and does not find, one it does not
    know, a bad kind, and run's caches and rows are each refused naming what was expected."""
    torch.manual_seed(7)
    model = decoder(**CONFIGS[1])
    step = native_step(model)
    tensors, ints, floats, texts = named_fields(step.layers[0])  # type: ignore[misc]
    obj = native.new_step()
    with pytest.raises(RuntimeError, match=r"layer 0 needs the tensor qkv\.weight"):
        obj.add_layer({k: v for k, v in tensors.items() if k != "qkv.weight"}, ints, floats, texts)
    with pytest.raises(RuntimeError, match=r"layer 0 has a field it does not know: qkv\.colour"):
        obj.add_layer(tensors, ints, floats, {**texts, "qkv.colour": "blue"})
    with pytest.raises(RuntimeError, match=r"activation must be silu, relu, gelu or gelu_tanh; got swish"):
        obj.add_layer(tensors, ints, floats, {**texts, "activation": "swish"})
    with pytest.raises(RuntimeError, match="needs the int n_heads"):
        obj.add_layer(tensors, {k: v for k, v in ints.items() if k != "n_heads"}, floats, texts)
    assert obj.n_layers() == 0  # nothing half-added
    with pytest.raises(RuntimeError, match="qk_norm must be head or all; got both"):
        obj.add_layer(tensors, ints, floats, {**texts, "qk_norm": "both"})
    with pytest.raises(RuntimeError, match=r"needs the string q_norm\.kind"):
        obj.add_layer(tensors, ints, floats, {**texts, "qk_norm": "head"})
    with pytest.raises(RuntimeError, match=r"has a field it does not know: k_norm\.eps"):
        obj.add_layer(tensors, ints, {**floats, "k_norm.eps": 1e-6}, texts)  # a norm without QK-norm
    with pytest.raises(RuntimeError, match="window must be positive; got 0"):
        obj.add_layer(tensors, {**ints, "window": 0}, floats, texts)
    with pytest.raises(RuntimeError, match=r"norm1\.offset is an RMSNorm's; a layernorm has none"):
        obj.add_layer(tensors, ints, {**floats, "norm1.offset": 1.0}, {**texts, "norm1.kind": "layernorm"})
    assert obj.n_layers() == 0  # nothing half-added
    obj.add_layer(tensors, ints, floats, texts)
    x = torch.zeros(2, 36)
    k = torch.zeros(2, 2, 4, 6)
    with pytest.raises(RuntimeError, match="1 layers need 1 key and value caches; got 0 and 0"):
        obj.run(x, [], [], 0, [None], [None], [-1])
    with pytest.raises(RuntimeError, match="1 layers need 1 cos, sin and held entries; got 0, 0 and 1"):
        obj.run(x, [k], [k.clone()], 0, [], [], [-1])
    with pytest.raises(RuntimeError, match=r"x must be \[batch, d_model\]"):
        obj.run(x[0], [k], [k.clone()], 0, [None], [None], [-1])
    with pytest.raises(RuntimeError, match="position 4 outside layer 0's cache capacity 4"):
        obj.run(x, [k], [k.clone()], 4, [None], [None], [-1])
    with pytest.raises(RuntimeError, match=r"caches must be float32 \[batch=2, n_kv_heads=2"):
        obj.run(x, [k[:, :1]], [k[:, :1].clone()], 0, [None], [None], [-1])
    with pytest.raises(RuntimeError, match="layer 0 has no window; its cache holds one"):
        obj.run(x, [k], [k.clone()], 0, [None], [None], [2])
    with pytest.raises(RuntimeError, match=r"cos and sin must hold 6 float32 features; got 5"):
        obj.run(x, [k], [k.clone()], 0, [torch.ones(1, 1, 5)], [torch.ones(1, 1, 5)], [-1])


@pytest.mark.slow
@needs_compiler
def test_smollm2_native_generation_equals_python(smollm2_gguf: Path, built: None) -> None:
    import headspace

    model = headspace.load("smollm2").model
    step = native_step(model)
    prompt = torch.tensor([[504, 3249, 282, 253, 23576, 30, 216, 1071]])  # any ids
    a = model.generate(prompt, 12, temperature=0, native=True)
    b = model.generate(prompt, 12, temperature=0, native=False)
    assert torch.equal(a, b)
    with torch.inference_mode():  # every step's logits and cache rows, bit for bit, at batch 1 and 2
        assert_native_equals_python(model, step, a, 8)
        assert_native_equals_python(model, step, torch.cat((a, a[:, [*range(8), *range(19, 7, -1)]])), 8)


@pytest.mark.slow
@needs_compiler
def test_gemma3_native_steps_equal_python(gemma3, built: None) -> None:
    """Gemma-3-270M natively (sandwich 1 + w norms, QK-norm per head, one key/value head, 15 layers of
    window 512 and rotary base 10,000, 3 full ones of base 1e6): generate's tokens, then every step's
    logits and cache rows at batch 2, bit for bit the Python step's (a few steps: the window is not
    crossed here, the random Gemma-like decoders cross theirs)."""
    model = gemma3.model
    step = native_step(model)
    assert [layer.window for layer in step.layers].count(512) == 15
    assert len({id(layer.rotary) for layer in step.layers}) == 2 and step.layers[0].q_norm.offset == 1.0
    prompt = torch.tensor([[2, 651, 6037, 529, 7001, 563]])  # "<bos>The capital of France is"
    a = model.generate(prompt, 3, temperature=0, native=True)
    assert torch.equal(a, model.generate(prompt, 3, temperature=0, native=False))
    with torch.inference_mode():
        assert_native_equals_python(model, step, torch.cat((a, a.flip(1))), 6)


@pytest.mark.usefixtures("automatic_choices")
@needs_compiler
@torch.no_grad()
def test_a_forced_native_fallback_decodes_in_python(built: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from headspace.kernels import cpu

    torch.manual_seed(0)
    model = decoder(**CONFIGS[1])
    prompt = torch.randint(0, V, (2, 4))
    want = model.generate(prompt, 5, temperature=0, native=True)
    calls: list[int] = []
    import headspace.decode.backends as backends_mod

    real = backends_mod._BACKENDS["native"]
    monkeypatch.setitem(backends_mod._BACKENDS, "native", lambda step: calls.append(1) or real(step))
    with cpu.force_fallback("native"):
        assert torch.equal(model.generate(prompt, 5, temperature=0), want)
    assert calls == []  # the Python step ran every token
    assert torch.equal(model.generate(prompt, 5, temperature=0), want) and calls  # and the native one


# ------------------------------------------------------------------------ building: lock, exit, ownership
posix_only = pytest.mark.skipif(
    sys.platform == "win32" or not hasattr(os, "getuid"),
    reason="the build's lock and process groups are POSIX",
)
has_proc = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds processes through /proc")


def fake_compiler(folder: Path, body: str) -> str:
    """An executable standing for the C++ compiler: ``$out`` is the file after ``-o``; ``body`` runs."""
    script = folder / "fake-cxx"
    script.write_text(
        '#!/bin/sh\nout=""; prev=""\nfor a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done\n'
        + body
        + "\n"
    )
    script.chmod(0o755)
    return str(script)


def build_processes(cache: Path) -> list[str]:
    """The command lines of running processes a build into ``cache`` started (or is): the builder, the
    compiler and every process under it (they carry native._native_build's marker in their environment
    or name the cache on their command line)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or not ours
            continue
        marked = any(e.startswith(b"HEADSPACE_NATIVE_BUILD=" + str(cache).encode()) for e in environ)
        ours = str(cache).encode() in cmdline and (
            b"_native_build.py" in cmdline or str(native.SOURCE).encode() in cmdline
        )
        if marked or ours:
            found.append(cmdline.decode(errors="replace"))
    return found


def wait_until(what: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Poll ``what`` until it holds; fail past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, f"timed out waiting for {what.__doc__ or what}"
        time.sleep(0.05)


def python(code: str, cache: Path, **env: str) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "HEADSPACE_CACHE": str(cache),
        # this checkout's headspace in the child too
        "PYTHONPATH": os.pathsep.join(
            filter(None, (str(Path(native.__file__).parents[2]), os.environ.get("PYTHONPATH")))
        ),
        **env,
    }
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,  # closed by communicate()
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


@pytest.fixture(scope="module")
def built_library(built: None) -> Path:
    """The session's build (in its cache, before any test's fresh_state moves it): what fake compilers
    "produce"."""
    return native.library_path()


@needs_compiler
@posix_only
@has_proc
def test_two_processes_building_at_once_compile_once(tmp_path: Path, built_library: Path) -> None:
    real = built_library  # what the one compile "produces"
    count, release = tmp_path / "compiles", tmp_path / "release"
    cxx = fake_compiler(
        tmp_path,
        f'echo compile >> "{count}"\n'
        f'i=0; while [ ! -e "{release}" ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done\n'
        f'cp "{real}" "$out"',
    )
    cache = tmp_path / "cache"
    code = (
        "from headspace.kernels import native; native.build(); "
        "print(native.status(), native._state.get('outcome'))"
    )
    first = python(code, cache, CXX=cxx)
    wait_until(lambda: count.is_file())  # the first build compiles, holding the lock
    second = python(code, cache, CXX=cxx)
    wait_until(lambda: sum("_native_build.py" in c for c in build_processes(cache)) == 2)  # both builders
    time.sleep(0.5)  # the second's builder tries the lock a few times meanwhile
    release.touch()
    outs = [p.communicate(timeout=120) for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0], outs
    assert [o.split() for o, _ in outs] == [["loaded", "compiled"], ["loaded", "found"]]
    assert count.read_text().splitlines() == ["compile"]  # exactly one compile
    assert not list(cache.rglob("*.tmp*"))


@needs_compiler
@posix_only
@has_proc
def test_a_script_that_exits_leaves_no_compiler_and_no_temporary_file(tmp_path: Path) -> None:
    code = (
        "import os, time\nfrom pathlib import Path\nfrom headspace.kernels import native\n"
        "native.start_build()\n"
        "def compiling():\n"
        "    for pid in filter(str.isdigit, os.listdir('/proc')):\n"
        "        try:\n"
        "            mark = b'HEADSPACE_NATIVE_BUILD=' + str(native.cache_dir()).encode()\n"
        "            if mark in Path(f'/proc/{pid}/environ').read_bytes() \\\n"
        "                    and b'cc1' in Path(f'/proc/{pid}/cmdline').read_bytes():\n"
        "                return True\n"
        "        except OSError:\n"
        "            pass\n"
        "    return False\n"
        "deadline = time.monotonic() + 60\n"
        "while not compiling() and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "print(native.status(), compiling())\n"
    )  # exits while the compiler (its cc1plus) runs
    done = python(code, tmp_path)
    out, err = done.communicate(timeout=120)
    assert done.returncode == 0, err
    assert out.split() == ["building", "True"]
    assert err.count("headspace: building the native decoding step in the background") == 1
    assert err.count("headspace: stopped the native decoding step's unfinished build at exit") == 1
    assert build_processes(tmp_path) == []  # gone by the time the script has exited
    assert not list(tmp_path.rglob("*.tmp*")) and not list(tmp_path.rglob("*.so"))


@posix_only
@has_proc
@pytest.mark.parametrize("how", ["exit", "kill -9"])
def test_a_build_stopped_while_writing_its_output_leaves_nothing(tmp_path: Path, how: str) -> None:
    # the "compiler" writes its output, then waits in a process of its own (as a linker or cc1plus would)
    started = tmp_path / "started"
    cxx = fake_compiler(tmp_path, f'echo half > "$out"\nsleep 120 &\ntouch "{started}"\nwait')
    cache = tmp_path / "cache"
    code = (
        "import sys, time\nfrom pathlib import Path\nfrom headspace.kernels import native\n"
        f"native.start_build()\nwhile not Path({str(started)!r}).exists():\n    time.sleep(0.05)\n"
        "print('writing', flush=True)\nsys.stdin.readline()\n"  # exits once told to (or is killed)
    )
    proc = python(code, cache, CXX=cxx)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    assert len(list(cache.rglob("*.tmp.so"))) == 1
    assert any(c.startswith("sleep") for c in build_processes(cache))
    if how == "kill -9":
        proc.kill()  # no atexit: the builder sees the parent's end of its pipe close
    proc.communicate(timeout=60)

    def cleaned() -> bool:
        """the builder, the fake compiler and its sleep gone, and the temporary file"""
        return not build_processes(cache) and not list(cache.rglob("*.tmp*"))

    wait_until(cleaned, 10)
    assert not list(cache.rglob("*.so"))


def test_stale_temporary_files_are_removed_by_the_next_build(fresh_state: Path) -> None:
    cxx = fake_compiler(fresh_state, 'echo built > "$out"')
    lib = native.library_path(cxx)
    lib.parent.mkdir(parents=True)
    ours = lib.parent / f"{lib.stem}.99999.tmp.so"  # a killed builder's, of this very library
    old, young = (lib.parent / f"headspace_decode_rows_{n * 20}.x.tmp.so" for n in "01")  # other versions'
    for f in (ours, old, young):
        f.write_text("half")
    os.utime(old, (1, 1))  # older than any build's time limit
    with pytest.MonkeyPatch.context() as m:
        m.setenv("CXX", cxx)
        native.build()  # (the text "built" is no library: loaded only where this process has the op)
    assert lib.read_text() == "built\n"
    assert sorted(p.name for p in lib.parent.glob("*.tmp.so")) == [young.name]


@posix_only
@pytest.mark.parametrize("where", ["the cache root", "native/"])
def test_no_build_into_a_folder_others_could_write(
    fresh_state: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    count = fresh_state / "compiles"
    cxx = fake_compiler(fresh_state, f'echo compile >> "{count}"\necho x > "$out"')
    monkeypatch.setenv("CXX", cxx)
    root = fresh_state / "cache"
    monkeypatch.setenv("HEADSPACE_CACHE", str(root))
    folder = root if where == "the cache root" else root / "native"
    folder.mkdir(parents=True)
    folder.chmod(0o777)  # anyone could put a library there, or replace one being built
    assert not native.build()
    assert native.status() == (
        f"failed: {folder} belongs to another user or is writable by others, so the native step is not "
        "built into it (make it yours and not writable by others, or point HEADSPACE_CACHE at a folder "
        "of your own)"
    )
    assert not count.exists() and not list(root.rglob("*.so"))  # nothing compiled


@posix_only
@pytest.mark.parametrize("where", ["the cache root", "native/"])
def test_a_library_in_a_folder_others_could_write_is_not_loaded(
    fresh_state: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    root = fresh_state / "cache"
    folder = root if where == "the cache root" else root / "native"
    # built as the folder turns writable by others (the check is the loader's, not only the builder's)
    cxx = fake_compiler(fresh_state, f'echo x > "$out"\nchmod 777 "{folder}"')
    monkeypatch.setenv("CXX", cxx)
    monkeypatch.setenv("HEADSPACE_CACHE", str(root))
    assert not native.build()
    lib = native.library_path()
    assert lib.is_file()  # built, not loaded
    assert native.status() == (
        f"failed: {folder} belongs to another user or is writable by others, so {lib.name} was not loaded "
        "(make it yours and not writable by others, or point HEADSPACE_CACHE at a folder of your own)"
    )
    monkeypatch.setattr(native, "_state", {"status": "not built", "thread": None, "warned": False})
    native.start_build()  # found by a later process: refused too
    assert not native.ready(warn=False) and native.status().startswith(f"failed: {folder} belongs to")


@pytest.mark.usefixtures("automatic_choices")
@posix_only
def test_a_background_build_says_so_once_and_is_stopped_at_exit(tmp_path: Path) -> None:
    cxx = fake_compiler(tmp_path, "sleep 120")
    code = (
        "import torch\nfrom headspace import Decoder, ModelConfig\n"
        "m = Decoder(ModelConfig(arch='decoder', vocab_size=13, d_model=12, n_layers=1, n_heads=2, d_mlp=8,"
        " max_seq_len=16, positions='rotary', norm_kind='rmsnorm', mlp_kind='gated', act='silu'))\n"
        "for _ in range(2):\n    m.generate(torch.tensor([[1, 2]]), 3, temperature=0)\n"
        "from headspace.kernels import native\nprint(native.status())\n"
    )
    proc = python(code, tmp_path / "cache", CXX=cxx)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.strip() == "building"  # two calls decoded in Python meanwhile
    lines = err.strip().splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        f"headspace: building the native decoding step in the background into {tmp_path / 'cache'}",
        "headspace: stopped the native decoding step's unfinished build at exit",
    ]
    assert not list((tmp_path / "cache").rglob("*.tmp*"))


def test_cli_native_build_and_status(fresh_state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from headspace.cli import cli

    monkeypatch.setenv("CXX", "false")  # fails
    lib = native.library_path()
    res = CliRunner().invoke(cli, ["native", "status"])
    assert res.exit_code == 0 and res.stdout.splitlines() == ["not built", str(lib)]
    res = CliRunner().invoke(cli, ["native", "build"])
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.splitlines()[-1] == (
        "error: the native decoding step is not loaded: expected loaded, got failed: "
        f"{native.compiler()} exited with 1: (no output)"
    )
    monkeypatch.setattr(native, "_state", {"status": "not built", "thread": None, "warned": False})
    lib.parent.mkdir(parents=True, exist_ok=True)
    lib.write_text("x")  # as if built
    lib.chmod(0o644)
    res = CliRunner().invoke(cli, ["native", "status"])
    assert res.exit_code == 0 and res.stdout.splitlines() == ["built", str(lib)]


@needs_compiler
def test_cli_native_build_loads(
    fresh_state: Path, built_library: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner

    from headspace.cli import cli

    monkeypatch.setenv("CXX", fake_compiler(fresh_state, f'cp "{built_library}" "$out"'))
    res = CliRunner().invoke(cli, ["native", "build"])
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines() == ["loaded", str(native.library_path())]
    assert res.stderr.startswith("building the native decoding step into ")
    res = CliRunner().invoke(cli, ["native", "build"])  # a second time: nothing to build
    assert res.exit_code == 0 and res.stderr == "" and res.stdout.splitlines()[0] == "loaded"


@posix_only
def test_a_library_linked_into_a_folder_others_could_write_is_not_loaded(
    fresh_state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 42: the check followed the link only for the file's own mode; the folder it lies in, which
    anyone could write, went unchecked. Links are resolved before the check now."""
    root = fresh_state / "cache"
    monkeypatch.setenv("CXX", fake_compiler(fresh_state, 'echo x > "$out"'))
    monkeypatch.setenv("HEADSPACE_CACHE", str(root))
    native.build()  # the fake library: built, then refused by the loader (it is no library)
    lib = native.library_path()
    open_folder = fresh_state / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)  # anyone could replace what is in it
    (open_folder / lib.name).write_bytes(lib.read_bytes())
    (open_folder / lib.name).chmod(0o644)
    lib.unlink()
    lib.symlink_to(open_folder / lib.name)
    # as a later process finds it (_op: the build above loads where this process registered the class)
    monkeypatch.setattr(native, "_state", {"status": "not built", "thread": None, "warned": False})
    monkeypatch.setattr(native, "_op", None)
    native.start_build()
    assert not native.ready(warn=False)
    assert native.status() == (
        f"failed: {open_folder} belongs to another user or is writable by others, so {lib.name} was not "
        "loaded (make it yours and not writable by others, or point HEADSPACE_CACHE at a folder of your own)"
    )


def test_an_unknown_headspace_native_value_is_refused_in_one_line(
    fresh_state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 42: HEADSPACE_NATIVE=bogus counted as on. Unknown values are refused where the variable is
    read (as HEADSPACE_FORCE_FALLBACK's are); the known ones keep their meaning."""
    from click.testing import CliRunner

    from headspace.cli import cli

    for value, on in [("1", True), (" Yes ", True), ("ON", True), ("", True), ("0", False), ("Off", False)]:
        monkeypatch.setenv("HEADSPACE_NATIVE", value)
        assert native.enabled() is on
    monkeypatch.setenv("HEADSPACE_NATIVE", "bogus")
    message = "HEADSPACE_NATIVE must be one of 1, true, on, yes (on) or 0, false, off, no (off); got 'bogus'"
    with pytest.raises(ValueError, match=f"^{message}$".replace("(", r"\(").replace(")", r"\)")):
        native.enabled()
    # generate reads it where it may choose the native step (not where CI forces every fallback)
    monkeypatch.delenv("HEADSPACE_FORCE_FALLBACK", raising=False)
    with pytest.raises(ValueError, match="HEADSPACE_NATIVE must be one of"):
        decoder().generate(torch.randint(0, V, (1, 3)), 2, temperature=0)
    for command in (["native", "status"], ["native", "build"]):
        res = CliRunner().invoke(cli, command)
        assert res.exit_code == 2 and res.stdout == "" and res.stderr.splitlines() == [f"error: {message}"]


@posix_only
def test_a_background_build_runs_niced_and_a_waited_one_does_not(
    fresh_state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = os.nice(0)
    if base >= 19:
        pytest.skip("this process runs at the lowest priority already: nothing lower to see")
    # the "compiler" writes its own niceness into the library file
    nice = f'"{sys.executable}" -c "import os; print(os.nice(0))" > "$out"'
    monkeypatch.setenv("CXX", fake_compiler(fresh_state, nice))
    native.start_build()  # in the background, as the first generate starts it
    thread = native._state["thread"]
    assert isinstance(thread, threading.Thread)
    thread.join(60)
    lib = native.library_path()
    assert int(lib.read_text()) == min(base + 10, 19)  # BACKGROUND_NICE lower, inherited by the compiler
    lib.unlink()
    monkeypatch.setattr(native, "_state", {"status": "not built", "thread": None, "warned": False})
    native.build()  # waited for: the caller's priority
    assert int(lib.read_text()) == base


@pytest.mark.usefixtures("automatic_choices")
@posix_only
def test_generate_streams_its_tokens_while_a_slow_build_runs(
    fresh_state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = fresh_state / "started"
    monkeypatch.setenv("CXX", fake_compiler(fresh_state, f'touch "{started}"\nsleep 120'))
    model = decoder(**CONFIGS[1])
    prompt = torch.randint(0, V, (1, 3))
    seen: list[tuple[int, str]] = []
    t0 = time.monotonic()
    out = model.generate(
        prompt, 6, temperature=0, on_token=lambda t: seen.append((int(t[0]), native.status()))
    )
    took = time.monotonic() - t0
    try:
        assert took < 30  # not the 120 s the build takes
        assert [t for t, _ in seen] == out[0, 3:].tolist()  # each token handed over as it came
        assert {s for _, s in seen} == {"building"}  # every one of them while the build ran
        wait_until(started.exists)  # (the compiler did start: it is the build that was slow)
        assert torch.equal(out, model.generate(prompt, 6, temperature=0, backend="python"))
    finally:
        native._stop_builds()


@needs_compiler
@torch.no_grad()
def test_a_hand_built_window_past_the_position_table_decodes_on_both_backends(built: None) -> None:
    """Issue 42: ``sliding_window=2**63`` in a ``ModelConfig`` built by hand (not loaded from a file) raised a
    raw RuntimeError in the native step (the window overflowed its int64). A window past ``max_seq_len``
    is stored as ``max_seq_len``, the same maths (every earlier key), so both steps decode it, and as a
    model without a window does."""
    torch.manual_seed(0)
    model = decoder(**{**LLAMA, "act": "silu", "sliding_window": 2**63})
    assert model.config.sliding_window == model.config.max_seq_len == 23
    plain = decoder(**{**LLAMA, "act": "silu"})
    plain.load_state_dict(model.state_dict())
    assert_native_equals_python(model, native_step(model), torch.randint(0, V, (B, 11)), 4)
    tokens = torch.randint(0, V, (B, 4))
    ours = model.generate(tokens, 6, temperature=0, native=True)
    assert torch.equal(ours, plain.generate(tokens, 6, temperature=0, native=False))
